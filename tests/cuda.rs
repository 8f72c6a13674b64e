//! The CUDA test suite (`cargo test --features cuda --test cuda`): the same checks as the CPU
//! suite, run on the first CUDA device and compared with the CPU path.
//!
//! - every custom op (frozen linear/conv, the frozen norm affine and residual adds, the
//!   hand-over ops, the fused norms, softmax and GEGLU): forward and the gradients of the tracked
//!   operands, CUDA against CPU;
//! - UNet, text-encoder and VAE parity with the diffusers/transformers references on the three
//!   fixtures, in f32 (≤ 1e-4) and bf16 (≤ 3e-2);
//! - a tiny LoRA run and a tiny full fine-tune from the CLI entry point, whose per-step losses
//!   track the same run on the CPU with the same seed;
//! - the gradient store of a LoRA step holds exactly the adapter Vars;
//! - every optimizer's CUDA kernel against its host kernel, and its state resumed across devices;
//!   the 8-bit state kernels (src/optim/quant8.cu) against the host's quantization, bit for bit
//!   (tests/cuda/optim.rs);
//! - flash attention (src/nn/kernels/flash_attention.cu) against the CPU attention, forward and
//!   gradients, on SD's shapes, with its time beside chunked attention
//!   (tests/cuda/flash_attention.rs);
//! - the fused norm and GEGLU kernels (src/nn/kernels/norm.cu) against the CPU, forward and
//!   every gradient, on SD's shapes, and the LoRA layers that recompute a norm or GEGLU in their
//!   backward (tests/cuda/norm_kernels.rs);
//! - with the `nccl` feature, data parallel through NCCL on one card: the in-place sum, and a
//!   one-rank run from the CLI's torchrun path against the plain run (tests/cuda/dist.rs);
//! - the out-of-memory classifier on the real CUDA error types (tests/cuda/oom.rs; no device
//!   needed).
//!
//! The whole binary compiles only with the `cuda` feature: a plain `cargo test` builds it empty,
//! so no CUDA test counts as passed there. With the feature, every test that needs a device is
//! `#[ignore]`d: a machine without a GPU reports it as ignored, never as passed, and asked to run
//! (`--include-ignored`) it fails without one. `scripts/gpu-check` runs this binary on a GPU
//! machine with `--include-ignored`. Only the out-of-memory classifier needs no device and
//! always runs.
#![cfg(feature = "cuda")]

mod common;
#[cfg(feature = "nccl")]
#[path = "cuda/dist.rs"]
mod dist;
#[path = "cuda/flash_attention.rs"]
mod flash_attention;
#[path = "cuda/norm_kernels.rs"]
mod norm_kernels;
#[path = "cuda/oom.rs"]
mod oom;
#[path = "cuda/optim.rs"]
mod optim;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use sdtrain::adapter::{adapter_vars, attach_unet, AdapterMode, AdapterSpec};
use sdtrain::model::clip::{ClipTextConfig, ClipTextModel};
use sdtrain::model::unet::{AddedConditions, UNet2DConditionModel, UnetConfig};
use sdtrain::model::vae::{AutoencoderKL, VaeConfig};
use sdtrain::model::weights::Weights;
use sdtrain::nn;

const FIXTURES: [&str; 3] = ["tiny-sd15", "tiny-sd21", "tiny-sdxl"];

use common::{fill, max_abs_diff};

/// The first CUDA device. The tests that call this are `#[ignore]`d so that a machine without a
/// GPU reports them as ignored, never as passed; asked to run, they fail without one.
fn cuda(test: &str) -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| panic!("{test}: no CUDA device ({e})"))
}

/// One operand of an op under test: its value, and whether it is a tracked Var.
struct Operand {
    value: Tensor,
    tracked: bool,
}

fn var(shape: &[usize], seed: u64) -> Operand {
    Operand {
        value: fill(shape, seed),
        tracked: true,
    }
}

fn constant(shape: &[usize], seed: u64) -> Operand {
    Operand {
        value: fill(shape, seed),
        tracked: false,
    }
}

