//! Text encoders in transformers 5's key layout (issue 12): `CLIPTextModel` saved without the
//! `text_model.` prefix, and `CLIPTextModelWithProjection` with it, loaded through the pipeline's
//! own entry point ([`load_text_encoder`]) and as part of whole pipelines.
//!
//! Fixtures and expected numbers: `tests/fixtures/te-transformers5/`, written by
//! `tests/fixtures/make_te_transformers5.py` (transformers 5.23 `save_pretrained`, torch 2.15,
//! f32 on CPU; rerun with the command in its docstring). They hold the tiny fixtures' text
//! encoders (`tiny-sd15/text_encoder`, `tiny-sd21/text_encoder` in f16, `tiny-sdxl/text_encoder_2`
//! in f16 and two shards), so they are also compared with the old prefixed files.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use common::{fixture, get, rel_err};
use sdtrain::error_chain::chain_text;
use sdtrain::model::clip::ClipTextModel;
use sdtrain::model::files::{component_files, Component, ComponentFiles};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{load_text_encoder, LoadOptions, StableDiffusion};
use sdtrain::model::weights::Weights;
use sdtrain::nn::{LayerMut, VisitLayers};

const TOL: f32 = 1e-4;

/// (reference prefix, folder under `te-transformers5/`, component, old-layout tiny pipeline).
const CASES: [(&str, &str, Component, &str); 3] = [
    ("sd15", "sd15", Component::TextEncoder, "tiny-sd15"),
    ("sd21", "sd21", Component::TextEncoder, "tiny-sd21"),
    ("sdxl", "sdxl", Component::TextEncoder2, "tiny-sdxl"),
];

fn te5(name: &str) -> PathBuf {
    fixture("te-transformers5").join(name)
}

fn reference() -> HashMap<String, Tensor> {
    let path = te5("reference.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap()
}

fn opts(trainable: bool) -> LoadOptions {
    LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: trainable,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    }
}

fn files(pipeline: &Path, component: Component) -> ComponentFiles {
    component_files(pipeline, component, None).unwrap()
}

fn load(pipeline: &Path, component: Component, trainable: bool) -> (ClipTextModel, Weights) {
    load_text_encoder(&files(pipeline, component), &opts(trainable)).unwrap()
}

/// Every tensor of a component's safetensors files, shards merged.
fn stored(files: &[PathBuf]) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for f in files {
        out.extend(candle_core::safetensors::load(f, &Device::Cpu).unwrap());
    }
    out
}

fn stored_names(files: &[PathBuf]) -> BTreeSet<String> {
    stored(files).into_keys().collect()
}

/// Compares `model`'s outputs on the reference ids with transformers' (`prefix.*`).
fn check_outputs(model: &ClipTextModel, refs: &HashMap<String, Tensor>, prefix: &str) {
    let ids = get(refs, "input_ids");
    let last = model.forward(&ids, 0).unwrap();
    let pen = model.forward(&ids, 1).unwrap();
    let mut checks = vec![
        ("last_hidden_state", last.last_hidden_state.clone()),
        ("penultimate", pen.hidden),
    ];
    match last.text_embeds {
        Some(t) => checks.push(("text_embeds", t)),
        None => checks.push(("pooled", last.pooled)),
    }
    for (what, ours) in checks {
        let err = rel_err(&ours, &get(refs, &format!("{prefix}.{what}")));
        assert!(err <= TOL, "{prefix} {what}: rel_err {err:.3e}");
    }
}

/// Catches: the loader reading only `text_model.*` (the flat files fail to load), the flat
/// branch looking tensors up under the wrong prefix, `text_projection` looked up under
/// `text_model.`, or only the first shard of a sharded file set being read.
#[test]
fn transformers5_text_encoders_match_transformers() {
    let refs = reference();
    for (prefix, folder, component, _) in CASES {
        let (model, w) = load(&te5(folder), component, false);
        check_outputs(&model, &refs, prefix);
        // transformers 5 writes no `position_ids` buffer: every tensor is read.
        assert!(w.unused().is_empty(), "{prefix}: unused {:?}", w.unused());
    }
}

