//! Single-file (LDM) checkpoints: files written by diffusers' own conversion scripts
//! (`tests/fixtures/single-file/`, made by `tests/fixtures/make_single_files.py` from the tiny
//! pipelines, float16) load with no unused tensor, the right family and the configs of the
//! folders they came from; their tensors are the folders' tensors bit for bit; and a model saved
//! as a single file by sdtrain round-trips to a diffusers folder exactly.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use sdtrain::model::clip::ClipTokenizer;
use sdtrain::model::family::{ModelFamily, PredictionType};
use sdtrain::model::files::{Component, ComponentFiles, ComponentSource};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{load_text_encoder, LoadOptions};
use sdtrain::model::single_file::{ConfigOrigin, SingleFileOptions};
use sdtrain::model::unet::{AddedConditions, UNet2DConditionModel, UnetConfig};
use sdtrain::model::vae::{AutoencoderKL, VaeConfig};
use sdtrain::model::weights::Weights;
use serde_json::Value;

const FIXTURES: [(&str, ModelFamily); 3] = [
    ("tiny-sd15", ModelFamily::Sd1),
    ("tiny-sd21", ModelFamily::Sd2),
    ("tiny-sdxl", ModelFamily::Sdxl),
];

fn script_file(name: &str) -> PathBuf {
    common::fixture("single-file").join(format!("{name}.safetensors"))
}

/// A safetensors file's `__metadata__`.
fn file_metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

/// `src` with `pairs` added to its `__metadata__`, written to `dst`: the header is rewritten,
/// the tensor bytes copied (their offsets count from the end of the header).
fn with_metadata(src: &Path, dst: &Path, pairs: &[(&str, &str)]) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = header
        .entry("__metadata__")
        .or_insert_with(|| Value::Object(Default::default()));
    for (k, v) in pairs {
        meta[*k] = Value::String(v.to_string());
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

fn opts() -> LoadOptions {
    LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    }
}

fn weights(c: &ComponentFiles) -> Weights {
    match &c.source {
        ComponentSource::Packed { packed, .. } => {
            Weights::from_view(packed.view.clone(), "x", DType::F32, &Device::Cpu, false)
        }
        ComponentSource::Folder { weights, .. } => {
            Weights::from_files(weights, "x", DType::F32, &Device::Cpu, false).unwrap()
        }
    }
}

fn unet(layout: &ModelLayout) -> (UNet2DConditionModel, Weights) {
    let c = layout.component(Component::Unet).unwrap();
    let (text, origin) = c.config_text().unwrap();
    let cfg = UnetConfig::from_json(&text, &origin.display().to_string()).unwrap();
    let w = weights(c);
    (UNet2DConditionModel::new(&w, &cfg).unwrap(), w)
}

fn vae(layout: &ModelLayout) -> (AutoencoderKL, Weights) {
    let c = layout.component(Component::Vae).unwrap();
    let (text, origin) = c.config_text().unwrap();
    let cfg = VaeConfig::from_json(&text, &origin).unwrap();
    let w = weights(c);
    (AutoencoderKL::new(&w, &cfg).unwrap(), w)
}

