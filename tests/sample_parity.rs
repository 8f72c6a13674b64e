//! The samplers against diffusers (`tests/fixtures/sample_reference.py`):
//! - each scheduler step (DDIM, DDPM, PNDM with and without Runge–Kutta steps, Euler, Euler
//!   ancestral, LMS, KDPM2 ancestral, DPM-Solver++ 2M and its SDE form, DPM-Solver++ single-step
//!   and DPM++ SDE, with and without Karras sigmas; several
//!   spacings, both prediction types, zero terminal SNR, solver orders 1–3, midpoint and Heun, a
//!   final σ of zero or σ_min, λ clipping) from the same latents, model outputs and noise: the
//!   timesteps, the σ table, the model's input and the latents after every step, and how many
//!   noise draws each takes;
//! - whole pipelines on the tiny fixtures from the same initial latents and ancestral noise (two
//!   with guidance rescale, one of them on the zero-terminal-SNR schedule): the latents after
//!   every step and the decoded image.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::sample::generate::{decode, denoise, zero_empty_negative};
use sdtrain::sample::prompts::PromptSyntax;
use sdtrain::sample::{PromptConds, SampleRequest, SamplerKind, SchedulerConfig, UnetRun};
use serde_json::Value;

fn reference() -> (HashMap<String, Tensor>, Value) {
    let dir = common::fixture("reference");
    let tensors =
        candle_core::safetensors::load(dir.join("sample_reference.safetensors"), &Device::Cpu)
            .expect("sample_reference.safetensors");
    let meta = std::fs::read_to_string(dir.join("sample_reference.json")).unwrap();
    (tensors, serde_json::from_str(&meta).unwrap())
}

fn steps_of(t: &Tensor) -> Vec<Tensor> {
    (0..t.dim(0).unwrap()).map(|i| t.get(i).unwrap()).collect()
}

/// `max |x|`, at least 1.
fn magnitude(t: &Tensor) -> f32 {
    max_diff(t, &t.zeros_like().unwrap()).max(1.0)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    common::max_abs_diff(a, b)
}

#[test]
fn scheduler_steps_match_diffusers() {
    let (refs, meta) = reference();
    let cases = meta["schedulers"].as_array().unwrap();
    assert_eq!(cases.len(), 50);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let get = |k: &str| common::get(&refs, &format!("{name}.{k}"));
        let cfg = SchedulerConfig::from_config(&case["config"], Path::new(name)).unwrap();
        let kind = SamplerKind::parse(case["sampler"].as_str().unwrap()).unwrap();
        let steps = case["steps"].as_u64().unwrap() as usize;
        let sampler = kind.build(&cfg, steps).unwrap();

        let want_t: Vec<f32> = get("timesteps").to_vec1().unwrap();
        let got_t: Vec<f32> = sampler.timesteps().iter().map(|&t| t as f32).collect();
        assert_eq!(
            got_t.len(),
            want_t.len(),
            "{name}: timesteps {got_t:?} vs {want_t:?}"
        );
        for (&g, &w) in got_t.iter().zip(&want_t) {
            // Whole timesteps exactly; those read back from a σ within 1e-5 relative (at least
            // 1e-3): the σ differ by ~1e-6 relative (diffusers' betas are float32, sdtrain's
            // float64), and near t = 0 a timestep moves ~50× faster than ln σ. A timestep read
            // from the wrong neighbours is off by more than 0.01.
            let tolerance = match w.fract() == 0.0 && g.fract() == 0.0 {
                true => 0.0,
                false => 1e-5 * w.abs().max(100.0),
            };
            assert!(
                (g - w).abs() <= tolerance,
                "{name}: timesteps {got_t:?} vs {want_t:?}"
            );
        }
        // Every σ (catches an off-by-one in an interleaved table or a wrong final σ even where
        // the latents would hide it); within 1e-5 relative, as the timesteps.
        match (
            refs.contains_key(&format!("{name}.sigmas")),
            sampler.sigmas(),
        ) {
            (true, Some(got)) => {
                let want: Vec<f32> = get("sigmas").to_vec1().unwrap();
                assert_eq!(got.len(), want.len(), "{name}: σ count");
                for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let d = (g as f32 - w).abs();
                    assert!(d <= 1e-5 * w.abs().max(1.0), "{name}: σ[{k}] {g} vs {w}");
                }
            }
            (false, None) => {}
            (want, got) => panic!(
                "{name}: σ table in diffusers {want}, here {}",
                got.is_some()
            ),
        }
        let init = case["init_noise_sigma"].as_f64().unwrap();
        assert!(
            (sampler.init_noise_sigma() - init).abs() <= 1e-5 * init,
            "{name}: init_noise_sigma {} vs {init}",
            sampler.init_noise_sigma()
        );

        let outs = steps_of(&get("out"));
        let noises = steps_of(&get("noise"));
        let inputs = steps_of(&get("input"));
        let prevs = steps_of(&get("prev"));
        let mut used = 0;
        let mut noise = |dims: &[usize]| {
            let n = noises[used].clone();
            used += 1;
            assert_eq!(n.dims(), dims);
            Ok(n)
        };
        let mut x = get("x");
        let mut worst = 0f32;
        for i in 0..want_t.len() {
            // Relative to the values' size: DDIM without clipping grows them to ~10³ here.
            let input = sampler.scale_model_input(&x, i).unwrap();
            let scale = magnitude(&inputs[i]);
            let d = max_diff(&input, &inputs[i]);
            assert!(
                d < 2e-5 * scale,
                "{name} step {i}: model input differs by {d}"
            );
            x = sampler.step(i, &outs[i], &x, &mut noise).unwrap();
            let scale = magnitude(&prevs[i]);
            let d = max_diff(&x, &prevs[i]);
            worst = worst.max(d / scale);
            assert!(
                d < 2e-5 * scale,
                "{name} step {i}: latents differ by {d} (scale {scale})"
            );
        }
        eprintln!("{name}: latents within {worst:.1e} relative");
        let draws = case["noise_used"].as_u64().unwrap() as usize;
        assert_eq!(used, draws, "{name}: noise draws");
    }
}

