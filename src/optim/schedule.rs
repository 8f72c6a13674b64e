//! Learning-rate schedules with linear warmup, as diffusers' `get_scheduler`
//! (src/diffusers/optimization.py, diffusers 0.42.1), transformers' (the newer kinds kohya
//! sd-scripts reaches through `transformers.optimization`, transformers 5.23) and OneTrainer's
//! (modules/util/lr_scheduler_util.py). A schedule is a pure function of the step.
//!
//! `lr_at(base, s)` is the lr of optimizer update number `s`, counting from 0. diffusers wraps a
//! `LambdaLR`, whose multiplier at scheduler step `s` is `λ(s)`; the training loop calls
//! `scheduler.step()` after each `optimizer.step()`, so update `s` runs at `base · λ(s)`. With
//! warmup `w > 0` the first update therefore uses lr 0, exactly as in diffusers and EveryDream2.
//!
//! With `w` = `warmup_steps`, `d` = `decay_steps` (total steps, warmup included, as diffusers'
//! `num_training_steps`), `p = (s − w) / max(1, d − w)` the progress after the warmup, `n` =
//! `num_cycles` and `r` = `min_lr_ratio` (default 0), where `floor(λ) = r + (1 − r)·λ`:
//!
//! ```text
//! s < w:        λ = s / max(1, w)                  (every kind but warmup_stable_decay)
//! constant:     λ = 1                                   (diffusers constant_with_warmup)
//! linear:       λ = floor(max(0, (d − s) / max(1, d − w)))
//! cosine:       λ = floor(max(0, ½·(1 + cos(π·min(1, p)))))
//! polynomial:   lr = (base − lr_end)·(1 − (s − w)/(d − w))^power + lr_end   for s ≤ d,
//!               lr = lr_end                                                  for s > d,
//!               lr_end = 1e-7 unless set, power = 1.0 unless set
//! cosine_with_restarts (n cycles, diffusers' `get_cosine_with_hard_restarts_schedule_with_warmup`):
//!               λ = floor(0) for p ≥ 1,
//!               else λ = floor(max(0, ½·(1 + cos(π·((n·p) mod 1)))))
//! cosine_with_min_lr (transformers' `get_cosine_with_min_lr_schedule_with_warmup` with
//!               `num_cycles = n/2`, as kohya passes its `lr_scheduler_num_cycles`: n = 1 is one
//!               half cosine from base to r·base, n = 2 goes down and back up):
//!               λ = max(0, floor(½·(1 + cos(π·n·min(1, p)))))
//! rex (OneTrainer's REX, arXiv 2107.04197):
//!               λ = floor((1 − p) / (0.1 + 0.9·(1 − p))) for p < 1, floor(0) after
//! inverse_sqrt (transformers' `get_inverse_sqrt_schedule`): t = timescale, or w, or 10000
//!               without a warmup: λ = 1 / √((s + t − w) / t)
//! warmup_stable_decay (transformers' `get_wsd_schedule`): D = decay_phase_steps, the stable
//!               phase is d − w − D steps:
//!               s < w:          λ = max(0, r + (1 − r)·up(s / max(1, w)))
//!               s < d − D:      λ = 1
//!               s < d:          λ = max(0, r + (1 − r)·down((s − d + D) / max(1, D)))
//!               after:          λ = r
//!               up: linear p, cosine ½·(1 − cos(π·p)), 1-sqrt 1 − √(1 − p);
//!               down: linear 1 − p, cosine ½·(1 + cos(π·n·p)), 1-sqrt 1 − √p
//! ```
//!
//! OneTrainer's schedules are these with its `learning_rate_min_factor` as `r`: its LINEAR,
//! COSINE, COSINE_WITH_HARD_RESTARTS and REX are `linear`, `cosine`, `cosine_with_restarts`
//! and `rex`, and its COSINE_WITH_RESTARTS (a smooth wave, `cos(2π·c·p)`) is
//! `cosine_with_min_lr` with n = 2c.
//!
//! Deliberate differences from the references, each past the end of the schedule (`s > d`) or
//! an edge case:
//! - cosine and cosine_with_min_lr clamp `p` at 1, so the lr stays at its floor after `d`.
//!   diffusers' and transformers' cosines keep going (`cos(π·p)` for `p > 1`), so their lr
//!   climbs back toward `base` if training runs past `d`. OneTrainer's restarts hold the value
//!   of step `d − 1` after `d`, sdtrain holds the floor.
//! - polynomial with `d == w` gives `lr_end` at `s == d`; diffusers divides by zero there.
//! - `base == 0` gives 0 for every kind; diffusers' polynomial refuses `base <= lr_end`.
//!   [`LrSchedule::validate`] rejects that, and `d <= w` for the decaying kinds, up front.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The schedule shapes. Each has a linear warmup from 0 over `warmup_steps` (warmup_stable_decay
/// its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    CosineWithRestarts,
    /// transformers' `cosine_with_min_lr`: `num_cycles` half cosines (kohya's unit) from the
    /// base lr to `min_lr_ratio` of it and back.
    CosineWithMinLr,
    /// OneTrainer's REX: a reflected exponential decay to 0 at `decay_steps`.
    Rex,
    /// transformers' `inverse_sqrt`: 1/√ of the steps over a timescale; never reaches 0.
    InverseSqrt,
    /// transformers' `warmup_stable_decay`: warm up, hold, then decay over the last
    /// `decay_phase_steps`.
    WarmupStableDecay,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 9] = [
        ScheduleKind::Constant,
        ScheduleKind::Linear,
        ScheduleKind::Cosine,
        ScheduleKind::Polynomial,
        ScheduleKind::CosineWithRestarts,
        ScheduleKind::CosineWithMinLr,
        ScheduleKind::Rex,
        ScheduleKind::InverseSqrt,
        ScheduleKind::WarmupStableDecay,
    ];

    /// The name used in optimizer.json (`lr_scheduler`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Polynomial => "polynomial",
            ScheduleKind::CosineWithRestarts => "cosine_with_restarts",
            ScheduleKind::CosineWithMinLr => "cosine_with_min_lr",
            ScheduleKind::Rex => "rex",
            ScheduleKind::InverseSqrt => "inverse_sqrt",
            ScheduleKind::WarmupStableDecay => "warmup_stable_decay",
        }
    }

    /// Every name, comma-separated, for messages.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// Whether the lr follows `decay_steps` (everything but constant and inverse_sqrt).
    pub fn decays(self) -> bool {
        !matches!(self, ScheduleKind::Constant | ScheduleKind::InverseSqrt)
    }

    /// Whether `num_cycles` shapes it.
    pub fn takes_cycles(self) -> bool {
        matches!(
            self,
            ScheduleKind::CosineWithRestarts
                | ScheduleKind::CosineWithMinLr
                | ScheduleKind::WarmupStableDecay
        )
    }

    /// Whether `min_lr_ratio` floors it.
    pub fn takes_min_lr(self) -> bool {
        matches!(
            self,
            ScheduleKind::Linear
                | ScheduleKind::Cosine
                | ScheduleKind::CosineWithRestarts
                | ScheduleKind::CosineWithMinLr
                | ScheduleKind::Rex
                | ScheduleKind::WarmupStableDecay
        )
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

/// How warmup_stable_decay rises and falls (transformers' `warmup_type` and `decay_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Ramp {
    #[serde(rename = "linear")]
    Linear,
    #[serde(rename = "cosine")]
    Cosine,
    #[serde(rename = "1-sqrt")]
    OneMinusSqrt,
}

