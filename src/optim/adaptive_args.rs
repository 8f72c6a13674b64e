//! How each rule launches src/optim/adaptive.cu: its state buffers in their order, and each pass's
//! entry point and f32 scalars from the rule's hyper-parameters and the step's estimate. The CUDA
//! path ([`super::adaptive_cuda`]) and the host-emulation tests launch from here, so both run what
//! a GPU runs.
//!
//! Every scalar is computed in f64 as the CPU path computes its coefficient, then rounded to f32,
//! as candle's tensor-by-scalar ops round it; read each function beside its rule's `accumulate`,
//! `apply` or `update` and the kernel of the same name.

use super::adacoor::AdaCoorParams;
use super::dadapt_adam::DAdaptAdamParams;
use super::dadapt_adan::DAdaptAdanParams;
use super::dadapt_lion::DAdaptLionParams;
use super::dadapt_sgd::DAdaptSgdParams;
use super::dowg::DowgParams;
use super::prodigy::ProdigyParams;
use super::rule::{Shares, StepScalars};
use super::schedulefree::{AdamWScheduleFree, Coefficients, ScheduleFreeParams};

/// A state buffer's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufKind {
    F32,
    Bf16,
}

/// One state buffer of a parameter: its name in the state file, its type, and the value a fresh
/// state holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Buffer {
    pub name: &'static str,
    pub kind: BufKind,
    pub fill: f32,
}

const fn f32_buffer(name: &'static str) -> Buffer {
    Buffer {
        name,
        kind: BufKind::F32,
        fill: 0.0,
    }
}

/// One launch: the entry point without its dtype suffix, the scalars, and how many sums it
/// gathers (0: it writes none and takes no sums buffer).
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub entry: &'static str,
    pub scalars: Vec<f32>,
    pub sums: usize,
}

/// The totals of `k` sums from an accumulate launch's per-block partials (`[block][k]`), added
/// in f64 in block order: what the CUDA path and the emulation tests both do with them.
pub fn block_totals(partials: &[f32], k: usize) -> Vec<f64> {
    let mut totals = vec![0f64; k];
    for block in partials.chunks_exact(k.max(1)) {
        for (t, s) in totals.iter_mut().zip(block) {
            *t += f64::from(*s);
        }
    }
    totals
}

/// A flag as the kernels take it.
fn flag(b: bool) -> f32 {
    if b {
        1.0
    } else {
        0.0
    }
}

/// A rule's launches. A pass the rule does not take, or a step that changes nothing, is `None`.
pub trait AdaptiveKernel: Send + Sync {
    /// The state buffers, in the state file's order (the rule's `ParamState::save`).
    fn buffers(&self) -> Vec<Buffer>;
    /// A step-size estimator's first pass, for a parameter with `done` completed updates.
    fn accumulate(&self, _step: &StepScalars, _done: u64) -> Option<Launch> {
        None
    }
    /// The parameter's shares from the first pass's sums (added in f64 over the blocks).
    fn shares(&self, _step: &StepScalars, sums: &[f64]) -> Shares {
        let mut out = [0.0; 3];
        for (o, s) in out.iter_mut().zip(sums) {
            *o = *s;
        }
        out
    }
    /// A step-size estimator's second pass.
    fn apply(&self, _step: &StepScalars) -> Option<Launch> {
        None
    }
    /// A one-pass rule's update number `t` (1 on the first) at learning rate `lr`.
    fn update(&self, _lr: f64, _t: u64) -> Option<Launch> {
        None
    }
    /// Writes the evaluation weights into the parameter (schedule-free AdamW's `x`; the launch's
    /// gradient is unused).
    fn eval(&self) -> Option<Launch> {
        None
    }
}

/// Prodigy (src/optim/prodigy.rs).
pub struct ProdigyKernel(pub ProdigyParams);

impl ProdigyKernel {
    fn has_m(&self) -> bool {
        self.0.beta1 > 0.0
    }

    fn entry(&self, pass: usize) -> &'static str {
        const ENTRIES: [[&str; 2]; 2] = [
            ["prodigy_accumulate", "prodigy_apply"],
            ["prodigy_nom_accumulate", "prodigy_nom_apply"],
        ];
        ENTRIES[usize::from(!self.has_m())][pass]
    }

    /// The coupled decay λ (0 when decoupled, or none).
    fn coupled(&self) -> f64 {
        let h = &self.0;
        if h.weight_decay != 0.0 && !h.decouple {
            h.weight_decay
        } else {
            0.0
        }
    }
}

