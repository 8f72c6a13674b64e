//! 2-D convolution on the CPU as im2col + one GEMM per image, with both gradients in the same
//! form (see [`super::im2col`] for the equations).
//!
//! Candle 0.11's CPU conv2d (`conv2d_tiled`) re-lays the weight out element by element on every
//! call, transposes the input to NHWC single-threaded, and runs one small GEMM per 512-pixel tile:
//! measured at 72% of an SD1.5 LoRA forward (perf, docs/BENCHMARKS.md). Here the weight is used
//! in its own layout, the columns come from contiguous row copies, and each image is one GEMM.
//! Its `conv_transpose2d` (the input gradient) is a loop of dot products; col2im replaces it.
//!
//! Everything here computes in f32 and returns the input's dtype; the operands are detached
//! (these are the kernels inside our custom ops, not differentiable ops themselves).

use candle_core::{DType, Device, Result, Tensor};

use super::conv_windows::{
    input_grad_in_windows, input_windows, output_windows, weight_grad_in_windows,
};
use super::im2col::{col2im_window, im2col_batch, im2col_rows, ConvGeometry};
use super::with_cpu_f32;

/// `conv2d(x, w, padding, stride)` (groups 1, dilation 1) on detached operands, by the faster
/// kernel for the device: ours on the CPU and on CUDA (`conv_cuda`: im2col + one cuBLAS GEMM),
/// candle's elsewhere, and on CUDA with the fused ops off (for before/after benchmarks).
pub fn conv2d_detached(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let (x, w) = (x.detach(), w.detach());
    match x.device() {
        Device::Cpu => conv2d_im2col(&x, &w, padding, stride),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if super::conv_grad::cuda_kernels(&x) => {
            super::conv_cuda::conv2d(&x, &w, padding, stride)
        }
        _ => x.conv2d(&w, padding, stride, 1, 1),
    }
}

/// The forward conv as `W · im2col(x)` per image, in GEMMs of at most [`COLUMN_BUDGET_BYTES`]
/// of columns each.
pub fn conv2d_im2col(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    conv2d_im2col_within(x, w, padding, stride, COLUMN_BUDGET_BYTES)
}

/// [`conv2d_im2col`] with its column budget given.
fn conv2d_im2col_within(
    x: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    budget: usize,
) -> Result<Tensor> {
    let (c_out, c_in, k_h, k_w) = w.dims4()?;
    let (batch, x_c, x_h, x_w) = x.dims4()?;
    if x_c != c_in {
        candle_core::bail!(
            "conv2d: input {:?} has {x_c} channels, the weight {:?} wants {c_in}",
            x.dims(),
            w.dims()
        );
    }
    let out_len = |len: usize, k: usize| {
        ConvGeometry::output_len(len, k, padding, stride).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "conv2d: kernel {k_h}x{k_w} does not fit the {x_h}x{x_w} input (padding {padding})"
            ))
        })
    };
    let geo = ConvGeometry {
        c_in,
        x_hw: (x_h, x_w),
        k_hw: (k_h, k_w),
        g_hw: (out_len(x_h, k_h)?, out_len(x_w, k_w)?),
        padding,
        stride,
    };
    let (g_h, g_w) = geo.g_hw;
    let w_mat = w
        .to_dtype(DType::F32)?
        .reshape((c_out, c_in * k_h * k_w))?
        .contiguous()?;
    let x32 = x.to_dtype(DType::F32)?.contiguous()?;
    let k = c_in * k_h * k_w;
    let chunk = rows_per_chunk(k, g_h, g_w, budget);
    let mut images = Vec::with_capacity(batch);
    for i in 0..batch {
        let image = x32.get(i)?;
        let mut parts = Vec::with_capacity(g_h.div_ceil(chunk));
        for r0 in (0..g_h).step_by(chunk) {
            let rows = r0..(r0 + chunk).min(g_h);
            let n = rows.len() * g_w;
            let cols = with_cpu_f32(&image, |plane| im2col_rows(plane, &geo, rows.clone()))?;
            let cols = Tensor::from_vec(cols, (k, n), &Device::Cpu)?;
            parts.push(w_mat.matmul(&cols)?.reshape((c_out, rows.len(), g_w))?);
        }
        let y = match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::cat(&parts, 1)?,
        };
        images.push(y.reshape((1, c_out, g_h, g_w))?);
    }
    cat_images(images)?.to_dtype(x.dtype())
}