/// Runs `f` on `device` with `L = Σ f(args) · r`; returns the output, the gradient of every
/// tracked operand, and whether any untracked operand got a gradient entry.
fn run_op(
    device: &Device,
    ops: &[Operand],
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Tensor, Vec<Tensor>, bool) {
    let mut vars = Vec::new();
    let args: Vec<Tensor> = ops
        .iter()
        .map(|o| {
            let t = o.value.to_device(device).unwrap();
            if o.tracked {
                let v = Var::from_tensor(&t).unwrap();
                vars.push(v.clone());
                v.as_tensor().clone()
            } else {
                t
            }
        })
        .collect();
    let y = f(&args).unwrap();
    let r = fill(y.dims(), 99).to_device(device).unwrap();
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let gs = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("tracked operand has a gradient")
                .clone()
        })
        .collect();
    let constant_grad = args
        .iter()
        .zip(ops)
        .any(|(a, o)| !o.tracked && grads.get(a).is_some());
    (y, gs, constant_grad)
}

/// Forward and gradients of `f` on CUDA against the CPU, to `tol` (max abs).
fn check_op(
    dev: &Device,
    name: &str,
    ops: &[Operand],
    tol: f32,
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) {
    let (y_cpu, g_cpu, c_cpu) = run_op(&Device::Cpu, ops, f);
    let (y_gpu, g_gpu, c_gpu) = run_op(dev, ops, f);
    assert!(y_gpu.device().is_cuda(), "{name}: output left the device");
    let e = max_abs_diff(&y_gpu, &y_cpu);
    println!("{name}: forward max abs diff {e:.2e}");
    assert!(e <= tol, "{name}: forward differs by {e}");
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let e = max_abs_diff(a, b);
        println!("{name}: grad {i} max abs diff {e:.2e}");
        assert!(e <= tol, "{name}: gradient {i} differs by {e}");
    }
    assert_eq!(c_gpu, c_cpu, "{name}: constant-gradient entries differ");
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_custom_ops_match_cpu() {
    let dev = cuda("cuda_custom_ops_match_cpu");
    let tol = 1e-4;
    check_op(
        &dev,
        "frozen_linear",
        &[var(&[6, 5], 1), constant(&[7, 5], 2), constant(&[7], 3)],
        tol,
        &|a| nn::frozen_linear(&a[0], &a[1], Some(&a[2])),
    );
    check_op(
        &dev,
        "frozen_matmul",
        &[var(&[6, 5], 1), constant(&[7, 5], 2)],
        tol,
        &|a| nn::frozen_matmul(&a[0], &a[1]),
    );
    for (stride, padding) in [(1, 1), (2, 1), (1, 0)] {
        check_op(
            &dev,
            &format!("frozen_conv2d_bias s{stride} p{padding}"),
            &[
                var(&[2, 3, 8, 8], 4),
                constant(&[5, 3, 3, 3], 5),
                constant(&[5], 6),
            ],
            tol,
            &|a| nn::frozen_conv2d_bias(&a[0], &a[1], Some(&a[2]), padding, stride),
        );
    }
    check_op(
        &dev,
        "frozen_conv2d 1x1",
        &[var(&[2, 4, 6, 6], 7), constant(&[3, 4, 1, 1], 8)],
        tol,
        &|a| nn::frozen_conv2d(&a[0], &a[1], 0, 1),
    );
    // Trainable convs: both gradients, with the GEMM-form input gradient.
    for (stride, padding) in [(1, 1), (2, 1), (1, 0)] {
        check_op(
            &dev,
            &format!("conv2d_trainable s{stride} p{padding}"),
            &[var(&[2, 3, 9, 7], 40), var(&[5, 3, 3, 3], 41)],
            tol,
            &|a| nn::conv2d_trainable(&a[0], &a[1], padding, stride),
        );
    }
    // Memory-efficient attention (self and cross, remainder chunks), all operands tracked.
    for (lq, lk) in [(40, 40), (40, 13)] {
        check_op(
            &dev,
            &format!("chunked_attention {lq}x{lk}"),
            &[
                var(&[2, 3, lq, 8], 42),
                var(&[2, 3, lk, 8], 43),
                var(&[2, 3, lk, 8], 44),
            ],
            tol,
            &|a| nn::chunked_attention(&a[0], &a[1], &a[2], 0.35, Some(16)),
        );
    }
    // The fused norms (full fine-tune: every operand tracked; LoRA: frozen γ/β), softmax and
    // GEGLU.
    for (name, tracked) in [("all tracked", true), ("frozen affine", false)] {
        let affine = |seed| {
            if tracked {
                var(&[12], seed)
            } else {
                constant(&[12], seed)
            }
        };
        check_op(
            &dev,
            &format!("group_norm {name}"),
            &[var(&[3, 12, 5, 7], 50), affine(51), affine(52)],
            tol,
            &|a| nn::group_norm(&a[0], &a[1], &a[2], 4, 1e-5),
        );
        check_op(
            &dev,
            &format!("group_norm_silu {name}"),
            &[var(&[3, 12, 5, 7], 53), affine(54), affine(55)],
            tol,
            &|a| nn::group_norm_silu(&a[0], &a[1], &a[2], 4, 1e-5),
        );
        check_op(
            &dev,
            &format!("layer_norm {name}"),
            &[var(&[2, 5, 12], 56), affine(57), affine(58)],
            tol,
            &|a| nn::layer_norm(&a[0], &a[1], &a[2], 1e-5),
        );
    }
    check_op(
        &dev,
        "softmax_last_dim",
        &[var(&[2, 3, 5, 11], 59)],
        tol,
        &|a| nn::softmax_last_dim(&(&a[0] * 4.0)?),
    );
    check_op(&dev, "geglu", &[var(&[2, 3, 14], 60)], tol, &|a| {
        nn::geglu(&(&a[0] * 3.0)?)
    });
    // The norms' frozen γ/β and the resnets' time-embedding add.
    check_op(
        &dev,
        "frozen_broadcast_mul",
        &[var(&[2, 4, 3, 3], 9), constant(&[1, 4, 1, 1], 10)],
        tol,
        &|a| nn::frozen_broadcast_mul(&a[0], &a[1]),
    );
    check_op(
        &dev,
        "frozen_broadcast_add",
        &[var(&[2, 4, 3, 3], 11), constant(&[2, 4, 1, 1], 12)],
        tol,
        &|a| nn::frozen_broadcast_add(&a[0], &a[1]),
    );
    check_op(
        &dev,
        "broadcast_mul_const",
        &[var(&[3, 8], 13), constant(&[8], 14)],
        tol,
        &|a| nn::broadcast_mul_const(&a[0], &a[1]),
    );
    check_op(
        &dev,
        "broadcast_add_const",
        &[var(&[3, 8], 15), constant(&[8], 16)],
        tol,
        &|a| nn::broadcast_add_const(&a[0], &a[1]),
    );
    // Residual adds with one constant side, either way round.
    check_op(
        &dev,
        "add_maybe_const (const lhs)",
        &[constant(&[2, 6], 17), var(&[2, 6], 18)],
        tol,
        &|a| nn::add_maybe_const(&a[0], &a[1]),
    );
    check_op(
        &dev,
        "add_maybe_const (const rhs)",
        &[var(&[2, 6], 19), constant(&[2, 6], 20)],
        tol,
        &|a| nn::add_maybe_const(&a[0], &a[1]),
    );
    // The hand-over ops.
    check_op(
        &dev,
        "matmul_const_lhs",
        &[constant(&[6, 5], 21), var(&[4, 5], 22)],
        tol,
        &|a| nn::matmul_const_lhs(&a[0], &a[1]),
    );
    for (stride, padding) in [(1, 1), (2, 1)] {
        check_op(
            &dev,
            &format!("conv2d_const_input s{stride} p{padding}"),
            &[constant(&[2, 3, 8, 8], 23), var(&[4, 3, 3, 3], 24)],
            tol,
            &|a| nn::conv2d_const_input(&a[0], &a[1], padding, stride),
        );
    }
    check_op(
        &dev,
        "cat_with_const",
        &[var(&[2, 3, 4], 25), constant(&[2, 5, 4], 26)],
        tol,
        &|a| nn::cat_with_const(&a[0], &a[1], 1),
    );
    check_op(
        &dev,
        "sub_const",
        &[var(&[3, 7], 27), constant(&[3, 7], 28)],
        tol,
        &|a| nn::sub_const(&a[0], &a[1]),
    );
}

