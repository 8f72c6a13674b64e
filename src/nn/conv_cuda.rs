//! 2-D convolution on CUDA as im2col/col2im kernels (src/nn/kernels/conv.cu, equations in its
//! header) around cuBLAS GEMMs, for the three products a training step needs: the forward, the
//! input gradient and the weight gradient. Detached: these are the kernels inside the conv ops of
//! [`super::cpu_conv`] and [`super::conv_grad`], not differentiable ops themselves.
//!
//! Against candle's CUDA conv (its own im2col, a GEMM into `[B, N, C_out]`, a transpose copy to
//! NCHW) and the input gradient as a conv of the padded gradient with a flipped copy of the
//! kernel: the forward needs no transpose copy at batch 1, and the input gradient needs no
//! flipped kernel, no padded gradient and no second im2col (one SD1.5 LoRA step on an H100 spent
//! 15 ms in candle's im2col, 10 ms flipping kernels and part of 18 ms in copies, 2026-11-24).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::conv_windows::{
    input_grad_in_windows, input_windows, output_windows, weight_grad_in_windows, RowWindow,
};
use super::im2col::ConvGeometry;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_conv.ptx"));
const MODULE: &str = "sdtrain_conv";
const THREADS: u32 = 256;
/// Grid-stride blocks at most.
const MAX_BLOCKS: u64 = 65535;

/// Whether the kernels take this dtype (else the callers keep candle's conv).
pub(crate) fn supported(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// One conv's sizes, as the kernels take them.
#[derive(Clone, Copy, Debug)]
struct Geo {
    batch: usize,
    c: usize,
    hw: (usize, usize),
    k: (usize, usize),
    g: (usize, usize),
    padding: usize,
    stride: usize,
}

impl Geo {
    fn new(
        batch: usize,
        c: usize,
        hw: (usize, usize),
        k: (usize, usize),
        padding: usize,
        stride: usize,
    ) -> Result<Self> {
        if stride == 0 {
            bail!("conv2d: stride 0");
        }
        let out = |len: usize, kl: usize| match ConvGeometry::output_len(len, kl, padding, stride) {
            Some(g) => Ok(g),
            None => bail!(
                "conv2d: kernel {}x{} does not fit the {}x{} input (padding {padding})",
                k.0,
                k.1,
                hw.0,
                hw.1
            ),
        };
        Ok(Self {
            batch,
            c,
            hw,
            k,
            g: (out(hw.0, k.0)?, out(hw.1, k.1)?),
            padding,
            stride,
        })
    }

    fn rows(&self) -> usize {
        self.c * self.k.0 * self.k.1
    }

    /// The same conv as the band planning sees it.
    fn geometry(&self) -> ConvGeometry {
        ConvGeometry {
            c_in: self.c,
            x_hw: self.hw,
            k_hw: self.k,
            g_hw: self.g,
            padding: self.padding,
            stride: self.stride,
        }
    }

    fn ints(&self) -> Result<[u32; 10]> {
        let v = [
            self.batch,
            self.c,
            self.hw.0,
            self.hw.1,
            self.k.0,
            self.k.1,
            self.g.0,
            self.g.1,
            self.padding,
            self.stride,
        ];
        let mut out = [0u32; 10];
        for (o, x) in out.iter_mut().zip(v) {
            *o = u32::try_from(x)
                .map_err(|_| candle_core::Error::Msg(format!("conv2d: size {x} exceeds u32")))?;
        }
        Ok(out)
    }
}

/// `conv2d(x, w, padding, stride)`: `W · im2col(x)`, every image in one GEMM.
pub(crate) fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let (c_out, c_in, k_h, k_w) = w.dims4()?;
    let (batch, x_c, x_h, x_w) = x.dims4()?;
    if x_c != c_in {
        bail!(
            "conv2d: input {:?} has {x_c} channels, the weight {:?} wants {c_in}",
            x.dims(),
            w.dims()
        );
    }
    let geo = Geo::new(batch, c_in, (x_h, x_w), (k_h, k_w), padding, stride)?;
    let w2 = w.reshape((c_out, geo.rows()))?;
    let (g_h, g_w) = geo.g;
    let row_bytes = geo.rows() * batch * g_w * x.dtype().size_in_bytes();
    let windows = output_windows(g_h, row_bytes, COLUMN_BUDGET_BYTES);
    if windows.len() <= 1 {
        let y = w2.matmul(&im2col(x, geo, 0..g_h)?)?;
        return images_first(y, batch, c_out, geo.g);
    }
    let mut parts = Vec::with_capacity(windows.len());
    for rows in windows {
        let n = rows.len();
        let y = w2.matmul(&im2col(x, geo, rows)?)?;
        parts.push(y.reshape((c_out, batch, n, g_w))?);
    }
    let y = Tensor::cat(&parts, 2)?;
    if batch == 1 {
        return y.reshape((1, c_out, g_h, g_w));
    }
    y.transpose(0, 1)?.contiguous()
}