/// Every diffusers name of a component with its tensor, as loaded (f32).
fn tensors(c: &ComponentFiles) -> BTreeMap<String, Vec<f32>> {
    let names: Vec<String> = c.tensor_shapes().unwrap().into_keys().collect();
    let w = weights(c);
    names
        .into_iter()
        .map(|n| {
            let shape = c.tensor_shapes().unwrap()[&n].0.clone();
            let t = w.get(shape, &n).unwrap();
            (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// A copy of the fixture folder `name` with every float tensor rounded to f16, as the
/// conversion scripts' `--half` stores them.
fn f16_folder(name: &str, into: &Path) -> PathBuf {
    let dst = into.join(name);
    common::copy_dir(&common::fixture(name), &dst);
    for c in ["unet", "vae", "text_encoder", "text_encoder_2"] {
        let dir = dst.join(c);
        for f in ["diffusion_pytorch_model.safetensors", "model.safetensors"] {
            let path = dir.join(f);
            if path.is_file() {
                let t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
                let t: std::collections::HashMap<String, Tensor> = t
                    .into_iter()
                    .map(|(k, v)| (k, v.to_dtype(DType::F16).unwrap()))
                    .collect();
                candle_core::safetensors::save(&t, &path).unwrap();
            }
        }
    }
    dst
}

/// diffusers' conversion scripts' files load with every tensor used, nothing unknown and
/// nothing skipped, as the right family, with the folder's architecture detected.
#[test]
fn diffusers_script_files_load_with_no_unused_tensors() {
    for (name, family) in FIXTURES {
        let file = script_file(name);
        let layout = ModelLayout::read(&file, None).unwrap();
        let sf = layout.single_file().unwrap();
        assert_eq!(layout.family, family, "{name}");
        assert_eq!(sf.origin, ConfigOrigin::Detected);
        assert!(sf.skipped.is_empty(), "{name}: skipped {:?}", sf.skipped);
        let (_, w) = unet(&layout);
        assert!(w.unused().is_empty(), "{name} unet: {:?}", w.unused());
        let (_, w) = vae(&layout);
        assert!(w.unused().is_empty(), "{name} vae: {:?}", w.unused());
        for c in [Component::TextEncoder, Component::TextEncoder2] {
            if let Some(files) = layout.component(c) {
                let (_, w) = load_text_encoder(files, &opts()).unwrap();
                assert!(w.unused().is_empty(), "{name} {c}: {:?}", w.unused());
            }
        }
        // What the shapes say matches the folder's configs.
        let folder = ModelLayout::read(&common::fixture(name), None).unwrap();
        for (c, keys) in [
            (
                Component::Unet,
                &[
                    "block_out_channels",
                    "layers_per_block",
                    "down_block_types",
                    "up_block_types",
                    "cross_attention_dim",
                    "use_linear_projection",
                    "in_channels",
                    "out_channels",
                    "norm_num_groups",
                    "upcast_attention",
                    "addition_embed_type",
                    "addition_time_embed_dim",
                    "projection_class_embeddings_input_dim",
                ][..],
            ),
            (
                Component::Vae,
                &[
                    "block_out_channels",
                    "layers_per_block",
                    "latent_channels",
                    "norm_num_groups",
                    "scaling_factor",
                ][..],
            ),
            (
                Component::TextEncoder,
                &[
                    "hidden_size",
                    "num_hidden_layers",
                    "intermediate_size",
                    "num_attention_heads",
                    "hidden_act",
                    "vocab_size",
                    "max_position_embeddings",
                    "pad_token_id",
                    "eos_token_id",
                ][..],
            ),
        ] {
            let got = layout.component(c).unwrap().config_json().unwrap();
            let want = folder.component(c).unwrap().config_json().unwrap();
            for k in keys {
                let w = want.get(*k).cloned().unwrap_or(Value::Null);
                assert_eq!(
                    got.get(*k).cloned().unwrap_or(Value::Null),
                    w,
                    "{name} {c} {k}"
                );
            }
        }
        assert_eq!(layout.prediction_type, folder.prediction_type, "{name}");
        assert_eq!(
            layout.tokenizers.len(),
            folder.tokenizers.len(),
            "{name} tokenizers"
        );
    }
}

/// Every tensor the file shows under a diffusers name is the folder's tensor (rounded to f16)
/// bit for bit, and the two have the same names.
#[test]
fn diffusers_script_files_hold_the_folder_tensors_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, _) in FIXTURES {
        let single = ModelLayout::read(&script_file(name), None).unwrap();
        let folder = ModelLayout::read(&f16_folder(name, tmp.path()), None).unwrap();
        for c in &folder.components {
            let got = tensors(single.component(c.component).unwrap());
            // The folder stores text encoders under `text_model.`, as the view names them.
            let want = tensors(c);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{name} {}",
                c.component
            );
            for (n, v) in &want {
                assert!(got[n] == *v, "{name} {}: `{n}` differs", c.component);
            }
        }
    }
}

/// The VAE mid-block attention's biases as diffusers' script of early 2024 wrote them, with the
/// 1×1 conv's unit dims (`[c, 1, 1]`), read as the plain biases. Catches such files refused with
/// a shape mismatch.
#[test]
fn vae_attention_biases_with_unit_dims_read_as_biases() {
    let tmp = tempfile::tempdir().unwrap();
    let mut all = candle_core::safetensors::load(script_file("tiny-sd15"), &Device::Cpu).unwrap();
    let biases: Vec<String> = all
        .keys()
        .filter(|k| k.contains("mid.attn_1.") && k.ends_with(".bias") && !k.contains("norm"))
        .cloned()
        .collect();
    assert_eq!(
        biases.len(),
        8,
        "q, k, v, proj_out in the encoder and decoder"
    );
    for k in &biases {
        let b = &all[k];
        all.insert(k.clone(), b.reshape((b.dims()[0], 1, 1)).unwrap());
    }
    let path = tmp.path().join("unit-dims.safetensors");
    candle_core::safetensors::save(&all, &path).unwrap();
    let single = ModelLayout::read(&path, None).unwrap();
    let plain = ModelLayout::read(&script_file("tiny-sd15"), None).unwrap();
    let (got, want) = (
        tensors(single.component(Component::Vae).unwrap()),
        tensors(plain.component(Component::Vae).unwrap()),
    );
    assert_eq!(got, want);
}

/// With `model_config` the folder's configs and tokenizers are used, and the UNet, VAE and text
/// encoders compute what the (f16-rounded) folder's do. SD1.5's detected configs compute the
/// same too (SD2/SDXL's tiny head counts are not SD's, so detection cannot know them).
#[test]
fn model_config_and_sd15_detection_give_the_folder_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, _) in FIXTURES {
        let folder = ModelLayout::read(&f16_folder(name, tmp.path()), None).unwrap();
        let with_config = SingleFileOptions {
            model_config: Some(common::fixture(name)),
            prediction_type: None,
        };
        let mut singles =
            vec![ModelLayout::read_with(&script_file(name), None, &with_config).unwrap()];
        if name == "tiny-sd15" {
            singles.push(ModelLayout::read(&script_file(name), None).unwrap());
        }
        let refs = common::reference(name);
        let (want_unet, _) = unet(&folder);
        let (want_vae, _) = vae(&folder);
        let added = refs.contains_key("unet.time_ids").then(|| AddedConditions {
            text_embeds: common::get(&refs, "unet.text_embeds"),
            time_ids: common::get(&refs, "unet.time_ids"),
        });
        let run_unet = |u: &UNet2DConditionModel| {
            u.forward(
                &common::get(&refs, "unet.sample"),
                &common::get(&refs, "unet.timesteps"),
                &common::get(&refs, "unet.encoder_hidden_states"),
                added.as_ref(),
            )
            .unwrap()
        };
        let want = run_unet(&want_unet);
        let image = common::get(&refs, "vae.image");
        let want_latent = want_vae.encode(&image).unwrap().mean;
        for single in &singles {
            let (u, _) = unet(single);
            assert_eq!(common::rel_err(&run_unet(&u), &want), 0.0, "{name} unet");
            let (v, _) = vae(single);
            let latent = v.encode(&image).unwrap().mean;
            assert_eq!(common::rel_err(&latent, &want_latent), 0.0, "{name} vae");
            for (i, c) in [Component::TextEncoder, Component::TextEncoder2]
                .into_iter()
                .enumerate()
            {
                let Some(files) = single.component(c) else {
                    continue;
                };
                let key = if i == 0 {
                    "te.input_ids"
                } else {
                    "te2.input_ids"
                };
                let ids = common::get(&refs, key).to_dtype(DType::U32).unwrap();
                let (got, _) = load_text_encoder(files, &opts()).unwrap();
                let (want, _) = load_text_encoder(folder.component(c).unwrap(), &opts()).unwrap();
                let a = got.forward(&ids, 0).unwrap().last_hidden_state;
                let b = want.forward(&ids, 0).unwrap().last_hidden_state;
                assert_eq!(common::rel_err(&a, &b), 0.0, "{name} {c}");
            }
        }
        // The built-in tokenizer of the detected layout tokenizes as the folder's.
        let detected = ModelLayout::read(&script_file(name), None).unwrap();
        for (t, f) in detected.tokenizers.iter().zip(&folder.tokenizers) {
            let b = t.builtin.as_ref().unwrap();
            let tok =
                ClipTokenizer::builtin(b.vocab_size, &b.pad, b.max_length, Path::new("f")).unwrap();
            let want = ClipTokenizer::from_dir(f.dir().unwrap()).unwrap();
            for p in ["a photo of a cat!!", "An astronaut, riding"] {
                assert_eq!(
                    tok.encode(p).unwrap(),
                    want.encode(p).unwrap(),
                    "{name} {p}"
                );
            }
        }
    }
}

