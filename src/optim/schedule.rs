//! Learning-rate schedules with linear warmup, as diffusers' `get_scheduler`
//! (src/diffusers/optimization.py, diffusers 0.42.1). A schedule is a pure function of the step.
//!
//! `lr_at(base, s)` is the lr of optimizer update number `s`, counting from 0. diffusers wraps a
//! `LambdaLR`, whose multiplier at scheduler step `s` is `λ(s)`; the training loop calls
//! `scheduler.step()` after each `optimizer.step()`, so update `s` runs at `base · λ(s)`. With
//! warmup `w > 0` the first update therefore uses lr 0, exactly as in diffusers and EveryDream2.
//!
//! With `w` = `warmup_steps`, `d` = `decay_steps` (total steps, warmup included, as diffusers'
//! `num_training_steps`):
//!
//! ```text
//! s < w:        λ = s / max(1, w)                                   (every kind)
//! constant:     λ = 1                                   (diffusers constant_with_warmup)
//! linear:       λ = max(0, (d − s) / max(1, d − w))
//! cosine:       λ = max(0, ½·(1 + cos(π·p))),  p = min(1, (s − w) / max(1, d − w))
//! polynomial:   lr = (base − lr_end)·(1 − (s − w)/(d − w))^power + lr_end   for s ≤ d,
//!               lr = lr_end                                                  for s > d,
//!               lr_end = 1e-7, power = 1.0
//! cosine_with_restarts (n cycles, diffusers' `get_cosine_with_hard_restarts_schedule_with_warmup`):
//!               p = (s − w) / max(1, d − w);  λ = 0 for p ≥ 1,
//!               else λ = max(0, ½·(1 + cos(π·((n·p) mod 1))))
//! ```
//!
//! Deliberate differences from diffusers, each an edge case:
//! - cosine clamps `p` at 1, so the lr stays 0 after `d`. diffusers' half-cosine keeps going
//!   (`cos(π·p)` for `p > 1`), so its lr climbs back toward `base` if training runs past `d`.
//! - polynomial with `d == w` gives `lr_end` at `s == d`; diffusers divides by zero there.
//! - `base == 0` gives 0 for every kind; diffusers' polynomial refuses `base <= lr_end`.
//!   [`LrSchedule::validate`] rejects that, and `d <= w` for the decaying kinds, up front.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The schedule shapes. Each has a linear warmup from 0 over `warmup_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// diffusers `constant_with_warmup`.
    Constant,
    /// diffusers `linear`: to 0 at `decay_steps`.
    Linear,
    /// diffusers `cosine` (half a cycle): to 0 at `decay_steps`.
    Cosine,
    /// diffusers `polynomial` (power 1, lr_end 1e-7): to lr_end at `decay_steps`.
    Polynomial,
    /// diffusers `cosine_with_restarts`: `num_cycles` whole cosines (each from the base lr to 0)
    /// over `decay_steps`, then 0.
    #[serde(rename = "cosine_with_restarts")]
    CosineWithRestarts,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 5] = [
        ScheduleKind::Constant,
        ScheduleKind::Linear,
        ScheduleKind::Cosine,
        ScheduleKind::Polynomial,
        ScheduleKind::CosineWithRestarts,
    ];

    /// The name used in optimizer.json (`lr_scheduler`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Polynomial => "polynomial",
            ScheduleKind::CosineWithRestarts => "cosine_with_restarts",
        }
    }

    /// Whether the lr decays over `decay_steps` (everything but constant).
    pub fn decays(self) -> bool {
        match self {
            ScheduleKind::Constant => false,
            ScheduleKind::Linear
            | ScheduleKind::Cosine
            | ScheduleKind::Polynomial
            | ScheduleKind::CosineWithRestarts => true,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| ScheduleError::UnknownKind(s.to_string()))
    }
}