fn load(fixture: &str) -> StableDiffusion {
    let layout = ModelLayout::read(&common::fixture(fixture), None).unwrap();
    let opts = LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    StableDiffusion::load(layout, &opts).unwrap()
}

#[test]
fn pipelines_match_diffusers_step_by_step() {
    let (refs, meta) = reference();
    let cases = meta["pipelines"].as_array().unwrap();
    assert_eq!(cases.len(), 16);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let get = |k: &str| common::get(&refs, &format!("{name}.{k}"));
        let sd = load(case["fixture"].as_str().unwrap());
        let req = SampleRequest {
            prompt: case["prompt"].as_str().unwrap().into(),
            negative_prompt: case["negative_prompt"].as_str().unwrap().into(),
            seed: 0,
            width: 32,
            height: 32,
            steps: case["steps"].as_u64().unwrap() as usize,
            cfg: case["cfg"].as_f64().unwrap(),
            guidance_rescale: case["guidance_rescale"].as_f64().unwrap(),
            sampler: SamplerKind::parse(case["sampler"].as_str().unwrap()).unwrap(),
        };
        let mut config = sd.layout.scheduler_json().unwrap();
        for (k, v) in case["scheduler_overrides"].as_object().unwrap() {
            config[k] = v.clone();
        }
        let cfg = SchedulerConfig::from_config(&config, Path::new(name)).unwrap();
        let sampler = req.sampler.build(&cfg, req.steps).unwrap();
        let conds = PromptConds::encode(
            &sd,
            &req.prompt,
            &req.negative_prompt,
            req.guided(),
            0,
            zero_empty_negative(&sd),
            PromptSyntax::Compel,
        )
        .unwrap();
        let latents = (get("latents") * sampler.init_noise_sigma()).unwrap();
        let noises = steps_of(&get("noise"));
        let want_steps = steps_of(&get("steps"));
        for batch_halves in [true, false] {
            let mut used = 0;
            let mut noise = |_: &[usize]| {
                used += 1;
                Ok(noises[used - 1].clone())
            };
            let mut diffs = Vec::new();
            let mut on_step = |i: usize, x: &Tensor| diffs.push((i, max_diff(x, &want_steps[i])));
            let run = UnetRun {
                dtype: DType::F32,
                batch_halves,
            };
            let x = denoise(
                &sd,
                run,
                sampler.as_ref(),
                &conds,
                &req,
                latents.clone(),
                &mut noise,
                &mut on_step,
            )
            .unwrap();
            assert_eq!(diffs.len(), want_steps.len(), "{name}");
            assert_eq!(
                used,
                case["noise_used"].as_u64().unwrap() as usize,
                "{name}"
            );
            for &(i, d) in &diffs {
                // 1e-4, or a relative 1e-5 where the latents grow past 10 (DPM-Solver++ with
                // Karras sigmas reaches 52 here; its x̂₀ divides the UNet's output by α ≈ 0.07).
                let tolerance = 1e-4 * (magnitude(&want_steps[i]) / 10.0).max(1.0);
                assert!(
                    d < tolerance,
                    "{name} (halves batched: {batch_halves}) step {i}: latents differ by {d}"
                );
            }
            let image = decode(sd.vae().unwrap(), &x)
                .unwrap()
                .permute((1, 2, 0))
                .unwrap();
            let d = max_diff(&image, &get("image"));
            assert!(d < 1e-4, "{name}: image differs by {d}");
        }
    }
}