/// `prediction_type` overrides detection (SD2 files default to v_prediction, as diffusers).
#[test]
fn prediction_type_option_overrides_detection() {
    let file = script_file("tiny-sd21");
    assert_eq!(
        ModelLayout::read(&file, None).unwrap().prediction_type,
        PredictionType::VPrediction
    );
    let eps = SingleFileOptions {
        model_config: None,
        prediction_type: Some(PredictionType::Epsilon),
    };
    let layout = ModelLayout::read_with(&file, None, &eps).unwrap();
    assert_eq!(layout.prediction_type, PredictionType::Epsilon);
    // A folder's own scheduler config decides: the option is an error there.
    let err = ModelLayout::read_with(&common::fixture("tiny-sd21"), None, &eps).unwrap_err();
    assert!(err.to_string().contains("prediction_type"), "{err}");
}

/// What other tools write into a file decides its prediction type: kohya's and OneTrainer's
/// `modelspec.prediction_type` makes an SD2 file epsilon (at 512 px, SD2-base) and an SD1 file
/// v; the option still overrides; declarations that disagree stop with both named. Catches the
/// metadata not read (the SD2 default, v at 768 px, would train the wrong objective silently).
#[test]
fn the_prediction_type_other_tools_write_into_a_file_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let sd2 = tmp.path().join("sd2-base.safetensors");
    with_metadata(
        &script_file("tiny-sd21"),
        &sd2,
        &[("modelspec.prediction_type", "epsilon")],
    );
    let layout = ModelLayout::read(&sd2, None).unwrap();
    assert_eq!(layout.prediction_type, PredictionType::Epsilon);
    // SD2-base's size, 512 px against 768-v's (the tiny VAE halves once: 128 against 192).
    let default = ModelLayout::read(&script_file("tiny-sd21"), None).unwrap();
    assert_eq!(default.prediction_type, PredictionType::VPrediction);
    assert_eq!(
        (layout.native_resolution, default.native_resolution),
        (128, 192)
    );
    let from = &layout.single_file().unwrap().prediction_from;
    assert!(from.contains("modelspec.prediction_type"), "{from}");
    let sd1 = tmp.path().join("sd1-v.safetensors");
    with_metadata(
        &script_file("tiny-sd15"),
        &sd1,
        &[("ss_v_parameterization", "True")],
    );
    let v = ModelLayout::read(&sd1, None).unwrap();
    assert_eq!(v.prediction_type, PredictionType::VPrediction);
    let eps = SingleFileOptions {
        model_config: None,
        prediction_type: Some(PredictionType::Epsilon),
    };
    let layout = ModelLayout::read_with(&sd1, None, &eps).unwrap();
    assert_eq!(layout.prediction_type, PredictionType::Epsilon);
    let both = tmp.path().join("both.safetensors");
    with_metadata(&sd1, &both, &[("modelspec.prediction_type", "epsilon")]);
    let err = ModelLayout::read(&both, None).unwrap_err().to_string();
    assert!(
        err.contains("ss_v_parameterization") && err.contains("modelspec.prediction_type"),
        "{err}"
    );
}

