//! kohya's `network_train_text_encoder_only` (and `disable_unet_training` in an adapter mode):
//! only the text encoders' adapters are attached and trained, as kohya's
//! `network.apply_to(text_encoder, unet, train_text_encoder, train_unet=False)`.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// The saved file holds the text encoder's modules alone, every one trained (its up weights
/// moved off zero), and the dry run prices no UNet group. Catches UNet adapters attached (or
/// saved) anyway, and the text encoder's left untrained.
#[test]
fn only_the_text_encoders_adapters_train() {
    let d = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"mode": "lora", "max_steps": 2,
        "network_train_text_encoder_only": true,
        "adapter": {"rank": 4, "alpha": 4, "save_dtype": "fp32"}});
    let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
    let dry = sdtrain(&["--config", path.to_str().unwrap(), "--dry-run"], d.path());
    let log = text(&dry);
    assert!(dry.status.success(), "{log}");
    assert!(log.contains("optim. state   text_encoder"), "{log}");
    assert!(!log.contains("optim. state   unet"), "{log}");
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], d.path());
    assert!(out.status.success(), "{}", text(&out));
    let t = common::f32_tensors(&run_folder(d.path()).join("sdtrain.safetensors"));
    assert!(!t.is_empty());
    assert!(
        t.keys().all(|k| k.starts_with("lora_te_")),
        "{:?}",
        t.keys()
    );
    let ups: Vec<_> = t
        .iter()
        .filter(|(k, _)| k.ends_with("lora_up.weight"))
        .collect();
    assert!(!ups.is_empty());
    for (k, v) in ups {
        assert!(v.iter().any(|x| *x != 0.0), "{k} never trained");
    }

    // Both parts off: nothing would train.
    let d = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"mode": "lora", "disable_unet_training": true,
        "adapter": {"train_text_encoder": false}});
    let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--dry-run"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("nothing would train"), "{}", text(&out));
}