/// The columns one GEMM takes at most, in the forward and in both gradients: a VAE decoder's 3×3
/// conv over 256 channels would otherwise take 1.2 GB of bf16 columns at once at 512 px, and
/// SDXL's 960-channel input gradient at 1024 px 270 MiB (inside the backward segment that holds
/// a checkpointed step's peak). A 64 MiB band is still a GEMM of thousands of columns (3,880 for
/// that conv).
const COLUMN_BUDGET_BYTES: usize = 64 << 20;

/// `∂L/∂x` of `y = conv2d(x, w, padding, stride)` for an `x_hw` input: `col2im(Wᵀ · G)`, a band
/// of input rows at a time within [`COLUMN_BUDGET_BYTES`] of columns ([`super::conv_windows`]).
pub(crate) fn input_grad(
    grad: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
) -> Result<Tensor> {
    let (c_out, c_in, k_h, k_w) = w.dims4()?;
    let (batch, g_c, g_h, g_w) = grad.dims4()?;
    let geo = Geo::new(batch, c_in, x_hw, (k_h, k_w), padding, stride)?;
    if g_c != c_out || geo.g != (g_h, g_w) {
        bail!(
            "conv2d input grad: gradient {:?} does not fit weight {:?} and a {}x{} input",
            grad.dims(),
            w.dims(),
            x_hw.0,
            x_hw.1
        );
    }
    let plan = geo.geometry();
    let elem = grad.dtype().size_in_bytes();
    let windows = input_windows(&plan, batch, elem, COLUMN_BUDGET_BYTES);
    let w_t = w.reshape((c_out, geo.rows()))?.t()?;
    input_grad_in_windows(grad, &w_t, &plan, &windows, grad.dtype(), |cols, window| {
        col2im(cols, geo, window.clone())
    })
}

/// `∂L/∂w` of `y = conv2d(x, w, padding, stride)` for a `k_hw` kernel: `G · im2col(x)ᵀ`, a band
/// of output rows at a time within [`COLUMN_BUDGET_BYTES`] of columns (bands summed in f32).
pub(crate) fn weight_grad(
    x: &Tensor,
    grad: &Tensor,
    padding: usize,
    stride: usize,
    k_hw: (usize, usize),
) -> Result<Tensor> {
    let (batch, c_in, x_h, x_w) = x.dims4()?;
    let (g_b, c_out, g_h, g_w) = grad.dims4()?;
    let geo = Geo::new(batch, c_in, (x_h, x_w), k_hw, padding, stride)?;
    if g_b != batch || geo.g != (g_h, g_w) {
        bail!(
            "conv2d weight grad: gradient {:?} does not fit input {:?}",
            grad.dims(),
            x.dims()
        );
    }
    let row_bytes = geo.rows() * batch * g_w * x.dtype().size_in_bytes();
    let windows = output_windows(g_h, row_bytes, COLUMN_BUDGET_BYTES);
    weight_grad_in_windows(grad, &windows, |rows| im2col(x, geo, rows))?
        .reshape((c_out, c_in, k_hw.0, k_hw.1))
}

/// `[C, B·N]` → `[B, C, g_h, g_w]`.
fn images_first(y: Tensor, b: usize, c: usize, (g_h, g_w): (usize, usize)) -> Result<Tensor> {
    if b == 1 {
        return y.reshape((1, c, g_h, g_w));
    }
    y.reshape((c, b, g_h * g_w))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((b, c, g_h, g_w))
}

/// The columns of output rows `rows`: `[C·k_h·k_w, B·rows·g_w]`.
fn im2col(x: &Tensor, geo: Geo, rows: std::ops::Range<usize>) -> Result<Tensor> {
    x.detach().contiguous()?.apply_op1_no_bwd(&Columns {
        geo,
        col2im: false,
        rows,
        input_rows: 0..0,
    })
}

