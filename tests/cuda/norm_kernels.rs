//! The norm and GEGLU CUDA kernels (src/nn/kernels/norm.cu) against the CPU path: forward and
//! the gradients of `x` (or `p`), `γ` and `β` for `L = Σ out·r` (`r` a fixed fill), in f32 and
//! bf16, on SD-sized shapes and ragged ones; and the LoRA layers that recompute a norm or GEGLU
//! inside their op (`nn::low_rank_input`). Formulas: the headers of src/nn/group_norm.rs,
//! layer_norm.rs and geglu.rs.
//!
//! Tolerances are relative to the largest magnitude of the CPU result: f32 1e-4 (the kernels sum
//! a group of 40 960 elements in another order than the CPU), bf16 2e-2 (one bf16 rounding of
//! each result, compared on results that were rounded on both sides).

use candle_core::{DType, Device, Tensor, Var};
use sdtrain::nn::{
    frozen_linear_low_rank_on, geglu, group_norm, group_norm_silu, layer_norm, BaseWeight,
    DerivedInput, LowRank,
};

/// The first CUDA device. These tests are `#[ignore]`d so that a machine without a GPU reports
/// them as ignored, never as passed; asked to run (`--include-ignored`), they fail without one.
fn cuda(test: &str) -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| panic!("{test}: no CUDA device ({e})"))
}

/// A deterministic fill in [−amplitude, amplitude) on the CPU.
fn fill(shape: &[usize], seed: u64, amplitude: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let h = (i as u64).wrapping_mul(2654435761).wrapping_add(seed * 97) % 1000;
            amplitude * (h as f32 / 500.0 - 1.0)
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

type Op = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// The output and every input's gradient (as f32 on the CPU) of `op` on `inputs` moved to `dev`,
/// for `L = Σ out·r`.
fn output_and_grads(dev: &Device, inputs: &[Tensor], op: &Op) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(dev).unwrap()).unwrap())
        .collect();
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = op(&args).unwrap();
    let r = fill(out.dims(), 99, 1.0).to_device(dev).unwrap();
    let loss = (out.to_dtype(DType::F32).unwrap() * r).unwrap();
    let grads = loss.sum_all().unwrap().backward().unwrap();
    let to_cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let mut all = vec![to_cpu(&out)];
    for (a, v) in args.iter().zip(&vars) {
        let g = grads
            .get(a)
            .unwrap_or_else(|| panic!("no gradient for an input"));
        assert_eq!(g.dtype(), v.dtype(), "gradient dtype");
        all.push(to_cpu(g));
    }
    all
}

/// Largest absolute difference relative to the largest magnitude of `want`.
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let max = |t: Tensor| {
        t.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let diff = max((got - want).unwrap());
    diff / max(want.clone()).max(1e-12)
}

/// Runs `op` on the GPU and on the CPU and compares the output and every gradient.
fn check(dev: &Device, what: &str, inputs: &[Tensor], op: &Op, tol: f32) {
    let gpu = output_and_grads(dev, inputs, op);
    let cpu = output_and_grads(&Device::Cpu, inputs, op);
    let names = ["output", "grad 0", "grad 1", "grad 2", "grad 3"];
    for ((g, c), name) in gpu.iter().zip(&cpu).zip(names) {
        assert_eq!(g.dims(), c.dims(), "{what}: {name} shape");
        let e = rel_err(g, c);
        assert!(
            e <= tol,
            "{what}: {name} differs by {e:.2e} (relative), tolerance {tol:.0e}"
        );
    }
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::F32 {
        1e-4
    } else {
        2e-2
    }
}

/// `x` `[B, C, ...]` in `dtype` with a per-channel offset, `γ`, `β` `[C]` f32 far from 1 and 0.
fn norm_inputs(dims: &[usize], channel_dim: usize, dtype: DType) -> Vec<Tensor> {
    let c = dims[channel_dim];
    let mut offset_shape = vec![1; dims.len()];
    offset_shape[channel_dim] = c;
    let offset = (Tensor::arange(0f32, c as f32, &Device::Cpu).unwrap() * 0.01)
        .unwrap()
        .reshape(offset_shape)
        .unwrap();
    let x = fill(dims, 1, 2.0).broadcast_add(&offset).unwrap();
    let w = (fill(&[c], 2, 1.0) + 1.5).unwrap();
    let b = fill(&[c], 3, 0.8);
    vec![x.to_dtype(dtype).unwrap(), w, b]
}