impl Ramp {
    pub const ALL: [Ramp; 3] = [Ramp::Linear, Ramp::Cosine, Ramp::OneMinusSqrt];

    pub fn name(self) -> &'static str {
        match self {
            Ramp::Linear => "linear",
            Ramp::Cosine => "cosine",
            Ramp::OneMinusSqrt => "1-sqrt",
        }
    }

    pub fn parse(s: &str) -> Option<Ramp> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// The warmup's rise at progress `p` in [0, 1).
    fn up(self, p: f64) -> f64 {
        match self {
            Ramp::Linear => p,
            Ramp::Cosine => 0.5 * (1.0 - (PI * p).cos()),
            Ramp::OneMinusSqrt => 1.0 - (1.0 - p).sqrt(),
        }
    }

    /// The decay's fall at progress `p` in [0, 1); a cosine runs `half_waves` half cosines.
    fn down(self, p: f64, half_waves: f64) -> f64 {
        match self {
            Ramp::Linear => 1.0 - p,
            Ramp::Cosine => 0.5 * (1.0 + (PI * half_waves * p).cos()),
            Ramp::OneMinusSqrt => 1.0 - p.sqrt(),
        }
    }
}

impl fmt::Display for Ramp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The settings only some kinds read (each names its kinds); the defaults leave every kind as
/// diffusers has it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScheduleShape {
    /// The floor as a fraction of the base lr (kohya's `lr_scheduler_min_lr_ratio`,
    /// OneTrainer's `learning_rate_min_factor`): linear, cosine, cosine_with_restarts,
    /// cosine_with_min_lr, rex, warmup_stable_decay.
    pub min_lr_ratio: f64,
    /// inverse_sqrt's timescale; `None`: the warmup, or 10000 without one (transformers).
    pub timescale: Option<u64>,
    /// warmup_stable_decay: the steps of the final decay.
    pub decay_phase_steps: u64,
    /// warmup_stable_decay's rise.
    pub warmup_ramp: Ramp,
    /// warmup_stable_decay's fall.
    pub decay_ramp: Ramp,
    /// polynomial's end lr (diffusers' `lr_end`).
    pub lr_end: f64,
}

