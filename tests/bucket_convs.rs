//! Regression test for issue 11: candle's `Conv2D` backward fails on inputs whose H and W differ
//! in parity at a stride-2 conv (it takes `conv_transpose2d`'s output padding from the height
//! alone, `x_h − ((g_h − 1)·s + k − 2p)`, and uses it for the width too).
//!
//! Every conv a trainable parameter's gradient passes through is run, forward and backward, on
//! every spatial size a stride-2 or stride-1 3×3 conv sees for every aspect bucket of SD1.5 (512),
//! SD2.1 (768), SDXL (1024), all at step 64, and of the tiny fixtures (64 at step 8):
//! - a trainable `nn::Conv2d` (weight and bias Vars, tracked input), the UNet's own layer;
//! - a LoCon-wrapped frozen `nn::Conv2d` (`down` with the base's kernel, stride and padding, `up`
//!   1×1), on a tracked input (a LoCon deeper in the UNet) and on a constant one (the first);
//! - the device-specific gradient formulas the CPU does not pick (`*_gemm`, `*_reference`: the
//!   CUDA paths) and the custom-op-free fallback [`conv2d_parity_safe`], called directly.
//!
//! The reference is a naive direct convolution in f64 with its gradient written out from the
//! definition `y[o, a, b] = Σ_{c,u,v} x[c, a·s + u − p, b·s + v − p] · w[o, c, u, v]`:
//! `∂L/∂x` scatters `g[o, a, b] · w[o, c, u, v]` back to the input position each tap read, and
//! `∂L/∂w` sums `g · x` over the same positions. It shares no code with candle or `sdtrain`, and
//! is loop-per-element, so it cannot inherit a shape formula's parity mistake. The reference
//! itself is checked by central differences on a mixed-parity input
//! (`reference_matches_finite_differences`), so a slip in the hand-written adjoint cannot hide
//! the same slip in the code under test.
//!
//! Shapes are deduped across models and levels; with 3 → 2 channels and batch 1 the whole file
//! runs in seconds.

use std::collections::BTreeSet;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use rand::{rngs::StdRng, SeedableRng};
use sdtrain::adapter::{AdapterComponent, LoraKind, LoraModule, LoraShape};
use sdtrain::data::bucket::aspect_buckets;
use sdtrain::nn::{
    conv2d_input_grad_gemm, conv2d_input_grad_reference, conv2d_parity_safe,
    conv2d_weight_grad_reference, Conv2d, Conv2dConfig,
};

const C_IN: usize = 3;
const C_OUT: usize = 2;
const RANK: usize = 2;
/// Largest error relative to the largest reference magnitude: f32 sums against f64.
const TOL: f64 = 1e-4;

/// A set of `(h, w)` conv input sizes, deduped and in order.
type Shapes = BTreeSet<(usize, usize)>;

/// Every `(h, w)` a stride-2 conv sees (each model's levels that have a downsampler, and the
/// tiny models' /4 level too) and every `(h, w)` a stride-1 3×3 conv sees (all levels).
fn bucket_shapes() -> (Shapes, Shapes) {
    // (resolution, bucket step, pixels per latent, levels with a stride-2 conv, all levels)
    let models: [(usize, usize, usize, usize, usize); 4] = [
        (512, 64, 8, 3, 4),  // SD1.5: 4 blocks, 3 downsamplers
        (768, 64, 8, 3, 4),  // SD2.1: the same UNet layout
        (1024, 64, 8, 2, 3), // SDXL: 3 blocks, 2 downsamplers
        // Tiny fixtures: VAE ×2, 3 blocks. Their 2 downsamplers see /1 and /2; /4 is taken at
        // stride 2 too, as it holds the mixed-parity sizes (96×40 px → 48×20 → 24×10 → 12×5)
        // that a step-8 bucket with one more downsampler would meet.
        (64, 8, 2, 3, 3),
    ];
    let (mut strided, mut same) = (BTreeSet::new(), BTreeSet::new());
    for (resolution, step, vae, strided_levels, levels) in models {
        for b in aspect_buckets(resolution, step, None) {
            assert!(
                b.width % vae == 0 && b.height % vae == 0,
                "{b} at {resolution}"
            );
            let (h, w) = (b.height / vae, b.width / vae);
            for level in 0..levels {
                let hw = (h >> level, w >> level);
                assert!(
                    hw.0 << level == h && hw.1 << level == w,
                    "{b}: odd at /{}",
                    1 << level
                );
                same.insert(hw);
                if level < strided_levels {
                    strided.insert(hw);
                }
            }
        }
    }
    (strided, same)
}