impl AdaptiveKernel for ProdigyKernel {
    fn buffers(&self) -> Vec<Buffer> {
        let m = self.has_m().then_some(f32_buffer("exp_avg"));
        m.into_iter()
            .chain(["exp_avg_sq", "s", "p0"].map(f32_buffer))
            .collect()
    }

    fn accumulate(&self, step: &StepScalars, done: u64) -> Option<Launch> {
        let h = &self.0;
        let d = step.d;
        let ratio = d / h.d0;
        let s_scale = ratio * if h.safeguard_warmup { d } else { step.dlr };
        let flags = [flag(done == 0), flag(step.dlr > 0.0 || step.dlr.is_nan())];
        let values = [
            self.coupled(),
            h.beta1,
            d * (1.0 - h.beta1),
            h.beta2,
            d * d * (1.0 - h.beta2),
            h.beta3(),
            s_scale,
        ];
        let scalars = flags.into_iter().chain(values.map(|x| x as f32));
        Some(Launch {
            entry: self.entry(0),
            scalars: scalars.collect(),
            sums: 2,
        })
    }

    fn shares(&self, step: &StepScalars, sums: &[f64]) -> Shares {
        let ratio = step.d / self.0.d0;
        [ratio * step.dlr * sums[0], sums[1], 0.0]
    }

    fn apply(&self, step: &StepScalars) -> Option<Launch> {
        let h = &self.0;
        let decay = if h.weight_decay != 0.0 && h.decouple {
            -h.weight_decay * step.dlr
        } else {
            0.0
        };
        let scalars = [
            step.d * h.eps,
            step.dlr,
            decay,
            self.coupled(),
            step.dlr * step.d,
        ];
        Some(Launch {
            entry: self.entry(1),
            scalars: scalars.map(|x| x as f32).to_vec(),
            sums: 0,
        })
    }
}

/// D-Adaptation Adam (src/optim/dadapt_adam.rs).
pub struct DAdaptAdamKernel(pub DAdaptAdamParams);

impl AdaptiveKernel for DAdaptAdamKernel {
    fn buffers(&self) -> Vec<Buffer> {
        ["s", "exp_avg", "exp_avg_sq"].map(f32_buffer).to_vec()
    }

    fn accumulate(&self, step: &StepScalars, _done: u64) -> Option<Launch> {
        if step.dlr <= 0.0 {
            return None;
        }
        let h = &self.0;
        let coupled = if h.weight_decay != 0.0 && !h.decouple {
            h.weight_decay
        } else {
            0.0
        };
        let sqrt_b2 = h.beta2.sqrt();
        let scalars = [
            coupled,
            h.eps,
            h.beta1,
            step.dlr * (1.0 - h.beta1),
            h.beta2,
            1.0 - h.beta2,
            sqrt_b2,
            step.dlr * (1.0 - sqrt_b2),
        ];
        Some(Launch {
            entry: "dadapt_adam_accumulate",
            scalars: scalars.map(|x| x as f32).to_vec(),
            sums: 2,
        })
    }

    fn shares(&self, step: &StepScalars, sums: &[f64]) -> Shares {
        [step.dlr * sums[0], sums[1], 0.0]
    }

    fn apply(&self, step: &StepScalars) -> Option<Launch> {
        let h = &self.0;
        let decay = if h.weight_decay != 0.0 && h.decouple {
            -h.weight_decay * step.dlr
        } else {
            0.0
        };
        Some(Launch {
            entry: "dadapt_adam_apply",
            scalars: vec![h.eps as f32, decay as f32],
            sums: 0,
        })
    }
}

/// D-Adaptation Adan (src/optim/dadapt_adan.rs).
pub struct DAdaptAdanKernel(pub DAdaptAdanParams);

impl AdaptiveKernel for DAdaptAdanKernel {
    fn buffers(&self) -> Vec<Buffer> {
        ["s", "exp_avg", "exp_avg_diff", "exp_avg_sq", "pre_grad"]
            .map(f32_buffer)
            .to_vec()
    }

