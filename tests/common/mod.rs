//! Shared helpers for the integration tests: fixture paths, reference tensors, error metrics.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

pub mod cli;
pub mod full_size;

/// The repository root: `CARGO_MANIFEST_DIR` at run time (cargo sets it; `scripts/gpu-check`
/// sets it when it runs a test binary built on another machine), else where it was built.
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// `tests/fixtures/<name>` (e.g. `tiny-sd15`).
pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// A JSON reference file under tests/fixtures (`objective_reference.json`, …).
pub fn reference_json(name: &str) -> serde_json::Value {
    let path = fixture(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of numbers.
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap_or_else(|| panic!("not a number: {x}")))
        .collect()
}

/// A JSON array of sizes (a tensor's shape).
pub fn dims(v: &serde_json::Value) -> Vec<usize> {
    floats(v).into_iter().map(|x| x as usize).collect()
}

/// The reference tensors written by `tests/fixtures/make_fixtures.py` for one fixture.
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    let path = fixture("reference").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// A reference tensor by key, panicking with the key's name when it is absent.
pub fn get(refs: &HashMap<String, Tensor>, key: &str) -> Tensor {
    refs.get(key)
        .unwrap_or_else(|| panic!("reference tensor `{key}` missing"))
        .clone()
}

/// `‖a − b‖₂ / ‖b‖₂`, computed in f32 on the CPU.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let num = (&a - &b)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let den = b
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (num / den.max(1e-30)).sqrt()
}