/// The f32 columns one GEMM of the forward may take at most: a VAE decoder's 3×3 conv over 256
/// channels at 512 px would otherwise take 2.4 GB of columns at once (2026-11-24).
const COLUMN_BUDGET_BYTES: usize = 128 << 20;

/// Output rows per forward GEMM, so that its f32 columns stay within `budget` bytes (at least
/// one row; all of them when they fit).
fn rows_per_chunk(k: usize, g_h: usize, g_w: usize, budget: usize) -> usize {
    let row_bytes = (k * g_w * 4).max(1);
    (budget / row_bytes).clamp(1, g_h.max(1))
}

/// `∂L/∂x` as `col2im(Wᵀ · G)` in f32, the images side by side, in bands of input rows whose
/// columns stay within [`COLUMN_BUDGET_BYTES`] ([`super::conv_windows`]); in the gradient's dtype.
pub fn conv2d_input_grad_col2im(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
) -> Result<Tensor> {
    conv2d_input_grad_within(grad, w, padding, stride, x_hw, COLUMN_BUDGET_BYTES)
}

/// [`conv2d_input_grad_col2im`] with its column budget given.
fn conv2d_input_grad_within(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
    budget: usize,
) -> Result<Tensor> {
    let (c_out, c_in, k_h, k_w) = w.dims4()?;
    let (batch, g_c, g_h, g_w) = grad.dims4()?;
    let geo = ConvGeometry::for_gradient(c_in, x_hw, (k_h, k_w), (g_h, g_w), padding, stride);
    let Some(geo) = geo.filter(|_| g_c == c_out) else {
        candle_core::bail!(
            "conv2d input grad: gradient {:?} does not match weight {:?} on a {}x{} input \
             (padding {padding}, stride {stride})",
            grad.dims(),
            w.dims(),
            x_hw.0,
            x_hw.1
        );
    };
    let w_t = w
        .to_dtype(DType::F32)?
        .reshape((c_out, c_in * k_h * k_w))?
        .t()?;
    let grad32 = grad.to_dtype(DType::F32)?;
    let identity = k_h == 1 && k_w == 1 && padding == 0 && stride == 1;
    let windows = input_windows(&geo, batch, 4, budget);
    // Each band rounds to the gradient's dtype before the bands are joined.
    let dtype = grad.dtype();
    input_grad_in_windows(&grad32, &w_t, &geo, &windows, dtype, |cols, window| {
        let shape = (batch, c_in, window.input.len(), x_hw.1);
        let band = if identity && batch == 1 {
            // A 1×1 conv's columns are the gradient itself.
            cols.reshape(shape)?
        } else {
            let data = with_cpu_f32(cols, |c| col2im_window(c, &geo, batch, window))?;
            Tensor::from_vec(data, shape, &Device::Cpu)?
        };
        band.to_dtype(dtype)
    })
}

/// `∂L/∂w = G · im2col(x)ᵀ` in f32 over all images at once, in bands of output rows whose
/// columns stay within [`COLUMN_BUDGET_BYTES`]; shaped `[c_out, c_in, k_h, k_w]` in the
/// gradient's dtype.
pub fn conv2d_weight_grad_im2col(
    x: &Tensor,
    grad: &Tensor,
    padding: usize,
    stride: usize,
    k_hw: (usize, usize),
) -> Result<Tensor> {
    conv2d_weight_grad_within(x, grad, padding, stride, k_hw, COLUMN_BUDGET_BYTES)
}