/// A deterministic fill in [−1, 1).
fn fill(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// One batch-1 activation or kernel in f64, `[channels, h, w]` / `[out, in, k, k]` row-major.
#[derive(Clone)]
struct Arr {
    dims: Vec<usize>,
    v: Vec<f64>,
}

impl Arr {
    fn new(dims: &[usize], seed: u64) -> Self {
        let n = dims.iter().product();
        Self {
            dims: dims.to_vec(),
            v: fill(n, seed),
        }
    }

    fn zeros(dims: &[usize]) -> Self {
        Self {
            dims: dims.to_vec(),
            v: vec![0.0; dims.iter().product()],
        }
    }

    /// As an f32 tensor, with a leading batch dim of 1 for activations.
    fn tensor(&self, batch: bool) -> Tensor {
        let v: Vec<f32> = self.v.iter().map(|&x| x as f32).collect();
        let mut dims = self.dims.clone();
        if batch {
            dims.insert(0, 1);
        }
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }
}

/// The output length of a conv along one dim.
fn out_len(x: usize, k: usize, p: usize, s: usize) -> usize {
    (x + 2 * p - k) / s + 1
}

/// Calls `f(o, c, u, v, (a, b), (iy, ix))` for every weight tap and output position whose input
/// position lies inside `x` (`[C, H, W]`), for a `[O, C, K, K]` kernel: the definition's sum.
fn for_each_tap(
    x_dims: &[usize],
    w_dims: &[usize],
    p: usize,
    s: usize,
    mut f: impl FnMut(usize, usize, usize, usize, (usize, usize), (usize, usize)),
) {
    let (c_in, x_h, x_w) = (x_dims[0], x_dims[1], x_dims[2]);
    let (c_out, k) = (w_dims[0], w_dims[2]);
    let (g_h, g_w) = (out_len(x_h, k, p, s), out_len(x_w, k, p, s));
    for o in 0..c_out {
        for c in 0..c_in {
            for u in 0..k {
                for v in 0..k {
                    for a in 0..g_h {
                        let iy = (a * s + u) as i64 - p as i64;
                        if iy < 0 || iy >= x_h as i64 {
                            continue;
                        }
                        for b in 0..g_w {
                            let ix = (b * s + v) as i64 - p as i64;
                            if ix < 0 || ix >= x_w as i64 {
                                continue;
                            }
                            f(o, c, u, v, (a, b), (iy as usize, ix as usize));
                        }
                    }
                }
            }
        }
    }
}

/// The flat indices of `[C, H, W]` element `(c, y, x)` and `[O, C, K, K]` tap `(o, c, u, v)`.
fn at3(dims: &[usize], c: usize, y: usize, x: usize) -> usize {
    (c * dims[1] + y) * dims[2] + x
}
fn at4(dims: &[usize], o: usize, c: usize, u: usize, v: usize) -> usize {
    ((o * dims[1] + c) * dims[2] + u) * dims[3] + v
}

/// `y = conv2d(x, w, p, s)` by the definition.
fn conv(x: &Arr, w: &Arr, p: usize, s: usize) -> Arr {
    let k = w.dims[2];
    let g = [
        w.dims[0],
        out_len(x.dims[1], k, p, s),
        out_len(x.dims[2], k, p, s),
    ];
    let mut y = Arr::zeros(&g);
    for_each_tap(&x.dims, &w.dims, p, s, |o, c, u, v, (a, b), (iy, ix)| {
        y.v[at3(&g, o, a, b)] += x.v[at3(&x.dims, c, iy, ix)] * w.v[at4(&w.dims, o, c, u, v)];
    });
    y
}

/// `∂L/∂x` of [`conv`] for `∂L/∂y = g`: each product's `x` factor gets `g · w`.
fn conv_grad_x(g: &Arr, x_dims: &[usize], w: &Arr, p: usize, s: usize) -> Arr {
    let mut gx = Arr::zeros(x_dims);
    for_each_tap(x_dims, &w.dims, p, s, |o, c, u, v, (a, b), (iy, ix)| {
        gx.v[at3(x_dims, c, iy, ix)] += g.v[at3(&g.dims, o, a, b)] * w.v[at4(&w.dims, o, c, u, v)];
    });
    gx
}

/// `∂L/∂w` of [`conv`] for `∂L/∂y = g`: each product's `w` factor gets `g · x`.
fn conv_grad_w(g: &Arr, x: &Arr, w_dims: &[usize], p: usize, s: usize) -> Arr {
    let mut gw = Arr::zeros(w_dims);
    for_each_tap(&x.dims, w_dims, p, s, |o, c, u, v, (a, b), (iy, ix)| {
        gw.v[at4(w_dims, o, c, u, v)] += g.v[at3(&g.dims, o, a, b)] * x.v[at3(&x.dims, c, iy, ix)];
    });
    gw
}

/// `∂L/∂b` of a per-channel bias: `g` summed over the positions.
fn bias_grad(g: &Arr) -> Arr {
    let plane = g.dims[1] * g.dims[2];
    Arr {
        dims: vec![g.dims[0]],
        v: g.v.chunks(plane).map(|c| c.iter().sum()).collect(),
    }
}

fn add(a: &Arr, b: &Arr) -> Arr {
    assert_eq!(a.dims, b.dims);
    Arr {
        dims: a.dims.clone(),
        v: a.v.iter().zip(&b.v).map(|(x, y)| x + y).collect(),
    }
}

fn scale(a: &Arr, by: f64) -> Arr {
    Arr {
        dims: a.dims.clone(),
        v: a.v.iter().map(|x| x * by).collect(),
    }
}

/// Asserts `got` (any shape with the same elements) matches `want` to [`TOL`] relative.
fn check(what: &str, got: Option<&Tensor>, want: &Arr) {
    let Some(got) = got else {
        panic!("{what}: no gradient");
    };
    let mut dims = want.dims.clone();
    if got.rank() == dims.len() + 1 {
        dims.insert(0, 1);
    }
    assert_eq!(got.dims(), dims.as_slice(), "{what}: shape");
    let got: Vec<f32> = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let peak = want.v.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-12);
    let err = got
        .iter()
        .zip(&want.v)
        .fold(0f64, |m, (&g, w)| m.max((f64::from(g) - w).abs()));
    assert!(
        err / peak <= TOL,
        "{what}: off by {:.2e} relative",
        err / peak
    );
}

