//! AutoencoderKL parity with diffusers 0.42.1 on the tiny fixtures (relative L2: f32 ≤ 1e-4,
//! bf16 ≤ 3e-2 against the f32 reference), plus gradient flow, latent scaling and config errors.
//!
//! Expected tensors come from `tests/fixtures/make_fixtures.py` (`reference_*`, keys `vae.*`):
//! `vae.image` is uniform in [−1, 1]; `vae.latent_mean`/`vae.latent_std` are
//! `vae.encode(image).latent_dist.{mean,std}` (unscaled); `vae.decoded` is
//! `vae.decode(latent_mean).sample`. Rerun it with the command in that file's docstring.

mod common;

use candle_core::{DType, Device, Tensor};
use sdtrain::model::vae::{AutoencoderKL, VaeConfig};
use sdtrain::model::weights::Weights;
use sdtrain::nn::{LayerMut, VisitLayers};

const FIXTURES: [&str; 3] = ["tiny-sd15", "tiny-sd21", "tiny-sdxl"];

fn load_vae(name: &str, dtype: DType, trainable: bool) -> (AutoencoderKL, Weights) {
    let dir = common::fixture(name).join("vae");
    let cfg = VaeConfig::from_file(dir.join("config.json")).unwrap();
    let files = [dir.join("diffusion_pytorch_model.safetensors")];
    let w = Weights::from_files(&files, "vae", dtype, &Device::Cpu, trainable).unwrap();
    let vae = AutoencoderKL::new(&w, &cfg).unwrap();
    assert!(
        w.unused().is_empty(),
        "{name}: unused tensors: {:?}",
        w.unused()
    );
    (vae, w)
}

/// Relative errors of (latent_mean, latent_std, decoded) with weights and activations in `dtype`.
fn vae_errors(name: &str, dtype: DType) -> [f32; 3] {
    let refs = common::reference(name);
    let (vae, _) = load_vae(name, dtype, false);
    let cast = |k: &str| common::get(&refs, k).to_dtype(dtype).unwrap();
    let dist = vae.encode(&cast("vae.image")).unwrap();
    let decoded = vae.decode(&cast("vae.latent_mean")).unwrap();
    assert_eq!(dist.mean.dtype(), dtype);
    assert_eq!(decoded.dtype(), dtype);
    let errs = [
        common::rel_err(&dist.mean, &common::get(&refs, "vae.latent_mean")),
        common::rel_err(&dist.std, &common::get(&refs, "vae.latent_std")),
        common::rel_err(&decoded, &common::get(&refs, "vae.decoded")),
    ];
    eprintln!(
        "{name} {dtype:?}: latent_mean {:.2e}, latent_std {:.2e}, decoded {:.2e}",
        errs[0], errs[1], errs[2]
    );
    errs
}

#[test]
fn vae_f32_matches_diffusers() {
    for name in FIXTURES {
        let errs = vae_errors(name, DType::F32);
        for (what, e) in ["latent_mean", "latent_std", "decoded"].iter().zip(errs) {
            assert!(e <= 1e-4, "{name} f32 {what}: rel err {e:.3e} > 1e-4");
        }
    }
}

/// bf16 bounds against the f32 reference. diffusers itself, run in bf16 on the CPU (torch 2.11),
/// reaches decoded errors of 2.76e-2 (sd15), 2.08e-2 (sd21) and 2.34e-2 (sdxl), so 3e-2 leaves
/// little room. sdtrain's CPU bf16 path rounds once per layer as torch does (`nn::silu`,
/// `nn::Linear` and `nn::Conv2d` compute in f32 and round at the end); rounding after each
/// elementary step had measured 3.29e-2 on sd15.
///
/// The diffusers bf16 numbers come from (repository root, the fixtures' Python environment):
/// ```text
/// import torch; from diffusers import AutoencoderKL; from safetensors.torch import load_file
/// for n in ["tiny-sd15", "tiny-sd21", "tiny-sdxl"]:
///     ref = load_file(f"tests/fixtures/reference/{n}.safetensors")
///     vae = AutoencoderKL.from_pretrained(f"tests/fixtures/{n}/vae").to(torch.bfloat16)
///     with torch.no_grad():
///         dec = vae.decode(ref["vae.latent_mean"].bfloat16()).sample.float()
///     print(n, ((dec - ref["vae.decoded"]).norm() / ref["vae.decoded"].norm()).item())
/// ```
const BF16_LATENT_TOL: f32 = 3e-2;
const BF16_DECODED_TOL: f32 = 3e-2;

#[test]
fn vae_bf16_matches_diffusers_f32() {
    for name in FIXTURES {
        let errs = vae_errors(name, DType::BF16);
        let tols = [BF16_LATENT_TOL, BF16_LATENT_TOL, BF16_DECODED_TOL];
        for ((what, e), tol) in ["latent_mean", "latent_std", "decoded"]
            .iter()
            .zip(errs)
            .zip(tols)
        {
            assert!(e <= tol, "{name} bf16 {what}: rel err {e:.3e} > {tol:e}");
        }
    }
}

#[test]
fn vae_f16_runs_and_stays_close() {
    let errs = vae_errors("tiny-sd15", DType::F16);
    for e in errs {
        assert!(e <= 1e-2, "f16 rel err {e:.3e}");
    }
}

