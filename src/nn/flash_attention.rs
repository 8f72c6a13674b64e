//! Flash attention on CUDA: the kernels of `kernels/flash_attention.cu` (FlashAttention-2, Dao,
//! arXiv 2307.08691) as a candle op with its own backward, and their launch geometry.
//!
//! For `q` `[B, H, Lq, D]`, `k`, `v` `[B, H, Lk, D]` and scale `s`, with L the row log-sum-exp:
//!
//! ```text
//! forward:  O = softmax(s·q·kᵀ)·v, one pass over K/V tiles with an online softmax;  L saved
//! backward: Dr = rowsum(dO ∘ O);  P = exp(s·q·kᵀ − L)   (recomputed per tile, never stored)
//!           dV = Pᵀ·dO;  dP = dO·vᵀ;  dS = P ∘ (dP − Dr)·s;  dQ = dS·k;  dK = dSᵀ·q
//! ```
//!
//! The math is [`super::chunked_attention`]'s; the difference is that no score tile ever reaches
//! global memory. The graph keeps `q`, `k`, `v`, the output and L (one f32 per query row).
//! `causal` masks key j > query i (CLIP's text encoder, see [`super::attention::CausalMask`]).
//!
//! Head dims up to [`MAX_HEAD_DIM`] run, in the smallest bucket of [`BUCKETS`] that holds them
//! (the kernel zero-pads the rest). On the CPU this op is not used (chunked attention is); the
//! unit tests run the same kernels, with the same geometry, under the host emulation
//! ([`crate::kernel_emu`]).

use candle_core::{bail, DType, Result};
#[cfg(feature = "cuda")]
pub(crate) use cuda::FlashAttention;
#[cfg(feature = "cuda")]
use {candle_core::Tensor, std::sync::Mutex};

#[cfg(feature = "cuda")]
mod cuda;

/// Threads per block of every kernel (`FA_THREADS` in the .cu file).
pub(crate) const THREADS: u32 = 128;

/// Query rows per forward block and rows per warp-per-row dot block (the .cu file's `BQ`,
/// `FA_WARPS`).
const FWD_ROWS: usize = 32;
const DOT_ROWS: usize = 4;

/// The head-dim buckets the .cu file instantiates (`ENTRY_POINTS(d40_…)`), each with its
/// backward's key rows per block (`BK`, smaller at 160 to fit 48 KB of static shared memory).
pub(crate) const BUCKETS: [(usize, usize); 4] = [(40, 32), (64, 32), (80, 32), (160, 16)];

/// The largest head dim the kernels take.
pub const MAX_HEAD_DIM: usize = 160;

/// The head-dim buckets of the tensor-core kernels (`kernels/flash_attention_tc.cu`, bf16 and
/// f16 on compute capability 8.0 and later); bucket 160 stays on the SIMT kernels.
pub(crate) const TC_BUCKETS: [usize; 3] = [40, 64, 80];

/// Query rows per forward block and key rows per backward block of the tensor-core kernels.
const TC_FWD_ROWS: usize = 64;
const TC_BWD_ROWS: usize = 64;

/// Whether bf16/f16 attention may take the tensor-core kernels where the card has them: yes,
/// unless the environment sets `SDTRAIN_FLASH_TC=0` (read once), which keeps every call on the
/// SIMT kernels (a fallback, and the "before" of a before/after).
#[cfg(feature = "cuda")]
pub fn tensor_cores_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !std::env::var("SDTRAIN_FLASH_TC").is_ok_and(|v| v.trim() == "0"))
}

/// The largest grid y (heads × batch).
const MAX_GRID_Y: usize = 65535;

/// The shape of one flash-attention call and the launches it makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Batch × heads.
    pub bh: usize,
    pub lq: usize,
    pub lk: usize,
    /// The head dim, and the bucket that runs it.
    pub d: usize,
    bucket: usize,
    /// Key rows per backward block.
    bwd_rows: usize,
    /// The forward and backward run on the tensor-core kernels.
    tc: bool,
    /// The layout (tensor-core kernels only): split heads `[BH, L, D]` (heads 1, rows D apart),
    /// or merged heads `[B, L, H·D]` read in place (heads H, rows H·D apart).
    pub heads: usize,
    pub q_rs: usize,
    pub k_rs: usize,
}

