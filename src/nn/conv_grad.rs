//! Convolution gradients computed as ordinary convolutions, and a trainable conv2d that uses them.
//!
//! Candle's `Conv2D` backward takes the input gradient from `conv_transpose2d`, which on CUDA is
//! a naive kernel (one thread per output element looping over every input channel and tap):
//! measured by gpu-check as the bulk of an SD1.5 backward pass. The same gradient is a plain
//! convolution, which candle runs as im2col + cuBLAS GEMM:
//!
//! ```text
//! y[o, a] = Σ_{c,u} x[c, a·s + u − p] · w[o, c, u]                 (forward, per spatial dim)
//! ∂L/∂x[c, i] = Σ_{o,v} ĝ[o, i + v] · w̃[c, o, v]                    (correlation, stride 1)
//!   ĝ = ∂L/∂y dilated by s (s − 1 zeros between elements), padded by K − 1 − p in front and
//!       by x_len + p − len(dilated) behind;  w̃[c, o, v] = w[o, c, K − 1 − v] (swap, flip)
//! ∂L/∂w = conv2d(xᵀ, gᵀ) with stride and dilation swapped, trimmed to K (candle's formula)
//! ```
//!
//! `conv2d_input_grad_reference` keeps the `conv_transpose2d` form for the comparison test.
//!
//! Candle's `Conv2D` backward also picks `conv_transpose2d`'s output padding from the height
//! alone (`x_h − ((g_h − 1)·s + k − 2p)`) and uses it for the width too, so at a strided conv an
//! input whose H and W differ in parity (a 12×5 latent level at stride 2) gets a gradient one
//! column too wide or too narrow and the backward fails. Every gradient here is found per spatial
//! dim, and [`conv2d`] is the one entry point for a conv with a trainable operand (a trainable
//! layer, a LoCon `down` on a tracked input): where our custom op has no forward it falls back to
//! [`conv2d_parity_safe`], which never meets that output padding.

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor};

use super::cpu_conv::{conv2d_detached, conv2d_input_grad_col2im, conv2d_weight_grad_im2col};

use super::output_slot::OutputSlot;

/// `∂L/∂x` of `y = conv2d(x, w, padding, stride)` for `x` of spatial size `x_hw`, by the
/// faster form for the device. Measured (docs/BENCHMARKS.md): on CUDA the GEMM form is 9× faster
/// than candle's naive `conv_transpose2d` kernel. On the CPU, candle's `conv_transpose2d` beat the
/// GEMM form in a whole SD1.5 LoRA backward (9.5 s against 13.3 s per step: its kernel flip and
/// padded copies cost more there than they save), and col2im (`Wᵀ·G`, one GEMM per image and a
/// scatter-add) beats both: 4.3× faster than `conv_transpose2d` on a 320-channel 64×64 conv
/// (commit 5aa43ab).
pub fn conv2d_input_grad(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
) -> Result<Tensor> {
    match grad.device() {
        Device::Cpu => conv2d_input_grad_col2im(grad, w, padding, stride, x_hw),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if cuda_kernels(grad) => {
            super::conv_cuda::input_grad(&grad.detach(), &w.detach(), padding, stride, x_hw)
        }
        _ => conv2d_input_grad_gemm(grad, w, padding, stride, x_hw),
    }
}

/// Whether a CUDA conv runs on our kernels (`conv_cuda`): fused ops on and a dtype they take.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_kernels(t: &Tensor) -> bool {
    super::fused_op::use_fused(t) && super::conv_cuda::supported(t)
}

