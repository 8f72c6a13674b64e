//! kohya's `stop_text_encoder_training` (train_db.py): the text encoder trains for the first N
//! steps, then its weights stay as they are while the UNet goes on.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn text_encoder_after(dir: &std::path::Path, extra: serde_json::Value) -> (Vec<f32>, Vec<f32>) {
    let mut cfg = serde_json::json!({"mode": "full", "max_steps": 3, "amp": false,
        "lr": 1e-4, "seed": 5});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let path = write_config(dir, "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(dir).join("final");
    let flat = |file: &str| {
        let t = common::f32_tensors(&run.join(file));
        let mut names: Vec<&String> = t.keys().collect();
        names.sort();
        names
            .iter()
            .flat_map(|n| t[*n].clone())
            .collect::<Vec<f32>>()
    };
    (
        flat("text_encoder/model.safetensors"),
        flat("unet/diffusion_pytorch_model.safetensors"),
    )
}

/// Stopped after 1 step of 3, the text encoder is the 1-step run's bit for bit, while the UNet
/// trains on past it. Catches the stop ignored, taken a step late, or the UNet stopped with it.
#[test]
fn the_text_encoder_stops_where_told() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (te_stopped, unet_stopped) = text_encoder_after(
        a.path(),
        serde_json::json!({"stop_text_encoder_training": 1}),
    );
    let (te_one, unet_one) = text_encoder_after(b.path(), serde_json::json!({"max_steps": 1}));
    assert!(te_stopped == te_one, "the text encoder moved after step 1");
    assert!(
        unet_stopped != unet_one,
        "the UNet stopped with the text encoder"
    );
    let c = tempfile::tempdir().unwrap();
    let (te_all, _) = text_encoder_after(c.path(), serde_json::json!({}));
    assert!(
        te_all != te_one,
        "the text encoder trains past step 1 without the stop"
    );
}

/// Refused, naming the key, where no text encoder trains or a fused backward pass updates
/// inside the backward.
#[test]
fn refused_where_it_cannot_apply() {
    for (extra, why) in [
        (
            serde_json::json!({"disable_textenc_training": true}),
            "no text encoder trains",
        ),
        (serde_json::json!({"fused_backward_pass": true}), "fused"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = serde_json::json!({"mode": "full", "stop_text_encoder_training": 2});
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
        let out = sdtrain(&["--config", path.to_str().unwrap(), "--dry-run"], d.path());
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{log}");
        assert!(
            log.contains("stop_text_encoder_training") && log.contains(why),
            "{log}"
        );
    }
}
