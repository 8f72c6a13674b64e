//! kohya's `noise_offset` (EveryDream2's `zero_frequency_noise_ratio`),
//! `noise_offset_random_strength`, `adaptive_noise_scale`, `scale_v_pred_loss_like_noise_pred`
//! and `v_pred_like_loss` from the CLI. Their formulas are checked against kohya's functions in
//! tests/kohya_noise_weights_parity.rs; here, that a run takes them, records them as kohya
//! does, and refuses them where kohya does.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// A LoRA run with kohya's offset keys records them in kohya's metadata.
#[test]
fn a_run_records_kohyas_noise_offset_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "noise_offset": 0.1,
                                   "noise_offset_random_strength": true,
                                   "adaptive_noise_scale": 0.05, "v_pred_like_loss": 0.1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let bytes = std::fs::read(run_folder(tmp.path()).join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["ss_noise_offset"], "0.1");
    assert_eq!(meta["ss_noise_offset_random_strength"], "True");
    assert_eq!(meta["ss_adaptive_noise_scale"], "0.05");
}

/// Settings that cannot apply are refused with exit 2, naming the key.
#[test]
fn kohyas_noise_keys_are_refused_where_kohya_refuses_them() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            serde_json::json!({"scale_v_pred_loss_like_noise_pred": true}),
            "scale_v_pred_loss_like_noise_pred is for v-prediction models",
        ),
        (
            serde_json::json!({"noise_offset": 0.1, "zero_frequency_noise_ratio": 0.05}),
            "noise_offset",
        ),
        (
            serde_json::json!({"noise_offset": 0, "adaptive_noise_scale": 0.05}),
            "adaptive_noise_scale",
        ),
        (
            serde_json::json!({"v_pred_like_loss": -1}),
            "v_pred_like_loss",
        ),
    ];
    for (keys, says) in cases {
        let mut extra = serde_json::json!({"mode": "lora", "max_steps": 1});
        for (k, v) in keys.as_object().unwrap() {
            extra[k] = v.clone();
        }
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{keys}: {log}");
        assert!(log.contains(says), "{keys}: {log}");
    }
}