/// A conv whose columns exceed the budget of one GEMM (256 channels, 3×3, at 192² in f32: 340 MB
/// of columns, batch 1; and at 256² through a stride 2 with batch 2: 302 MB) runs in chunks of
/// output rows on CUDA, and both its gradients in bands of rows (src/nn/conv_windows.rs), and
/// all three equal the CPU's.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_large_conv_runs_in_row_chunks_and_matches_cpu() {
    let dev = cuda("cuda_large_conv_runs_in_row_chunks_and_matches_cpu");
    let on_cpu = |t: Tensor| t.to_device(&Device::Cpu).unwrap();
    let check = |what: &str, got: &Tensor, want: &Tensor| {
        assert_eq!(got.dims(), want.dims(), "{what}");
        let scale = max_abs_diff(want, &want.zeros_like().unwrap());
        let e = max_abs_diff(got, want);
        eprintln!("large conv {what}: max abs diff {e:.2e} (scale {scale:.2})");
        assert!(e <= 1e-4 * scale, "{what}: {e} (scale {scale})");
    };
    for (batch, size, stride) in [(1, 192, 1), (2, 256, 2)] {
        let x = fill(&[batch, 256, size, size], 41);
        let w = (fill(&[64, 256, 3, 3], 42) * 0.05).unwrap();
        let (xd, wd) = (x.to_device(&dev).unwrap(), w.to_device(&dev).unwrap());
        let shape = format!("b{batch} {size}² s{stride}");
        let want = nn::conv2d_detached(&x, &w, 1, stride).unwrap();
        let got = on_cpu(nn::conv2d_detached(&xd, &wd, 1, stride).unwrap());
        check(&format!("forward {shape}"), &got, &want);
        let g = fill(want.dims(), 43);
        let gd = g.to_device(&dev).unwrap();
        let want = nn::conv2d_input_grad(&g, &w, 1, stride, (size, size)).unwrap();
        let got = on_cpu(nn::conv2d_input_grad(&gd, &wd, 1, stride, (size, size)).unwrap());
        check(&format!("input grad {shape}"), &got, &want);
        let want = nn::conv2d_weight_grad(&x, &g, 1, stride, (3, 3)).unwrap();
        let got = on_cpu(nn::conv2d_weight_grad(&xd, &gd, 1, stride, (3, 3)).unwrap());
        check(&format!("weight grad {shape}"), &got, &want);
    }
}

