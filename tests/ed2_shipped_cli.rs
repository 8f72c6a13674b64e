//! EveryDream2's own train.json, optimizer.json, sample_prompts.json and validation_default.json,
//! as it ships them (tests/fixtures/everydream2/, EveryDream2trainer commit 5098db8), train the
//! tiny SD1.5 fixture from the CLI. Only the local paths change: `resume_ckpt` (the model),
//! `data_root`, and `sample_prompts` (pointed at the shipped .json rather than the .txt).
//!
//! The files are not edited beyond that. To keep the suite fast the training run adds
//! `--set max_epochs=2 --set resolution=64` on the command line (the shipped 40 epochs at 512 px
//! take over ten minutes on a 2-core CPU); `--dry-run` resolves the files exactly as shipped.
//!
//! [`DIFFERING_DEFAULTS`] names each key whose default in sdtrain differs from EveryDream2's,
//! and why; the test checks the plan holds sdtrain's.

mod common;

use std::path::Path;

use common::cli::{demo_data, sdtrain, text};
use serde_json::Value;

/// Keys whose sdtrain default differs from EveryDream2's argparser default, and why.
const DIFFERING_DEFAULTS: &[(&str, &str, &str, &str)] = &[
    (
        "loss_type",
        "\"mse_huber\"",
        "\"mse\"",
        "EveryDream2's own train.json, kohya and diffusers use MSE",
    ),
    (
        "ckpt_every_n_minutes",
        "20 when no save_every_n_epochs",
        "off",
        "a save carries a resume save point, several times the model's size; Ctrl-C and \
         errors already leave one",
    ),
    (
        "resolution",
        "512",
        "the model's native size",
        "SD2.1-v and SDXL are trained at 768 and 1024",
    ),
    (
        "lr",
        "overrides base.lr only",
        "overrides both groups' lr",
        "one number on the command line sets the run's learning rate (docs/config.md)",
    ),
];

fn shipped(name: &str) -> String {
    std::fs::read_to_string(common::fixture("everydream2").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn everydream2_shipped_configs_train_the_tiny_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for name in [
        "optimizer.json",
        "sample_prompts.json",
        "validation_default.json",
    ] {
        std::fs::write(dir.join(name), shipped(name)).unwrap();
    }
    let mut train: Value = serde_json::from_str(&shipped("train.json")).unwrap();
    let model = common::fixture("tiny-sd15");
    train["resume_ckpt"] = model.display().to_string().into();
    train["data_root"] = demo_data().display().to_string().into();
    train["sample_prompts"] = "sample_prompts.json".into();
    let cfg = dir.join("train.json");
    std::fs::write(&cfg, serde_json::to_string_pretty(&train).unwrap()).unwrap();

    let dry = sdtrain(&["--config", "train.json", "--cpu", "--dry-run"], dir);
    assert!(dry.status.success(), "{}", text(&dry));
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains("512"),
        "{}",
        text(&dry)
    );
    let speed = ["--set", "max_epochs=2", "--set", "resolution=64"];
    let mut args = vec!["--config", "train.json", "--cpu"];
    args.extend(speed);
    let out = sdtrain(&args, dir);
    assert!(out.status.success(), "{}", text(&out));

    // The run: 2 epochs of the 8 demo images less the 15% held out for validation, batch 8.
    let runs: Vec<_> = std::fs::read_dir(dir.join("output"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    let name = run.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("project_abc-"), "{name}");
    assert!(
        run.join("final/unet").is_dir(),
        "the final diffusers folder"
    );
    let log_dir = dir.join("logs").join(&name);
    let log = std::fs::read_to_string(log_dir.join("train_log.jsonl")).unwrap();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = records.last().expect("a log record");
    assert_eq!(last["step"], 2, "{last}");
    assert!(
        records.iter().any(|r| r.get("val_loss").is_some()),
        "validation_default.json"
    );
    assert!(records
        .iter()
        .all(|r| r["loss"].as_f64().unwrap().is_finite()));

    // The plan says what the shipped files asked for, and sdtrain's differing defaults.
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["optimizer"]["unet"]["optimizer"], "adamw8bit");
    assert_eq!(plan["optimizer"]["text_encoder"]["lr"], 5e-7);
    assert_eq!(
        plan["optimizer"]["text_encoder"]["schedule"]["kind"],
        "cosine"
    );
    let reasons: Vec<String> = DIFFERING_DEFAULTS
        .iter()
        .map(|(k, ed2, ours, why)| format!("{k}: EveryDream2 {ed2}, sdtrain {ours} ({why})"))
        .collect();
    assert_eq!(reasons.len(), 4);
    assert!(plan["saving"]["every_n_minutes"].is_null(), "{reasons:?}");
    let lr_only = serde_json::json!({"lr": 3e-6});
    check_lr_override(dir, &lr_only);
}