/// `∂L/∂x` as a stride-1 convolution of the dilated, padded gradient with the flipped kernel
/// (im2col + GEMM in candle).
pub fn conv2d_input_grad_gemm(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
) -> Result<Tensor> {
    let (_, _, k_h, k_w) = w.dims4()?;
    let (_, _, g_h, g_w) = grad.dims4()?;
    if padding >= k_h.min(k_w) {
        // Padding ≥ kernel size never occurs in SD models; keep candle's path for it.
        return conv2d_input_grad_reference(grad, w, padding, stride, x_hw);
    }
    let g = dilate(grad, stride)?;
    let pads = |g_len: usize, k: usize, x_len: usize| -> Result<(usize, usize)> {
        let dilated = (g_len - 1) * stride + 1;
        let front = k - 1 - padding;
        match (x_len + padding).checked_sub(dilated) {
            Some(back) => Ok((front, back)),
            None => candle_core::bail!(
                "conv2d input grad: gradient length {g_len} does not fit input length {x_len}"
            ),
        }
    };
    let (fh, bh) = pads(g_h, k_h, x_hw.0)?;
    let (fw, bw) = pads(g_w, k_w, x_hw.1)?;
    let w_flipped = flip_spatial(&w.transpose(0, 1)?.contiguous()?)?;
    if fh == bh && fw == bw && fh == fw {
        // The common stride-1 same-padding case: the conv pads for us, no padded copy.
        return g.conv2d(&w_flipped, fh, 1, 1, 1);
    }
    let g = g.pad_with_zeros(2, fh, bh)?.pad_with_zeros(3, fw, bw)?;
    g.conv2d(&w_flipped, 0, 1, 1, 1)
}

/// `∂L/∂x` through `conv_transpose2d`, as candle's `Conv2D` backward computes it, except that
/// the output padding is found per spatial dim (candle uses the height's for both, which fails
/// on non-square inputs whose H and W differ in parity at a strided conv).
pub fn conv2d_input_grad_reference(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    (x_h, x_w): (usize, usize),
) -> Result<Tensor> {
    let (_, _, k_h, k_w) = w.dims4()?;
    let (_, _, g_h, g_w) = grad.dims4()?;
    let span = |g: usize, k: usize| (g - 1) * stride + k - 2 * padding;
    let (s_h, s_w) = (span(g_h, k_h), span(g_w, k_w));
    if s_h > x_h || s_w > x_w {
        candle_core::bail!("conv2d input grad: grad {g_h}x{g_w} does not fit input {x_h}x{x_w}");
    }
    let out_padding = (x_h - s_h).max(x_w - s_w);
    let gx = grad.conv_transpose2d(w, padding, out_padding, stride, 1)?;
    // The larger padding only appends rows/columns; trim them back to the input's size.
    let gx = if gx.dim(2)? != x_h {
        gx.narrow(2, 0, x_h)?
    } else {
        gx
    };
    if gx.dim(3)? != x_w {
        gx.narrow(3, 0, x_w)
    } else {
        Ok(gx)
    }
}

/// `∂L/∂w` of `y = conv2d(x, w, padding, stride)` for a `k_hw` kernel, by the faster form for
/// the device: `G · im2col(x)ᵀ` on the CPU, candle's formula elsewhere.
pub fn conv2d_weight_grad(
    x: &Tensor,
    grad: &Tensor,
    padding: usize,
    stride: usize,
    k_hw: (usize, usize),
) -> Result<Tensor> {
    match grad.device() {
        Device::Cpu => conv2d_weight_grad_im2col(x, grad, padding, stride, k_hw),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if cuda_kernels(grad) => {
            super::conv_cuda::weight_grad(&x.detach(), &grad.detach(), padding, stride, k_hw)
        }
        _ => conv2d_weight_grad_reference(x, grad, padding, stride, k_hw),
    }
}

/// `∂L/∂w` of `y = conv2d(x, w, padding, stride)` for a `k_hw` kernel: candle's own formula (a
/// convolution of the transposed input with the transposed gradient, stride and dilation
/// swapped), trimmed to the kernel size.
pub fn conv2d_weight_grad_reference(
    x: &Tensor,
    grad: &Tensor,
    padding: usize,
    stride: usize,
    (k_h, k_w): (usize, usize),
) -> Result<Tensor> {
    let gk = x
        .transpose(0, 1)?
        .conv2d(&grad.transpose(0, 1)?, padding, 1, stride, 1)?
        .transpose(0, 1)?;
    let (_, _, g0, g1) = gk.dims4()?;
    if g0 != k_h || g1 != k_w {
        gk.narrow(2, 0, k_h)?.narrow(3, 0, k_w)
    } else {
        Ok(gk)
    }
}