/// Largest absolute difference, computed in f32 on the CPU (any device, any dtype).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let (a, b) = (cpu(a), cpu(b));
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A deterministic fill in [−1, 1) on the CPU that does not depend on any device RNG.
pub fn fill(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Standard normal draws on the CPU from a generator seeded with `seed`, so a failure reproduces
/// (candle's CPU `Tensor::randn` cannot be seeded).
pub fn randn(shape: &[usize], seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.sample(rand_distr::StandardNormal))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Copies the folder `from` (recursively) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Sets every adapter module's zero-initialised tensors (LoRA's `up`, LoHa's `hada_w2_a`, LoKr's
/// `w2` or `w2_b`) to seeded normal draws with standard deviation 0.5, and moves DoRA's
/// magnitude 20% off the base weight's norm, so that every factor changes the output.
pub fn randomise_adapters(modules: &[std::sync::Arc<sdtrain::adapter::LoraModule>]) {
    for (i, m) in modules.iter().enumerate() {
        for (j, (suffix, v)) in m.params.iter().enumerate() {
            let seed = (i * 16 + j) as u64;
            let zero = v.as_tensor().abs().unwrap().sum_all().unwrap();
            if *suffix == "dora_scale" {
                let noise = randn(v.dims(), seed).affine(0.2, 1.0).unwrap();
                v.set(&(v.as_tensor() * noise).unwrap()).unwrap();
            } else if zero.to_scalar::<f32>().unwrap() == 0.0 {
                v.set(&(randn(v.dims(), seed) * 0.5).unwrap()).unwrap();
            }
        }
    }
}

/// tiny-sd15's UNet output on the reference inputs (`unet.sample`, `unet.timesteps`,
/// `unet.encoder_hidden_states` of tests/fixtures/reference/tiny-sd15.safetensors).
pub fn sd15_unet_out(sd: &sdtrain::model::pipeline::StableDiffusion) -> Tensor {
    let refs = reference("tiny-sd15");
    sd.unet
        .forward(
            &get(&refs, "unet.sample"),
            &get(&refs, "unet.timesteps"),
            &get(&refs, "unet.encoder_hidden_states"),
            None,
        )
        .unwrap()
}

/// The fixture pipeline `tests/fixtures/<name>` on the CPU in f32, everything frozen (the
/// adapter tests attach to it).
pub fn load_frozen_f32(name: &str) -> sdtrain::model::pipeline::StableDiffusion {
    load_frozen_f32_at(&fixture(name))
}

/// [`load_frozen_f32`] of the model folder `root`.
pub fn load_frozen_f32_at(root: &Path) -> sdtrain::model::pipeline::StableDiffusion {
    load_f32(sdtrain::model::layout::ModelLayout::read(root, None).unwrap())
}

/// The adapter settings the LyCORIS reference scripts use (tests/fixtures/lycoris*_reference.py):
/// rank = conv rank 2, alpha = conv alpha 1.5, text encoders trained.
pub fn lycoris_plan(
    init_from: Option<PathBuf>,
    save_dtype: sdtrain::config::SaveDtype,
) -> sdtrain::config::AdapterPlan {
    sdtrain::config::AdapterPlan {
        rank: 2,
        alpha: 1.5,
        conv_rank: 2,
        conv_alpha: 1.5,
        train_text_encoder: true,
        train_unet: true,
        unet_lr: None,
        text_encoder_lr: None,
        dropout: 0.0,
        factor: -1,
        init_from,
        save_dtype,
        training_metadata: true,
        training_comment: None,
        dim_from_weights: false,
        loraplus: Default::default(),
        rank_dropout: 0.0,
        module_dropout: 0.0,
        blocks: None,
        layer_filter: None,
        scale_weight_norms: None,
    }
}

/// Attaches `mode` with `plan` to `sd` (seed 7), sets every factor to seeded random values and
/// saves the adapter file to `path`: the files the LyCORIS reference scripts read.
pub fn write_random_adapter(
    mut sd: sdtrain::model::pipeline::StableDiffusion,
    mode: sdtrain::config::TrainMode,
    plan: sdtrain::config::AdapterPlan,
    path: &Path,
) {
    use sdtrain::train::adapters::{attach_with, SaveInfo};
    let a = attach_with(&mut sd, mode, plan, 7).unwrap();
    randomise_adapters(&a.modules);
    let info = SaveInfo {
        steps: 1,
        epoch: 1,
        num_train_images: 1,
        resolution: 32,
        seed: 7,
        unet_lr: 1e-4,
        text_encoder_lr: None,
        output_name: "sdtrain",
        started_at: 0.0,
        run: None,
        bundle: &[],
    };
    a.save(path, info).unwrap();
}

/// A copy of fixture `name` in `dir` whose SD1/SD2 text encoder's final LayerNorm has the bias
/// `-0.1 - 0.001·i` (SDXL's is left alone). The tiny fixtures' zero bias makes their encodings
/// average ~1e-9, so kohya's mean-keeping prompt weighting divides by about nothing (inf, NaN)
/// where real CLIP's non-zero bias keeps it stable; tests/fixtures/kohya_prompt_reference.py
/// gives its copy the same bias.
pub fn with_text_ln_bias(name: &str, dir: &Path) -> PathBuf {
    let root = dir.join(name);
    copy_dir(&fixture(name), &root);
    if name != "tiny-sdxl" {
        let file = root.join("text_encoder/model.safetensors");
        let mut w = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        let key = "text_model.final_layer_norm.bias";
        let n = w[key].elem_count();
        let bias: Vec<f32> = (0..n).map(|i| -0.1 - 0.001 * i as f32).collect();
        w.insert(key.into(), Tensor::new(bias, &Device::Cpu).unwrap());
        std::fs::remove_file(&file).unwrap();
        candle_core::safetensors::save(&w, &file).unwrap();
    }
    root
}

/// The model at `layout` on the CPU in f32, everything frozen (a layout with a `vae` in place of
/// its own, for one).
pub fn load_f32(
    layout: sdtrain::model::layout::ModelLayout,
) -> sdtrain::model::pipeline::StableDiffusion {
    let opts = sdtrain::model::pipeline::LoadOptions {
        dtype: DType::F32,
        trained_dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
    };
    sdtrain::model::pipeline::StableDiffusion::load(layout, &opts).unwrap()
}

/// A safetensors file's f32 tensors by name (an adapter file saved with `save_dtype: "fp32"`).
pub fn f32_tensors(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let v = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, v)
        })
        .collect()
}

/// Every Linear and Conv2d weight of the UNet and text encoders, keyed
/// `<component>.<module path>.weight` as diffusers' state dicts name them.
pub fn layer_weights(
    sd: &mut sdtrain::model::pipeline::StableDiffusion,
) -> HashMap<String, Tensor> {
    use sdtrain::nn::{LayerMut, VisitLayers};
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

/// A diffusers state-dict key's weight in [`layer_weights`]: transformers 5's CLIPTextModel names
/// its layers without the `text_model.` level sdtrain's paths keep.
pub fn layer_weight<'a>(all: &'a HashMap<String, Tensor>, key: &str) -> Option<&'a Tensor> {
    all.get(key).or_else(|| {
        let (comp, rest) = key.split_once('.')?;
        all.get(&format!("{comp}.text_model.{rest}"))
    })
}

/// The Frobenius norm of `t` (f32).
pub fn frobenius(t: &Tensor) -> f32 {
    t.sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt()
}
