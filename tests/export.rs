//! Saving a trained model as a diffusers folder (`model::export`): the folder reloads through
//! our loader and gives exactly the in-memory model's outputs; untrained components, tokenizers
//! and the scheduler come through unchanged; sharded and `.fp16`-variant bases, replacement of
//! an existing folder and failed exports behave.
//!
//! Manual check with diffusers (not in CI): `SDTRAIN_KEEP_EXPORT=/tmp/exports cargo test --test
//! export` keeps the SD1.5 and SDXL folders, then
//! `python -c "from diffusers import StableDiffusionPipeline as P; P.from_pretrained('/tmp/exports/tiny-sd15')"`
//! (and `StableDiffusionXLPipeline` for `/tmp/exports/tiny-sdxl`).

mod common;

use common::max_abs_diff;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use sdtrain::model::export::{save_diffusers_folder, ExportError};
use sdtrain::model::files::Component;
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::model::unet::AddedConditions;
use serde_json::Value;

const PROMPTS: [&str; 2] = ["a photo of a cat", "An astronaut riding a horse"];

fn load(dir: &Path, train_unet: bool, train_text_encoders: bool) -> StableDiffusion {
    let layout = ModelLayout::read(dir, None).unwrap();
    let opts = LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet,
        train_text_encoders,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: DType::F32,
    };
    StableDiffusion::load(layout, &opts).unwrap()
}

/// Scales every Var by `factor`, as a stand-in for training.
fn perturb(params: &[(String, Var)], factor: f64) {
    for (_, v) in params {
        v.set(&(v.as_tensor() * factor).unwrap()).unwrap();
    }
}

/// The UNet output on the fixture's reference inputs.
fn unet_out(sd: &StableDiffusion, fixture: &str) -> Tensor {
    let refs = common::reference(fixture);
    let added = refs.contains_key("unet.time_ids").then(|| AddedConditions {
        text_embeds: common::get(&refs, "unet.text_embeds"),
        time_ids: common::get(&refs, "unet.time_ids"),
    });
    sd.unet
        .forward(
            &common::get(&refs, "unet.sample"),
            &common::get(&refs, "unet.timesteps"),
            &common::get(&refs, "unet.encoder_hidden_states"),
            added.as_ref(),
        )
        .unwrap()
}

fn same_bytes(a: &Path, b: &Path) {
    assert_eq!(
        fs::read(a).unwrap(),
        fs::read(b).unwrap(),
        "{} differs from {}",
        a.display(),
        b.display()
    );
}

/// Relative paths of every file under `dir`, sorted.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn copy_tree(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for e in fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let to = dst.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &to);
        } else {
            fs::copy(&p, &to).unwrap();
        }
    }
}

/// Keeps a copy of an exported folder under `$SDTRAIN_KEEP_EXPORT/<name>` when that is set.
fn keep(out: &Path, name: &str) {
    if let Some(dir) = std::env::var_os("SDTRAIN_KEEP_EXPORT") {
        let dst = Path::new(&dir).join(name);
        if dst.exists() {
            fs::remove_dir_all(&dst).unwrap();
        }
        copy_tree(out, &dst);
    }
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
}

/// The tensors of a safetensors file by name.
fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