/// `g` with `s − 1` zeros between neighbouring elements of both spatial dims.
fn dilate(g: &Tensor, s: usize) -> Result<Tensor> {
    if s == 1 {
        return Ok(g.clone());
    }
    let (b, c, h, w) = g.dims4()?;
    g.reshape((b, c, h, 1, w, 1))?
        .pad_with_zeros(3, 0, s - 1)?
        .pad_with_zeros(5, 0, s - 1)?
        .reshape((b, c, h * s, w * s))?
        .narrow(2, 0, (h - 1) * s + 1)?
        .narrow(3, 0, (w - 1) * s + 1)
}

/// Reverses the last two (spatial) dims of a kernel.
fn flip_spatial(w: &Tensor) -> Result<Tensor> {
    let (_, _, k_h, k_w) = w.dims4()?;
    let rev = |k: usize| {
        let idx: Vec<u32> = (0..k as u32).rev().collect();
        Tensor::new(idx.as_slice(), w.device())
    };
    let w = if k_h > 1 {
        w.index_select(&rev(k_h)?, 2)?
    } else {
        w.clone()
    };
    let w = if k_w > 1 {
        w.index_select(&rev(k_w)?, 3)?
    } else {
        w
    };
    w.contiguous()
}

/// `conv2d(x, w, padding, stride)` (groups 1, dilation 1) whose backward computes both
/// gradients with the functions above. The forward runs candle's own conv on detached operands
/// and hands the output over (one output-sized copy), as the frozen conv does. On a device our
/// custom ops have no forward for, [`conv2d_parity_safe`].
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    if !super::frozen::custom_op_device(x) {
        return conv2d_parity_safe(x, w, padding, stride);
    }
    let y = conv2d_detached(x, w, padding, stride)?;
    if !x.track_op() && !w.track_op() {
        return Ok(y);
    }
    x.apply_op2(
        w,
        TrainableConv {
            padding,
            stride,
            out: OutputSlot::new("conv2d", y)?,
        },
    )
}

/// `conv2d(x, w, padding, stride)` from candle's own ops only (any device), laid out so that
/// candle's `Conv2D` backward is right for every input shape: `x` is zero-padded explicitly and
/// its trailing rows/columns that no output reads are cut off, so the conv runs unpadded with
/// `(len − k) % s == 0` in both dims, where candle's output padding is 0 for height and width
/// alike. Costs a padded copy of `x`; only the fallback of [`conv2d`].
pub fn conv2d_parity_safe(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let (_, _, k_h, k_w) = w.dims4()?;
    let (_, _, x_h, x_w) = x.dims4()?;
    // The padded length the taps of the last output end at: (g − 1)·s + k.
    let used = |x_len: usize, k: usize| match (x_len + 2 * padding).checked_sub(k) {
        Some(span) => Ok(span / stride * stride + k),
        None => candle_core::bail!(
            "conv2d: kernel {k_h}x{k_w} does not fit the {x_h}x{x_w} input (padding {padding})"
        ),
    };
    let (u_h, u_w) = (used(x_h, k_h)?, used(x_w, k_w)?);
    let x = if padding > 0 {
        x.pad_with_zeros(2, padding, padding)?
            .pad_with_zeros(3, padding, padding)?
    } else {
        x.clone()
    };
    let x = if x.dim(2)? != u_h {
        x.narrow(2, 0, u_h)?
    } else {
        x
    };
    let x = if x.dim(3)? != u_w {
        x.narrow(3, 0, u_w)?
    } else {
        x
    };
    x.conv2d(w, 0, stride, 1, 1)
}

struct TrainableConv {
    padding: usize,
    stride: usize,
    out: OutputSlot,
}