/// [`conv2d_weight_grad_im2col`] with its column budget given.
fn conv2d_weight_grad_within(
    x: &Tensor,
    grad: &Tensor,
    padding: usize,
    stride: usize,
    k_hw: (usize, usize),
    budget: usize,
) -> Result<Tensor> {
    let (batch, c_in, x_h, x_w) = x.dims4()?;
    let (g_b, c_out, g_h, g_w) = grad.dims4()?;
    let (k_h, k_w) = k_hw;
    let geo = ConvGeometry::for_gradient(c_in, (x_h, x_w), k_hw, (g_h, g_w), padding, stride);
    let Some(geo) = geo.filter(|_| g_b == batch && batch > 0) else {
        candle_core::bail!(
            "conv2d weight grad: gradient {:?} does not match input {:?} for a {k_h}x{k_w} \
             kernel (padding {padding}, stride {stride})",
            grad.dims(),
            x.dims()
        );
    };
    let x32 = x.to_dtype(DType::F32)?.contiguous()?;
    let grad32 = grad.to_dtype(DType::F32)?;
    let k = c_in * k_h * k_w;
    let windows = output_windows(g_h, k * batch * g_w * 4, budget);
    let gw = weight_grad_in_windows(&grad32, &windows, |rows| {
        let n = batch * rows.len() * g_w;
        let cols = with_cpu_f32(&x32, |plane| im2col_batch(plane, &geo, batch, rows))?;
        Tensor::from_vec(cols, (k, n), &Device::Cpu)
    })?;
    gw.reshape((c_out, c_in, k_h, k_w))?.to_dtype(grad.dtype())
}