/// Schedule errors, found before training starts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    #[error("unknown lr_scheduler `{0}`: allowed are constant, linear, cosine, polynomial, cosine_with_restarts")]
    UnknownKind(String),
    #[error("lr {0} must be finite and >= 0")]
    BadLr(f64),
    #[error("lr_scheduler {kind}: lr_decay_steps ({decay}) must be greater than lr_warmup_steps ({warmup}); decay steps count from step 0 and include the warmup")]
    DecayWithinWarmup {
        kind: ScheduleKind,
        warmup: usize,
        decay: usize,
    },
    #[error("lr_scheduler cosine_with_restarts needs at least 1 cycle (got {0})")]
    NoCycles(u32),
    #[error("lr_scheduler polynomial decays to {lr_end:e}, so lr ({lr:e}) must be greater")]
    PolynomialLrTooSmall { lr: f64, lr_end: f64 },
    #[error("lr_scheduler_power {0} must be a number greater than 0")]
    BadPower(f64),
}

/// A learning-rate schedule. See the module docs for the formulas.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    /// Steps of linear warmup from 0 to the base lr.
    pub warmup_steps: usize,
    /// Total steps (warmup included) over which the lr decays, after which it is 0 (linear,
    /// cosine) or `POLYNOMIAL_LR_END` (polynomial). Unused by constant.
    pub decay_steps: usize,
    /// cosine_with_restarts' cycles (diffusers' `num_cycles`, kohya's
    /// `lr_scheduler_num_cycles`; default 1); unused by the other kinds.
    pub num_cycles: u32,
    /// polynomial's power (diffusers' `power`, kohya's `lr_scheduler_power`; default 1, a
    /// linear decay to `POLYNOMIAL_LR_END`); unused by the other kinds.
    #[serde(default = "default_power")]
    pub power: f64,
}

fn default_power() -> f64 {
    LrSchedule::POLYNOMIAL_POWER
}

impl LrSchedule {
    /// diffusers' `get_polynomial_decay_schedule_with_warmup` default `lr_end`.
    pub const POLYNOMIAL_LR_END: f64 = 1e-7;
    /// diffusers' `get_scheduler` default `power`.
    pub const POLYNOMIAL_POWER: f64 = 1.0;

    /// Checks what diffusers would reject or what makes the schedule degenerate.
    pub fn validate(&self, base_lr: f64) -> Result<(), ScheduleError> {
        if !base_lr.is_finite() || base_lr < 0.0 {
            return Err(ScheduleError::BadLr(base_lr));
        }
        if self.kind.decays() && self.decay_steps <= self.warmup_steps {
            return Err(ScheduleError::DecayWithinWarmup {
                kind: self.kind,
                warmup: self.warmup_steps,
                decay: self.decay_steps,
            });
        }
        if self.kind == ScheduleKind::CosineWithRestarts && self.num_cycles == 0 {
            return Err(ScheduleError::NoCycles(self.num_cycles));
        }
        if !(self.power.is_finite() && self.power > 0.0) {
            return Err(ScheduleError::BadPower(self.power));
        }
        if self.kind == ScheduleKind::Polynomial && base_lr <= Self::POLYNOMIAL_LR_END {
            return Err(ScheduleError::PolynomialLrTooSmall {
                lr: base_lr,
                lr_end: Self::POLYNOMIAL_LR_END,
            });
        }
        Ok(())
    }