#[test]
fn vae_latent_scaling_uses_scaling_factor() {
    for name in FIXTURES {
        let refs = common::reference(name);
        let (vae, _) = load_vae(name, DType::F32, false);
        let image = common::get(&refs, "vae.image");
        let mean = common::get(&refs, "vae.latent_mean");
        let sf = vae.config.scaling_factor;
        assert_eq!(vae.config.shift_factor, None);
        let latents = vae.latents_from_image(&image, false).unwrap();
        let e = common::rel_err(&latents, &(&mean * sf).unwrap());
        assert!(
            e <= 1e-4,
            "{name}: latents_from_image vs mean·{sf}: {e:.3e}"
        );

        let back = vae.image_from_latents(&latents).unwrap();
        let e = common::rel_err(&back, &common::get(&refs, "vae.decoded"));
        assert!(e <= 1e-4, "{name}: image_from_latents vs decoded: {e:.3e}");

        // A posterior sample is mean + std·ε: with ε = 0 it is the mean, and a random draw
        // moves it by about std.
        let dist = vae.encode(&image).unwrap();
        let zero = dist
            .sample_with_noise(&dist.mean.zeros_like().unwrap())
            .unwrap();
        assert_eq!(common::rel_err(&zero, &dist.mean), 0.0);
        let eps = ((dist.sample().unwrap() - &dist.mean).unwrap() / &dist.std).unwrap();
        let var = eps
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((0.5..1.5).contains(&var), "{name}: noise variance {var}");
        let sampled = vae.latents_from_image(&image, true).unwrap();
        assert_eq!(sampled.dims(), latents.dims());
    }
}

#[test]
fn vae_gradients_reach_every_parameter() {
    let refs = common::reference("tiny-sd15");
    let (vae, w) = load_vae("tiny-sd15", DType::F32, true);
    let image = common::get(&refs, "vae.image");
    let decoded = vae.decode(&vae.encode(&image).unwrap().mean).unwrap();
    let loss = decoded.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let params = w.params();
    assert!(!params.is_empty());
    let mut bad = Vec::new();
    for (name, var) in &params {
        let ok = grads.get(var).is_some_and(|g| {
            let g = g.to_dtype(DType::F32).unwrap();
            let finite = g
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|v| v.is_finite());
            let norm = g
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            finite && norm > 0.0
        });
        if !ok {
            bad.push(name.clone());
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} params without a finite non-zero gradient: {bad:?}",
        bad.len(),
        params.len()
    );
}

#[test]
fn vae_visit_layers_reaches_every_conv_and_linear() {
    let (mut vae, w) = load_vae("tiny-sd15", DType::F32, true);
    let mut paths = Vec::new();
    vae.visit_layers(&mut |layer| match layer {
        LayerMut::Linear(l) => paths.push(format!("{}.weight", l.path)),
        LayerMut::Conv2d(c) => paths.push(format!("{}.weight", c.path)),
    });
    let mut want: Vec<String> = w
        .params()
        .into_iter()
        .filter(|(n, v)| n.ends_with(".weight") && v.rank() != 1)
        .map(|(n, _)| n)
        .collect();
    paths.sort();
    want.sort();
    assert_eq!(paths, want);
}

#[test]
fn vae_config_rejects_unknown_down_block_type_naming_file_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let text =
        std::fs::read_to_string(common::fixture("tiny-sd15").join("vae/config.json")).unwrap();
    let text = text.replacen("\"DownEncoderBlock2D\"", "\"AttnDownEncoderBlock2D\"", 1);
    std::fs::write(&path, text).unwrap();
    let msg = VaeConfig::from_file(&path).unwrap_err().to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("AttnDownEncoderBlock2D"), "{msg}");
    assert!(msg.contains("down_block_types[0]"), "{msg}");
}

#[test]
fn vae_config_reads_fixture_fields() {
    let cfg = VaeConfig::from_file(common::fixture("tiny-sdxl").join("vae/config.json")).unwrap();
    assert_eq!(cfg.scaling_factor, 0.13025);
    assert_eq!(cfg.downscale_factor(), 2);
    assert!(cfg.force_upcast);
    let missing = VaeConfig::from_file("/nonexistent/vae/config.json")
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("/nonexistent/vae/config.json"),
        "{missing}"
    );
}

#[test]
fn vae_legacy_attention_names_load() {
    // VAEs saved before diffusers 0.14 name the mid-block attention query/key/value/proj_attn.
    let name = "tiny-sd15";
    let dir = common::fixture(name).join("vae");
    let src = candle_core::safetensors::load(
        dir.join("diffusion_pytorch_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let renamed: std::collections::HashMap<String, Tensor> = src
        .into_iter()
        .map(|(k, v)| {
            let k = k
                .replace("attentions.0.to_q.", "attentions.0.query.")
                .replace("attentions.0.to_k.", "attentions.0.key.")
                .replace("attentions.0.to_v.", "attentions.0.value.")
                .replace("attentions.0.to_out.0.", "attentions.0.proj_attn.");
            (k, v)
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("legacy.safetensors");
    candle_core::safetensors::save(&renamed, &file).unwrap();
    let cfg = VaeConfig::from_file(dir.join("config.json")).unwrap();
    let w = Weights::from_files(&[file], "vae", DType::F32, &Device::Cpu, false).unwrap();
    let vae = AutoencoderKL::new(&w, &cfg).unwrap();
    assert!(w.unused().is_empty(), "unused tensors: {:?}", w.unused());
    let refs = common::reference(name);
    let decoded = vae.decode(&common::get(&refs, "vae.latent_mean")).unwrap();
    let e = common::rel_err(&decoded, &common::get(&refs, "vae.decoded"));
    assert!(e <= 1e-4, "legacy names: decoded rel err {e:.3e}");
}