/// sdtrain's `lr` in train.json sets both groups (EveryDream2's overrides `base.lr` only).
fn check_lr_override(dir: &Path, extra: &Value) {
    let mut train: Value = serde_json::from_str(&shipped("train.json")).unwrap();
    train["resume_ckpt"] = common::fixture("tiny-sd15").display().to_string().into();
    train["data_root"] = demo_data().display().to_string().into();
    train["sample_prompts"] = "sample_prompts.json".into();
    if let (Some(t), Some(e)) = (train.as_object_mut(), extra.as_object()) {
        t.extend(e.clone());
    }
    let cfg = dir.join("train-lr.json");
    std::fs::write(&cfg, serde_json::to_string(&train).unwrap()).unwrap();
    let plan = sdtrain::config::TrainPlan::resolve(&cfg, &[]).unwrap();
    assert_eq!(plan.optimizer.unet.lr, 3e-6);
    assert_eq!(plan.optimizer.text_encoder.lr, 3e-6);
    assert_eq!(
        plan.objective.loss.loss_type,
        sdtrain::diffusion::loss::LossType::Mse
    );
    // The shipped sample_prompts.json: DPM++ 2M, 15 steps, cfgs 7 and 4, three prompts.
    let set = &plan.samples.as_ref().expect("sampling on").set;
    assert_eq!(
        set.sampler.name(),
        "dpm++_2m",
        "ED2 maps \"dpm++\" to DPM++ 2M"
    );
    assert_eq!(
        (set.steps, set.cfgs.as_slice(), set.prompts.len()),
        (15, &[7.0, 4.0][..], 3)
    );
}

/// EveryDream2's chain0.json (its chaining example, as shipped) still holds keys of older
/// EveryDream2 versions (`disable_xformers`, `ed1_mode`, `lowvram`, `scale_lr`, `useadam8bit`),
/// which EveryDream2 no longer reads and ignores. sdtrain plans it, naming each in a warning.
/// Only the local paths change (and the empty sample_prompts.txt becomes the shipped .json, as in
/// the test above). Catches those keys refused one per run as unknown (with
/// `disable_xformers` taken for a typo of `disable_amp`).
#[test]
fn everydream2_chain_config_with_obsolete_keys_plans_with_warnings() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut chain: Value = serde_json::from_str(&shipped("chain0.json")).unwrap();
    chain["resume_ckpt"] = common::fixture("tiny-sd15").display().to_string().into();
    chain["data_root"] = demo_data().display().to_string().into();
    std::fs::write(
        dir.join("sample_prompts.json"),
        shipped("sample_prompts.json"),
    )
    .unwrap();
    chain["sample_prompts"] = "sample_prompts.json".into();
    std::fs::write(
        dir.join("chain0.json"),
        serde_json::to_string_pretty(&chain).unwrap(),
    )
    .unwrap();
    let dry = sdtrain(&["--config", "chain0.json", "--cpu", "--dry-run"], dir);
    assert!(dry.status.success(), "{}", text(&dry));
    for key in [
        "disable_xformers",
        "ed1_mode",
        "lowvram",
        "scale_lr",
        "useadam8bit",
    ] {
        assert!(
            text(&dry).contains(&format!("warning: chain0.json: `{key}` is a key of older")),
            "{key}: {}",
            text(&dry)
        );
    }
}