    /// The lr for optimizer update number `step` (0-based). Pure; total over all inputs.
    ///
    /// The arithmetic follows diffusers' expression by expression (including `base · (x / base)`
    /// for polynomial, as LambdaLR multiplies a ratio back by the base) so values match bit for
    /// bit where the formulas agree.
    pub fn lr_at(&self, base_lr: f64, step: usize) -> f64 {
        if base_lr == 0.0 {
            return 0.0;
        }
        let (s, w, d) = (
            step as i64,
            self.warmup_steps as i64,
            self.decay_steps as i64,
        );
        if s < w {
            return base_lr * (s as f64 / w.max(1) as f64);
        }
        let span = (d - w).max(1) as f64;
        match self.kind {
            ScheduleKind::Constant => base_lr,
            ScheduleKind::Linear => {
                let progress = (d - s) as f64 / span;
                base_lr * progress.max(0.0)
            }
            ScheduleKind::Cosine => {
                let progress = ((s - w) as f64 / span).min(1.0);
                base_lr * (0.5 * (1.0 + (PI * 0.5 * 2.0 * progress).cos())).max(0.0)
            }
            ScheduleKind::Polynomial => {
                let lr_end = Self::POLYNOMIAL_LR_END;
                if s > d || d == w {
                    return base_lr * (lr_end / base_lr);
                }
                let pct_remaining = 1.0 - (s - w) as f64 / (d - w) as f64;
                let decay = (base_lr - lr_end) * pct_remaining.powf(self.power) + lr_end;
                base_lr * (decay / base_lr)
            }
            ScheduleKind::CosineWithRestarts => {
                let progress = (s - w) as f64 / span;
                if progress >= 1.0 {
                    return 0.0;
                }
                let phase = (f64::from(self.num_cycles) * progress) % 1.0;
                base_lr * (0.5 * (1.0 + (PI * phase).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ScheduleKind::*;

    fn sched(kind: ScheduleKind, warmup_steps: usize, decay_steps: usize) -> LrSchedule {
        LrSchedule {
            kind,
            warmup_steps,
            decay_steps,
            num_cycles: 1,
            power: LrSchedule::POLYNOMIAL_POWER,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-300)
    }

    #[track_caller]
    fn check(s: &LrSchedule, base: f64, cases: &[(usize, f64)]) {
        for &(step, want) in cases {
            let got = s.lr_at(base, step);
            assert!(
                close(got, want),
                "{s:?} step {step}: got {got}, want {want}"
            );
        }
    }

    // Hand-computed from the formulas in the module docs: step 0, mid-warmup, end of warmup,
    // mid-decay, end, past the end.

    #[test]
    fn constant_warms_up_then_holds() {
        check(
            &sched(Constant, 4, 0),
            2.0,
            &[(0, 0.0), (2, 1.0), (3, 1.5), (4, 2.0), (1000, 2.0)],
        );
        check(&sched(Constant, 0, 0), 2.0, &[(0, 2.0), (7, 2.0)]);
    }

    #[test]
    fn linear_warms_up_then_decays_to_zero() {
        // w = 3, d = 10: λ = (10 − s)/7 after warmup.
        check(
            &sched(Linear, 3, 10),
            1.0,
            &[
                (0, 0.0),
                (1, 1.0 / 3.0),
                (3, 1.0),
                (6, 4.0 / 7.0),
                (9, 1.0 / 7.0),
                (10, 0.0),
                (25, 0.0),
            ],
        );
        // No warmup: the very first update runs at the full lr.
        check(&sched(Linear, 0, 4), 1.0, &[(0, 1.0), (2, 0.5), (4, 0.0)]);
    }

    #[test]
    fn cosine_warms_up_then_half_cosine_to_zero_and_stays_there() {
        // w = 2, d = 10: p = (s − 2)/8.
        let quarter = 0.5 * (1.0 + (PI / 4.0).cos()); // p = 0.25
        check(
            &sched(Cosine, 2, 10),
            1.0,
            &[
                (0, 0.0),
                (1, 0.5),
                (2, 1.0),
                (4, quarter),
                (6, 0.5),
                (10, 0.0),
                (13, 0.0),
                (100, 0.0),
            ],
        );
    }

    #[test]
    fn polynomial_warms_up_then_decays_to_lr_end() {
        // w = 2, d = 10, base 1e-3: lr = (1e-3 − 1e-7)·(1 − (s − 2)/8) + 1e-7.
        check(
            &sched(Polynomial, 2, 10),
            1e-3,
            &[
                (0, 0.0),
                (1, 5e-4),
                (2, 1e-3),
                (6, (1e-3 - 1e-7) * 0.5 + 1e-7),
                (10, 1e-7),
                (11, 1e-7),
                (500, 1e-7),
            ],
        );
    }

    #[test]
    fn zero_base_lr_is_zero_everywhere() {
        for kind in ScheduleKind::ALL {
            for step in [0, 3, 10, 50] {
                assert_eq!(sched(kind, 3, 10).lr_at(0.0, step), 0.0, "{kind}");
            }
        }
    }

    #[test]
    fn names_round_trip_and_unknown_is_an_error() {
        for kind in ScheduleKind::ALL {
            assert_eq!(kind.name().parse::<ScheduleKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
        }
        let err = "piecewise_constant".parse::<ScheduleKind>().unwrap_err();
        assert!(err.to_string().contains("piecewise_constant"), "{err}");
    }

    #[test]
    fn validate_rejects_what_diffusers_rejects_or_degenerates() {
        assert!(sched(Linear, 3, 10).validate(1e-4).is_ok());
        assert!(sched(Constant, 30, 0).validate(1e-4).is_ok());
        assert_eq!(
            sched(Cosine, 4, 4).validate(1e-4),
            Err(ScheduleError::DecayWithinWarmup {
                kind: Cosine,
                warmup: 4,
                decay: 4
            })
        );
        assert!(matches!(
            sched(Polynomial, 0, 10).validate(1e-7),
            Err(ScheduleError::PolynomialLrTooSmall { .. })
        ));
        assert!(sched(Linear, 0, 10).validate(f64::NAN).is_err());
        assert!(sched(Linear, 0, 10).validate(-1.0).is_err());
    }

    // Cross-check against diffusers 0.42.1 / torch 2.15, made with python3 and tests/fixtures/requirements.txt:
    //
    // ```python
    // # diffusers 0.42.1, torch 2.15: lr at scheduler step s (after s calls of scheduler.step()).
    // import warnings, torch
    // from diffusers.optimization import get_scheduler
    // warnings.filterwarnings("ignore")
    // BASE = 1e-4
    // names = {"constant": "constant_with_warmup", "linear": "linear",
    //          "cosine": "cosine", "polynomial": "polynomial"}
    // for kind, dname in names.items():
    //     for warmup, decay in [(0, 10), (3, 10), (4, 4), (5, 2)]:
    //         opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    //         sched = get_scheduler(dname, opt, num_warmup_steps=warmup, num_training_steps=decay)
    //         for s in range(15):
    //             try:
    //                 if s > 0:
    //                     sched.step()
    //                 lr = repr(sched.get_last_lr()[0])
    //             except ZeroDivisionError:  # polynomial with warmup == decay, at step == decay
    //                 lr = "f64::NAN"
    //             print(f'("{kind}", {warmup}, {decay}, {s}, {lr}),')
    // ```
    //
    // Rows: (kind, warmup, decay, step, lr) with base lr 1e-4. NAN marks diffusers'
    // ZeroDivisionError (polynomial, warmup == decay, at step == decay).
    #[rustfmt::skip]
    const DIFFUSERS: &[(&str, usize, usize, usize, f64)] = &[
        ("constant", 0, 10, 0, 0.0001),
        ("constant", 0, 10, 1, 0.0001),
        ("constant", 0, 10, 2, 0.0001),
        ("constant", 0, 10, 3, 0.0001),
        ("constant", 0, 10, 4, 0.0001),
        ("constant", 0, 10, 5, 0.0001),
        ("constant", 0, 10, 6, 0.0001),
        ("constant", 0, 10, 7, 0.0001),
        ("constant", 0, 10, 8, 0.0001),
        ("constant", 0, 10, 9, 0.0001),
        ("constant", 0, 10, 10, 0.0001),
        ("constant", 0, 10, 11, 0.0001),
        ("constant", 0, 10, 12, 0.0001),
        ("constant", 0, 10, 13, 0.0001),
        ("constant", 0, 10, 14, 0.0001),
        ("constant", 3, 10, 0, 0.0),
        ("constant", 3, 10, 1, 3.3333333333333335e-05),
        ("constant", 3, 10, 2, 6.666666666666667e-05),
        ("constant", 3, 10, 3, 0.0001),
        ("constant", 3, 10, 4, 0.0001),
        ("constant", 3, 10, 5, 0.0001),
        ("constant", 3, 10, 6, 0.0001),
        ("constant", 3, 10, 7, 0.0001),
        ("constant", 3, 10, 8, 0.0001),
        ("constant", 3, 10, 9, 0.0001),
        ("constant", 3, 10, 10, 0.0001),
        ("constant", 3, 10, 11, 0.0001),
        ("constant", 3, 10, 12, 0.0001),
        ("constant", 3, 10, 13, 0.0001),
        ("constant", 3, 10, 14, 0.0001),
        ("constant", 4, 4, 0, 0.0),
        ("constant", 4, 4, 1, 2.5e-05),
        ("constant", 4, 4, 2, 5e-05),
        ("constant", 4, 4, 3, 7.500000000000001e-05),
        ("constant", 4, 4, 4, 0.0001),
        ("constant", 4, 4, 5, 0.0001),
        ("constant", 4, 4, 6, 0.0001),
        ("constant", 4, 4, 7, 0.0001),
        ("constant", 4, 4, 8, 0.0001),
        ("constant", 4, 4, 9, 0.0001),
        ("constant", 4, 4, 10, 0.0001),
        ("constant", 4, 4, 11, 0.0001),
        ("constant", 4, 4, 12, 0.0001),
        ("constant", 4, 4, 13, 0.0001),
        ("constant", 4, 4, 14, 0.0001),
        ("constant", 5, 2, 0, 0.0),
        ("constant", 5, 2, 1, 2e-05),
        ("constant", 5, 2, 2, 4e-05),
        ("constant", 5, 2, 3, 6e-05),
        ("constant", 5, 2, 4, 8e-05),
        ("constant", 5, 2, 5, 0.0001),
        ("constant", 5, 2, 6, 0.0001),
        ("constant", 5, 2, 7, 0.0001),
        ("constant", 5, 2, 8, 0.0001),
        ("constant", 5, 2, 9, 0.0001),
        ("constant", 5, 2, 10, 0.0001),
        ("constant", 5, 2, 11, 0.0001),
        ("constant", 5, 2, 12, 0.0001),
        ("constant", 5, 2, 13, 0.0001),
        ("constant", 5, 2, 14, 0.0001),
        ("linear", 0, 10, 0, 0.0001),
        ("linear", 0, 10, 1, 9e-05),
        ("linear", 0, 10, 2, 8e-05),
        ("linear", 0, 10, 3, 7e-05),
        ("linear", 0, 10, 4, 6e-05),
        ("linear", 0, 10, 5, 5e-05),
        ("linear", 0, 10, 6, 4e-05),
        ("linear", 0, 10, 7, 3e-05),
        ("linear", 0, 10, 8, 2e-05),
        ("linear", 0, 10, 9, 1e-05),
        ("linear", 0, 10, 10, 0.0),
        ("linear", 0, 10, 11, 0.0),
        ("linear", 0, 10, 12, 0.0),
        ("linear", 0, 10, 13, 0.0),
        ("linear", 0, 10, 14, 0.0),
        ("linear", 3, 10, 0, 0.0),
        ("linear", 3, 10, 1, 3.3333333333333335e-05),
        ("linear", 3, 10, 2, 6.666666666666667e-05),
        ("linear", 3, 10, 3, 0.0001),
        ("linear", 3, 10, 4, 8.571428571428571e-05),
        ("linear", 3, 10, 5, 7.142857142857143e-05),
        ("linear", 3, 10, 6, 5.714285714285714e-05),
        ("linear", 3, 10, 7, 4.2857142857142856e-05),
        ("linear", 3, 10, 8, 2.857142857142857e-05),
        ("linear", 3, 10, 9, 1.4285714285714285e-05),
        ("linear", 3, 10, 10, 0.0),
        ("linear", 3, 10, 11, 0.0),
        ("linear", 3, 10, 12, 0.0),
        ("linear", 3, 10, 13, 0.0),
        ("linear", 3, 10, 14, 0.0),
        ("linear", 4, 4, 0, 0.0),
        ("linear", 4, 4, 1, 2.5e-05),
        ("linear", 4, 4, 2, 5e-05),
        ("linear", 4, 4, 3, 7.500000000000001e-05),
        ("linear", 4, 4, 4, 0.0),
        ("linear", 4, 4, 5, 0.0),
        ("linear", 4, 4, 6, 0.0),
        ("linear", 4, 4, 7, 0.0),
        ("linear", 4, 4, 8, 0.0),
        ("linear", 4, 4, 9, 0.0),
        ("linear", 4, 4, 10, 0.0),
        ("linear", 4, 4, 11, 0.0),
        ("linear", 4, 4, 12, 0.0),
        ("linear", 4, 4, 13, 0.0),
        ("linear", 4, 4, 14, 0.0),
        ("linear", 5, 2, 0, 0.0),
        ("linear", 5, 2, 1, 2e-05),
        ("linear", 5, 2, 2, 4e-05),
        ("linear", 5, 2, 3, 6e-05),
        ("linear", 5, 2, 4, 8e-05),
        ("linear", 5, 2, 5, 0.0),
        ("linear", 5, 2, 6, 0.0),
        ("linear", 5, 2, 7, 0.0),
        ("linear", 5, 2, 8, 0.0),
        ("linear", 5, 2, 9, 0.0),
        ("linear", 5, 2, 10, 0.0),
        ("linear", 5, 2, 11, 0.0),
        ("linear", 5, 2, 12, 0.0),
        ("linear", 5, 2, 13, 0.0),
        ("linear", 5, 2, 14, 0.0),
        ("cosine", 0, 10, 0, 0.0001),
        ("cosine", 0, 10, 1, 9.755282581475769e-05),
        ("cosine", 0, 10, 2, 9.045084971874738e-05),
        ("cosine", 0, 10, 3, 7.938926261462366e-05),
        ("cosine", 0, 10, 4, 6.545084971874738e-05),
        ("cosine", 0, 10, 5, 5e-05),
        ("cosine", 0, 10, 6, 3.4549150281252636e-05),
        ("cosine", 0, 10, 7, 2.061073738537635e-05),
        ("cosine", 0, 10, 8, 9.549150281252633e-06),
        ("cosine", 0, 10, 9, 2.4471741852423237e-06),
        ("cosine", 0, 10, 10, 0.0),
        ("cosine", 0, 10, 11, 2.4471741852423237e-06),
        ("cosine", 0, 10, 12, 9.549150281252623e-06),
        ("cosine", 0, 10, 13, 2.061073738537634e-05),
        ("cosine", 0, 10, 14, 3.454915028125262e-05),
        ("cosine", 3, 10, 0, 0.0),
        ("cosine", 3, 10, 1, 3.3333333333333335e-05),
        ("cosine", 3, 10, 2, 6.666666666666667e-05),
        ("cosine", 3, 10, 3, 0.0001),
        ("cosine", 3, 10, 4, 9.504844339512095e-05),
        ("cosine", 3, 10, 5, 8.117449009293668e-05),
        ("cosine", 3, 10, 6, 6.112604669781572e-05),
        ("cosine", 3, 10, 7, 3.887395330218429e-05),
        ("cosine", 3, 10, 8, 1.8825509907063327e-05),
        ("cosine", 3, 10, 9, 4.951556604879048e-06),
        ("cosine", 3, 10, 10, 0.0),
        ("cosine", 3, 10, 11, 4.951556604879043e-06),
        ("cosine", 3, 10, 12, 1.8825509907063317e-05),
        ("cosine", 3, 10, 13, 3.8873953302184275e-05),
        ("cosine", 3, 10, 14, 6.112604669781572e-05),
        ("cosine", 4, 4, 0, 0.0),
        ("cosine", 4, 4, 1, 2.5e-05),
        ("cosine", 4, 4, 2, 5e-05),
        ("cosine", 4, 4, 3, 7.500000000000001e-05),
        ("cosine", 4, 4, 4, 0.0001),
        ("cosine", 4, 4, 5, 0.0),
        ("cosine", 4, 4, 6, 0.0001),
        ("cosine", 4, 4, 7, 0.0),
        ("cosine", 4, 4, 8, 0.0001),
        ("cosine", 4, 4, 9, 0.0),
        ("cosine", 4, 4, 10, 0.0001),
        ("cosine", 4, 4, 11, 0.0),
        ("cosine", 4, 4, 12, 0.0001),
        ("cosine", 4, 4, 13, 0.0),
        ("cosine", 4, 4, 14, 0.0001),
        ("cosine", 5, 2, 0, 0.0),
        ("cosine", 5, 2, 1, 2e-05),
        ("cosine", 5, 2, 2, 4e-05),
        ("cosine", 5, 2, 3, 6e-05),
        ("cosine", 5, 2, 4, 8e-05),
        ("cosine", 5, 2, 5, 0.0001),
        ("cosine", 5, 2, 6, 0.0),
        ("cosine", 5, 2, 7, 0.0001),
        ("cosine", 5, 2, 8, 0.0),
        ("cosine", 5, 2, 9, 0.0001),
        ("cosine", 5, 2, 10, 0.0),
        ("cosine", 5, 2, 11, 0.0001),
        ("cosine", 5, 2, 12, 0.0),
        ("cosine", 5, 2, 13, 0.0001),
        ("cosine", 5, 2, 14, 0.0),
        ("polynomial", 0, 10, 0, 0.0001),
        ("polynomial", 0, 10, 1, 9.001e-05),
        ("polynomial", 0, 10, 2, 8.002000000000001e-05),
        ("polynomial", 0, 10, 3, 7.003e-05),
        ("polynomial", 0, 10, 4, 6.0039999999999994e-05),
        ("polynomial", 0, 10, 5, 5.005000000000001e-05),
        ("polynomial", 0, 10, 6, 4.0060000000000006e-05),
        ("polynomial", 0, 10, 7, 3.0070000000000005e-05),
        ("polynomial", 0, 10, 8, 2.0079999999999994e-05),
        ("polynomial", 0, 10, 9, 1.0089999999999998e-05),
        ("polynomial", 0, 10, 10, 9.999999999999998e-08),
        ("polynomial", 0, 10, 11, 9.999999999999998e-08),
        ("polynomial", 0, 10, 12, 9.999999999999998e-08),
        ("polynomial", 0, 10, 13, 9.999999999999998e-08),
        ("polynomial", 0, 10, 14, 9.999999999999998e-08),
        ("polynomial", 3, 10, 0, 0.0),
        ("polynomial", 3, 10, 1, 3.3333333333333335e-05),
        ("polynomial", 3, 10, 2, 6.666666666666667e-05),
        ("polynomial", 3, 10, 3, 0.0001),
        ("polynomial", 3, 10, 4, 8.572857142857144e-05),
        ("polynomial", 3, 10, 5, 7.145714285714287e-05),
        ("polynomial", 3, 10, 6, 5.7185714285714285e-05),
        ("polynomial", 3, 10, 7, 4.291428571428572e-05),
        ("polynomial", 3, 10, 8, 2.8642857142857137e-05),
        ("polynomial", 3, 10, 9, 1.4371428571428578e-05),
        ("polynomial", 3, 10, 10, 9.999999999999998e-08),
        ("polynomial", 3, 10, 11, 9.999999999999998e-08),
        ("polynomial", 3, 10, 12, 9.999999999999998e-08),
        ("polynomial", 3, 10, 13, 9.999999999999998e-08),
        ("polynomial", 3, 10, 14, 9.999999999999998e-08),
        ("polynomial", 4, 4, 0, 0.0),
        ("polynomial", 4, 4, 1, 2.5e-05),
        ("polynomial", 4, 4, 2, 5e-05),
        ("polynomial", 4, 4, 3, 7.500000000000001e-05),
        ("polynomial", 4, 4, 4, f64::NAN),
        ("polynomial", 4, 4, 5, 9.999999999999998e-08),
        ("polynomial", 4, 4, 6, 9.999999999999998e-08),
        ("polynomial", 4, 4, 7, 9.999999999999998e-08),
        ("polynomial", 4, 4, 8, 9.999999999999998e-08),
        ("polynomial", 4, 4, 9, 9.999999999999998e-08),
        ("polynomial", 4, 4, 10, 9.999999999999998e-08),
        ("polynomial", 4, 4, 11, 9.999999999999998e-08),
        ("polynomial", 4, 4, 12, 9.999999999999998e-08),
        ("polynomial", 4, 4, 13, 9.999999999999998e-08),
        ("polynomial", 4, 4, 14, 9.999999999999998e-08),
        ("polynomial", 5, 2, 0, 0.0),
        ("polynomial", 5, 2, 1, 2e-05),
        ("polynomial", 5, 2, 2, 4e-05),
        ("polynomial", 5, 2, 3, 6e-05),
        ("polynomial", 5, 2, 4, 8e-05),
        ("polynomial", 5, 2, 5, 9.999999999999998e-08),
        ("polynomial", 5, 2, 6, 9.999999999999998e-08),
        ("polynomial", 5, 2, 7, 9.999999999999998e-08),
        ("polynomial", 5, 2, 8, 9.999999999999998e-08),
        ("polynomial", 5, 2, 9, 9.999999999999998e-08),
        ("polynomial", 5, 2, 10, 9.999999999999998e-08),
        ("polynomial", 5, 2, 11, 9.999999999999998e-08),
        ("polynomial", 5, 2, 12, 9.999999999999998e-08),
        ("polynomial", 5, 2, 13, 9.999999999999998e-08),
        ("polynomial", 5, 2, 14, 9.999999999999998e-08),
    ];

    #[test]
    fn matches_diffusers_get_scheduler() {
        let base = 1e-4;
        let mut cosine_past_end = 0;
        let (mut compared, mut bit_identical, mut worst) = (0, 0, 0.0f64);
        for &(kind, warmup, decay, step, want) in DIFFUSERS {
            let s = sched(kind.parse().unwrap(), warmup, decay);
            let got = s.lr_at(base, step);
            let past_end =
                step >= warmup && (step - warmup) > (decay.saturating_sub(warmup)).max(1);
            if want.is_nan() {
                // diffusers divides by zero; we give lr_end (module docs).
                assert_eq!(got, base * (LrSchedule::POLYNOMIAL_LR_END / base));
            } else if s.kind == Cosine && past_end {
                // Deliberate: we hold 0 where diffusers' cosine climbs back up (module docs).
                assert_eq!(got, 0.0, "{s:?} step {step}");
                cosine_past_end += 1;
            } else {
                assert!(
                    close(got, want) || got == want,
                    "{s:?} step {step}: got {got:e}, diffusers {want:e}"
                );
                compared += 1;
                bit_identical += usize::from(got == want);
                if want != 0.0 {
                    worst = worst.max((got - want).abs() / want.abs());
                }
            }
        }
        eprintln!(
            "diffusers: {bit_identical}/{compared} rows bit-identical, max rel err {worst:e}, \
             {cosine_past_end} cosine rows past the end held at 0"
        );
        // The deviation is exercised, not vacuous: diffusers is non-zero on some of those rows.
        assert!(cosine_past_end > 0);
        assert!(DIFFUSERS
            .iter()
            .any(|&(k, w, d, s, lr)| k == "cosine" && s > d.max(w + 1) && lr > 0.0));
    }
}