/// Input rows `window.input` of `∂L/∂x` (`[B, C, rows, W]`) from the columns of output rows
/// `window.output`.
fn col2im(cols: &Tensor, geo: Geo, window: RowWindow) -> Result<Tensor> {
    cols.detach().contiguous()?.apply_op1_no_bwd(&Columns {
        geo,
        col2im: true,
        rows: window.output,
        input_rows: window.input,
    })
}

/// im2col (`x` → columns `[C·k_h·k_w, B·N]` of the output rows `rows`) or col2im (columns of
/// output rows `rows` → input rows `input_rows` of `x`, `[B, C, rows, W]`).
struct Columns {
    geo: Geo,
    col2im: bool,
    rows: std::ops::Range<usize>,
    input_rows: std::ops::Range<usize>,
}

impl Columns {
    fn out_shape(&self) -> Shape {
        let g = &self.geo;
        if self.col2im {
            Shape::from((g.batch, g.c, self.input_rows.len(), g.hw.1))
        } else {
            Shape::from((g.rows(), g.batch * self.rows.len() * g.g.1))
        }
    }

    fn in_len(&self) -> usize {
        let g = &self.geo;
        if self.col2im {
            g.rows() * g.batch * self.rows.len() * g.g.1
        } else {
            g.batch * g.c * g.hw.0 * g.hw.1
        }
    }

    fn run<T: CudaDType + DeviceRepr>(&self, s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("{}: input is not contiguous", self.name());
        };
        if b - a != self.in_len() {
            bail!(
                "{}: input of {} elements, the geometry wants {}",
                self.name(),
                b - a,
                self.in_len()
            );
        }
        let dev = s.device();
        let input = s.as_cuda_slice::<T>()?.slice(a..b);
        let n = self.out_shape().elem_count();
        // SAFETY: the kernel writes every one of the n elements (grid-stride over all of them).
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let stem = if self.col2im {
            "conv_col2im"
        } else {
            "conv_im2col"
        };
        let suffix = match s.dtype() {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => bail!("{}: no kernel for {other:?}", self.name()),
        };
        let f = dev
            .get_or_load_custom_func(&format!("{stem}_{suffix}"), MODULE, PTX)?
            .into_cuda_function();
        let ints = self.geo.ints()?;
        // Within g_h and h, which fit u32 as checked by `ints`.
        let row_args = [
            self.rows.start as u32,
            self.rows.len() as u32,
            self.input_rows.start as u32,
            self.input_rows.len() as u32,
        ];
        if self.rows.end > self.geo.g.0 || self.input_rows.end > self.geo.hw.0 {
            bail!(
                "{}: output rows {:?} past {} or input rows {:?} past {}",
                self.name(),
                self.rows,
                self.geo.g.0,
                self.input_rows,
                self.geo.hw.0
            );
        }
        let stream = dev.cuda_stream();
        let mut lb = stream.launch_builder(&f);
        lb.arg(&mut out).arg(&input);
        for v in &ints {
            lb.arg(v);
        }
        if self.col2im {
            // (y0, ys, oy0, oys)
            lb.arg(&row_args[2])
                .arg(&row_args[3])
                .arg(&row_args[0])
                .arg(&row_args[1]);
        } else {
            lb.arg(&row_args[0]).arg(&row_args[1]);
        }
        let blocks = (n as u64).div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: conv.cu's (out, in, batch, c, h, w, kh, kw, gh, gw, pad, stride, then row0,
        // rows for im2col or y0, ys, oy0, oys for col2im) signature; `input` holds in_len
        // elements and `out` n, as the geometry and the rows (checked within g_h and h above)
        // say the kernel reads and writes.
        unsafe { lb.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp1 for Columns {
    fn name(&self) -> &'static str {
        if self.col2im {
            "conv-col2im-cuda"
        } else {
            "conv-im2col-cuda"
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{}: the CUDA kernel got a CPU tensor", self.name())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => self.run::<f32>(s, l)?,
            DType::BF16 => self.run::<half::bf16>(s, l)?,
            DType::F16 => self.run::<half::f16>(s, l)?,
            other => bail!("{}: no kernel for {other:?}", self.name()),
        };
        Ok((out, self.out_shape()))
    }
}