impl Default for ScheduleShape {
    fn default() -> Self {
        ScheduleShape {
            min_lr_ratio: 0.0,
            timescale: None,
            decay_phase_steps: 0,
            warmup_ramp: Ramp::Linear,
            decay_ramp: Ramp::Cosine,
            lr_end: LrSchedule::POLYNOMIAL_LR_END,
        }
    }
}

/// Schedule errors, found before training starts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    #[error("unknown lr_scheduler `{0}`: allowed are {names}", names = ScheduleKind::names())]
    UnknownKind(String),
    #[error("lr {0} must be finite and >= 0")]
    BadLr(f64),
    #[error("lr_scheduler {kind}: lr_decay_steps ({decay}) must be greater than lr_warmup_steps ({warmup}); decay steps count from step 0 and include the warmup")]
    DecayWithinWarmup {
        kind: ScheduleKind,
        warmup: usize,
        decay: usize,
    },
    #[error("lr_scheduler {kind} needs a number of cycles greater than 0 (got {cycles})")]
    NoCycles { kind: ScheduleKind, cycles: f64 },
    #[error("lr_scheduler polynomial decays to {lr_end:e}, so lr ({lr:e}) must be greater")]
    PolynomialLrTooSmall { lr: f64, lr_end: f64 },
    #[error("lr_scheduler_power {0} must be a number greater than 0")]
    BadPower(f64),
    #[error("lr_scheduler_min_lr_ratio {0} must be from 0 to 1")]
    BadMinLr(f64),
    #[error("lr_scheduler_lr_end {0} must be 0 or more")]
    BadLrEnd(f64),
    #[error("lr_scheduler_timescale must be at least 1 step")]
    BadTimescale,
    #[error("lr_scheduler warmup_stable_decay: its decay (lr_wsd_decay_steps; kohya's lr_decay_steps) is {decay} steps, and must be at least 1 step and at most the schedule's {total} steps")]
    BadDecayPhase { decay: u64, total: usize },
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
    /// `lr_scheduler_num_cycles`; default 1), cosine_with_min_lr's and warmup_stable_decay's
    /// half cosines; unused by the other kinds.
    pub num_cycles: f64,
    /// polynomial's power (diffusers' `power`, kohya's `lr_scheduler_power`; default 1, a
    /// linear decay to `POLYNOMIAL_LR_END`); unused by the other kinds.
    #[serde(default = "default_power")]
    pub power: f64,
    #[serde(default)]
    pub shape: ScheduleShape,
}

fn default_power() -> f64 {
    LrSchedule::POLYNOMIAL_POWER
}

