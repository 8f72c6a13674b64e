//! Parity of our CLIP text encoders with transformers' `CLIPTextModel` /
//! `CLIPTextModelWithProjection` on the tiny fixtures.
//!
//! Expected tensors come from `tests/fixtures/make_fixtures.py` (transformers 5, torch, f32 on
//! CPU; rerun with the command in its docstring): `te.*` for `text_encoder`, `te2.*` for SDXL's
//! `text_encoder_2`. `penultimate` is `hidden_states[-2]`, `pooled` is `pooler_output`.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, get, reference, rel_err};
use sdtrain::model::clip::{ClipTextConfig, ClipTextModel};
use sdtrain::model::weights::Weights;

const F32_TOL: f32 = 1e-4;
const HALF_TOL: f32 = 3e-2;

fn load(name: &str, sub: &str, dtype: DType, with_projection: bool) -> (ClipTextModel, Weights) {
    let dir = fixture(name).join(sub);
    let cfg = ClipTextConfig::from_file(dir.join("config.json")).unwrap();
    let w = Weights::from_files(
        &[dir.join("model.safetensors")],
        sub,
        dtype,
        &Device::Cpu,
        false,
    )
    .unwrap();
    (ClipTextModel::new(&w, &cfg, with_projection).unwrap(), w)
}

/// Runs `model` on the reference ids (prefix `te` or `te2`) and returns the worst relative error.
fn compare(name: &str, prefix: &str, model: &ClipTextModel, label: &str, tol: f32) -> f32 {
    let refs = reference(name);
    let ids = get(&refs, &format!("{prefix}.input_ids"));
    let last = model.forward(&ids, 0).unwrap();
    let pen = model.forward(&ids, 1).unwrap();
    let mut checks: Vec<(&str, Tensor, String)> = vec![
        (
            "last_hidden_state",
            last.last_hidden_state.clone(),
            format!("{prefix}.last_hidden_state"),
        ),
        (
            "penultimate",
            pen.hidden.clone(),
            format!("{prefix}.penultimate"),
        ),
    ];
    if prefix == "te" {
        checks.push(("pooled", last.pooled.clone(), "te.pooled".to_string()));
    } else {
        let embeds = last
            .text_embeds
            .clone()
            .expect("text_encoder_2 has a projection");
        checks.push(("text_embeds", embeds, format!("{prefix}.text_embeds")));
    }
    // skip 0 returns the last layer's output, which final_layer_norm then normalises.
    assert!(rel_err(&last.hidden, &last.last_hidden_state) > 1e-2);
    let mut worst = 0f32;
    for (what, ours, key) in checks {
        let err = rel_err(&ours, &get(&refs, &key));
        eprintln!("{name} {prefix} {label} {what}: rel_err {err:.3e}");
        assert!(
            err <= tol,
            "{name} {prefix} {label} {what}: rel_err {err:.3e} > {tol:.0e}"
        );
        worst = worst.max(err);
    }
    worst
}

fn check_fixture(name: &str) {
    let (te, w) = load(name, "text_encoder", DType::F32, false);
    compare(name, "te", &te, "f32", F32_TOL);
    // Every tensor is read except the `position_ids` buffer some files carry.
    assert!(
        w.unused().iter().all(|n| n.ends_with("position_ids")),
        "{name}: {:?}",
        w.unused()
    );
    let (te, _) = load(name, "text_encoder", DType::BF16, false);
    compare(name, "te", &te, "bf16", HALF_TOL);
    if name == "tiny-sdxl" {
        let (te2, w2) = load(name, "text_encoder_2", DType::F32, true);
        compare(name, "te2", &te2, "f32", F32_TOL);
        assert!(
            w2.unused().iter().all(|n| n.ends_with("position_ids")),
            "{:?}",
            w2.unused()
        );
        let (te2, _) = load(name, "text_encoder_2", DType::BF16, true);
        compare(name, "te2", &te2, "bf16", HALF_TOL);
    }
}

#[test]
fn sd15_text_encoder_matches_transformers() {
    check_fixture("tiny-sd15");
}

#[test]
fn sd21_text_encoder_matches_transformers() {
    check_fixture("tiny-sd21");
}

#[test]
fn sdxl_text_encoders_match_transformers() {
    check_fixture("tiny-sdxl");
}

/// f32 master weights with bf16/f16 activations (mixed precision), as training runs them.
#[test]
fn mixed_precision_forward_is_close_to_f32() {
    for dtype in [DType::BF16, DType::F16] {
        let (mut te2, _) = load("tiny-sdxl", "text_encoder_2", DType::F32, true);
        te2.compute_dtype = dtype;
        compare(
            "tiny-sdxl",
            "te2",
            &te2,
            &format!("{dtype:?} compute"),
            HALF_TOL,
        );
    }
    let (te, _) = load("tiny-sd15", "text_encoder", DType::F16, false);
    compare("tiny-sd15", "te", &te, "f16", HALF_TOL);
}

#[test]
fn unknown_hidden_act_is_an_error_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let text =
        std::fs::read_to_string(fixture("tiny-sd15").join("text_encoder/config.json")).unwrap();
    let text = text.replace("\"quick_gelu\"", "\"swishy\"");
    std::fs::write(&path, text).unwrap();
    let err = ClipTextConfig::from_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("hidden_act") && err.contains("swishy"),
        "{err}"
    );
    assert!(err.contains(&path.display().to_string()), "{err}");
}

#[test]
fn missing_config_is_an_error_naming_the_file() {
    let err = ClipTextConfig::from_file("/nonexistent/text_encoder/config.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/nonexistent/text_encoder/config.json"),
        "{err}"
    );
}