impl CustomOp2 for TrainableConv {
    fn name(&self) -> &'static str {
        "conv2d-gemm-grad"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (_, _, x_h, x_w) = x.dims4()?;
        let (_, _, k_h, k_w) = w.dims4()?;
        let gx = if x.track_op() {
            Some(conv2d_input_grad(
                grad,
                w,
                self.padding,
                self.stride,
                (x_h, x_w),
            )?)
        } else {
            None
        };
        let gw = if w.track_op() {
            Some(conv2d_weight_grad(
                x,
                grad,
                self.padding,
                self.stride,
                (k_h, k_w),
            )?)
        } else {
            None
        };
        Ok((gx, gw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::conv2d_input_grad_col2im;
    use crate::nn::test_util::max_abs;
    use candle_core::{Device, Var};

    fn fill(shape: &[usize], seed: u64) -> Tensor {
        crate::nn::test_util::fill(shape, seed, 1.0)
    }

    /// Every (kernel, padding, stride) SD models use, on odd, even and non-square inputs.
    const CASES: [(usize, usize, usize); 4] = [(3, 1, 1), (3, 1, 2), (1, 0, 1), (3, 0, 1)];
    const SIZES: [(usize, usize); 4] = [(8, 8), (7, 9), (6, 5), (5, 12)];

    #[test]
    fn input_grad_matches_conv_transpose() {
        for (k, p, s) in CASES {
            for (h, w) in SIZES {
                let x = fill(&[2, 3, h, w], 1);
                let wt = fill(&[4, 3, k, k], 2);
                let y = x.conv2d(&wt, p, s, 1, 1).unwrap();
                let g = fill(y.dims(), 3);
                let want = conv2d_input_grad_reference(&g, &wt, p, s, (h, w)).unwrap();
                let gemm = conv2d_input_grad_gemm(&g, &wt, p, s, (h, w)).unwrap();
                let e = max_abs(&gemm, &want);
                assert!(e < 1e-4, "gemm k{k} p{p} s{s} {h}x{w}: {e}");
                let col2im = conv2d_input_grad_col2im(&g, &wt, p, s, (h, w)).unwrap();
                assert_eq!(col2im.dims(), want.dims());
                let e = max_abs(&col2im, &want);
                assert!(e < 1e-4, "col2im k{k} p{p} s{s} {h}x{w}: {e}");
            }
        }
    }

    #[test]
    fn trainable_conv_gradients_match_candle() {
        for (k, p, s) in CASES {
            for (h, w) in [(8, 8), (6, 10)] {
                let x = Var::from_tensor(&fill(&[2, 3, h, w], 4)).unwrap();
                let wt = Var::from_tensor(&fill(&[5, 3, k, k], 5)).unwrap();
                let ours = conv2d(x.as_tensor(), wt.as_tensor(), p, s).unwrap();
                let want = x.as_tensor().conv2d(wt.as_tensor(), p, s, 1, 1).unwrap();
                assert!(max_abs(&ours, &want) < 1e-5);
                let r = fill(want.dims(), 6);
                let ga = (&ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let gb = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
                for v in [&x, &wt] {
                    let e = max_abs(ga.get(v).unwrap(), gb.get(v).unwrap());
                    assert!(e < 1e-4, "k{k} p{p} s{s} {h}x{w}: {e}");
                }
            }
        }
    }

    #[test]
    fn parity_safe_conv_matches_the_trainable_conv() {
        // (3, 0, 2) cuts an unread input row/column off (8 → 7) rather than padding.
        for (k, p, s) in CASES.into_iter().chain([(3, 0, 2)]) {
            for (h, w) in SIZES {
                let what = format!("k{k} p{p} s{s} {h}x{w}");
                let inputs = [fill(&[2, 3, h, w], 7), fill(&[4, 3, k, k], 8)];
                crate::nn::test_util::assert_parity(
                    &what,
                    &inputs,
                    &[true, true],
                    1e-5,
                    &|a| conv2d_parity_safe(&a[0], &a[1], p, s),
                    &|a| conv2d(&a[0], &a[1], p, s),
                );
            }
        }
    }

    #[test]
    fn dilate_spaces_elements_with_zeros() {
        let g = Tensor::new(&[[[[1f32, 2.], [3., 4.]]]], &Device::Cpu).unwrap();
        let d = dilate(&g, 2).unwrap();
        assert_eq!(
            d.squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            vec![vec![1., 0., 2.], vec![0., 0., 0.], vec![3., 0., 4.]]
        );
    }
}
