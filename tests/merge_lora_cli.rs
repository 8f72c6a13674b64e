//! `sdtrain merge-lora`: LoRA files folded into a model and saved. The saved model holds the
//! weights diffusers fuses from the same file (tests/fixtures/diffusers_lora_reference.py,
//! diffusers 0.42.1 `fuse_lora`), and nothing else changes; a merged single file and folder draw
//! the image `sdtrain sample --lora` draws; bad input is refused with the reason.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use common::cli::{sdtrain, text};
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::nn::{LayerMut, VisitLayers};

fn fixture_str(name: &str) -> String {
    common::fixture(name).display().to_string()
}

fn merge(dir: &Path, model: &str, loras: &[(&str, &str)], out: &str) -> std::process::Output {
    let mut args = vec![
        "merge-lora".to_string(),
        "--model".into(),
        model.into(),
        "--out".into(),
        out.into(),
    ];
    for (file, ratio) in loras {
        args.extend([
            "--lora".into(),
            file.to_string(),
            "--ratio".into(),
            ratio.to_string(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sdtrain(&args, dir)
}

/// Every Linear and Conv2d weight, keyed `<component>.<module path>.weight`.
fn weights(sd: &mut StableDiffusion) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    let mut put = |comp: &str, l: LayerMut<'_>| {
        let (path, w) = match l {
            LayerMut::Linear(m) => (m.path.clone(), m.weight.clone()),
            LayerMut::Conv2d(m) => (m.path.clone(), m.weight.clone()),
        };
        out.insert(format!("{comp}.{path}.weight"), w);
    };
    sd.unet.visit_layers(&mut |l| put("unet", l));
    for (te, comp) in sd
        .text_encoders
        .iter_mut()
        .zip(["text_encoder", "text_encoder_2"])
    {
        te.model.visit_layers(&mut |l| put(comp, l));
    }
    out
}

/// A reference key's weight: transformers 5 names CLIP's layers without the `text_model.`
/// level sdtrain's paths keep.
fn ours<'a>(all: &'a HashMap<String, Tensor>, key: &str) -> &'a Tensor {
    all.get(key)
        .or_else(|| {
            let (comp, rest) = key.split_once('.')?;
            all.get(&format!("{comp}.text_model.{rest}"))
        })
        .unwrap_or_else(|| panic!("no layer {key}"))
}

/// Merged into a diffusers folder, each adapted layer is the weight diffusers fuses (SD1.5 and
/// SDXL, PEFT files with their header's alphas), and every other layer is the base's, bit for
/// bit. Catches a stored name mismatched (the tensor would stay the base's or the export would
/// fail), a text encoder's update written to the other, or the ratio dropped.
#[test]
fn merged_models_hold_the_weights_diffusers_fuses() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, fixture) in [("sd15", "tiny-sd15"), ("sdxl", "tiny-sdxl")] {
        let file = fixture_str(&format!("diffusers_lora/{model}_peft.safetensors"));
        let out = merge(tmp.path(), &fixture_str(fixture), &[(&file, "1")], model);
        assert!(out.status.success(), "{model}: {}", text(&out));
        let reference: HashMap<String, Tensor> = candle_core::safetensors::load(
            common::fixture(&format!("diffusers_lora/merged_{model}_peft.safetensors")),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let merged = weights(&mut common::load_frozen_f32_at(&tmp.path().join(model)));
        let base = weights(&mut common::load_frozen_f32(fixture));
        for (key, want) in &reference {
            let err = common::rel_err(ours(&merged, key), want);
            assert!(err <= 1e-6, "{model}: {key}: rel err {err}");
        }
        let changed = base
            .iter()
            .filter(|(k, w)| common::max_abs_diff(w, &merged[*k]) > 0.0)
            .count();
        assert_eq!(changed, reference.len(), "{model}: layers changed");
    }
}

fn sample(dir: &Path, model: &str, loras: &[&str], out: &str) -> Vec<u8> {
    let mut args = vec![
        "sample",
        "--model",
        model,
        "--prompt",
        "a cat",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "4",
        "--seed",
        "3",
        "--precision",
        "fp32",
        "--out",
        out,
    ];
    for l in loras {
        args.extend(["--lora", l]);
    }
    if !loras.is_empty() {
        args.extend(["--lora-scale", "0.7"]);
    }
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::read(dir.join(out)).unwrap()
}

/// A kohya LoRA and a diffusers one merged at 0.7 into a single file and into a folder draw the
/// image the base model draws with both files at `--lora-scale 0.7`, byte for byte; the base
/// alone draws another. Catches a file merged twice or left out, the ratio applied to one file
/// only, or a single file whose names the loader maps elsewhere.
#[test]
fn a_merged_model_draws_what_the_loras_draw() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture_str("tiny-sd15");
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let peft = fixture_str("diffusers_lora/sd15_peft.safetensors");
    let files = [(kohya.as_str(), "0.7"), (peft.as_str(), "0.7")];
    for out in ["merged.safetensors", "merged"] {
        let o = merge(tmp.path(), &base, &files, out);
        assert!(o.status.success(), "{out}: {}", text(&o));
    }
    let with_loras = sample(tmp.path(), &base, &[&kohya, &peft], "loras.png");
    let single = sample(tmp.path(), "merged.safetensors", &[], "single.png");
    let folder = sample(tmp.path(), "merged", &[], "folder.png");
    let plain = sample(tmp.path(), &base, &[], "base.png");
    assert!(single == with_loras, "the single file draws another image");
    assert!(folder == with_loras, "the folder draws another image");
    assert!(plain != with_loras);
}

/// Bad input ends with an error that names the flag or the file; nothing is written.
#[test]
fn bad_merges_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture_str("tiny-sd15");
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let sdxl_lora = fixture_str("diffusers_lora/sdxl_peft.safetensors");
    let missing = tmp.path().join("missing.safetensors").display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--lora", &kohya, "--ratio", "1", "--ratio", "2"],
            "2 --ratio for 1 --lora",
        ),
        (
            vec!["--lora", &kohya, "--ratio", "nan"],
            "must be a finite number",
        ),
        (vec!["--lora", &sdxl_lora], "does not fit the weight"),
        (vec!["--lora", &missing], "missing.safetensors"),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["merge-lora", "--model", &base, "--out", "out.safetensors"];
        args.extend(flags);
        let o = sdtrain(&args, tmp.path());
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o).contains(needle), "{args:?}: {}", text(&o));
        assert!(!tmp.path().join("out.safetensors").exists());
    }
    let o = sdtrain(
        &[
            "merge-lora",
            "--model",
            &base,
            "--lora",
            &kohya,
            "--out",
            &base,
        ],
        tmp.path(),
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains("would replace the base model"),
        "{}",
        text(&o)
    );
}
