//! GroupNorm (+SiLU) on the CPU as direct kernels over the storage's own dtype (f32, bf16, f16),
//! the statistics and every sum in f64, each element computed in f32: the role src/nn/kernels/
//! norm.cu plays on CUDA.
//!
//! The composed form (`group_norm.rs`' `Stats`, kept as the reference and for other devices) builds
//! its forward and backward from whole-tensor f32 ops: an f32 copy of `x` and of the gradient,
//! `x̂`, the SiLU terms, `dy`, `dy·x̂` and the result, each as large as the input. In SDXL's
//! 960-channel up-block resnet at 1024 px that is six 60 MiB buffers at once, the peak of a
//! checkpointed step on the CPU (`bench_step --heap-peak-site`). Here a task per (image, group)
//! walks its slice twice and keeps only the group's `dy` (`C/G·H·W` f32) between the walks; the
//! result is written once, in the input's dtype.
//!
//! For a group of `n` elements with mean `μ` and `r = 1/√(var + ε)` (biased variance), `x̂ =
//! (x − μ)·r`, `y = γ·x̂ + β`, out `= y` or `silu(y)`, and `g_y` the gradient at `y` (the upstream
//! gradient, times `σ(y)·(1 + y·(1 − σ(y)))` through the SiLU):
//!
//! ```text
//! ∂L/∂γ_c = Σ g_y·x̂     ∂L/∂β_c = Σ g_y         (over images and pixels of channel c)
//! dy = g_y·γ_c          ∂L/∂x = r·(dy − mean(dy) − x̂·mean(dy·x̂))   (means over the group)
//! ```

use candle_core::{bail, Device, Result, Tensor};
use rayon::prelude::*;

pub(crate) use super::cpu_elem::supported;
use super::cpu_elem::{dispatch, with_slice, Elem};

/// `[B, C, ...]` split into `groups`: images, channels, groups and pixels per channel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupShape {
    pub batch: usize,
    pub channels: usize,
    pub groups: usize,
    pub pixels: usize,
}

impl GroupShape {
    pub fn of(dims: &[usize], groups: usize) -> Result<Self> {
        let (batch, channels) = match dims {
            [b, c, ..] => (*b, *c),
            _ => bail!("group norm: input {dims:?} has no channel dim"),
        };
        if groups == 0 || !channels.is_multiple_of(groups) {
            bail!("group norm: {channels} channels in {groups} groups");
        }
        Ok(Self {
            batch,
            channels,
            groups,
            pixels: dims[2..].iter().product(),
        })
    }

    /// Elements of one (image, group).
    fn group_len(&self) -> usize {
        self.channels / self.groups * self.pixels
    }

    fn per_group(&self) -> usize {
        self.channels / self.groups
    }
}

