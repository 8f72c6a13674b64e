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

    /// Output pixels of every image together.
    fn cols(&self) -> usize {
        self.batch * self.g.0 * self.g.1
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
    let chunk = (COLUMN_BUDGET_BYTES / row_bytes.max(1)).clamp(1, g_h.max(1));
    if chunk >= g_h {
        let y = w2.matmul(&im2col(x, geo, 0..g_h)?)?;
        return images_first(y, batch, c_out, geo.g);
    }
    let mut parts = Vec::with_capacity(g_h.div_ceil(chunk));
    for r0 in (0..g_h).step_by(chunk) {
        let rows = r0..(r0 + chunk).min(g_h);
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

/// The columns one forward GEMM takes at most: a VAE decoder's 3×3 conv over 256 channels
/// would otherwise take 1.2 GB of bf16 columns at once at 512 px, 4.8 GB at 1024 px. Larger
/// convs run in chunks of output rows (one GEMM each, then one copy of the output).
const COLUMN_BUDGET_BYTES: usize = 256 << 20;

/// `∂L/∂x` of `y = conv2d(x, w, padding, stride)` for an `x_hw` input: `col2im(Wᵀ · G)`.
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
    let g = channels_first(grad)?;
    let cols = w.reshape((c_out, geo.rows()))?.t()?.matmul(&g)?;
    col2im(&cols, geo)
}

/// `∂L/∂w` of `y = conv2d(x, w, padding, stride)` for a `k_hw` kernel: `G · im2col(x)ᵀ`.
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
    let cols = im2col(x, geo, 0..geo.g.0)?;
    channels_first(grad)?
        .matmul(&cols.t()?)?
        .reshape((c_out, c_in, k_hw.0, k_hw.1))
}

/// `[B, C, H, W]` → `[C, B·H·W]` (a reshape at batch 1, a transpose copy otherwise).
fn channels_first(t: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = t.dims4()?;
    if b == 1 {
        return t.reshape((c, h * w));
    }
    t.reshape((b, c, h * w))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((c, b * h * w))
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
    })
}

fn col2im(cols: &Tensor, geo: Geo) -> Result<Tensor> {
    cols.detach().contiguous()?.apply_op1_no_bwd(&Columns {
        geo,
        col2im: true,
        rows: 0..geo.g.0,
    })
}

/// im2col (`x` → columns `[C·k_h·k_w, B·N]`, of the output rows `rows`) or col2im (columns of
/// every row → `x` `[B, C, H, W]`).
struct Columns {
    geo: Geo,
    col2im: bool,
    rows: std::ops::Range<usize>,
}

impl Columns {
    fn out_shape(&self) -> Shape {
        let g = &self.geo;
        if self.col2im {
            Shape::from((g.batch, g.c, g.hw.0, g.hw.1))
        } else {
            Shape::from((g.rows(), g.batch * self.rows.len() * g.g.1))
        }
    }

    fn in_len(&self) -> usize {
        let g = &self.geo;
        if self.col2im {
            g.rows() * g.cols()
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
        let row_args = [self.rows.start as u32, self.rows.len() as u32];
        if self.rows.end > self.geo.g.0 {
            bail!(
                "{}: output rows {:?} past {}",
                self.name(),
                self.rows,
                self.geo.g.0
            );
        }
        let stream = dev.cuda_stream();
        let mut lb = stream.launch_builder(&f);
        lb.arg(&mut out).arg(&input);
        for v in &ints {
            lb.arg(v);
        }
        if !self.col2im {
            lb.arg(&row_args[0]).arg(&row_args[1]);
        }
        let blocks = (n as u64).div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: conv.cu's (out, in, batch, c, h, w, kh, kw, gh, gw, pad, stride[, row0, rows])
        // signature; `input` holds in_len elements and `out` n, as the geometry (and the rows,
        // checked within g_h above, each fitting u32 as g_h does) says the kernel reads and
        // writes.
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