    fn accumulate(&self, step: &StepScalars, done: u64) -> Option<Launch> {
        let h = &self.0;
        let dlr = step.dlr;
        let scalars = [
            h.beta1,
            dlr * (1.0 - h.beta1),
            h.beta2,
            dlr * (1.0 - h.beta2),
            h.beta3,
            1.0 - h.beta3,
            dlr * (1.0 - h.beta3),
            h.eps,
        ];
        let scalars = std::iter::once(flag(done == 0)).chain(scalars.map(|x| x as f32));
        Some(Launch {
            entry: "dadapt_adan_accumulate",
            scalars: scalars.collect(),
            sums: 3,
        })
    }

    fn apply(&self, step: &StepScalars) -> Option<Launch> {
        let h = &self.0;
        let decay = step.dlr * h.weight_decay;
        let a = if h.no_prox {
            1.0 - decay
        } else {
            1.0 / (1.0 + decay)
        };
        Some(Launch {
            entry: "dadapt_adan_apply",
            scalars: vec![h.eps as f32, h.beta2 as f32, flag(h.no_prox), a as f32],
            sums: 0,
        })
    }
}

/// D-Adaptation Lion (src/optim/dadapt_lion.rs): the whole update in the first pass.
pub struct DAdaptLionKernel(pub DAdaptLionParams);

impl AdaptiveKernel for DAdaptLionKernel {
    fn buffers(&self) -> Vec<Buffer> {
        ["exp_avg", "s"].map(f32_buffer).to_vec()
    }

    fn accumulate(&self, step: &StepScalars, _done: u64) -> Option<Launch> {
        let h = &self.0;
        let dlr = step.dlr;
        let sqrt_b2 = h.beta2.sqrt();
        let scalars = [
            1.0 - dlr * h.weight_decay,
            h.beta1,
            1.0 - h.beta1,
            -dlr,
            h.beta2,
            (1.0 - h.beta2) * dlr,
            sqrt_b2,
            (1.0 - sqrt_b2) * dlr,
        ];
        Some(Launch {
            entry: "dadapt_lion_accumulate",
            scalars: scalars.map(|x| x as f32).to_vec(),
            sums: 2,
        })
    }

    fn shares(&self, step: &StepScalars, sums: &[f64]) -> Shares {
        [step.dlr * sums[0], sums[1], 0.0]
    }
}

/// D-Adaptation SGD (src/optim/dadapt_sgd.rs).
pub struct DAdaptSgdKernel(pub DAdaptSgdParams);

impl AdaptiveKernel for DAdaptSgdKernel {
    fn buffers(&self) -> Vec<Buffer> {
        ["s", "x0"].map(f32_buffer).to_vec()
    }

    fn accumulate(&self, step: &StepScalars, done: u64) -> Option<Launch> {
        let active = !(step.dlr.is_nan() || step.dlr <= 0.0);
        let dlr = if active { step.dlr as f32 } else { 0.0 };
        Some(Launch {
            entry: "dadapt_sgd_accumulate",
            scalars: vec![
                flag(done == 0),
                flag(active),
                self.0.weight_decay as f32,
                dlr,
            ],
            sums: 2,
        })
    }

    fn shares(&self, step: &StepScalars, sums: &[f64]) -> Shares {
        if step.dlr.is_nan() || step.dlr <= 0.0 {
            return [0.0; 3];
        }
        [step.dlr * sums[0], sums[1], 0.0]
    }

    fn apply(&self, _step: &StepScalars) -> Option<Launch> {
        let ck = 1.0 - self.0.momentum;
        Some(Launch {
            entry: "dadapt_sgd_apply",
            scalars: vec![(1.0 - ck) as f32, ck as f32],
            sums: 0,
        })
    }
}

/// Coordinate DoWG (src/optim/dowg.rs): one pass.
pub struct CoordinateDowgKernel(pub DowgParams);

impl AdaptiveKernel for CoordinateDowgKernel {
    fn buffers(&self) -> Vec<Buffer> {
        let r2 = Buffer {
            fill: self.0.eps as f32,
            ..f32_buffer("rt2")
        };
        vec![f32_buffer("x0"), r2, f32_buffer("vt")]
    }