#[test]
fn sd15_exported_unet_reloads_with_identical_output() {
    let base = common::fixture("tiny-sd15");
    let sd = load(&base, true, false);
    let before = unet_out(&sd, "tiny-sd15");
    perturb(&sd.unet_weights.params(), 1.01);
    let want = unet_out(&sd, "tiny-sd15");
    assert!(
        max_abs_diff(&before, &want) > 1e-4,
        "perturbation had no effect"
    );
    let cond = sd.encode_prompts(&PROMPTS, 0).unwrap().context;

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    let updated = vec![(Component::Unet, sd.unet_weights.params())];
    save_diffusers_folder(&sd.layout, &out, &updated, DType::F32).unwrap();
    keep(&out, "tiny-sd15");
    assert_eq!(
        tree(tmp.path())
            .iter()
            .filter(|p| !p.starts_with("export/"))
            .count(),
        0
    );

    let re = load(&out, false, false);
    let got = unet_out(&re, "tiny-sd15");
    let diff = max_abs_diff(&got, &want);
    println!("sd15 reloaded UNet max abs diff {diff:e}");
    assert_eq!(diff, 0.0);
    // Every checkpoint tensor is in the new file under its own name, in f32.
    let new = tensors(&out.join("unet/diffusion_pytorch_model.safetensors"));
    let old = tensors(&base.join("unet/diffusion_pytorch_model.safetensors"));
    let mut names: Vec<&String> = new.keys().collect();
    let mut old_names: Vec<&String> = old.keys().collect();
    names.sort();
    old_names.sort();
    assert_eq!(names, old_names);
    assert!(new.values().all(|t| t.dtype() == DType::F32));

    // Untrained parts: byte-identical copies, and the same text conditioning.
    assert_eq!(tree(&out), tree(&base));
    for f in [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "tokenizer/special_tokens_map.json",
        "unet/config.json",
    ] {
        same_bytes(&base.join(f), &out.join(f));
    }
    let re_cond = re.encode_prompts(&PROMPTS, 0).unwrap().context;
    assert_eq!(max_abs_diff(&cond, &re_cond), 0.0);
    assert_eq!(re.layout.prediction_type, sd.layout.prediction_type);
    assert_eq!(re.family(), sd.family());
}

#[test]
fn sdxl_export_with_trained_text_encoders_reloads_exactly() {
    let base = common::fixture("tiny-sdxl");
    let sd = load(&base, true, true);
    perturb(&sd.unet_weights.params(), 1.01);
    for te in &sd.text_encoders {
        perturb(&te.weights.params(), 0.98);
    }
    let want_unet = unet_out(&sd, "tiny-sdxl");
    let want = sd.encode_prompts(&PROMPTS, 0).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sdxl-out");
    let updated = vec![
        (Component::Unet, sd.unet_weights.params()),
        (Component::TextEncoder, sd.text_encoders[0].weights.params()),
        (
            Component::TextEncoder2,
            sd.text_encoders[1].weights.params(),
        ),
    ];
    save_diffusers_folder(&sd.layout, &out, &updated, DType::F32).unwrap();
    keep(&out, "tiny-sdxl");

    let re = load(&out, false, false);
    let d_unet = max_abs_diff(&unet_out(&re, "tiny-sdxl"), &want_unet);
    let got = re.encode_prompts(&PROMPTS, 0).unwrap();
    let d_ctx = max_abs_diff(&got.context, &want.context);
    let d_pool = max_abs_diff(&got.pooled.unwrap(), &want.pooled.unwrap());
    println!("sdxl reloaded: UNet {d_unet:e}, context {d_ctx:e}, pooled {d_pool:e}");
    assert_eq!((d_unet, d_ctx, d_pool), (0.0, 0.0, 0.0));

    assert_eq!(tree(&out), tree(&base));
    for f in [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "tokenizer/vocab.json",
        "tokenizer_2/tokenizer.json",
        "tokenizer_2/merges.txt",
        "text_encoder/config.json",
        "text_encoder_2/config.json",
    ] {
        same_bytes(&base.join(f), &out.join(f));
    }
    // The text encoder files were rewritten with the same names, including the projection.
    let te2 = tensors(&out.join("text_encoder_2/model.safetensors"));
    assert!(te2.contains_key("text_projection.weight"));
    assert!(te2
        .keys()
        .all(|k| k.starts_with("text_model.") || k == "text_projection.weight"));
}

#[test]
fn f16_export_holds_the_rounded_weights() {
    let base = common::fixture("tiny-sd15");
    let sd = load(&base, true, false);
    perturb(&sd.unet_weights.params(), 1.01);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("half");
    let params = sd.unet_weights.params();
    save_diffusers_folder(
        &sd.layout,
        &out,
        &[(Component::Unet, params.clone())],
        DType::F16,
    )
    .unwrap();
    let saved = tensors(&out.join("unet/diffusion_pytorch_model.safetensors"));
    assert_eq!(saved.len(), params.len());
    for (name, var) in &params {
        let t = &saved[name];
        assert_eq!(t.dtype(), DType::F16, "{name}");
        let want = var.as_tensor().to_dtype(DType::F16).unwrap();
        let d = max_abs_diff(
            &t.to_dtype(DType::F32).unwrap(),
            &want.to_dtype(DType::F32).unwrap(),
        );
        assert_eq!(d, 0.0, "{name}");
    }
    // The untouched VAE stays as it was (f32).
    same_bytes(
        &base.join("vae/diffusion_pytorch_model.safetensors"),
        &out.join("vae/diffusion_pytorch_model.safetensors"),
    );
    load(&out, false, false);
}