/// An unguided pipeline (guidance amplifies bf16's rounding fivefold) with bf16 weights and UNet
/// inputs ends near the f32 reference, with f32 latents: the scheduler's arithmetic stays f32.
#[test]
fn bf16_sampling_stays_near_the_f32_reference() {
    let (refs, meta) = reference();
    let case = &meta["pipelines"][3];
    assert_eq!(case["cfg"].as_f64(), Some(1.0));
    let name = case["name"].as_str().unwrap();
    let get = |k: &str| common::get(&refs, &format!("{name}.{k}"));
    let layout =
        ModelLayout::read(&common::fixture(case["fixture"].as_str().unwrap()), None).unwrap();
    let opts = LoadOptions {
        dtype: DType::BF16,
        vae_dtype: Some(DType::F32),
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    let sd = StableDiffusion::load(layout, &opts).unwrap();
    let req = SampleRequest {
        prompt: case["prompt"].as_str().unwrap().into(),
        negative_prompt: String::new(),
        seed: 0,
        width: 32,
        height: 32,
        steps: case["steps"].as_u64().unwrap() as usize,
        cfg: case["cfg"].as_f64().unwrap(),
        guidance_rescale: 0.0,
        sampler: SamplerKind::Ddim,
    };
    let cfg = SchedulerConfig::from_layout(&sd.layout).unwrap();
    let sampler = req.sampler.build(&cfg, req.steps).unwrap();
    let conds =
        PromptConds::encode(&sd, &req.prompt, "", false, 0, false, PromptSyntax::Compel).unwrap();
    let run = UnetRun {
        dtype: DType::BF16,
        batch_halves: true,
    };
    let mut no_noise = |_: &[usize]| -> candle_core::Result<Tensor> { unreachable!() };
    let x = denoise(
        &sd,
        run,
        sampler.as_ref(),
        &conds,
        &req,
        get("latents"),
        &mut no_noise,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(x.dtype(), DType::F32);
    let want = common::get(&refs, &format!("{name}.steps"))
        .get(req.steps - 1)
        .unwrap();
    let err = common::rel_err(&x, &want);
    assert!(err < 3e-2, "bf16 latents rel err {err}");
}

/// Guidance rescale against diffusers' `rescale_noise_cfg` on a batch of 2 with different
/// spreads: catches statistics taken over the whole batch (the pipelines draw one image) or a
/// ratio upside down.
#[test]
fn guidance_rescale_matches_diffusers_rescale_noise_cfg() {
    let (refs, _) = reference();
    let get = |k: &str| common::get(&refs, &format!("rescale.{k}"));
    let out =
        sdtrain::sample::generate::rescale_guidance(&get("guided"), &get("cond"), 0.7).unwrap();
    let d = max_diff(&out, &get("out"));
    assert!(d < 1e-5, "differs by {d}");
}
