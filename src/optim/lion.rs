//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675,
//! Algorithm 2), with one momentum in f32 (`lion`) or blockwise 8-bit (`lion8bit`, as
//! bitsandbytes' `Lion8bit`: the signed dynamic map, 256-element blocks, f32 under 4096 elements).
//!
//! ```text
//! p ← p · (1 − lr·λ)                       (decoupled weight decay)
//! u ← sign(β1·m + (1 − β1)·g)              (sign(0) = 0)
//! m ← β2·m + (1 − β2)·g
//! p ← p − lr·u
//! ```
//!
//! This is lucidrains' `lion_pytorch.Lion` (EveryDream2's `lion`) and bitsandbytes' update order.
//! Defaults: betas (0.9, 0.99), no epsilon. Use an lr 3–10× smaller than AdamW's and a weight
//! decay 3–10× larger.

use candle_core::{Tensor, Var};
use rayon::prelude::*;
use serde::Serialize;

use super::host;
use super::placed::PlacedMoment;
use super::quant8::{dequantize, maps, requantize, Moment, BLOCK};
use super::rule::{ParamState, UpdateRule};
use super::{OptimError, Result};

/// Lion's hyper-parameters (the lr is the group's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LionParams {
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
}

impl Default for LionParams {
    /// The paper's and lion-pytorch's: betas (0.9, 0.99), no weight decay.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }
}

/// The Lion rule; 8-bit momentum when `eight_bit`.
#[derive(Debug, Clone, Copy)]
pub struct Lion {
    hyper: LionParams,
    eight_bit: bool,
}

impl Lion {
    pub fn rule(hyper: LionParams, eight_bit: bool) -> Result<Self> {
        for (field, b) in [("beta1", hyper.beta1), ("beta2", hyper.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(OptimError::InvalidParam {
                    field,
                    value: b,
                    allowed: "must be in [0, 1)",
                });
            }
        }
        if hyper.weight_decay < 0.0 {
            return Err(OptimError::InvalidParam {
                field: "weight_decay",
                value: hyper.weight_decay,
                allowed: "must be >= 0",
            });
        }
        Ok(Self { hyper, eight_bit })
    }
}

impl UpdateRule for Lion {
    fn name(&self) -> &'static str {
        if self.eight_bit {
            "lion8bit"
        } else {
            "lion"
        }
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        Ok(Box::new(State {
            hyper: self.hyper,
            shape: var.dims().to_vec(),
            m: PlacedMoment::zeros(var, self.eight_bit, &maps().0)?,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        Moment::bytes_for(shape.iter().product(), self.eight_bit)
    }
}

#[derive(Debug)]
struct State {
    hyper: LionParams,
    shape: Vec<usize>,
    m: PlacedMoment,
}

/// The f32 scalars of one update.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scalars {
    b1: f32,
    b2: f32,
    lr: f32,
    decay: f32,
}

impl Scalars {
    pub(crate) fn new(h: &LionParams, lr: f64) -> Self {
        Self {
            b1: h.beta1 as f32,
            b2: h.beta2 as f32,
            lr: lr as f32,
            decay: (1.0 - lr * h.weight_decay) as f32,
        }
    }

    /// The scalars of kernels.cu's `lion_*` entry points, in argument order.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn device_args(&self) -> [f32; 4] {
        [self.b1, self.b2, self.lr, self.decay]
    }
}

fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

fn lion_elements(p: &mut [f32], g: &[f32], m: &mut [f32], k: &Scalars) {
    for i in 0..p.len() {
        let u = sign(k.b1 * m[i] + (1.0 - k.b1) * g[i]);
        m[i] = k.b2 * m[i] + (1.0 - k.b2) * g[i];
        p[i] = p[i] * k.decay - k.lr * u;
    }
}

/// The fused kernel, blocks (or f32 chunks) in parallel.
fn kernel(p: &mut [f32], g: &[f32], m: &mut Moment, k: &Scalars) {
    match m {
        Moment::F32(m) => {
            const CHUNK: usize = 1 << 14;
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .for_each(|((p, g), m)| lion_elements(p, g, m, k));
        }
        Moment::Q8 { codes, absmax } => {
            let map = &maps().0;
            p.par_chunks_mut(BLOCK)
                .zip(g.par_chunks(BLOCK))
                .zip(codes.par_chunks_mut(BLOCK).zip(absmax.par_iter_mut()))
                .for_each(|((p, g), (c, a))| {
                    let mut mb = [0f32; BLOCK];
                    let n = p.len();
                    dequantize(c, *a, map, &mut mb[..n]);
                    lion_elements(p, g, &mut mb[..n], k);
                    *a = requantize(&mb[..n], map, c);
                });
        }
    }
}

/// The paper's update on the whole tensor, with the exhaustive nearest-code requantization: the
/// reference the kernel is tested against.
#[cfg(test)]
fn reference(p: &mut [f32], g: &[f32], m: &mut Moment, k: &Scalars) {
    let map = &maps().0;
    let mut mf = m.values(map);
    for i in 0..p.len() {
        let update = sign(k.b1 * mf[i] + (1.0 - k.b1) * g[i]);
        p[i] *= k.decay;
        p[i] -= k.lr * update;
        mf[i] = k.b2 * mf[i] + (1.0 - k.b2) * g[i];
    }
    m.store_reference(mf, map);
}

