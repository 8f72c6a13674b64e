//! Checks of hyper-parameters that several rules share, with [`OptimError::InvalidParam`]
//! naming the field.

use super::{OptimError, Result};

/// The error for `field` = `value`, which `allowed` says how to fix.
pub(super) fn invalid(field: &'static str, value: f64, allowed: &'static str) -> OptimError {
    OptimError::InvalidParam {
        field,
        value,
        allowed,
    }
}

/// The checks the step-size estimators share: betas in [0, 1), d0 > 0, growth ≥ 1, decay ≥ 0.
pub(super) fn check_common(
    betas: &[(&'static str, f64)],
    d0: f64,
    growth_rate: f64,
    weight_decay: f64,
) -> Result<()> {
    for &(field, b) in betas {
        if !(0.0..1.0).contains(&b) {
            return Err(invalid(field, b, "must be in [0, 1)"));
        }
    }
    if !(d0.is_finite() && d0 > 0.0) {
        return Err(invalid("d0", d0, "must be greater than 0"));
    }
    if growth_rate.is_nan() || growth_rate < 1.0 {
        return Err(invalid("growth_rate", growth_rate, "must be 1 or more"));
    }
    if !(weight_decay.is_finite() && weight_decay >= 0.0) {
        return Err(invalid("weight_decay", weight_decay, "must be >= 0"));
    }
    Ok(())
}

/// Adam's bias correction inside Prodigy's and D-Adaptation Adam's `d·lr` at group step `k`
/// (from 0): `√(1 − β2^(k+1)) / (1 − β1^(k+1))`, or 1 when off.
pub(super) fn bias_correction(on: bool, beta1: f64, beta2: f64, k: u64) -> f64 {
    if on {
        let k = k as i32;
        (1.0 - beta2.powi(k + 1)).sqrt() / (1.0 - beta1.powi(k + 1))
    } else {
        1.0
    }
}
