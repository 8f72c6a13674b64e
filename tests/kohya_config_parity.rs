//! A kohya config file read as kohya reads it, against kohya's own code
//! (tests/fixtures/kohya_config_reference.py, sd-scripts 48d368f):
//! - every option of kohya's training scripts' parsers is one sdtrain reads (or refuses, or
//!   notes), so none is taken for a typo or dropped unseen;
//! - the learning rate of each step equals kohya's `get_scheduler_fix` for the same
//!   `lr_scheduler`, `lr_warmup_steps` (steps, or a float fraction of the run), cycles and power;
//! - kohya's defaults where a file is silent.

mod common;

use std::path::Path;

use sdtrain::config::TrainPlan;
use sdtrain::optim::LrSchedule;

fn plan(dir: &Path, body: &str) -> TrainPlan {
    let images = dir.join("img").join("1_x");
    std::fs::create_dir_all(&images).unwrap();
    let text = format!(
        "pretrained_model_name_or_path = {:?}\ntrain_data_dir = {:?}\n{body}",
        common::fixture("tiny-sd15").display().to_string(),
        dir.join("img").display().to_string()
    );
    let path = dir.join("k.toml");
    std::fs::write(&path, text).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap_or_else(|e| panic!("{body}: {e}"))
}

/// A missing option fails here by name (and a typo'd one in sdtrain's table would too).
#[test]
fn every_option_of_kohyas_parsers_has_a_rule() {
    let reference = common::reference_json("reference/kohya_config.json");
    let options = reference["options"].as_object().unwrap();
    assert!(options.len() > 190, "{}", options.len());
    let missing: Vec<&String> = options
        .keys()
        .filter(|k| !sdtrain::config::is_kohya_option(k))
        .collect();
    assert!(missing.is_empty(), "no rule for {missing:?}");
}

/// Catches the decay not over the run (sdtrain's automatic 1.5×), a float warmup not taken as
/// a fraction (or rounded up), `constant_with_warmup` without its warmup, and the cycles or
/// power dropped.
#[test]
fn each_steps_learning_rate_is_kohyas() {
    let reference = common::reference_json("reference/kohya_config.json");
    for case in reference["schedules"].as_array().unwrap() {
        let c = &case["case"];
        let mut body = format!(
            "learning_rate = {}\nlr_scheduler = {}\nlr_warmup_steps = {}\nmax_train_steps = {}\n",
            case["lr"], c["lr_scheduler"], c["lr_warmup_steps"], c["max_train_steps"]
        );
        for key in ["lr_scheduler_num_cycles", "lr_scheduler_power"] {
            if let Some(v) = c.get(key) {
                body.push_str(&format!("{key} = {v}\n"));
            }
        }
        if let Some(f) = c["lr_warmup_steps"]
            .as_f64()
            .filter(|_| c["lr_warmup_steps"].is_f64())
        {
            // TOML must see a float: 0.3, not 0.3 written as an int.
            body = body.replace(
                &format!("lr_warmup_steps = {}", c["lr_warmup_steps"]),
                &format!("lr_warmup_steps = {f:?}"),
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let p = plan(dir.path(), &body);
        let total = c["max_train_steps"].as_u64().unwrap();
        let r = p.optimizer.unet.schedule.resolve(total);
        let s = LrSchedule {
            kind: r.kind,
            warmup_steps: r.warmup_steps as usize,
            decay_steps: r.decay_steps as usize,
            num_cycles: r.num_cycles,
            power: r.power,
        };
        let lr = p.optimizer.unet.lr;
        for (step, want) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = s.lr_at(lr, step);
            assert!(
                (got - want).abs() <= 1e-12 + 1e-9 * want.abs(),
                "{c}: step {step}: {got} vs kohya's {want}"
            );
        }
    }
}

/// kohya's parser defaults, where a file leaves the option out.
#[test]
fn a_silent_file_takes_kohyas_defaults() {
    let reference = common::reference_json("reference/kohya_config.json");
    let d = &reference["options"];
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "network_module = \"networks.lora\"\n");
    assert_eq!(p.optimizer.unet.lr, d["learning_rate"].as_f64().unwrap());
    assert_eq!(p.max_steps, d["max_train_steps"].as_u64());
    assert_eq!(p.clip_grad_norm, d["max_grad_norm"].as_f64());
    let a = p.adapter.as_ref().unwrap();
    assert_eq!(a.alpha, d["network_alpha"].as_f64().unwrap());
    assert_eq!(p.batch_size as u64, d["train_batch_size"].as_u64().unwrap());
    assert_eq!(
        p.grad_accum as u64,
        d["gradient_accumulation_steps"].as_u64().unwrap()
    );
    assert_eq!(p.objective.zero_frequency_noise_ratio, 0.0);
    assert!(p.random_seed, "kohya's seed is None: a random seed");
    let bucketed = plan(dir.path(), "enable_bucket = true\n");
    let k = bucketed.data.buckets.and_then(|b| b.kohya).unwrap();
    assert_eq!(k.min as u64, d["min_bucket_reso"].as_u64().unwrap());
    assert_eq!(k.max as u64, d["max_bucket_reso"].as_u64().unwrap());
    assert_eq!(k.steps as u64, d["bucket_reso_steps"].as_u64().unwrap());
}