/// `Σ y · r`, the loss every case differentiates: `r` is the upstream gradient `∂L/∂y`.
fn loss_grads(what: &str, y: &Tensor, r: &Arr) -> candle_core::backprop::GradStore {
    (y * r.tensor(true))
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .unwrap_or_else(|e| panic!("{what}: backward failed: {e}"))
}

/// A trainable 3×3 conv (weight and bias Vars) on a tracked input, through `nn::Conv2d::forward`.
fn trainable_conv(hw: (usize, usize), stride: usize) {
    let what = |t: &str| format!("trainable conv s{stride} {}x{}: {t}", hw.0, hw.1);
    let (p, k) = (1, 3);
    let x = Arr::new(&[C_IN, hw.0, hw.1], 1);
    let w = Arr::new(&[C_OUT, C_IN, k, k], 2);
    let b = Arr::new(&[C_OUT], 3);
    let xv = Var::from_tensor(&x.tensor(true)).unwrap();
    let wv = Var::from_tensor(&w.tensor(false)).unwrap();
    let bv = Var::from_tensor(&b.tensor(false)).unwrap();
    let layer = Conv2d {
        path: "down_blocks.0.downsamplers.0.conv".into(),
        weight: wv.as_tensor().clone(),
        weight_scale: None,
        bias: Some(bv.as_tensor().clone()),
        cfg: Conv2dConfig {
            kernel: k,
            stride,
            padding: p,
        },
        adapter: None,
    };
    let y = layer.forward(xv.as_tensor()).unwrap();
    let mut y_ref = conv(&x, &w, p, stride);
    for (i, chunk) in y_ref
        .v
        .chunks_mut(y_ref.dims[1] * y_ref.dims[2])
        .enumerate()
    {
        chunk.iter_mut().for_each(|e| *e += b.v[i]);
    }
    check(&what("forward"), Some(&y), &y_ref);
    let r = Arr::new(&y_ref.dims, 4);
    let grads = loss_grads(&what("backward"), &y, &r);
    check(
        &what("∂x"),
        grads.get(&xv),
        &conv_grad_x(&r, &x.dims, &w, p, stride),
    );
    check(
        &what("∂w"),
        grads.get(&wv),
        &conv_grad_w(&r, &x, &w.dims, p, stride),
    );
    check(&what("∂b"), grads.get(&bv), &bias_grad(&r));
}

