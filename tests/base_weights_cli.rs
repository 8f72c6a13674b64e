//! kohya's `base_weights` and `base_weights_multiplier`: adapter files merged into the frozen
//! model before an adapter trains on it. The merge itself is `sample --lora`'s, checked against
//! diffusers in tests/diffusers_lora_parity.rs; here, that a run merges before it trains, at
//! each file's multiplier, into an fp8 base too, and refuses what cannot apply.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use common::fixture;

/// One step of a LoRA on tiny-sd15 (fp32 file) with `extra` keys: the file's tensors and the log.
fn one_step(dir: &Path, extra: serde_json::Value) -> (HashMap<String, Vec<f32>>, String) {
    let mut cfg = serde_json::json!({"mode": "lora", "max_steps": 1,
                                     "adapter": {"rank": 4, "alpha": 4, "save_dtype": "fp32"}});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let path = write_config(dir, "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], dir);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let tensors = common::f32_tensors(&run_folder(dir).join("sdtrain.safetensors"));
    (tensors, log)
}

/// At multiplier 0 the run is the plain run bit for bit (the merge leaves every weight); at 1
/// the first update differs, because the model it trains on does. Catches the files not merged,
/// merged after the adapters attach (their first update would not see them), or the multiplier
/// ignored.
#[test]
fn base_weights_are_merged_before_training_at_their_multiplier() {
    let lora = fixture("kohya_tiny_sd15.safetensors");
    let plain_dir = tempfile::tempdir().unwrap();
    let (plain, _) = one_step(plain_dir.path(), serde_json::json!({}));
    let zero_dir = tempfile::tempdir().unwrap();
    let (zero, log) = one_step(
        zero_dir.path(),
        serde_json::json!({"base_weights": [lora], "base_weights_multiplier": [0.0]}),
    );
    assert!(log.contains("base_weights: merged"), "{log}");
    assert_eq!(zero, plain, "multiplier 0 changes nothing");
    let one_dir = tempfile::tempdir().unwrap();
    let (one, _) = one_step(one_dir.path(), serde_json::json!({"base_weights": [lora]}));
    let moved = one
        .iter()
        .filter(|(name, v)| name.contains("lora_up") && *v != &plain[*name])
        .count();
    assert!(moved > 10, "{moved} up weights differ");

    // Into an fp8 base: dequantised, merged and quantised again.
    let fp8 = serde_json::json!({"base_weight_dtype": "fp8"});
    let fp8_dir = tempfile::tempdir().unwrap();
    let (fp8_plain, _) = one_step(fp8_dir.path(), fp8.clone());
    let merged_dir = tempfile::tempdir().unwrap();
    let mut merged_keys = fp8;
    merged_keys["base_weights"] = serde_json::json!([lora]);
    let (fp8_merged, _) = one_step(merged_dir.path(), merged_keys);
    assert_ne!(fp8_merged, fp8_plain);
}

/// What cannot apply is refused with exit 2, naming the key (or the file's modules).
#[test]
fn base_weights_that_cannot_apply_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = fixture("kohya_tiny_sd15.safetensors");
    let sdxl_lora = fixture("diffusers_lora/sdxl_peft.safetensors");
    let cases = [
        (
            serde_json::json!({"mode": "full", "base_weights": [lora]}),
            "a full fine-tune",
        ),
        (
            serde_json::json!({"mode": "lora", "base_weights": [lora],
                               "base_weights_multiplier": [1.0, 0.5]}),
            "base_weights_multiplier",
        ),
        (
            serde_json::json!({"mode": "lora", "base_weights": ["missing.safetensors"]}),
            "not a file",
        ),
        (
            serde_json::json!({"mode": "lora", "base_weights": [sdxl_lora]}),
            "base_weights",
        ),
    ];
    for (extra, says) in cases {
        let mut extra = extra;
        extra["max_steps"] = 1.into();
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra.clone());
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{extra}: {log}");
        assert!(log.contains(says), "{extra}: {log}");
    }
}