impl LrSchedule {
    /// diffusers' `get_polynomial_decay_schedule_with_warmup` default `lr_end`.
    pub const POLYNOMIAL_LR_END: f64 = 1e-7;
    /// diffusers' `get_scheduler` default `power`.
    pub const POLYNOMIAL_POWER: f64 = 1.0;
    /// transformers' inverse_sqrt timescale without a warmup.
    pub const INVERSE_SQRT_TIMESCALE: u64 = 10_000;

    /// Checks what the references would reject or what makes the schedule degenerate.
    pub fn validate(&self, base_lr: f64) -> Result<(), ScheduleError> {
        let shape = &self.shape;
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
        if self.kind.takes_cycles() && !(self.num_cycles.is_finite() && self.num_cycles > 0.0) {
            return Err(ScheduleError::NoCycles {
                kind: self.kind,
                cycles: self.num_cycles,
            });
        }
        if !(self.power.is_finite() && self.power > 0.0) {
            return Err(ScheduleError::BadPower(self.power));
        }
        if !(0.0..=1.0).contains(&shape.min_lr_ratio) {
            return Err(ScheduleError::BadMinLr(shape.min_lr_ratio));
        }
        if !(shape.lr_end.is_finite() && shape.lr_end >= 0.0) {
            return Err(ScheduleError::BadLrEnd(shape.lr_end));
        }
        if shape.timescale == Some(0) {
            return Err(ScheduleError::BadTimescale);
        }
        if self.kind == ScheduleKind::Polynomial && base_lr <= shape.lr_end {
            return Err(ScheduleError::PolynomialLrTooSmall {
                lr: base_lr,
                lr_end: shape.lr_end,
            });
        }
        // A decay longer than the schedule's stable part starts inside the warmup's span, as
        // transformers' arithmetic has it; longer than the whole schedule it cannot start.
        let phase = shape.decay_phase_steps;
        if self.kind == ScheduleKind::WarmupStableDecay
            && (phase == 0 || phase > self.decay_steps as u64)
        {
            return Err(ScheduleError::BadDecayPhase {
                decay: phase,
                total: self.decay_steps,
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
        if self.kind == ScheduleKind::WarmupStableDecay {
            return base_lr * self.stable_decay_factor(step);
        }
        let (s, w) = (step as i64, self.warmup_steps as i64);
        if s < w {
            return base_lr * (s as f64 / w.max(1) as f64);
        }
        match self.kind {
            ScheduleKind::Constant => base_lr,
            ScheduleKind::Polynomial => self.polynomial(base_lr, step),
            ScheduleKind::InverseSqrt => {
                let t = self.shape.timescale.unwrap_or(match w {
                    0 => Self::INVERSE_SQRT_TIMESCALE,
                    w => w as u64,
                }) as i64;
                base_lr * (1.0 / ((s + t - w) as f64 / t as f64).sqrt())
            }
            _ => base_lr * self.floored(self.decay_factor(step)),
        }
    }

    /// `r + (1 − r)·λ` (OneTrainer's `apply_min_factor`; exactly `λ` when `r` is 0).
    fn floored(&self, factor: f64) -> f64 {
        let r = self.shape.min_lr_ratio;
        if r == 0.0 {
            return factor;
        }
        r + (1.0 - r) * factor
    }

    /// λ after the warmup of the kinds [`Self::floored`] floors, before the floor.
    fn decay_factor(&self, step: usize) -> f64 {
        let (s, w, d) = (
            step as i64,
            self.warmup_steps as i64,
            self.decay_steps as i64,
        );
        let span = (d - w).max(1) as f64;
        let progress = (s - w) as f64 / span;
        match self.kind {
            ScheduleKind::Linear => ((d - s) as f64 / span).max(0.0),
            ScheduleKind::Cosine => {
                (0.5 * (1.0 + (PI * 0.5 * 2.0 * progress.min(1.0)).cos())).max(0.0)
            }
            ScheduleKind::CosineWithRestarts => {
                if progress >= 1.0 {
                    return 0.0;
                }
                let phase = (self.num_cycles * progress) % 1.0;
                (0.5 * (1.0 + (PI * phase).cos())).max(0.0)
            }
            ScheduleKind::CosineWithMinLr => {
                0.5 * (1.0 + (PI * self.num_cycles * progress.min(1.0)).cos())
            }
            ScheduleKind::Rex => {
                if progress >= 1.0 {
                    return 0.0;
                }
                (1.0 - progress) / ((1.0 - 0.9) + 0.9 * (1.0 - progress))
            }
            ScheduleKind::Constant
            | ScheduleKind::Polynomial
            | ScheduleKind::InverseSqrt
            | ScheduleKind::WarmupStableDecay => 1.0,
        }
    }

    fn polynomial(&self, base_lr: f64, step: usize) -> f64 {
        let (s, w, d) = (
            step as i64,
            self.warmup_steps as i64,
            self.decay_steps as i64,
        );
        let lr_end = self.shape.lr_end;
        if s > d || d == w {
            return base_lr * (lr_end / base_lr);
        }
        let pct_remaining = 1.0 - (s - w) as f64 / (d - w) as f64;
        let decay = (base_lr - lr_end) * pct_remaining.powf(self.power) + lr_end;
        base_lr * (decay / base_lr)
    }

    /// warmup_stable_decay's λ, warmup included (transformers' `_get_wsd_scheduler_lambda`).
    fn stable_decay_factor(&self, step: usize) -> f64 {
        let shape = &self.shape;
        let r = shape.min_lr_ratio;
        let (s, w, d) = (
            step as u64,
            self.warmup_steps as u64,
            self.decay_steps as u64,
        );
        let phase = shape.decay_phase_steps;
        let decay_from = d.saturating_sub(phase);
        let factor = if s < w {
            shape.warmup_ramp.up(s as f64 / w.max(1) as f64)
        } else if s < decay_from {
            return 1.0;
        } else if s < d {
            let p = (s - decay_from) as f64 / phase.max(1) as f64;
            shape.decay_ramp.down(p, self.num_cycles)
        } else {
            return r;
        };
        (factor * (1.0 - r) + r).max(0.0)
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
            num_cycles: 1.0,
            power: LrSchedule::POLYNOMIAL_POWER,
            shape: ScheduleShape::default(),
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

    #[test]
    fn validate_rejects_the_newer_settings_out_of_range() {
        let with = |kind, f: &dyn Fn(&mut LrSchedule)| {
            let mut s = sched(kind, 2, 10);
            f(&mut s);
            s.validate(1e-4)
        };
        assert_eq!(
            with(CosineWithMinLr, &|s| s.num_cycles = 0.0),
            Err(ScheduleError::NoCycles {
                kind: CosineWithMinLr,
                cycles: 0.0
            })
        );
        assert_eq!(
            with(Rex, &|s| s.shape.min_lr_ratio = 1.5),
            Err(ScheduleError::BadMinLr(1.5))
        );
        assert_eq!(
            with(InverseSqrt, &|s| s.shape.timescale = Some(0)),
            Err(ScheduleError::BadTimescale)
        );
        assert_eq!(
            with(WarmupStableDecay, &|_| {}),
            Err(ScheduleError::BadDecayPhase {
                decay: 0,
                total: 10
            })
        );
        assert!(with(WarmupStableDecay, &|s| s.shape.decay_phase_steps = 11).is_err());
        assert!(with(WarmupStableDecay, &|s| s.shape.decay_phase_steps = 10).is_ok());
        // inverse_sqrt needs no decay length.
        assert!(sched(InverseSqrt, 5, 0).validate(1e-4).is_ok());
        let ramps: Vec<String> = Ramp::ALL
            .iter()
            .map(|r| serde_json::to_string(r).unwrap())
            .collect();
        assert_eq!(ramps, ["\"linear\"", "\"cosine\"", "\"1-sqrt\""]);
    }

    /// A save point written before the newer settings existed (whole cycles, no `shape`) reads
    /// as the same schedule.
    #[test]
    fn an_older_saved_schedule_still_reads() {
        let old = r#"{"kind":"cosine_with_restarts","warmup_steps":3,"decay_steps":20,"num_cycles":2,"power":1.0}"#;
        let s: LrSchedule = serde_json::from_str(old).unwrap();
        assert_eq!(s.num_cycles, 2.0);
        assert_eq!(s.shape, ScheduleShape::default());
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