/// A copy of tiny-sd15 with the UNet in two shards, the VAE as an `.fp16` variant file only, a
/// listed-but-absent safety checker, and a config-only feature extractor.
fn awkward_base(dir: &Path) -> PathBuf {
    let base = dir.join("base");
    copy_tree(&common::fixture("tiny-sd15"), &base);
    let unet = base.join("unet");
    let all = tensors(&unet.join("diffusion_pytorch_model.safetensors"));
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut weight_map = BTreeMap::new();
    for (file, part) in [
        ("diffusion_pytorch_model-00001-of-00002.safetensors", a),
        ("diffusion_pytorch_model-00002-of-00002.safetensors", b),
    ] {
        let shard: HashMap<&String, Tensor> = part.iter().map(|n| (*n, all[*n].clone())).collect();
        candle_core::safetensors::save(&shard, unet.join(file)).unwrap();
        for n in part {
            weight_map.insert(n.to_string(), file);
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    fs::write(
        unet.join("diffusion_pytorch_model.safetensors.index.json"),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();
    fs::remove_file(unet.join("diffusion_pytorch_model.safetensors")).unwrap();
    fs::rename(
        base.join("vae/diffusion_pytorch_model.safetensors"),
        base.join("vae/diffusion_pytorch_model.fp16.safetensors"),
    )
    .unwrap();
    let mut idx = json(&base.join("model_index.json"));
    idx["safety_checker"] = serde_json::json!(["stable_diffusion", "StableDiffusionSafetyChecker"]);
    idx["feature_extractor"] = serde_json::json!(["transformers", "CLIPImageProcessor"]);
    fs::write(base.join("model_index.json"), idx.to_string()).unwrap();
    fs::create_dir(base.join("feature_extractor")).unwrap();
    fs::write(
        base.join("feature_extractor/preprocessor_config.json"),
        r#"{"crop_size": 224}"#,
    )
    .unwrap();
    fs::write(base.join("scheduler/notes.json"), "{}").unwrap();
    base
}

#[test]
fn sharded_and_fp16_variant_bases_export_as_plain_single_files() {
    let tmp = tempfile::tempdir().unwrap();
    let base = awkward_base(tmp.path());
    let sd = load(&base, true, false);
    assert!(sd
        .layout
        .component(Component::Unet)
        .unwrap()
        .index()
        .is_some());
    perturb(&sd.unet_weights.params(), 1.02);
    let want = unet_out(&sd, "tiny-sd15");
    let out = tmp.path().join("out");
    save_diffusers_folder(
        &sd.layout,
        &out,
        &[(Component::Unet, sd.unet_weights.params())],
        DType::F32,
    )
    .unwrap();
    keep(&out, "tiny-sd15-from-sharded-base");

    let mut files = tree(&out);
    files.retain(|f| f.starts_with("unet/") || f.starts_with("vae/"));
    assert_eq!(
        files,
        [
            "unet/config.json",
            "unet/diffusion_pytorch_model.safetensors",
            "vae/config.json",
            "vae/diffusion_pytorch_model.safetensors",
        ]
    );
    same_bytes(
        &base.join("vae/diffusion_pytorch_model.fp16.safetensors"),
        &out.join("vae/diffusion_pytorch_model.safetensors"),
    );
    same_bytes(
        &base.join("scheduler/notes.json"),
        &out.join("scheduler/notes.json"),
    );
    same_bytes(
        &base.join("feature_extractor/preprocessor_config.json"),
        &out.join("feature_extractor/preprocessor_config.json"),
    );
    let idx = json(&out.join("model_index.json"));
    assert_eq!(idx["safety_checker"], serde_json::json!([null, null]));
    assert_eq!(
        idx["feature_extractor"],
        serde_json::json!(["transformers", "CLIPImageProcessor"])
    );
    assert_eq!(
        idx["unet"],
        serde_json::json!(["diffusers", "UNet2DConditionModel"])
    );

    let re = load(&out, false, false);
    assert_eq!(max_abs_diff(&unet_out(&re, "tiny-sd15"), &want), 0.0);
}

#[test]
fn sharded_untrained_component_is_copied_with_its_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let base = awkward_base(tmp.path());
    let sd = load(&base, false, true);
    let out = tmp.path().join("te-only");
    save_diffusers_folder(
        &sd.layout,
        &out,
        &[(Component::TextEncoder, sd.text_encoders[0].weights.params())],
        DType::F32,
    )
    .unwrap();
    for f in [
        "unet/diffusion_pytorch_model.safetensors.index.json",
        "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
        "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
    ] {
        same_bytes(&base.join(f), &out.join(f));
    }
    let re = load(&out, false, false);
    let d = max_abs_diff(&unet_out(&re, "tiny-sd15"), &unet_out(&sd, "tiny-sd15"));
    assert_eq!(d, 0.0);
}

#[test]
fn existing_folder_is_replaced_only_by_a_complete_export() {
    let base = common::fixture("tiny-sd15");
    let sd = load(&base, true, false);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let params = sd.unet_weights.params();
    save_diffusers_folder(
        &sd.layout,
        &out,
        &[(Component::Unet, params.clone())],
        DType::F32,
    )
    .unwrap();
    fs::write(out.join("stale.txt"), "from an earlier save").unwrap();
    let first = fs::read(out.join("unet/diffusion_pytorch_model.safetensors")).unwrap();

    // A failing export (a tensor name the checkpoint lacks) leaves the old folder untouched and
    // no staging directory behind.
    let bogus = vec![(
        Component::Unet,
        vec![("not.a.tensor".to_string(), params[0].1.as_tensor().clone())],
    )];
    let err = save_diffusers_folder(&sd.layout, &out, &bogus, DType::F32).unwrap_err();
    assert!(matches!(err, ExportError::UnknownTensor { .. }), "{err}");
    assert!(err.to_string().contains("not.a.tensor"), "{err}");
    assert!(out.join("stale.txt").exists());
    let mut top: Vec<String> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(top, ["model"]);

    perturb(&params, 1.5);
    save_diffusers_folder(&sd.layout, &out, &[(Component::Unet, params)], DType::F32).unwrap();
    assert!(!out.join("stale.txt").exists());
    assert_ne!(
        fs::read(out.join("unet/diffusion_pytorch_model.safetensors")).unwrap(),
        first
    );
    let top: Vec<_> = fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(top.len(), 1);
}

#[test]
fn export_refuses_bad_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    copy_tree(&common::fixture("tiny-sd15"), &base);
    let sd = load(&base, true, false);
    let params = sd.unet_weights.params();
    let unet = || vec![(Component::Unet, params.clone())];
    let err = save_diffusers_folder(&sd.layout, &base, &unet(), DType::F32).unwrap_err();
    assert!(matches!(err, ExportError::IntoBase { .. }), "{err}");
    let err = save_diffusers_folder(&sd.layout, tmp.path(), &unet(), DType::F32).unwrap_err();
    assert!(matches!(err, ExportError::IntoBase { .. }), "{err}");
    let out = tmp.path().join("out");
    let err = save_diffusers_folder(&sd.layout, &out, &unet(), DType::U8).unwrap_err();
    assert!(matches!(err, ExportError::Dtype(DType::U8)), "{err}");
    let te2 = vec![(Component::TextEncoder2, params.clone())];
    let err = save_diffusers_folder(&sd.layout, &out, &te2, DType::F32).unwrap_err();
    assert!(matches!(err, ExportError::MissingComponent { .. }), "{err}");
    let twice = [unet(), unet()].concat();
    let err = save_diffusers_folder(&sd.layout, &out, &twice, DType::F32).unwrap_err();
    assert!(
        matches!(err, ExportError::Duplicate(Component::Unet)),
        "{err}"
    );
    let (name, var) = &params[0];
    let wrong = Tensor::zeros((1, 2, 3), DType::F32, &Device::Cpu).unwrap();
    let bad_shape = vec![(Component::Unet, vec![(name.clone(), wrong)])];
    let err = save_diffusers_folder(&sd.layout, &out, &bad_shape, DType::F32).unwrap_err();
    assert!(matches!(err, ExportError::Shape { .. }), "{err}");
    assert!(err.to_string().contains(name.as_str()), "{err}");
    assert!(!var.as_tensor().dims().is_empty());
    assert!(!out.exists());
}