fn weights(dir: &Path, file: &str, component: &str, dtype: DType, dev: &Device) -> Weights {
    Weights::from_files(&[dir.join(file)], component, dtype, dev, false).unwrap()
}

/// UNet output on `dev` in `dtype` against the diffusers reference.
fn unet_err(name: &str, dtype: DType, dev: &Device) -> f32 {
    let refs = common::reference(name);
    let dir = common::fixture(name).join("unet");
    let cfg = UnetConfig::from_file(&dir.join("config.json")).unwrap();
    let w = weights(
        &dir,
        "diffusion_pytorch_model.safetensors",
        "unet",
        dtype,
        dev,
    );
    let unet = UNet2DConditionModel::new(&w, &cfg).unwrap();
    let get = |k: &str| common::get(&refs, k).to_device(dev).unwrap();
    let cast = |k: &str| get(k).to_dtype(dtype).unwrap();
    let added = refs.contains_key("unet.time_ids").then(|| AddedConditions {
        text_embeds: cast("unet.text_embeds"),
        time_ids: get("unet.time_ids"),
    });
    let out = unet
        .forward(
            &cast("unet.sample"),
            &get("unet.timesteps"),
            &cast("unet.encoder_hidden_states"),
            added.as_ref(),
        )
        .unwrap();
    assert!(out.device().is_cuda() && out.dtype() == dtype);
    common::rel_err(&out, &common::get(&refs, "unet.out"))
}