/// A frozen 3×3 conv with a LoCon adapter: `y = conv(x, W) + b + (α/r)·up(down(x))`.
fn locon_conv(hw: (usize, usize), stride: usize, tracked_input: bool) {
    let what = |t: &str| {
        let input = if tracked_input { "tracked" } else { "constant" };
        format!("LoCon s{stride} {}x{} ({input} input): {t}", hw.0, hw.1)
    };
    let (p, k, alpha) = (1, 3, 1.0);
    let x = Arr::new(&[C_IN, hw.0, hw.1], 5);
    let w = Arr::new(&[C_OUT, C_IN, k, k], 6);
    let b = Arr::new(&[C_OUT], 7);
    let up = Arr::new(&[C_OUT, RANK, 1, 1], 8);
    let shape = LoraShape {
        module_path: "down_blocks.0.downsamplers.0.conv".into(),
        component: AdapterComponent::Unet,
        kind: LoraKind::Conv {
            kernel: k,
            stride,
            padding: p,
        },
        in_dim: C_IN,
        out_dim: C_OUT,
    };
    let m = LoraModule::new(
        shape,
        RANK,
        alpha,
        0.0,
        &mut StdRng::seed_from_u64(9),
        &Device::Cpu,
    )
    .unwrap();
    // A fresh `up` is zeros, which would leave `down` with a zero gradient.
    m.var("lora_up.weight")
        .unwrap()
        .set(&up.tensor(false))
        .unwrap();
    let down = Arr {
        dims: m.var("lora_down.weight").unwrap().dims().to_vec(),
        v: m.var("lora_down.weight")
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
    };
    let m = Arc::new(m);
    let layer = Conv2d {
        path: "down_blocks.0.downsamplers.0.conv".into(),
        weight: w.tensor(false),
        weight_scale: None,
        bias: Some(b.tensor(false)),
        cfg: Conv2dConfig {
            kernel: k,
            stride,
            padding: p,
        },
        adapter: Some(m.clone()),
    };
    let xv = Var::from_tensor(&x.tensor(true)).unwrap();
    let xt = if tracked_input {
        xv.as_tensor().clone()
    } else {
        x.tensor(true)
    };
    let y = layer.forward(&xt).unwrap();
    let s = alpha / RANK as f64;
    let h = conv(&x, &down, p, stride);
    let mut y_ref = add(&conv(&x, &w, p, stride), &scale(&conv(&h, &up, 0, 1), s));
    for (i, chunk) in y_ref
        .v
        .chunks_mut(y_ref.dims[1] * y_ref.dims[2])
        .enumerate()
    {
        chunk.iter_mut().for_each(|e| *e += b.v[i]);
    }
    check(&what("forward"), Some(&y), &y_ref);
    let r = Arr::new(&y_ref.dims, 10);
    let grads = loss_grads(&what("backward"), &y, &r);
    // Through the adapter: z = up(h), ∂L/∂z = s·r, ∂L/∂h = upᵀ·∂L/∂z.
    let gz = scale(&r, s);
    let gh = conv_grad_x(&gz, &h.dims, &up, 0, 1);
    check(
        &what("∂up"),
        grads.get(m.var("lora_up.weight").unwrap()),
        &conv_grad_w(&gz, &h, &up.dims, 0, 1),
    );
    check(
        &what("∂down"),
        grads.get(m.var("lora_down.weight").unwrap()),
        &conv_grad_w(&gh, &x, &down.dims, p, stride),
    );
    if tracked_input {
        let gx = add(
            &conv_grad_x(&r, &x.dims, &w, p, stride),
            &conv_grad_x(&gh, &x.dims, &down, p, stride),
        );
        check(&what("∂x"), grads.get(&xv), &gx);
    }
}

