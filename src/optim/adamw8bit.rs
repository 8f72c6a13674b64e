//! AdamW with blockwise 8-bit moments, as bitsandbytes' `AdamW8bit` (the CUDA kernel
//! `kOptimizerStatic8bit2StateBlockwise`; see [`super::quant8`] for the quantization).
//!
//! Per element, at update `t`, with `c1 = 1 − β1^t`, `c2 = sqrt(1 − β2^t)`:
//!
//! ```text
//! m, v ← dequantize(state1, absmax1), dequantize(state2, absmax2)
//! v ← β2·v + (1 − β2)·g²;   m ← β1·m + (1 − β1)·g
//! absmax1, absmax2 ← max|m|, max|v| per block of 256 (of the updated moments)
//! p ← p − (lr·c2/c1) · m / (sqrt(v) + ε·c2)      (= torch's lr/c1 · m / (sqrt(v)/c2 + ε))
//! p ← p · (1 − lr·λ)                               (bitsandbytes applies the decay after the step)
//! state1, state2 ← nearest codes of m/absmax1 (signed map), v/absmax2 (unsigned map)
//! ```
//!
//! Tensors under 4096 elements keep f32 moments and the same update without quantization. State
//! per parameter: 2 bytes of codes plus 8 bytes of absmax per 256 elements, 2.03 bytes in all.

use candle_core::{Tensor, Var};
use rayon::prelude::*;

use super::adamw::AdamWParams;
use super::host;
use super::placed::PlacedMoment;
use super::quant8::{dequantize, maps, requantize, Moment, BLOCK};
use super::rule::{ParamState, UpdateRule};
use super::Result;

const NAME: &str = "adamw8bit";

/// The AdamW8bit rule.
#[derive(Debug, Clone, Copy)]
pub struct AdamW8bit {
    hyper: AdamWParams,
}

impl AdamW8bit {
    /// The rule; `hyper.lr` is the group's business.
    pub fn rule(hyper: AdamWParams) -> Result<Self> {
        hyper.validate()?;
        Ok(Self { hyper })
    }
}

impl UpdateRule for AdamW8bit {
    fn name(&self) -> &'static str {
        NAME
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        let (signed, unsigned) = maps();
        Ok(Box::new(State {
            hyper: self.hyper,
            shape: var.dims().to_vec(),
            m: PlacedMoment::zeros(var, true, signed)?,
            v: PlacedMoment::zeros(var, true, unsigned)?,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        2 * Moment::bytes_for(shape.iter().product(), true)
    }
}

#[derive(Debug)]
struct State {
    hyper: AdamWParams,
    shape: Vec<usize>,
    m: PlacedMoment,
    v: PlacedMoment,
}

/// The f32 scalars of update `t`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scalars {
    b1: f32,
    b2: f32,
    /// `−lr·c2/c1`.
    step_size: f32,
    /// `ε·c2`.
    eps_c2: f32,
    /// `1 − lr·λ` (1 when λ = 0).
    decay: f32,
}

impl Scalars {
    pub(crate) fn new(h: &AdamWParams, lr: f64, t: u64) -> Self {
        let c1 = 1.0 - h.beta1.powf(t as f64);
        let c2 = (1.0 - h.beta2.powf(t as f64)).sqrt();
        Self {
            b1: h.beta1 as f32,
            b2: h.beta2 as f32,
            step_size: (-lr * c2 / c1) as f32,
            eps_c2: (h.eps * c2) as f32,
            decay: (1.0 - lr * h.weight_decay) as f32,
        }
    }

    /// The scalars of kernels.cu's `adamw8bit_*` entry points, in argument order.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn device_args(&self) -> [f32; 5] {
        [self.b1, self.b2, self.step_size, self.eps_c2, self.decay]
    }
}

/// The f32 update of one run of elements whose moments are already dequantized.
fn adam_elements(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &Scalars) {
    for i in 0..p.len() {
        let gi = g[i];
        v[i] = v[i] * k.b2 + (1.0 - k.b2) * gi * gi;
        m[i] = m[i] * k.b1 + (1.0 - k.b1) * gi;
        p[i] += k.step_size * (m[i] / (v[i].sqrt() + k.eps_c2));
        p[i] *= k.decay;
    }
}