/// The same weights in either layout give the same model: the same parameter and layer names
/// (so LoRA names, freezing rules and resume state do not depend on the file), the same values
/// (the f16 files are the f32 ones rounded), and `checkpoint_params` names the file's tensors.
/// Catches: parameters or layer paths named as stored (`encoder.layers.0…` instead of
/// `text_model.encoder.layers.0…`), or `checkpoint_params` giving module names (an export into
/// a flat base would then fail with an unknown tensor).
#[test]
fn either_layout_loads_the_same_parameters_under_the_same_names() {
    for (prefix, folder, component, old) in CASES {
        let (mut new_model, new_w) = load(&te5(folder), component, true);
        let (mut old_model, old_w) = load(&fixture(old), component, true);
        let (new_p, old_p) = (new_w.params(), old_w.params());
        let names = |p: &[(String, candle_core::Var)]| -> Vec<String> {
            p.iter().map(|(n, _)| n.clone()).collect()
        };
        assert_eq!(names(&new_p), names(&old_p), "{prefix}");
        let in_file = stored(files(&te5(folder), component).weights());
        let file_dtype = in_file.values().next().unwrap().dtype();
        for ((name, new), (_, old)) in new_p.iter().zip(&old_p) {
            let old = old
                .to_dtype(file_dtype)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let diff = (new.as_tensor() - old).unwrap().abs().unwrap();
            let max = diff.flatten_all().unwrap().max(0).unwrap();
            assert_eq!(max.to_scalar::<f32>().unwrap(), 0.0, "{prefix}: {name}");
        }
        let paths = |m: &mut ClipTextModel| {
            let mut out = Vec::new();
            m.visit_layers(&mut |l| {
                if let LayerMut::Linear(l) = l {
                    out.push(l.path.clone());
                }
            });
            out
        };
        let new_paths = paths(&mut new_model);
        assert_eq!(new_paths, paths(&mut old_model), "{prefix}");
        assert_eq!(
            new_paths[0], "text_model.encoder.layers.0.self_attn.q_proj",
            "{prefix}"
        );
        let in_file: BTreeSet<String> = in_file.into_keys().collect();
        let stored: BTreeSet<String> = new_w
            .checkpoint_params()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(stored, in_file, "{prefix}");
    }
}

/// `CLIPTextModelWithProjection` without the prefix: transformers 5 loads it but never writes
/// it, so the file is `sdxl/text_encoder_2` with `text_model.` stripped from each name (the
/// generator checks transformers loads exactly this file cleanly and gives the same outputs).
/// Catches: the projection model reading only the prefixed layout.
#[test]
fn projection_model_without_the_prefix_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text_encoder_2");
    std::fs::create_dir_all(&dir).unwrap();
    let src = te5("sdxl/text_encoder_2");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let flat: HashMap<String, Tensor> =
        stored(files(&te5("sdxl"), Component::TextEncoder2).weights())
            .into_iter()
            .map(|(name, t)| match name.strip_prefix("text_model.") {
                Some(rest) => (rest.to_string(), t),
                None => (name, t),
            })
            .collect();
    candle_core::safetensors::save(&flat, dir.join("model.safetensors")).unwrap();
    let (model, w) = load(tmp.path(), Component::TextEncoder2, false);
    check_outputs(&model, &reference(), "sdxl");
    assert!(w.unused().is_empty(), "{:?}", w.unused());
}

/// A `text_encoder_2` whose file has no `text_projection.weight` (a `CLIPTextModel` saved in its
/// place): transformers would initialise the projection at random; we refuse, naming the tensor
/// and the file. Catches: a missing projection being skipped (SDXL's pooled embedding unset).
#[test]
fn text_encoder_2_without_its_projection_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    common::copy_dir(
        &te5("sd21/text_encoder"),
        &tmp.path().join("text_encoder_2"),
    );
    let f = files(tmp.path(), Component::TextEncoder2);
    let err = chain_text(&load_text_encoder(&f, &opts(false)).err().unwrap());
    assert!(err.contains("`text_projection.weight` not found"), "{err}");
    assert!(err.contains(&f.weights()[0].display().to_string()), "{err}");
}