/// Stacks `[1, …]` images along dim 0 (no copy for a batch of one).
fn cat_images(mut images: Vec<Tensor>) -> Result<Tensor> {
    if images.len() == 1 {
        if let Some(only) = images.pop() {
            return Ok(only);
        }
    }
    Tensor::cat(&images, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{fill, max_abs};

    /// Every (kernel, padding, stride) SD models use, on odd, even and non-square inputs.
    const CASES: [(usize, usize, usize); 4] = [(3, 1, 1), (3, 1, 2), (1, 0, 1), (3, 0, 1)];
    const SIZES: [(usize, usize); 4] = [(8, 8), (7, 9), (6, 5), (5, 12)];

    #[test]
    fn forward_and_weight_grad_match_candle() {
        for (k, p, s) in CASES {
            for (h, w) in SIZES {
                let x = fill(&[2, 3, h, w], 1, 1.0);
                let wt = fill(&[4, 3, k, k], 2, 1.0);
                let want = x.conv2d(&wt, p, s, 1, 1).unwrap();
                let ours = conv2d_im2col(&x, &wt, p, s).unwrap();
                assert_eq!(ours.dims(), want.dims());
                let e = max_abs(&ours, &want);
                assert!(e < 1e-4, "forward k{k} p{p} s{s} {h}x{w}: {e}");
                let g = fill(want.dims(), 3, 1.0);
                let gw = conv2d_weight_grad_im2col(&x, &g, p, s, (k, k)).unwrap();
                let want = crate::nn::conv2d_weight_grad_reference(&x, &g, p, s, (k, k)).unwrap();
                let e = max_abs(&gw, &want);
                assert!(e < 1e-4, "weight grad k{k} p{p} s{s} {h}x{w}: {e}");
            }
        }
    }

    /// The forward in GEMMs of one and of two output rows (a budget of one byte, and of two rows'
    /// columns) equals the forward in one GEMM: a chunk that starts at the wrong row, leaves out
    /// the last partial chunk or puts its columns in the wrong place fails.
    #[test]
    fn forward_in_row_chunks_matches_one_gemm() {
        for (k, p, s) in CASES {
            for (h, w) in SIZES {
                let x = fill(&[2, 3, h, w], 4, 1.0);
                let wt = fill(&[4, 3, k, k], 5, 1.0);
                let whole = conv2d_im2col_within(&x, &wt, p, s, usize::MAX).unwrap();
                let g_w = whole.dim(3).unwrap();
                for budget in [1, 2 * 3 * k * k * g_w * 4] {
                    let chunked = conv2d_im2col_within(&x, &wt, p, s, budget).unwrap();
                    let e = max_abs(&chunked, &whole);
                    assert!(e < 1e-5, "k{k} p{p} s{s} {h}x{w}, budget {budget}: {e}");
                }
            }
        }
        assert_eq!(rows_per_chunk(2304, 512, 512, COLUMN_BUDGET_BYTES), 28);
        assert_eq!(rows_per_chunk(27, 8, 8, COLUMN_BUDGET_BYTES), 8);
    }

    /// Both gradients built in bands (a budget of one byte: one output row per band; and of
    /// about two rows) equal the gradients in one band, which match candle's: a band joined at
    /// the wrong row, a weight-gradient band left out of the sum or an image's block misread
    /// fails.
    #[test]
    fn gradients_in_bands_match_one_band() {
        for (k, p, s) in CASES.into_iter().chain([(1, 0, 2)]) {
            for (h, w) in SIZES {
                let x = fill(&[2, 3, h, w], 6, 1.0);
                let wt = fill(&[4, 3, k, k], 7, 1.0);
                let y = conv2d_im2col(&x, &wt, p, s).unwrap();
                let g = fill(y.dims(), 8, 1.0);
                let g_w = y.dim(3).unwrap();
                let whole_x = conv2d_input_grad_within(&g, &wt, p, s, (h, w), usize::MAX).unwrap();
                let candle_x = crate::nn::conv2d_input_grad_reference(&g, &wt, p, s, (h, w));
                let e = max_abs(&whole_x, &candle_x.unwrap());
                assert!(e < 1e-4, "input grad k{k} p{p} s{s} {h}x{w}: {e}");
                let whole_w = conv2d_weight_grad_within(&x, &g, p, s, (k, k), usize::MAX).unwrap();
                for budget in [1, 2 * 2 * 3 * k * k * g_w * 4] {
                    let gx = conv2d_input_grad_within(&g, &wt, p, s, (h, w), budget).unwrap();
                    let e = max_abs(&gx, &whole_x);
                    assert!(e < 1e-5, "input grad k{k} p{p} s{s} {h}x{w} {budget}: {e}");
                    let gw = conv2d_weight_grad_within(&x, &g, p, s, (k, k), budget).unwrap();
                    let e = max_abs(&gw, &whole_w);
                    assert!(e < 1e-4, "weight grad k{k} p{p} s{s} {h}x{w} {budget}: {e}");
                }
            }
        }
    }

    /// A 1×1 conv of stride 2 with padding 1 reads only odd input rows; in one-row bands the
    /// last even row of an odd-height input has no output row reaching it, so its band is a
    /// zero gradient, joined with the others in bf16: a zero band made in the f32 the GEMMs
    /// ran in would fail the join, a band of the wrong height the shape.
    #[test]
    fn an_unread_band_is_a_zero_gradient_in_the_output_dtype() {
        let (h, w) = (7, 6);
        let x = fill(&[1, 3, h, w], 9, 1.0).to_dtype(DType::BF16).unwrap();
        let wt = fill(&[4, 3, 1, 1], 10, 1.0).to_dtype(DType::BF16).unwrap();
        let y = conv2d_im2col(&x, &wt, 1, 2).unwrap();
        let g = fill(y.dims(), 11, 1.0).to_dtype(DType::BF16).unwrap();
        let whole = conv2d_input_grad_within(&g, &wt, 1, 2, (h, w), usize::MAX).unwrap();
        let banded = conv2d_input_grad_within(&g, &wt, 1, 2, (h, w), 1).unwrap();
        assert_eq!(banded.dtype(), DType::BF16);
        assert_eq!(max_abs(&banded, &whole), 0.0);
        let last = banded
            .narrow(2, h - 1, 1)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        assert_eq!(max_abs(&last, &last.zeros_like().unwrap()), 0.0);
    }

    #[test]
    fn keeps_the_dtype_and_rejects_wrong_shapes() {
        let wt = fill(&[4, 3, 3, 3], 2, 1.0);
        let x = fill(&[2, 3, 8, 8], 1, 1.0).to_dtype(DType::BF16).unwrap();
        assert_eq!(conv2d_im2col(&x, &wt, 1, 1).unwrap().dtype(), DType::BF16);
        let g = fill(&[2, 4, 8, 8], 3, 1.0).to_dtype(DType::BF16).unwrap();
        let gx = conv2d_input_grad_col2im(&g, &wt, 1, 1, (8, 8)).unwrap();
        assert_eq!((gx.dtype(), gx.dims()), (DType::BF16, &[2, 3, 8, 8][..]));
        let err = conv2d_input_grad_col2im(&g, &wt, 1, 1, (9, 9)).unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
        let err = conv2d_weight_grad_im2col(&x, &g, 1, 2, (3, 3)).unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
        let wide = fill(&[4, 5, 3, 3], 2, 1.0);
        let err = conv2d_im2col(&x, &wide, 1, 1).unwrap_err();
        assert!(err.to_string().contains("channels"), "{err}");
    }
}