/// The gradient formulas a CUDA run picks (GEMM input gradient, candle's weight-gradient
/// formula, `conv_transpose2d` with per-dim output padding) and the fallback for devices with no
/// custom-op forward, on the CPU.
fn device_formulas(hw: (usize, usize), stride: usize) {
    let what = |t: &str| format!("{t} s{stride} {}x{}", hw.0, hw.1);
    let (p, k) = (1, 3);
    let x = Arr::new(&[C_IN, hw.0, hw.1], 11);
    let w = Arr::new(&[C_OUT, C_IN, k, k], 12);
    let g_dims = [
        C_OUT,
        out_len(hw.0, k, p, stride),
        out_len(hw.1, k, p, stride),
    ];
    let r = Arr::new(&g_dims, 13);
    let (xt, wt, rt) = (x.tensor(true), w.tensor(false), r.tensor(true));
    let gx = conv_grad_x(&r, &x.dims, &w, p, stride);
    let gw = conv_grad_w(&r, &x, &w.dims, p, stride);
    let gemm = conv2d_input_grad_gemm(&rt, &wt, p, stride, hw).unwrap();
    check(&what("conv2d_input_grad_gemm"), Some(&gemm), &gx);
    let transpose = conv2d_input_grad_reference(&rt, &wt, p, stride, hw).unwrap();
    check(&what("conv2d_input_grad_reference"), Some(&transpose), &gx);
    let gw_ref = conv2d_weight_grad_reference(&xt, &rt, p, stride, (k, k)).unwrap();
    check(&what("conv2d_weight_grad_reference"), Some(&gw_ref), &gw);
    let xv = Var::from_tensor(&xt).unwrap();
    let wv = Var::from_tensor(&wt).unwrap();
    let y = conv2d_parity_safe(xv.as_tensor(), wv.as_tensor(), p, stride).unwrap();
    check(
        &what("conv2d_parity_safe forward"),
        Some(&y),
        &conv(&x, &w, p, stride),
    );
    let grads = loss_grads(&what("backward"), &y, &r);
    check(&what("conv2d_parity_safe ∂x"), grads.get(&xv), &gx);
    check(&what("conv2d_parity_safe ∂w"), grads.get(&wv), &gw);
}