/// Text-encoder outputs (last hidden state, penultimate, pooled or projected) on `dev`.
fn text_encoder_errs(name: &str, sub: &str, prefix: &str, dtype: DType, dev: &Device) -> Vec<f32> {
    let refs = common::reference(name);
    let dir = common::fixture(name).join(sub);
    let cfg = ClipTextConfig::from_file(dir.join("config.json")).unwrap();
    let projection = prefix == "te2";
    let te = ClipTextModel::new(
        &weights(&dir, "model.safetensors", sub, dtype, dev),
        &cfg,
        projection,
    )
    .unwrap();
    let ids = common::get(&refs, &format!("{prefix}.input_ids"))
        .to_device(dev)
        .unwrap();
    let last = te.forward(&ids, 0).unwrap();
    let pen = te.forward(&ids, 1).unwrap();
    let key = |k: &str| common::get(&refs, &format!("{prefix}.{k}"));
    let mut errs = vec![
        common::rel_err(&last.last_hidden_state, &key("last_hidden_state")),
        common::rel_err(&pen.hidden, &key("penultimate")),
    ];
    errs.push(match last.text_embeds {
        Some(e) if projection => common::rel_err(&e, &key("text_embeds")),
        _ => common::rel_err(&last.pooled, &key("pooled")),
    });
    errs
}

