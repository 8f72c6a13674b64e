//! kohya's max-norm regularization (`adapter.scale_weight_norms`) from the CLI: after a LoCon
//! run with a cap its updates exceed, no module's `ΔW = (alpha/rank)·up·down` in the saved file
//! is above the cap, the log and TensorBoard carry kohya's three numbers, and the file's
//! `ss_scale_weight_norms` records the cap. The rule itself is checked against kohya's code in
//! tests/kohya_max_norm_parity.rs.

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

const CAP: f64 = 1e-3;

/// Each module's `‖ΔW‖_F` in a kohya file.
fn update_norms(path: &std::path::Path) -> HashMap<String, f64> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let mut out = HashMap::new();
    for (name, down) in &tensors {
        let Some(module) = name.strip_suffix(".lora_down.weight") else {
            continue;
        };
        let up = &tensors[&format!("{module}.lora_up.weight")];
        let alpha: f32 = tensors[&format!("{module}.alpha")]
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .to_scalar()
            .unwrap();
        let f32s = |t: &Tensor| t.to_dtype(candle_core::DType::F32).unwrap();
        let rank = down.dim(0).unwrap();
        let up = f32s(up).reshape((up.dim(0).unwrap(), rank)).unwrap();
        let down = f32s(down).reshape((rank, ())).unwrap();
        let norm: f32 = up
            .matmul(&down)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar()
            .unwrap();
        out.insert(
            module.to_string(),
            f64::from(norm) * f64::from(alpha) / rank as f64,
        );
    }
    out
}

/// Catches the regularization not run, run on the wrong modules (the text encoder's, the
/// convs'), or run before the update instead of after it, and its numbers not logged.
#[test]
fn no_update_exceeds_the_cap_and_the_log_says_what_was_scaled() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "mode": "locon",
        "max_steps": 3,
        "lr": 1e-3,
        "log_step": 1,
        "adapter": {"rank": 4, "alpha": 4, "conv_rank": 2, "train_text_encoder": true,
                    "save_dtype": "fp32", "scale_weight_norms": CAP},
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let norms = update_norms(&run.join("sdtrain.safetensors"));
    let (te, conv) = (
        norms.keys().filter(|k| k.starts_with("lora_te")).count(),
        norms.keys().filter(|k| k.contains("resnets")).count(),
    );
    assert!(te > 0 && conv > 0, "{norms:?}");
    let over: Vec<_> = norms
        .iter()
        .filter(|(_, &n)| n > CAP * (1.0 + 1e-4))
        .collect();
    assert!(over.is_empty(), "{over:?}");
    let at_cap = norms.values().filter(|&&n| n > CAP * 0.999).count();
    assert!(
        at_cap * 2 > norms.len(),
        "the cap binds: {at_cap} of {}",
        norms.len()
    );
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    let m = &last["max_norm"];
    assert!(m["keys_scaled"].as_u64().unwrap() > 0, "{last}");
    assert!(
        (m["max_key_norm"].as_f64().unwrap() - CAP).abs() < CAP * 1e-4,
        "{last}"
    );
    assert!(
        m["average_key_norm"].as_f64().unwrap() <= CAP * (1.0 + 1e-6),
        "{last}"
    );
    let bytes = std::fs::read(run.join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        header.metadata().as_ref().unwrap()["ss_scale_weight_norms"],
        "0.001"
    );
}

/// The cap is checked with the rest of the config.
#[test]
fn the_cap_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    for (mode, cap) in [("lora", -1.0), ("loha", 1.0)] {
        let extra = serde_json::json!({"mode": mode, "adapter": {"scale_weight_norms": cap}});
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--dry-run"],
            tmp.path(),
        );
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(
            text(&out).contains("adapter.scale_weight_norms"),
            "{}",
            text(&out)
        );
    }
}