impl Geometry {
    pub fn new(bh: usize, lq: usize, lk: usize, d: usize) -> Result<Self> {
        let Some(&(bucket, bwd_rows)) = BUCKETS.iter().find(|(b, _)| d <= *b) else {
            bail!("flash attention: head dim {d} is over the kernels' {MAX_HEAD_DIM}")
        };
        if d == 0 || bh == 0 || lq == 0 || lk == 0 {
            bail!("flash attention: empty input (heads {bh}, Lq {lq}, Lk {lk}, head dim {d})")
        }
        if bh > MAX_GRID_Y {
            bail!("flash attention: {bh} batch×heads is over the grid's {MAX_GRID_Y}")
        }
        if bh.saturating_mul(lq) > i32::MAX as usize {
            bail!("flash attention: {bh} batch×heads × {lq} queries overflows i32")
        }
        if lq.max(lk).saturating_mul(d) > i32::MAX as usize {
            bail!(
                "flash attention: sequence of {} × head dim {d} overflows i32",
                lq.max(lk)
            )
        }
        Ok(Self {
            bh,
            lq,
            lk,
            d,
            bucket,
            bwd_rows,
            tc: false,
            heads: 1,
            q_rs: d,
            k_rs: d,
        })
    }

    /// This call on merged heads `[B, L, H·D]` read in place (`bh` = B·`heads`), on the
    /// tensor-core kernels; `None` when they do not take its dtype or head dim.
    pub fn merged(self, heads: usize, dtype: DType) -> Option<Self> {
        let g = self.with_tensor_cores(dtype);
        (g.tc && heads > 0 && g.bh.is_multiple_of(heads)).then(|| Self {
            heads,
            q_rs: heads * g.d,
            k_rs: heads * g.d,
            ..g
        })
    }

    /// This call on the tensor-core kernels when they take its dtype (bf16, f16) and head dim;
    /// otherwise unchanged. The caller checks that the card has them (compute capability 8.0).
    pub fn with_tensor_cores(self, dtype: DType) -> Self {
        let tc = matches!(dtype, DType::BF16 | DType::F16) && TC_BUCKETS.contains(&self.bucket);
        Self { tc, ..self }
    }

    /// Whether the forward and backward run on the tensor-core kernels.
    pub fn tensor_cores(&self) -> bool {
        self.tc
    }

    /// The tensor-core kernels' layout arguments: heads, q's and k's row strides.
    pub fn layout_args(&self) -> [i32; 3] {
        [self.heads as i32, self.q_rs as i32, self.k_rs as i32]
    }

    /// The entry point of `kernel` (`flash_fwd`, `flash_dot`, `flash_bwd`) for `dtype`: the
    /// tensor-core file's (`flash_fwd_tc_…`) when [`Self::tensor_cores`].
    pub fn entry(&self, kernel: &str, dtype: DType) -> Result<String> {
        let ty = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => bail!("flash attention: no kernel for {other:?}"),
        };
        let tc = if self.tc { "_tc" } else { "" };
        Ok(format!("{kernel}{tc}_d{}_{ty}", self.bucket))
    }

    /// One block per query tile and head.
    pub fn fwd_grid(&self) -> [u32; 3] {
        let rows = if self.tc { TC_FWD_ROWS } else { FWD_ROWS };
        [self.lq.div_ceil(rows) as u32, self.bh as u32, 1]
    }

    /// One warp per query row.
    pub fn dot_grid(&self) -> [u32; 3] {
        [(self.bh * self.lq).div_ceil(DOT_ROWS) as u32, 1, 1]
    }

    /// One block per key tile and head.
    pub fn bwd_grid(&self) -> [u32; 3] {
        let rows = if self.tc { TC_BWD_ROWS } else { self.bwd_rows };
        [self.lk.div_ceil(rows) as u32, self.bh as u32, 1]
    }

    /// Elements of `q` (and of the output, dO and dQ) and of `k` (and `v`, dK, dV).
    pub fn q_len(&self) -> usize {
        self.bh * self.lq * self.d
    }

    pub fn k_len(&self) -> usize {
        self.bh * self.lk * self.d
    }
}

