//! kohya's LoRA+ (`adapter.loraplus_lr_ratio`, `loraplus_unet_lr_ratio`,
//! `loraplus_text_encoder_lr_ratio`) from the CLI. Its rule, that a scaled parameter steps as it
//! would in a group of its own at the scaled rate, is checked for every optimizer in
//! `train::param_groups`' unit tests; here, that a run applies it to the right weights.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// One step of a LoRA on the tiny SD1.5 fixture (UNet and text encoder), saved in fp32; the
/// file's tensors and its metadata.
fn one_step(dir: &Path, adapter_extra: serde_json::Value) -> (HashMap<String, Vec<f32>>, String) {
    one_step_in(dir, "lora", adapter_extra)
}

/// [`one_step`] in another adapter mode.
fn one_step_in(
    dir: &Path,
    mode: &str,
    adapter_extra: serde_json::Value,
) -> (HashMap<String, Vec<f32>>, String) {
    let mut adapter = serde_json::json!({"rank": 4, "alpha": 4, "train_text_encoder": true,
                                         "save_dtype": "fp32"});
    for (k, v) in adapter_extra.as_object().unwrap() {
        adapter[k] = v.clone();
    }
    // No weight decay: a group at a scaled rate also decays by the scaled rate (as kohya's
    // "plus" group does), which would make the first update not exactly the ratio times.
    let opt = dir.join("optimizer.json");
    std::fs::write(
        &opt,
        r#"{"base": {"optimizer": "adamw8bit", "weight_decay": 0.0}}"#,
    )
    .unwrap();
    let extra = serde_json::json!({"mode": mode, "max_steps": 1, "adapter": adapter,
                                   "optimizer_config": opt});
    let cfg = write_config(dir, "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let path = run_folder(dir).join("sdtrain.safetensors");
    let tensors = common::f32_tensors(&path);
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let args = header.metadata().as_ref().unwrap()["ss_network_args"].clone();
    (tensors, args)
}

/// After the first step `lora_up` (zero at the start) is the first update alone, so with the
/// same gradients it is exactly the ratio times the plain run's (a power of two: no rounding),
/// the UNet's by its ratio and the text encoder's by its own; `lora_down` (whose gradient is zero
/// while `lora_up` is) and the alphas are the plain run's. Catches the ratio on the wrong
/// weights, in the wrong group, or not at all.
#[test]
fn loraplus_scales_only_the_up_weights_by_each_groups_ratio() {
    let plain_dir = tempfile::tempdir().unwrap();
    let (plain, plain_args) = one_step(plain_dir.path(), serde_json::json!({}));
    let plus_dir = tempfile::tempdir().unwrap();
    let (plus, args) = one_step(
        plus_dir.path(),
        serde_json::json!({"loraplus_lr_ratio": 2.0, "loraplus_unet_lr_ratio": 4.0}),
    );
    assert!(!plain_args.contains("loraplus"), "{plain_args}");
    assert!(
        args.contains(r#""loraplus_unet_lr_ratio": "4.0""#)
            && args.contains(r#""loraplus_text_encoder_lr_ratio": "2.0""#),
        "{args}"
    );
    let (mut ups, mut moved) = (0, 0);
    for (name, want) in &plain {
        let got = &plus[name];
        let ratio = match (name.contains("lora_up"), name.starts_with("lora_unet")) {
            (true, true) => 4.0,
            (true, false) => 2.0,
            (false, _) => 1.0,
        };
        let scaled: Vec<f32> = want.iter().map(|v| v * ratio).collect();
        assert_eq!(got, &scaled, "{name} (ratio {ratio})");
        if name.contains("lora_up") {
            ups += 1;
            moved += usize::from(want.iter().any(|&v| v != 0.0));
        }
    }
    assert!(
        ups > 0 && moved * 2 > ups,
        "{moved} of {ups} up weights moved"
    );
}

/// DoRA's `lora_up` weights take LoRA+'s ratio as LyCORIS's kohya network gives it (its
/// `prepare_optimizer_params` tests the name for `lora_up`, as kohya's does); the magnitude
/// (`dora_scale`) and `lora_down` keep the group's rate. Catches the ratio on the magnitude, or
/// DoRA left out.
#[test]
fn loraplus_scales_doras_up_weights_as_lycoris_does() {
    let plain_dir = tempfile::tempdir().unwrap();
    let (plain, _) = one_step_in(plain_dir.path(), "dora", serde_json::json!({}));
    let plus_dir = tempfile::tempdir().unwrap();
    let (plus, args) = one_step_in(
        plus_dir.path(),
        "dora",
        serde_json::json!({"loraplus_lr_ratio": 4.0}),
    );
    assert!(args.contains(r#""loraplus_lr_ratio": "4.0""#), "{args}");
    let mut scales = 0;
    for (name, want) in &plain {
        let ratio = if name.contains("lora_up") { 4.0 } else { 1.0 };
        let scaled: Vec<f32> = want.iter().map(|v| v * ratio).collect();
        assert_eq!(&plus[name], &scaled, "{name} (ratio {ratio})");
        scales += usize::from(name.contains("dora_scale"));
    }
    assert!(scales > 0, "the file holds DoRA magnitudes");
}

/// An optimizer with no per-parameter rate is refused before anything loads, naming the key.
#[test]
fn loraplus_with_a_learning_rate_free_optimizer_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let opt = tmp.path().join("prodigy.json");
    std::fs::write(&opt, r#"{"base": {"optimizer": "prodigy", "lr": 1.0}}"#).unwrap();
    let extra = serde_json::json!({"mode": "lora", "optimizer_config": opt,
                                   "adapter": {"loraplus_lr_ratio": 16}});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(
        log.contains("adapter.loraplus_unet_lr_ratio") && log.contains("prodigy"),
        "{log}"
    );
    let extra = serde_json::json!({"mode": "loha", "adapter": {"loraplus_lr_ratio": 16}});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("adapter.loraplus_lr_ratio"),
        "{}",
        text(&out)
    );
}
