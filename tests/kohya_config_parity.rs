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
    let other: Vec<&str> = reference["other_options"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .filter(|k| !sdtrain::config::is_kohya_option(k))
        .collect();
    assert!(
        other.is_empty(),
        "the other models' {other:?} would read as typos"
    );
}

/// A kohya option as a TOML value: floats stay floats (a float warmup is a fraction of the
/// run), texts quoted, lists of texts.
fn toml_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => format!("{:?}", n.as_f64().unwrap()),
        serde_json::Value::Array(items) => {
            let items: Vec<String> = items.iter().map(toml_value).collect();
            format!("[{}]", items.join(", "))
        }
        serde_json::Value::String(s) => format!("{:?}", s),
        other => other.to_string(),
    }
}

/// Catches the decay not over the run (sdtrain's automatic 1.5×), a float warmup not taken as
/// a fraction (or rounded up), `constant_with_warmup` without its warmup, and the cycles or
/// power dropped; and for the newer schedules (reference/kohya_schedules.json): kohya's cycles
/// not halved for cosine_with_min_lr, `min_lr` not divided by the learning rate, the
/// warmup_stable_decay decay length or ramps dropped, a fractional `lr_decay_steps` not taken
/// of the run, inverse_sqrt's timescale, `lr_end`, a cosine's `num_cycles`, and a min ratio
/// applied where kohya ignores it (linear).
#[test]
fn each_steps_learning_rate_is_kohyas() {
    let mut kinds = std::collections::BTreeSet::new();
    for file in [
        "reference/kohya_config.json",
        "reference/kohya_schedules.json",
    ] {
        let reference = common::reference_json(file);
        for case in reference["schedules"].as_array().unwrap() {
            let c = &case["case"];
            let mut body = format!("learning_rate = {}\n", case["lr"]);
            for (key, value) in c.as_object().unwrap() {
                body.push_str(&format!("{key} = {}\n", toml_value(value)));
            }
            let dir = tempfile::tempdir().unwrap();
            let p = plan(dir.path(), &body);
            let total = c["max_train_steps"].as_u64().unwrap();
            let r = p.optimizer.unet.schedule.resolve(total);
            kinds.insert(r.kind.name());
            let s = r.lr_schedule();
            let lr = p.optimizer.unet.lr;
            s.validate(lr).unwrap_or_else(|e| panic!("{c}: {e}"));
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
    assert!(kinds.len() >= 8, "{kinds:?}");
}

/// What kohya fails on is refused, naming the option and kohya's reason.
#[test]
fn a_schedule_kohya_cannot_build_is_refused_with_its_reason() {
    for (body, field, words) in [
        ("lr_scheduler = \"cosine_with_min_lr\"", "lr_scheduler", "min_lr"),
        (
            "lr_scheduler = \"cosine_with_min_lr\"\nlr_scheduler_args = [\"min_lr_rate=0.1\"]",
            "lr_scheduler_args",
            "multiple values",
        ),
        (
            "lr_scheduler = \"cosine_with_min_lr\"\nlr_scheduler_min_lr_ratio = 0.1\nlr_scheduler_args = [\"min_lr=1e-7\"]",
            "lr_scheduler_args",
            "Only one",
        ),
        ("lr_scheduler = \"warmup_stable_decay\"", "lr_decay_steps", "never decays"),
        (
            "lr_scheduler = \"warmup_stable_decay\"\nlr_decay_steps = 3\nlr_scheduler_args = [\"decay_type='exp'\"]",
            "lr_scheduler_args",
            "1-sqrt",
        ),
        (
            "lr_scheduler = \"linear\"\nlr_scheduler_args = [\"power=2\"]",
            "lr_scheduler_args",
            "no other settings",
        ),
        (
            "lr_scheduler = \"inverse_sqrt\"\nlr_scheduler_args = [\"timescale=3\"]",
            "lr_scheduler_args",
            "lr_scheduler_timescale",
        ),
        ("lr_scheduler = \"piecewise_constant\"", "lr_scheduler", "step_rules"),
        (
            "lr_scheduler = \"cosine_with_min_lr\"\nlearning_rate = 1e-4\nlr_scheduler_args = [\"min_lr=1e-3\"]",
            "lr_scheduler_args",
            "above learning_rate",
        ),
        ("lr_scheduler = \"cosine_warmup_with_min_lr\"", "lr_scheduler", "num_decay_steps"),
        ("lr_scheduler = \"adafactor:1e-3\"", "lr_scheduler", "relative-step"),
        (
            "lr_scheduler = \"cosine\"\nlr_scheduler_type = \"CosineAnnealingLR\"",
            "lr_scheduler_type",
            "Python",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("img").join("1_x");
        std::fs::create_dir_all(&images).unwrap();
        let text = format!(
            "pretrained_model_name_or_path = {:?}\ntrain_data_dir = {:?}\n{body}\n",
            common::fixture("tiny-sd15").display().to_string(),
            dir.path().join("img").display().to_string()
        );
        let path = dir.path().join("k.toml");
        std::fs::write(&path, text).unwrap();
        let err = TrainPlan::resolve(&path, &[])
            .err()
            .unwrap_or_else(|| panic!("{body}: accepted"))
            .to_string();
        assert!(err.contains(field) && err.contains(words), "{body}: {err}");
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

/// Each `optimizer_type` with its `optimizer_args` is built with the settings kohya's
/// `get_optimizer` gives it (the package's defaults, then the arguments). Catches a default
/// taken from optimizer.json instead (weight decay 0.01 for Lion or Prodigy, Prodigy's
/// `safeguard_warmup` true, Adafactor's `scale_parameter` false), and an argument name mapped
/// to the wrong setting.
#[test]
fn each_optimizer_is_built_as_kohyas_get_optimizer_builds_it() {
    let reference = common::reference_json("reference/kohya_config.json");
    for case in reference["optimizers"].as_array().unwrap() {
        let name = case["optimizer_type"].as_str().unwrap();
        let args: Vec<String> = case["optimizer_args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| format!("{:?}", a.as_str().unwrap()))
            .collect();
        let body = format!(
            "learning_rate = 1e-3\noptimizer_type = {name:?}\noptimizer_args = [{}]\n",
            args.join(", ")
        );
        let dir = tempfile::tempdir().unwrap();
        let g = plan(dir.path(), &body).optimizer.unet;
        let want = &case["group"];
        let at = format!("{name} {:?}", case["optimizer_args"]);
        let num = |k: &str| want[k].as_f64();
        assert_eq!(Some(g.lr), num("lr"), "{at}: lr");
        assert_eq!(
            Some(g.weight_decay),
            num("weight_decay"),
            "{at}: weight_decay"
        );
        if let Some(b) = want["betas"].as_array() {
            assert_eq!(Some(g.betas.0), b[0].as_f64(), "{at}: beta1");
            assert_eq!(Some(g.betas.1), b[1].as_f64(), "{at}: beta2");
        }
        match case["class"].as_str().unwrap() {
            "Adafactor" => {
                let a = g.adafactor;
                assert_eq!(Some(a.clip_threshold), num("clip_threshold"), "{at}");
                assert_eq!(Some(a.decay_rate), num("decay_rate"), "{at}");
                assert_eq!(a.beta1, num("beta1"), "{at}");
                assert_eq!(
                    Some(a.scale_parameter),
                    want["scale_parameter"].as_bool(),
                    "{at}"
                );
                let eps = want["eps"].as_array().unwrap();
                // serde_json reads 1e-30 one ulp off (no float_roundtrip): compare relatively.
                let close = |a: f64, b: &serde_json::Value| {
                    (a - b.as_f64().unwrap()).abs() <= 1e-12 * a.abs()
                };
                assert!(
                    close(a.eps.0, &eps[0]) && close(a.eps.1, &eps[1]),
                    "{at}: eps"
                );
            }
            "AdamWScheduleFree" => {
                let s = g.schedulefree;
                assert_eq!(Some(s.warmup_steps), want["warmup_steps"].as_u64(), "{at}");
                assert_eq!(Some(s.r), num("r"), "{at}");
                assert_eq!(Some(s.weight_lr_power), num("weight_lr_power"), "{at}");
                assert_eq!(Some(g.epsilon), num("eps"), "{at}: eps");
            }
            class @ ("Prodigy" | "DAdaptAdam" | "DAdaptLion" | "DAdaptSGD" | "DAdaptAdan") => {
                let e = g.estimator;
                assert_eq!(Some(e.d0), num("d"), "{at}: d0");
                let inf = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::INFINITY);
                if want.get("growth_rate").is_some() {
                    assert_eq!(e.growth_rate, inf(&want["growth_rate"]), "{at}");
                }
                if let Some(d) = want["decouple"].as_bool() {
                    assert_eq!(e.decouple, d, "{at}: decouple");
                }
                if let Some(s) = want["safeguard_warmup"].as_bool() {
                    assert_eq!(e.safeguard_warmup, s, "{at}: safeguard_warmup");
                }
                if let Some(b) = want["use_bias_correction"].as_bool() {
                    assert_eq!(e.use_bias_correction, Some(b), "{at}: use_bias_correction");
                }
                if let Some(m) = num("momentum") {
                    assert_eq!(e.momentum, m, "{at}: momentum");
                }
                if let Some(n) = want["no_prox"].as_bool() {
                    assert_eq!(e.no_prox, n, "{at}: no_prox");
                }
                if class == "DAdaptAdan" {
                    let b = want["betas"].as_array().unwrap();
                    assert_eq!(e.beta3, b[2].as_f64(), "{at}: beta3");
                }
                if let Some(eps) = num("eps") {
                    assert_eq!(g.epsilon, eps, "{at}: eps");
                }
            }
            _ => {
                if let Some(eps) = num("eps").filter(|e| *e > 0.0) {
                    assert_eq!(g.epsilon, eps, "{at}: eps");
                }
            }
        }
    }
}