/// An inpainting UNet (9 input channels: latents, mask, masked image) is refused when the model
/// is opened, as a folder or a single file, before a run folder is made. Catches the check
/// missing on either path (the run then failed at its first step with a conv shape error).
#[test]
fn inpainting_unets_are_refused_when_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("inpaint");
    common::copy_dir(&common::fixture("tiny-sd15"), &folder);
    let cfg_path = folder.join("unet/config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["in_channels"] = Value::from(9);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = ModelLayout::read(&folder, None).unwrap_err().to_string();
    assert!(
        err.contains("takes 9") && err.contains("inpainting") && err.contains("unet"),
        "{err}"
    );

    let mut all = candle_core::safetensors::load(script_file("tiny-sd15"), &Device::Cpu).unwrap();
    let key = "model.diffusion_model.input_blocks.0.0.weight";
    let w = &all[key];
    let (o, _, kh, kw) = w.dims4().unwrap();
    all.insert(
        key.into(),
        Tensor::zeros((o, 9, kh, kw), w.dtype(), &Device::Cpu).unwrap(),
    );
    let file = tmp.path().join("inpaint.safetensors");
    candle_core::safetensors::save(&all, &file).unwrap();
    let err = ModelLayout::read(&file, None).unwrap_err().to_string();
    assert!(
        err.contains("takes 9") && err.contains("inpaint.safetensors"),
        "{err}"
    );
}