impl ParamState for State {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, _t: u64) -> candle_core::Result<()> {
        let k = Scalars::new(&self.hyper, lr);
        match &mut self.m {
            PlacedMoment::Host(m) => host::update_in_place(var, grad, |p, g| kernel(p, g, m, &k)),
            #[cfg(feature = "cuda")]
            PlacedMoment::Cuda(m) => {
                super::cuda::update(var, grad, "lion", &mut [m], &k.device_args())
            }
        }
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        self.m.save(("state1", "absmax1"), &self.shape)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        self.m.load(&mut tensors.into_iter())
    }

    fn bytes(&self) -> usize {
        self.m.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::kernel_emu;
    use crate::optim::test_values;

    /// kernels.cu's `lion_*` entry points under the host emulation against the host kernel, f32
    /// and 8-bit momentum: bit for bit but for codes of values exactly on a midpoint.
    #[test]
    fn cuda_kernel_under_emulation_matches_host_kernel() {
        let h = LionParams {
            weight_decay: 0.3,
            ..LionParams::default()
        };
        let map_buf = kernel_emu::map_buffer();
        // The third case's gradients span 9 decades per block: the sign fix decides most codes.
        for (n, eight_bit, spread) in [
            (5000usize, true, false),
            (5000, false, false),
            (5000, true, true),
        ] {
            let (mut pa, mut pb) = (test_values(3, n, 1.0), test_values(3, n, 1.0));
            let mut ma = Moment::zeros(n, eight_bit, &maps().0);
            let mut mb = ma.clone();
            for t in 1..=5 {
                let g = crate::optim::adamw8bit::tests::spread_values(200 + t, n, spread);
                let k = Scalars::new(&h, 1e-3);
                kernel(&mut pa, &g, &mut ma, &k);
                // f32 state on a grid of 2 blocks, so the grid-stride loop goes round.
                let grid = (!eight_bit).then_some(2);
                kernel_emu::run_moments(
                    "lion",
                    &mut pb,
                    &g,
                    &mut [&mut mb],
                    &map_buf,
                    &k.device_args(),
                    grid,
                );
                kernel_emu::gap(&pa, &pb, &[&ma], &[&mb]).assert_tracks(n, t);
            }
        }
    }

    /// `lion_{f32,q8}_bf16`/`_f16` against their f32-parameter versions under the emulation:
    /// the f32 update rounded to nearest even, the same momentum (f32 and 8-bit).
    #[test]
    fn bf16_and_f16_entry_points_round_the_f32_update() {
        let h = LionParams {
            weight_decay: 0.3,
            ..LionParams::default()
        };
        let n = 5000;
        for eight_bit in [false, true] {
            kernel_emu::assert_low_precision_tracks_f32(
                "lion",
                n,
                &[Moment::zeros(n, eight_bit, &maps().0)],
                &kernel_emu::map_buffer(),
                |t| crate::optim::adamw8bit::tests::spread_values(200 + t, n, false),
                |_| Scalars::new(&h, 1e-2).device_args().to_vec(),
                4,
            );
        }
    }

    /// The paper's update on fixture numbers, by hand: two steps from m = 0.
    #[test]
    fn two_steps_match_the_paper_by_hand() {
        let h = LionParams {
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.1,
        };
        let lr = 0.01;
        let mut p = vec![1.0f32, -0.5, 0.25];
        let mut m = Moment::F32(vec![0.0; 3]);
        let g1 = [0.2f32, -0.4, 0.0];
        kernel(&mut p, &g1, &mut m, &Scalars::new(&h, lr));
        let d = 1.0 - 0.01 * 0.1;
        // u = sign(0.1·g1) = [1, −1, 0]; m = 0.01·g1
        let want1 = [1.0 * d - 0.01, -0.5 * d + 0.01, 0.25 * d];
        for (a, b) in p.iter().zip(want1) {
            assert!((a - b).abs() < 1e-7, "{a} vs {b}");
        }
        // Step 2 with g2 = [−0.001, 0.001, 1]: u = sign(0.9·m + 0.1·g2)
        //   = sign([0.0018 − 0.0001, −0.0036 + 0.0001, 0.1]) = [1, −1, 1]
        let g2 = [-0.001f32, 0.001, 1.0];
        kernel(&mut p, &g2, &mut m, &Scalars::new(&h, lr));
        let want2 = [
            want1[0] * d - 0.01,
            want1[1] * d + 0.01,
            want1[2] * d - 0.01,
        ];
        for (a, b) in p.iter().zip(want2) {
            assert!((a - b).abs() < 1e-7, "{a} vs {b}");
        }
        let Moment::F32(m) = m else { panic!("f32") };
        let want_m = [0.99 * 0.002 - 0.00001, 0.99 * -0.004 + 0.00001, 0.01];
        for (a, b) in m.iter().zip(want_m) {
            assert!((a - b).abs() < 1e-7, "{a} vs {b}");
        }
    }

    #[test]
    fn kernel_matches_reference() {
        let h = LionParams {
            weight_decay: 0.3,
            ..LionParams::default()
        };
        for (n, eight_bit) in [(5000usize, true), (5000, false), (100, true)] {
            let (mut pa, mut pb) = (test_values(3, n, 1.0), test_values(3, n, 1.0));
            let mut ma = Moment::zeros(n, eight_bit, &maps().0);
            let mut mb = ma.clone();
            for t in 1..=5 {
                let g = test_values(50 + t, n, 0.01);
                let k = Scalars::new(&h, 1e-3);
                kernel(&mut pa, &g, &mut ma, &k);
                reference(&mut pb, &g, &mut mb, &k);
                let worst = pa
                    .iter()
                    .zip(&pb)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-6, "n={n} t={t}: params differ by {worst}");
            }
        }
    }
}