/// VAE latent mean, std and decoded image on `dev`.
fn vae_errs(name: &str, dtype: DType, dev: &Device) -> Vec<f32> {
    let refs = common::reference(name);
    let dir = common::fixture(name).join("vae");
    let cfg = VaeConfig::from_file(dir.join("config.json")).unwrap();
    let w = weights(
        &dir,
        "diffusion_pytorch_model.safetensors",
        "vae",
        dtype,
        dev,
    );
    let vae = AutoencoderKL::new(&w, &cfg).unwrap();
    let cast = |k: &str| {
        common::get(&refs, k)
            .to_device(dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    let dist = vae.encode(&cast("vae.image")).unwrap();
    let decoded = vae.decode(&cast("vae.latent_mean")).unwrap();
    vec![
        common::rel_err(&dist.mean, &common::get(&refs, "vae.latent_mean")),
        common::rel_err(&dist.std, &common::get(&refs, "vae.latent_std")),
        common::rel_err(&decoded, &common::get(&refs, "vae.decoded")),
    ]
}

fn assert_within(what: &str, errs: &[f32], tol: f32) {
    let worst = errs.iter().copied().fold(0f32, f32::max);
    let all: Vec<String> = errs.iter().map(|e| format!("{e:.2e}")).collect();
    println!("{what}: worst rel err {worst:.3e} ({})", all.join(", "));
    assert!(worst <= tol, "{what}: rel err {worst:.3e} > {tol:.0e}");
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_models_match_references_in_f32_and_bf16() {
    let dev = cuda("cuda_models_match_references_in_f32_and_bf16");
    for name in FIXTURES {
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
            let tag = format!("{name} {dtype:?} cuda");
            assert_within(&format!("{tag} unet"), &[unet_err(name, dtype, &dev)], tol);
            let te = text_encoder_errs(name, "text_encoder", "te", dtype, &dev);
            assert_within(&format!("{tag} text_encoder"), &te, tol);
            if name == "tiny-sdxl" {
                let te2 = text_encoder_errs(name, "text_encoder_2", "te2", dtype, &dev);
                assert_within(&format!("{tag} text_encoder_2"), &te2, tol);
            }
            assert_within(&format!("{tag} vae"), &vae_errs(name, dtype, &dev), tol);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_lora_grad_store_holds_exactly_the_adapter_vars() {
    let dev = cuda("cuda_lora_grad_store_holds_exactly_the_adapter_vars");
    let refs = common::reference("tiny-sd15");
    let dir = common::fixture("tiny-sd15").join("unet");
    let cfg = UnetConfig::from_file(&dir.join("config.json")).unwrap();
    let w = weights(
        &dir,
        "diffusion_pytorch_model.safetensors",
        "unet",
        DType::F32,
        &dev,
    );
    let mut unet = UNet2DConditionModel::new(&w, &cfg).unwrap();
    for mode in [AdapterMode::Lora, AdapterMode::Locon] {
        let spec = AdapterSpec {
            mode,
            rank: 4,
            alpha: 2.0,
            conv_rank: 2,
            conv_alpha: 1.0,
            dropout: 0.0,
            factor: -1,
            seed: 7,
        };
        // A fresh UNet per mode: attaching twice is an error.
        if mode == AdapterMode::Locon {
            unet = UNet2DConditionModel::new(&w, &cfg).unwrap();
        }
        let mods = attach_unet(&mut unet, &spec).unwrap();
        let vars = adapter_vars(&mods);
        let get = |k: &str| common::get(&refs, k).to_device(&dev).unwrap();
        let out = unet
            .forward(
                &get("unet.sample"),
                &get("unet.timesteps"),
                &get("unet.encoder_hidden_states"),
                None,
            )
            .unwrap();
        let target = Tensor::zeros_like(&out).unwrap();
        let loss = sdtrain::diffusion::objective::mse_loss(&out, &target, None).unwrap();
        let grads = loss.backward().unwrap();
        let adapter_ids: HashSet<_> = vars.iter().map(|v| v.as_tensor().id()).collect();
        let stray: Vec<Vec<usize>> = grads
            .get_ids()
            .filter(|id| !adapter_ids.contains(id))
            .filter_map(|id| grads.get_id(*id).map(|g| g.dims().to_vec()))
            .collect();
        println!(
            "{mode:?} on CUDA: {} adapter Vars, {} other entries",
            vars.len(),
            stray.len()
        );
        assert!(
            stray.is_empty(),
            "{mode:?}: non-adapter gradients {stray:?}"
        );
        for v in &vars {
            let g = grads
                .get(v.as_tensor())
                .expect("every adapter Var has a gradient");
            assert!(g.device().is_cuda());
        }
    }
}

/// Runs `sdtrain --config` in-process (the CLI entry point) and returns the per-step losses
/// from the run's train_log.jsonl and the memory source it logged.
fn train_losses(tmp: &Path, tag: &str, extra: serde_json::Value, cpu: bool) -> (Vec<f64>, String) {
    let dir = tmp.join(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = serde_json::json!({
        "model": common::fixture("tiny-sd15"),
        "data_root": common::repo_root().join("data/demo"),
        "output_dir": dir.join("out"),
        "resolution": 64,
        "batch_size": 2,
        "max_steps": 4,
        "lr": 1e-3,
        "log_step": 1,
        "seed": 3,
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let config = dir.join("train.json");
    std::fs::write(&config, cfg.to_string()).unwrap();
    let mut args = vec![
        "sdtrain".to_string(),
        "--config".into(),
        config.display().to_string(),
    ];
    if cpu {
        args.push("--cpu".into());
    }
    let cli = sdtrain::cli::Cli::try_parse_from(&args).unwrap();
    sdtrain::cli::run(cli).unwrap_or_else(|e| panic!("{tag}: {e:#}"));
    let run: PathBuf = std::fs::read_dir(dir.join("out"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let mut source = String::new();
    let losses = log
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            source = v["memory"]["source"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            v["loss"].as_f64().unwrap()
        })
        .collect();
    (losses, source)
}

/// A CUDA run with `extra` plus `cuda_extra` tracks the CPU f32 run with `extra` within `tol`
/// (relative, per step).
fn check_run_tracks_cpu(test: &str, extra: serde_json::Value) {
    check_run_tracks_cpu_with(test, extra, serde_json::json!({}), 2e-3)
}

fn check_run_tracks_cpu_with(
    test: &str,
    extra: serde_json::Value,
    cuda_extra: serde_json::Value,
    tol: f64,
) {
    cuda(test);
    let tmp = tempfile::tempdir().unwrap();
    // f32 on both sides unless `cuda_extra` says otherwise (CUDA's default is bf16).
    let mut extra = extra;
    extra["amp"] = "off".into();
    let mut on_cuda = extra.clone();
    if let (Some(c), Some(e)) = (on_cuda.as_object_mut(), cuda_extra.as_object()) {
        c.extend(e.clone());
    }
    let (gpu, gpu_source) = train_losses(tmp.path(), "cuda", on_cuda, false);
    let (cpu, cpu_source) = train_losses(tmp.path(), "cpu", extra, true);
    println!("{test}: cuda losses {gpu:?}\n{test}: cpu losses  {cpu:?}");
    assert_eq!(gpu_source, "cuda_pool", "the CUDA run logs device memory");
    assert_eq!(cpu_source, "process_rss");
    assert_eq!(gpu.len(), cpu.len());
    assert!(gpu.len() >= 4);
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        let rel = (g - c).abs() / c.abs().max(1e-6);
        assert!(
            rel <= tol,
            "{test}: step {} loss {g} on CUDA vs {c} on CPU",
            i + 1
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_lora_run_tracks_cpu_run() {
    check_run_tracks_cpu(
        "cuda_lora_run_tracks_cpu_run",
        serde_json::json!({ "mode": "lora", "adapter": { "rank": 4, "alpha": 4 } }),
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_full_finetune_tracks_cpu_run() {
    check_run_tracks_cpu(
        "cuda_full_finetune_tracks_cpu_run",
        serde_json::json!({ "mode": "full", "lr": 1e-4 }),
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_checkpointed_lora_run_tracks_cpu_run() {
    check_run_tracks_cpu_with(
        "cuda_checkpointed_lora_run_tracks_cpu_run",
        serde_json::json!({ "mode": "locon", "adapter": { "rank": 4, "alpha": 4, "dropout": 0.1 } }),
        serde_json::json!({ "gradient_checkpointing": true }),
        2e-3,
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_bf16_checkpointed_full_run_tracks_cpu_f32_run() {
    check_run_tracks_cpu_with(
        "cuda_bf16_checkpointed_full_run_tracks_cpu_f32_run",
        serde_json::json!({ "mode": "full", "lr": 1e-4 }),
        serde_json::json!({ "amp": "bf16", "gradient_checkpointing": true }),
        3e-2,
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_fp16_lora_run_tracks_cpu_f32_run() {
    check_run_tracks_cpu_with(
        "cuda_fp16_lora_run_tracks_cpu_f32_run",
        serde_json::json!({ "mode": "lora", "adapter": { "rank": 4, "alpha": 4 } }),
        serde_json::json!({ "amp": "fp16" }),
        3e-2,
    );
}

/// The fp8 base's kernels (src/nn/kernels/fp8.cu) on the card give the host's bits: row scales,
/// codes, and the weight dequantised into f32, bf16 and f16, for f32 and bf16 weights of SD
/// shapes (a 3×3 conv and a wide linear).
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_fp8_kernels_match_the_host_bit_for_bit() {
    let dev = cuda("cuda_fp8_kernels_match_the_host_bit_for_bit");
    for (shape, dtype) in [
        (vec![320usize, 640, 3, 3], DType::BF16),
        (vec![1280usize, 5120], DType::F32),
        (vec![7usize, 33], DType::BF16),
    ] {
        let w = (fill(&shape, 3) * 0.05).unwrap().to_dtype(dtype).unwrap();
        let (codes, scale) = nn::fp8::quantize(&w, "w").unwrap();
        let (gc, gs) = nn::fp8::quantize(&w.to_device(&dev).unwrap(), "w").unwrap();
        let bits = |t: &Tensor| -> Vec<u8> {
            t.to_device(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        assert_eq!(bits(&gc), bits(&codes), "{shape:?} codes");
        let s: Vec<f32> = scale.to_vec1().unwrap();
        let g: Vec<f32> = gs.to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
        assert_eq!(s, g, "{shape:?} scales");
        for out in [DType::F32, DType::BF16, DType::F16] {
            let host = nn::fp8::dequantize(&codes, &scale, out).unwrap();
            let card = nn::fp8::dequantize(&gc, &gs, out).unwrap();
            assert_eq!(card.dtype(), out);
            let diff = max_abs_diff(
                &host.to_dtype(DType::F32).unwrap(),
                &card
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
            );
            assert_eq!(diff, 0.0, "{shape:?} dequantised to {out:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_fp8_base_lora_run_tracks_cpu_run() {
    check_run_tracks_cpu(
        "cuda_fp8_base_lora_run_tracks_cpu_run",
        serde_json::json!({
            "mode": "lora",
            "adapter": { "rank": 4, "alpha": 4 },
            "base_weight_dtype": "fp8",
        }),
    );
}