    fn update(&self, _lr: f64, t: u64) -> Option<Launch> {
        Some(Launch {
            entry: "coordinate_dowg_update",
            scalars: vec![flag(t == 1), self.0.clip as f32, self.0.eps as f32],
            sums: 0,
        })
    }
}

/// Scalar DoWG (src/optim/dowg.rs): `step.d` is `r²`, `step.dlr` the denominator in the second
/// pass.
pub struct ScalarDowgKernel(pub DowgParams);

impl AdaptiveKernel for ScalarDowgKernel {
    fn buffers(&self) -> Vec<Buffer> {
        vec![f32_buffer("x0")]
    }

    fn accumulate(&self, _step: &StepScalars, done: u64) -> Option<Launch> {
        Some(Launch {
            entry: "scalar_dowg_accumulate",
            scalars: vec![flag(done == 0)],
            sums: 2,
        })
    }

    fn apply(&self, step: &StepScalars) -> Option<Launch> {
        Some(Launch {
            entry: "scalar_dowg_apply",
            scalars: vec![self.0.clip as f32, step.d as f32, step.dlr as f32],
            sums: 0,
        })
    }
}

/// AdaCoor (src/optim/adacoor.rs): one pass, its accumulator in bf16.
pub struct AdaCoorKernel(pub AdaCoorParams);

impl AdaptiveKernel for AdaCoorKernel {
    fn buffers(&self) -> Vec<Buffer> {
        vec![Buffer {
            name: "vt",
            kind: BufKind::Bf16,
            fill: 0.0,
        }]
    }

    fn update(&self, _lr: f64, _t: u64) -> Option<Launch> {
        let eps_b = half::bf16::from_f64(self.0.eps).to_f32();
        Some(Launch {
            entry: "adacoor_update",
            scalars: vec![eps_b, self.0.eps as f32],
            sums: 0,
        })
    }
}

/// Schedule-free AdamW (src/optim/schedulefree.rs).
pub struct ScheduleFreeKernel(pub ScheduleFreeParams);

impl AdaptiveKernel for ScheduleFreeKernel {
    fn buffers(&self) -> Vec<Buffer> {
        ["z", "exp_avg_sq"].map(f32_buffer).to_vec()
    }

    /// Only a parameter's first step launches: `z` takes its starting point.
    fn accumulate(&self, _step: &StepScalars, done: u64) -> Option<Launch> {
        (done == 0).then(|| Launch {
            entry: "sf_adamw_start",
            scalars: Vec::new(),
            sums: 0,
        })
    }

    fn apply(&self, step: &StepScalars) -> Option<Launch> {
        let h = &self.0;
        let c = Coefficients::new(h, step);
        let (lerp_w, lerp_first) = lerp_args(c.ckp1);
        let scalars = [
            h.beta2,
            1.0 - h.beta2,
            c.inv_bc2,
            h.eps,
            h.weight_decay,
            lerp_first,
            lerp_w,
            c.y_coef,
            c.z_coef,
        ];
        Some(Launch {
            entry: "sf_adamw_apply",
            scalars: scalars.map(|x| x as f32).to_vec(),
            sums: 0,
        })
    }

    fn eval(&self) -> Option<Launch> {
        let (w, first) = lerp_args(AdamWScheduleFree::eval_weight(&self.0));
        Some(Launch {
            entry: "sf_adamw_eval",
            scalars: vec![first as f32, w as f32],
            sums: 0,
        })
    }
}

/// torch's lerp by `w` as the kernels take it (src/optim/schedulefree.rs `lerp`): the
/// coefficient of `b − a` and a flag for the first form (`a + w·(b − a)`; else
/// `b − (1 − w)·(b − a)`).
fn lerp_args(w: f64) -> (f64, f64) {
    if w < 0.5 {
        (w, 1.0)
    } else {
        (-(1.0 - w), 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::block_totals;

    #[test]
    fn block_totals_add_each_sum_over_the_blocks() {
        let partials = [1.0, 10.0, 2.0, 20.0, 4.0, 40.0];
        assert_eq!(block_totals(&partials, 2), vec![7.0, 70.0]);
        assert!(block_totals(&[], 0).is_empty());
    }
}