/// Per (image, group) mean and `1/√(var + ε)`, `[B·G]` each, for the fused op's backward.
#[derive(Debug, Clone)]
pub(crate) struct Stats {
    pub shape: GroupShape,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

/// The statistics of `x` (contiguous, on the CPU).
pub(crate) fn stats(x: &Tensor, groups: usize, eps: f64) -> Result<Stats> {
    let shape = GroupShape::of(x.dims(), groups)?;
    let len = shape.group_len();
    let (mean, rstd) = dispatch!("group norm", x, |xs| {
        xs.par_chunks(len.max(1))
            .take(shape.batch * groups)
            .map(|g| group_stats(g, eps))
            .unzip()
    })?;
    Ok(Stats { shape, mean, rstd })
}

fn group_stats<T: Elem>(g: &[T], eps: f64) -> (f32, f32) {
    let n = g.len().max(1) as f64;
    let mean = g.iter().map(|v| v.f() as f64).sum::<f64>() / n;
    let var = g.iter().map(|v| (v.f() as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
}

/// `γ·x̂ + β` (then SiLU), in `x`'s dtype and shape.
pub(crate) fn forward(
    x: &Tensor,
    gamma: &[f32],
    beta: &[f32],
    st: &Stats,
    silu: bool,
) -> Result<Tensor> {
    let out = dispatch!("group norm", x, |xs| {
        let out = forward_typed(xs, gamma, beta, st, silu);
        Tensor::from_vec(out, x.dims(), &Device::Cpu)
    })??;
    Ok(out)
}

fn forward_typed<T: Elem>(xs: &[T], gamma: &[f32], beta: &[f32], st: &Stats, silu: bool) -> Vec<T> {
    let s = st.shape;
    let mut out = vec![T::default(); xs.len()];
    out.par_chunks_mut(s.pixels.max(1))
        .zip(xs.par_chunks(s.pixels.max(1)))
        .enumerate()
        .for_each(|(bc, (o, xp))| {
            let (b, c) = (bc / s.channels, bc % s.channels);
            let bg = b * s.groups + c / s.per_group();
            let a = gamma[c] * st.rstd[bg];
            let shift = beta[c] - st.mean[bg] * a;
            for (o, x) in o.iter_mut().zip(xp) {
                let y = x.f() * a + shift;
                *o = T::of(if silu { y / (1.0 + (-y).exp()) } else { y });
            }
        });
    out
}

/// The three gradients: `∂L/∂x` (in `x`'s dtype, when `want_dx`), `∂L/∂γ` and `∂L/∂β` (f32, `[C]`).
pub(crate) fn backward(
    x: &Tensor,
    grad: &Tensor,
    gamma: &[f32],
    beta: &[f32],
    st: &Stats,
    silu: bool,
    want_dx: bool,
) -> Result<(Option<Tensor>, Vec<f32>, Vec<f32>)> {
    let grad = grad.to_dtype(x.dtype())?.contiguous()?;
    let s = st.shape;
    let ctx = Ctx {
        gamma,
        beta,
        st,
        silu,
    };
    let (dx, partials) = dispatch!("group norm", x, |xs| {
        with_slice(&grad, |gs| {
            let (dx, partials) = ctx.all_groups(xs, gs, want_dx);
            let dx = dx.map(|v| Tensor::from_vec(v, x.dims(), &Device::Cpu));
            (dx.transpose(), partials)
        })
    })??;
    let (mut dgamma, mut dbeta) = (vec![0f64; s.channels], vec![0f64; s.channels]);
    for (bg, p) in partials.iter().enumerate() {
        let c0 = (bg % s.groups) * s.per_group();
        for (i, (dg, db)) in p.iter().enumerate() {
            dgamma[c0 + i] += dg;
            dbeta[c0 + i] += db;
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|v| v as f32).collect();
    Ok((dx?, f(dgamma), f(dbeta)))
}

/// One group's `(Σ g_y·x̂, Σ g_y)` per channel.
type ChannelSums = Vec<(f64, f64)>;

/// What every group's task reads.
struct Ctx<'a> {
    gamma: &'a [f32],
    beta: &'a [f32],
    st: &'a Stats,
    silu: bool,
}

impl Ctx<'_> {
    /// Every (image, group) in parallel: `∂L/∂x` (when `want_dx`) and each group's per-channel
    /// sums.
    fn all_groups<T: Elem>(
        &self,
        xs: &[T],
        gs: &[T],
        want_dx: bool,
    ) -> (Option<Vec<T>>, Vec<ChannelSums>) {
        let len = self.st.shape.group_len().max(1);
        let tasks = xs.par_chunks(len).zip(gs.par_chunks(len)).enumerate();
        if !want_dx {
            let partials = tasks
                .map(|(bg, (xg, gg))| self.group(bg, xg, gg, None))
                .collect();
            return (None, partials);
        }
        let mut dx = vec![T::default(); xs.len()];
        let partials = tasks
            .zip(dx.par_chunks_mut(len))
            .map(|((bg, (xg, gg)), out)| self.group(bg, xg, gg, Some(out)))
            .collect();
        (Some(dx), partials)
    }

    /// One (image, group): writes its `∂L/∂x` into `out` (if given) and returns each of its
    /// channels' `(Σ g_y·x̂, Σ g_y)`.
    fn group<T: Elem>(
        &self,
        bg: usize,
        xg: &[T],
        gg: &[T],
        out: Option<&mut [T]>,
    ) -> Vec<(f64, f64)> {
        let s = self.st.shape;
        let (mean, r) = (self.st.mean[bg], self.st.rstd[bg]);
        let c0 = (bg % s.groups) * s.per_group();
        let mut dy = vec![0f32; if out.is_some() { xg.len() } else { 0 }];
        let (mut sum_dy, mut sum_dy_xhat) = (0f64, 0f64);
        let mut per_channel = Vec::with_capacity(s.per_group());
        for i in 0..s.per_group() {
            let (gamma, beta) = (self.gamma[c0 + i], self.beta[c0 + i]);
            let range = i * s.pixels..(i + 1) * s.pixels;
            let (mut dg, mut db) = (0f64, 0f64);
            for (k, (x, g)) in xg[range.clone()].iter().zip(&gg[range.clone()]).enumerate() {
                let xhat = (x.f() - mean) * r;
                let mut gy = g.f();
                if self.silu {
                    let y = gamma * xhat + beta;
                    let sg = 1.0 / (1.0 + (-y).exp());
                    gy *= sg * (1.0 + y * (1.0 - sg));
                }
                dg += (gy * xhat) as f64;
                db += gy as f64;
                if !dy.is_empty() {
                    let d = gy * gamma;
                    dy[range.start + k] = d;
                    sum_dy += d as f64;
                    sum_dy_xhat += (d * xhat) as f64;
                }
            }
            per_channel.push((dg, db));
        }
        if let Some(out) = out {
            let n = xg.len().max(1) as f64;
            let (m_dy, m_dy_xhat) = ((sum_dy / n) as f32, (sum_dy_xhat / n) as f32);
            for ((o, x), d) in out.iter_mut().zip(xg).zip(&dy) {
                let xhat = (x.f() - mean) * r;
                *o = T::of(r * (d - m_dy - xhat * m_dy_xhat));
            }
        }
        per_channel
    }
}