/// A LoRA file, a UNet-only file and a file with an unknown tensor are refused with the file
/// and what is wrong.
#[test]
fn files_that_are_not_checkpoints_are_refused() {
    let lora = common::fixture("kohya_tiny_sd15.safetensors");
    let err = ModelLayout::read(&lora, None).unwrap_err().to_string();
    assert!(
        err.contains("LoRA") && err.contains("kohya_tiny_sd15"),
        "{err}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let all = candle_core::safetensors::load(script_file("tiny-sd15"), &Device::Cpu).unwrap();
    let unet_only: std::collections::HashMap<String, Tensor> = all
        .iter()
        .filter(|(k, _)| k.starts_with("model.diffusion_model."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let path = tmp.path().join("unet.safetensors");
    candle_core::safetensors::save(&unet_only, &path).unwrap();
    let err = ModelLayout::read(&path, None).unwrap_err().to_string();
    assert!(
        err.contains("no VAE")
            && err.contains("no text encoder")
            && err.contains("unet.safetensors"),
        "{err}"
    );

    let mut extra = all.clone();
    extra.insert(
        "model.diffusion_model.input_blocks.1.7.weight".into(),
        Tensor::zeros(2, DType::F16, &Device::Cpu).unwrap(),
    );
    extra.insert(
        "alphas_cumprod".into(),
        Tensor::zeros(1000, DType::F32, &Device::Cpu).unwrap(),
    );
    let path = tmp.path().join("extra.safetensors");
    candle_core::safetensors::save(&extra, &path).unwrap();
    let err = ModelLayout::read(&path, None).unwrap_err().to_string();
    assert!(
        err.contains("1 tensor(s)") && err.contains("input_blocks.1.7.weight"),
        "{err}"
    );
    extra.remove("model.diffusion_model.input_blocks.1.7.weight");
    candle_core::safetensors::save(&extra, &path).unwrap();
    let layout = ModelLayout::read(&path, None).unwrap();
    let skipped = &layout.single_file().unwrap().skipped;
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, "alphas_cumprod");

    // The text encoder's token embedding twice, in both key layouts (a bad merge): kohya keeps
    // one copy and this file's other readers the other, so the file is refused.
    let mut twice = all.clone();
    let te = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
    twice.insert(
        te.replace("text_model.", ""),
        (&twice[te] + 1.0)
            .unwrap()
            .to_dtype(twice[te].dtype())
            .unwrap(),
    );
    let path = tmp.path().join("twice.safetensors");
    candle_core::safetensors::save(&twice, &path).unwrap();
    let err = ModelLayout::read(&path, None).unwrap_err().to_string();
    assert!(
        err.contains("stored twice")
            && err.contains("cond_stage_model.transformer.embeddings.token_embedding.weight")
            && err.contains("twice.safetensors"),
        "{err}"
    );

    let ckpt = tmp.path().join("model.ckpt");
    std::fs::write(&ckpt, b"pickle").unwrap();
    let err = ModelLayout::read(&ckpt, None).unwrap_err().to_string();
    assert!(
        err.contains("a torch pickle") && err.contains("sdtrain convert"),
        "{err}"
    );
}

/// diffusers folder → single file (sdtrain's writer) → diffusers folder (sdtrain's export) is
/// exact for all three fixtures: every tensor bit for bit, every config equal, the same token
/// ids; and the single file reopens from its metadata with the folder's configs.
#[test]
fn diffusers_to_single_file_to_diffusers_is_exact() {
    use sdtrain::model::export::save_diffusers_folder;
    use sdtrain::model::export::save_single_file;
    let tmp = tempfile::tempdir().unwrap();
    let none: &[(Component, Vec<(String, Tensor)>)] = &[];
    for (name, family) in FIXTURES {
        let folder = ModelLayout::read(&common::fixture(name), None).unwrap();
        let file = tmp.path().join(format!("{name}.safetensors"));
        save_single_file(&folder, &file, none, DType::F32).unwrap();
        let single = ModelLayout::read(&file, None).unwrap();
        let sf = single.single_file().unwrap();
        assert_eq!(sf.origin, ConfigOrigin::Metadata, "{name}");
        assert_eq!(single.family, family);
        // The prediction type, as kohya, OneTrainer and ComfyUI read it: ModelSpec metadata and,
        // for v (tiny-sd21), ComfyUI's empty `v_pred` tensor, the one tensor left out on reading.
        let v = folder.prediction_type == PredictionType::VPrediction;
        assert_eq!(single.prediction_type, folder.prediction_type, "{name}");
        let meta = file_metadata(&file);
        for key in ["modelspec.prediction_type", "modelspec.predict_key"] {
            assert_eq!(meta[key], if v { "v" } else { "epsilon" }, "{name} {key}");
        }
        let skipped: Vec<&str> = sf.skipped.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(skipped, if v { vec!["v_pred"] } else { vec![] }, "{name}");
        // The LDM names are the ones diffusers' scripts write.
        let ours: Vec<String> = candle_core::safetensors::load(&file, &Device::Cpu)
            .unwrap()
            .into_keys()
            .filter(|n| n != "v_pred")
            .collect();
        let theirs = candle_core::safetensors::load(script_file(name), &Device::Cpu).unwrap();
        let mut ours_sorted = ours.clone();
        ours_sorted.sort();
        let mut theirs_sorted: Vec<String> = theirs.into_keys().collect();
        theirs_sorted.sort();
        if name != "tiny-sdxl" {
            assert_eq!(ours_sorted, theirs_sorted, "{name}");
        } else {
            // diffusers' SDXL script writes the projection as the linear weight
            // (`text_projection.weight`); the original layout (and ours) stores `x @ P`.
            let fix =
                |n: &String| n.replace("model.text_projection.weight", "model.text_projection");
            let theirs_fixed: Vec<String> = theirs_sorted.iter().map(fix).collect();
            assert_eq!(ours_sorted, theirs_fixed, "{name}");
        }

        let back = tmp.path().join(format!("{name}-back"));
        save_diffusers_folder(&single, &back, none, DType::F32).unwrap();
        let back = ModelLayout::read(&back, None).unwrap();
        assert_eq!(back.family, family);
        for c in &folder.components {
            let b = back.component(c.component).unwrap();
            assert_eq!(
                b.config_json().unwrap(),
                c.config_json().unwrap(),
                "{name} {}",
                c.component
            );
            let (x, y) = (tensors(c), tensors(b));
            assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
            for (n, v) in &x {
                assert!(y[n] == *v, "{name} {}: `{n}` differs", c.component);
            }
        }
        assert_eq!(
            back.scheduler_json().unwrap(),
            folder.scheduler_json().unwrap()
        );
        assert_eq!(
            back.model_index_json().unwrap(),
            folder.model_index_json().unwrap()
        );
        for (t, f) in back.tokenizers.iter().zip(&folder.tokenizers) {
            let a = ClipTokenizer::from_dir(t.dir().unwrap()).unwrap();
            let b = ClipTokenizer::from_dir(f.dir().unwrap()).unwrap();
            for p in ["a photo of a cat!!", "An astronaut, riding", ""] {
                assert_eq!(a.encode(p).unwrap(), b.encode(p).unwrap(), "{name} {p}");
            }
        }
    }
}