/// Catches: a file that is no CLIP text model (here a VAE's) failing with a message about some
/// arbitrary tensor, or loading at all.
#[test]
fn file_in_neither_layout_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text_encoder");
    common::copy_dir(&te5("sd15/text_encoder"), &dir);
    std::fs::copy(
        fixture("tiny-sd15").join("vae/diffusion_pytorch_model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let f = files(tmp.path(), Component::TextEncoder);
    let err = chain_text(&load_text_encoder(&f, &opts(false)).err().unwrap());
    assert!(
        err.contains(
            "neither `text_model.embeddings.token_embedding.weight` nor \
             `embeddings.token_embedding.weight`"
        ),
        "{err}"
    );
    assert!(err.contains(&f.weights()[0].display().to_string()), "{err}");
}

/// A copy of the tiny pipeline `name` with `component` replaced by the transformers 5 one.
fn pipeline_with_te5(name: &str, folder: &str, component: Component) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join(name);
    common::copy_dir(&fixture(name), &root);
    let dst = root.join(component.folder());
    std::fs::remove_dir_all(&dst).unwrap();
    common::copy_dir(&te5(folder).join(component.folder()), &dst);
    tmp
}

fn load_pipeline(root: &Path) -> StableDiffusion {
    let layout = ModelLayout::read(root, None).unwrap();
    StableDiffusion::load(layout, &opts(false)).unwrap()
}

/// Whole pipelines whose text encoder is a transformers 5 folder condition exactly as the
/// originals (SD1.5: same f32 weights; SDXL: `text_encoder_2` in f16 and two shards, so the
/// pooled projection differs by the rounding only). Catches: the pipeline loading text encoders
/// by another path than [`load_text_encoder`], or dropping the projection of a flat file.
#[test]
fn pipelines_with_a_transformers5_text_encoder_condition_as_the_originals() {
    let prompts = ["a photo of a cat", ""];
    let tmp = pipeline_with_te5("tiny-sd15", "sd15", Component::TextEncoder);
    let new = load_pipeline(&tmp.path().join("tiny-sd15"));
    let old = load_pipeline(&fixture("tiny-sd15"));
    let (a, b) = (
        new.encode_prompts(&prompts, 0).unwrap(),
        old.encode_prompts(&prompts, 0).unwrap(),
    );
    assert_eq!(common::max_abs_diff(&a.context, &b.context), 0.0);

    let tmp = pipeline_with_te5("tiny-sdxl", "sdxl", Component::TextEncoder2);
    let new = load_pipeline(&tmp.path().join("tiny-sdxl"));
    let old = load_pipeline(&fixture("tiny-sdxl"));
    let (a, b) = (
        new.encode_prompts(&prompts, 0).unwrap(),
        old.encode_prompts(&prompts, 0).unwrap(),
    );
    let err = rel_err(&a.context, &b.context);
    assert!(err > 0.0 && err < 1e-2, "context rel_err {err:.3e}");
    let err = rel_err(&a.pooled.unwrap(), &b.pooled.unwrap());
    assert!(err > 0.0 && err < 1e-2, "pooled rel_err {err:.3e}");
}

/// A full fine-tune (UNet and text encoder) of a pipeline whose text encoder is flat: one step
/// via the CLI, then the saved text encoder keeps the base's flat names (as transformers 5 wrote
/// them; transformers 5 and diffusers load it), holds the trained values and loads again.
/// Catches: the export writing module names (`text_model.*`) into a flat base (it fails with an
/// unknown tensor), or the trained text encoder not being written.
#[test]
fn full_fine_tune_of_a_flat_text_encoder_saves_it_in_its_layout() {
    let tmp = pipeline_with_te5("tiny-sd15", "sd15", Component::TextEncoder);
    let base = tmp.path().join("tiny-sd15");
    let extra = serde_json::json!({"model": base, "max_steps": 1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let saved = run_folder(tmp.path()).join("final");
    let te = "text_encoder/model.safetensors";
    let names = stored_names(&[saved.join(te)]);
    assert_eq!(names, stored_names(&[base.join(te)]));
    assert!(names.iter().all(|n| !n.starts_with("text_model.")));
    let (_, trained) = load(&saved, Component::TextEncoder, true);
    let (_, before) = load(&base, Component::TextEncoder, true);
    let changed = trained
        .params()
        .iter()
        .zip(before.params())
        .filter(|((_, a), (_, b))| common::max_abs_diff(a.as_tensor(), b.as_tensor()) > 0.0)
        .count();
    assert!(changed > 0, "the text encoder did not train");
    assert!(trained.unused().is_empty(), "{:?}", trained.unused());
}