/// SD's largest UNet group norm (`[2, 320, 64, 64]`, 32 groups: 10 chunks per group) and the
/// VAE's 4-channel groups at 128×128, a ragged `[3, 96, 13, 11]`, with and without the fused
/// SiLU.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_group_norm_kernels_match_cpu() {
    let dev = cuda("cuda_group_norm_kernels_match_cpu");
    let shapes: [(&[usize], usize); 3] = [
        (&[2, 320, 64, 64], 32),
        (&[1, 128, 128, 128], 32),
        (&[3, 96, 13, 11], 32),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (dims, groups) in shapes {
            for silu in [false, true] {
                let op = move |a: &[Tensor]| {
                    let f = if silu { group_norm_silu } else { group_norm };
                    f(&a[0], &a[1], &a[2], groups, 1e-5)
                };
                let what = format!("group norm {dims:?}/{groups} silu {silu} {dtype:?}");
                check(&dev, &what, &norm_inputs(dims, 1, dtype), &op, tol(dtype));
            }
        }
    }
}

/// SD's transformer width (`[2, 4096, 320]`), CLIP's (`[2, 77, 1280]`), bigG's 2048 and a
/// ragged `[3, 7, 45]`.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_layer_norm_kernels_match_cpu() {
    let dev = cuda("cuda_layer_norm_kernels_match_cpu");
    let shapes: [&[usize]; 4] = [&[2, 4096, 320], &[2, 77, 1280], &[1, 77, 2048], &[3, 7, 45]];
    for dtype in [DType::F32, DType::BF16] {
        for dims in shapes {
            let op = |a: &[Tensor]| layer_norm(&a[0], &a[1], &a[2], 1e-5);
            let inputs = norm_inputs(dims, dims.len() - 1, dtype);
            let what = format!("layer norm {dims:?} {dtype:?}");
            check(&dev, &what, &inputs, &op, tol(dtype));
        }
    }
}

/// SD1.5's first transformer block (`[2, 4096, 2·1280]`) and a ragged odd width.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_geglu_kernels_match_cpu() {
    let dev = cuda("cuda_geglu_kernels_match_cpu");
    let shapes: [&[usize]; 2] = [&[2, 4096, 2560], &[3, 7, 2 * 45]];
    for dtype in [DType::F32, DType::BF16] {
        for dims in shapes {
            let p = fill(dims, 11, 3.0).to_dtype(dtype).unwrap();
            let op = |a: &[Tensor]| geglu(&a[0]);
            check(
                &dev,
                &format!("geglu {dims:?} {dtype:?}"),
                &[p],
                &op,
                tol(dtype),
            );
        }
    }
}

/// A LoRA layer (rank 16, scale 0.5) after a frozen LayerNorm and after GEGLU as one op with the
/// block's residual (`nn::low_rank_input`): the norm (`layer_norm_recomputed`: the forward
/// kernel again, then the dx kernel on its statistics) and GEGLU recomputed in the backward.
/// SD1.5's level-0 block: 4096 tokens, width 320 (GEGLU's projection 2·1280). Gradients of the
/// input, `down`, `up` and the residual.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_low_rank_on_derived_inputs_matches_cpu() {
    let dev = cuda("cuda_low_rank_on_derived_inputs_matches_cpu");
    for dtype in [DType::F32, DType::BF16] {
        for (what, norm, width) in [("layer norm", true, 320), ("geglu", false, 2 * 1280)] {
            let inner = if norm { width } else { width / 2 };
            let inputs = vec![
                fill(&[1, 4096, width], 21, 2.0).to_dtype(dtype).unwrap(),
                fill(&[16, inner], 22, 0.1),
                fill(&[320, 16], 23, 0.1),
                fill(&[1, 4096, 320], 24, 1.0).to_dtype(dtype).unwrap(),
            ];
            let op = move |a: &[Tensor]| {
                let on = |t: Tensor| t.to_dtype(dtype)?.to_device(a[0].device());
                let w = on(fill(&[320, inner], 25, 0.05))?;
                let b = on(fill(&[320], 26, 0.5))?;
                let input = if norm {
                    DerivedInput::LayerNorm {
                        weight: (fill(&[width], 27, 1.0) + 1.5)?.to_device(a[0].device())?,
                        bias: fill(&[width], 28, 0.8).to_device(a[0].device())?,
                        eps: 1e-5,
                    }
                } else {
                    DerivedInput::Geglu
                };
                let lr = LowRank {
                    down: &a[1],
                    up: &a[2],
                    scale: 0.5,
                    dropout: &|_| Ok(None),
                };
                let w = BaseWeight::plain(&w);
                frozen_linear_low_rank_on(&a[0], &input, None, &w, Some(&b), lr, Some(&a[3]))
            };
            check(&dev, &format!("{what} {dtype:?}"), &inputs, &op, tol(dtype));
        }
    }
}