/// The op for one call, its operands' shapes and dtypes checked.
#[cfg(feature = "cuda")]
fn flash_op(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    tensor_cores: bool,
) -> Result<FlashAttention> {
    let (b, h, lq, d) = q.dims4()?;
    let (bk, hk, lk, dk) = k.dims4()?;
    if (bk, hk, dk) != (b, h, d) || v.dims() != k.dims() {
        bail!(
            "flash attention: q {:?}, k {:?}, v {:?} do not match",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("flash attention: q, k, v must share a dtype")
    }
    let mut geo = Geometry::new(b * h, lq, lk, d)?;
    if tensor_cores && has_tensor_cores(q.device()) {
        geo = geo.with_tensor_cores(q.dtype());
    }
    Ok(FlashAttention {
        geo,
        scale: scale as f32,
        causal,
        lse: Mutex::new(None),
    })
}

/// Whether `device` is a CUDA card with bf16/f16 `mma.sync` (compute capability 8.0 or later).
#[cfg(feature = "cuda")]
fn has_tensor_cores(device: &candle_core::Device) -> bool {
    match device {
        candle_core::Device::Cuda(dev) => dev
            .cuda_stream()
            .context()
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 8),
        _ => false,
    }
}

/// `softmax(s·q·kᵀ)·v` for `q` `[B, H, Lq, D]`, `k`/`v` `[B, H, Lk, D]` (same dtype: f32, bf16
/// or f16) on CUDA, by the flash kernels; `causal` masks key j > query i.
#[cfg(feature = "cuda")]
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    flash_attention_on(q, k, v, scale, causal, tensor_cores_enabled())
}

/// [`flash_attention`] on the SIMT kernels whatever the dtype and card: the tensor-core kernels'
/// reference on a GPU, and their "before" in benchmarks.
#[cfg(feature = "cuda")]
pub fn flash_attention_simt(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    flash_attention_on(q, k, v, scale, causal, false)
}

#[cfg(feature = "cuda")]
fn flash_attention_on(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    tensor_cores: bool,
) -> Result<Tensor> {
    let op = flash_op(q, k, v, scale, causal, tensor_cores)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)
    }
}

/// Flash attention on merged heads, `q` `[B, Lq, H·D]`, `k`/`v` `[B, Lk, H·D]`, read and written
/// in place by the tensor-core kernels: no split copies of q, k, v, the output or the gradients,
/// forward or backward (`super::merged_heads` makes twelve per layer). `None` where those kernels
/// do not run (dtype, head dim, card, `SDTRAIN_FLASH_TC=0`): the caller splits the heads then.
#[cfg(feature = "cuda")]
pub(crate) fn flash_merged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    scale: f64,
    causal: bool,
) -> Result<Option<Tensor>> {
    let (b, lq, inner) = q.dims3()?;
    let (bk, lk, ik) = k.dims3()?;
    let same = (bk, ik) == (b, inner)
        && v.dims() == k.dims()
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype();
    if heads == 0 || !inner.is_multiple_of(heads) || !same {
        return Ok(None);
    }
    if !(tensor_cores_enabled() && has_tensor_cores(q.device())) {
        return Ok(None);
    }
    let Some(geo) = Geometry::new(b * heads, lq, lk, inner / heads)?.merged(heads, q.dtype())
    else {
        return Ok(None);
    };
    let op = FlashAttention {
        geo,
        scale: scale as f32,
        causal,
        lse: Mutex::new(None),
    };
    let (qd, kd, vd) = (
        q.detach().contiguous()?,
        k.detach().contiguous()?,
        v.detach().contiguous()?,
    );
    let out = qd.apply_op3_no_bwd(&kd, &vd, &op)?;
    let out = super::fused_op::attach3((q, k, v), "flash-attention", out, MergedFlash(op))?;
    Ok(Some(out))
}

/// The backward of [`flash_merged`]: the kernels' own, on the merged layout.
#[cfg(feature = "cuda")]
struct MergedFlash(FlashAttention);

#[cfg(feature = "cuda")]
impl super::fused_op::Backward3 for MergedFlash {
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<super::fused_op::Grads3> {
        use super::merged_heads::HeadsKernel;
        let want = [q.track_op(), k.track_op(), v.track_op()];
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        self.0.backward(&q, &k, &v, res, grad, want)
    }
}

/// [`flash_attention`]'s forward on detached operands, for an op that carries the backward
/// itself (`super::merged_heads`): the output, and the op holding L for the backward.
#[cfg(feature = "cuda")]
pub(crate) fn flash_detached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<(Tensor, FlashAttention)> {
    let op = flash_op(q, k, v, scale, causal, tensor_cores_enabled())?;
    let (q, k, v) = (
        q.detach().contiguous()?,
        k.detach().contiguous()?,
        v.detach().contiguous()?,
    );
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    Ok((out, op))
}

#[cfg(test)]
mod tests;