/// The fused kernel: each block is dequantized into the stack, updated and requantized in one
/// pass, blocks in parallel.
fn kernel(p: &mut [f32], g: &[f32], m: &mut Moment, v: &mut Moment, k: &Scalars) {
    let (signed, unsigned) = maps();
    match (m, v) {
        (Moment::F32(m), Moment::F32(v)) => {
            const CHUNK: usize = 1 << 14;
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| adam_elements(p, g, m, v, k));
        }
        (
            Moment::Q8 {
                codes: c1,
                absmax: a1,
            },
            Moment::Q8 {
                codes: c2,
                absmax: a2,
            },
        ) => {
            p.par_chunks_mut(BLOCK)
                .zip(g.par_chunks(BLOCK))
                .zip(c1.par_chunks_mut(BLOCK).zip(a1.par_iter_mut()))
                .zip(c2.par_chunks_mut(BLOCK).zip(a2.par_iter_mut()))
                .for_each(|(((p, g), (c1, a1)), (c2, a2))| {
                    let (mut mb, mut vb) = ([0f32; BLOCK], [0f32; BLOCK]);
                    let n = p.len();
                    dequantize(c1, *a1, signed, &mut mb[..n]);
                    dequantize(c2, *a2, unsigned, &mut vb[..n]);
                    adam_elements(p, g, &mut mb[..n], &mut vb[..n], k);
                    *a1 = requantize(&mb[..n], signed, c1);
                    *a2 = requantize(&vb[..n], unsigned, c2);
                });
        }
        // Both moments of a tensor are made by the same `Moment::zeros` rule.
        _ => unreachable!("adamw8bit: moments of different kinds"),
    }
}

/// The same update written plainly: the whole tensor dequantized, updated element by element,
/// and requantized block by block with the exhaustive nearest-code search. The kernel is tested
/// against it.
#[cfg(test)]
fn reference(p: &mut [f32], g: &[f32], m: &mut Moment, v: &mut Moment, k: &Scalars) {
    let (signed, unsigned) = maps();
    let (mut mf, mut vf) = (m.values(signed), v.values(unsigned));
    adam_elements(p, g, &mut mf, &mut vf, k);
    m.store_reference(mf, signed);
    v.store_reference(vf, unsigned);
}

impl ParamState for State {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> candle_core::Result<()> {
        let k = Scalars::new(&self.hyper, lr, t);
        match (&mut self.m, &mut self.v) {
            (PlacedMoment::Host(m), PlacedMoment::Host(v)) => {
                host::update_in_place(var, grad, |p, g| kernel(p, g, m, v, &k))
            }
            #[cfg(feature = "cuda")]
            (PlacedMoment::Cuda(m), PlacedMoment::Cuda(v)) => {
                super::cuda::update(var, grad, NAME, &mut [m, v], &k.device_args())
            }
            #[cfg(feature = "cuda")]
            _ => candle_core::bail!("{NAME}: moments on different devices"),
        }
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let mut out = self.m.save(("state1", "absmax1"), &self.shape)?;
        out.extend(self.v.save(("state2", "absmax2"), &self.shape)?);
        Ok(out)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let mut it = tensors.into_iter();
        self.m.load(&mut it)?;
        self.v.load(&mut it)
    }