#[test]
fn bucket_shapes_include_mixed_parity_at_stride_2() {
    // The test is only worth its name if some strided input has H and W of different parity
    // (the tiny models' /4 level: 96×40 px → latent 48×20 → 12×5).
    let (strided, _) = bucket_shapes();
    assert!(
        strided.contains(&(5, 12)) && strided.contains(&(12, 5)),
        "{strided:?}"
    );
}

#[test]
fn candle_conv2d_backward_fails_on_mixed_parity_at_stride_2() {
    // What issue 11 guards against, as of candle-core 0.11.1 (backprop.rs, `Op::Conv2D`). If this
    // starts passing with a candle upgrade, the bug is fixed upstream: keep the guards anyway.
    for (h, w) in [(12, 5), (9, 8)] {
        let x = Var::from_tensor(&Arr::new(&[C_IN, h, w], 1).tensor(true)).unwrap();
        let wt = Var::from_tensor(&Arr::new(&[C_OUT, C_IN, 3, 3], 2).tensor(false)).unwrap();
        let y = x.as_tensor().conv2d(wt.as_tensor(), 1, 2, 1, 1).unwrap();
        // The input gradient comes out a column short (9×8) or long (12×5), and adding it to
        // the input-sized store entry fails.
        let result = y.sum_all().unwrap().backward();
        assert!(
            result.is_err(),
            "{h}x{w}: candle's conv2d backward now works on mixed parity"
        );
    }
}

#[test]
fn reference_matches_finite_differences() {
    // Central differences of L = Σ conv(x, w)·r on a mixed-parity input at stride 2, in f64
    // (exact up to rounding for a function linear in each operand).
    let (p, s, hw) = (1, 2, (5, 8));
    let x = Arr::new(&[C_IN, hw.0, hw.1], 21);
    let w = Arr::new(&[C_OUT, C_IN, 3, 3], 22);
    let y = conv(&x, &w, p, s);
    let r = Arr::new(&y.dims, 23);
    let loss = |x: &Arr, w: &Arr| -> f64 {
        conv(x, w, p, s)
            .v
            .iter()
            .zip(&r.v)
            .map(|(a, b)| a * b)
            .sum()
    };
    let (gx, gw) = (
        conv_grad_x(&r, &x.dims, &w, p, s),
        conv_grad_w(&r, &x, &w.dims, p, s),
    );
    let eps = 1e-3;
    for i in 0..x.v.len() {
        let (mut hi, mut lo) = (x.clone(), x.clone());
        hi.v[i] += eps;
        lo.v[i] -= eps;
        let fd = (loss(&hi, &w) - loss(&lo, &w)) / (2.0 * eps);
        assert!((fd - gx.v[i]).abs() < 1e-8, "∂x[{i}]: {fd} vs {}", gx.v[i]);
    }
    for i in 0..w.v.len() {
        let (mut hi, mut lo) = (w.clone(), w.clone());
        hi.v[i] += eps;
        lo.v[i] -= eps;
        let fd = (loss(&x, &hi) - loss(&x, &lo)) / (2.0 * eps);
        assert!((fd - gw.v[i]).abs() < 1e-8, "∂w[{i}]: {fd} vs {}", gw.v[i]);
    }
}

/// Runs `case(hw, stride)` for every strided shape at stride 2 and every shape at stride 1.
fn every_bucket_shape(case: impl Fn((usize, usize), usize)) {
    let (strided, same) = bucket_shapes();
    for hw in strided {
        case(hw, 2);
    }
    for hw in same {
        case(hw, 1);
    }
}

#[test]
fn trainable_conv_on_every_bucket_shape() {
    every_bucket_shape(trainable_conv);
}

#[test]
fn locon_conv_on_every_bucket_shape() {
    every_bucket_shape(|hw, stride| {
        locon_conv(hw, stride, true);
        locon_conv(hw, stride, false);
    });
}

#[test]
fn device_gradient_formulas_on_every_bucket_shape() {
    every_bucket_shape(device_formulas);
}