    fn bytes(&self) -> usize {
        self.m.bytes() + self.v.bytes()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::optim::kernel_emu;
    use crate::optim::test_values;

    /// Test gradients: uniform in ±0.01, or with `spread` one element per 64 at ±10 and the
    /// rest at ±1e-8.
    pub(crate) fn spread_values(seed: u64, n: usize, spread: bool) -> Vec<f32> {
        let mut g = test_values(seed, n, 0.01);
        if spread {
            for (i, x) in g.iter_mut().enumerate() {
                *x *= if i % 64 == 0 { 1e3 } else { 1e-6 };
            }
        }
        g
    }

    /// kernels.cu's `adamw8bit_*` entry points under the host emulation against the host kernel,
    /// 5 steps on an 8-bit tensor with a ragged last block and on an f32-state one: the same
    /// arithmetic, so bit for bit but for the codes of values exactly on a midpoint (the CUDA
    /// kernel searches as bitsandbytes does, the host uses a lookup table).
    #[test]
    fn cuda_kernel_under_emulation_matches_host_kernel() {
        let h = AdamWParams {
            lr: 1e-3,
            weight_decay: 0.1,
            ..AdamWParams::default()
        };
        let (signed, unsigned) = maps();
        let map_buf = kernel_emu::map_buffer();
        // The third case spreads each block's gradients over 9 decades, so that most moments
        // fall below the smallest code and the signed map's sign fix decides their codes.
        for (n, spread) in [(5000usize, false), (300, false), (5000, true)] {
            let (mut pa, mut pb) = (test_values(1, n, 1.0), test_values(1, n, 1.0));
            let (mut ma, mut va) = (
                Moment::zeros(n, true, signed),
                Moment::zeros(n, true, unsigned),
            );
            let (mut mb, mut vb) = (ma.clone(), va.clone());
            for t in 1..=5 {
                let g = spread_values(100 + t, n, spread);
                let k = Scalars::new(&h, h.lr, t);
                kernel(&mut pa, &g, &mut ma, &mut va, &k);
                let args = k.device_args();
                kernel_emu::run_moments(
                    NAME,
                    &mut pb,
                    &g,
                    &mut [&mut mb, &mut vb],
                    &map_buf,
                    &args,
                    None,
                );
                kernel_emu::gap(&pa, &pb, &[&ma, &va], &[&mb, &vb]).assert_tracks(n, t);
            }
        }
    }

    /// `adamw8bit_q8_bf16`/`_f16` against `adamw8bit_q8_f32` under the emulation: the f32
    /// update rounded to nearest even, the same codes and absmax.
    #[test]
    fn bf16_and_f16_entry_points_round_the_f32_update() {
        let h = AdamWParams {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamWParams::default()
        };
        let (signed, unsigned) = maps();
        let n = 5000;
        kernel_emu::assert_low_precision_tracks_f32(
            NAME,
            n,
            &[
                Moment::zeros(n, true, signed),
                Moment::zeros(n, true, unsigned),
            ],
            &kernel_emu::map_buffer(),
            |t| spread_values(100 + t, n, false),
            |t| Scalars::new(&h, h.lr, t).device_args().to_vec(),
            4,
        );
    }

    /// Kernel vs reference over 5 steps on a tensor of 8-bit size with a ragged last block, and
    /// on one small enough for f32 state: parameters identical, codes identical but for exact
    /// midpoint ties.
    #[test]
    fn kernel_matches_reference() {
        let h = AdamWParams {
            lr: 1e-3,
            weight_decay: 0.1,
            ..AdamWParams::default()
        };
        for n in [5000usize, 300] {
            let (signed, unsigned) = maps();
            let (mut pa, mut pb) = (test_values(1, n, 1.0), test_values(1, n, 1.0));
            let (mut ma, mut va) = (
                Moment::zeros(n, true, signed),
                Moment::zeros(n, true, unsigned),
            );
            let (mut mb, mut vb) = (ma.clone(), va.clone());
            for t in 1..=5 {
                let g = test_values(100 + t, n, 0.01);
                let k = Scalars::new(&h, h.lr, t);
                kernel(&mut pa, &g, &mut ma, &mut va, &k);
                reference(&mut pb, &g, &mut mb, &mut vb, &k);
                let diff = match (&ma, &mb) {
                    (Moment::Q8 { codes: a, .. }, Moment::Q8 { codes: b, .. }) => {
                        a.iter().zip(b).filter(|(x, y)| x != y).count()
                    }
                    (a, b) => usize::from(a != b),
                };
                assert!(diff <= n / 1000, "n={n} t={t}: {diff} codes differ");
                let worst = pa
                    .iter()
                    .zip(&pb)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-6, "n={n} t={t}: params differ by {worst}");
            }
        }
    }

    /// The first step from zero state, by hand: m = (1−β1)g, v = (1−β2)g², so the step is
    /// lr·g/(|g| + ε·c2)·(c2/c1)·… = lr·sign(g) (to within ε), then the decay.
    #[test]
    fn first_step_is_lr_times_sign_then_decay() {
        let h = AdamWParams {
            lr: 1e-2,
            weight_decay: 0.5,
            ..AdamWParams::default()
        };
        let (signed, unsigned) = maps();
        let n = 4096;
        let mut p = vec![1f32; n];
        let g: Vec<f32> = (0..n)
            .map(|i| if i % 2 == 0 { 0.3 } else { -2.0 })
            .collect();
        let (mut m, mut v) = (
            Moment::zeros(n, true, signed),
            Moment::zeros(n, true, unsigned),
        );
        kernel(&mut p, &g, &mut m, &mut v, &Scalars::new(&h, h.lr, 1));
        let decay = 1.0 - 1e-2 * 0.5;
        assert!((p[0] - (1.0 - 1e-2) * decay).abs() < 1e-6, "{}", p[0]);
        assert!((p[1] - (1.0 + 1e-2) * decay).abs() < 1e-6, "{}", p[1]);
        // The second moment's absmax is (1−β2)·max g² and m's is (1−β1)·max|g|.
        let Moment::Q8 { absmax, .. } = &v else {
            panic!("8-bit")
        };
        assert!(
            (absmax[0] / (0.001 * 4.0) - 1.0).abs() < 1e-4,
            "{}",
            absmax[0]
        );
        let Moment::Q8 { absmax, codes } = &m else {
            panic!("8-bit")
        };
        assert!(
            (absmax[0] / (0.1 * 2.0) - 1.0).abs() < 1e-5,
            "{}",
            absmax[0]
        );
        // 0.03/0.2 = 0.15 and −1: the codes nearest to them.
        assert_eq!(codes[1], 0);
        assert_eq!(codes[0], signed.quantize_reference(0.15));
    }
}
