//! kohya's max-norm regularization of LoRA weights (`adapter.scale_weight_norms`, kohya's
//! `--scale_weight_norms`; `networks/lora.py` `apply_max_norm_regularization`), applied after
//! every optimizer step. For each LoRA/LoCon module, with `ΔW = (alpha/rank) · up · down` (a conv's
//! factors flattened to matrices, whose product is the conv kernel kohya composes):
//!
//! ```text
//! n = max(‖ΔW‖_F, max_norm/2);  r = min(n, max_norm) / n
//! up ← √r · up;  down ← √r · down          (only when r ≠ 1)
//! ```
//!
//! so the update's norm never exceeds `max_norm`. kohya logs the modules scaled and the mean and
//! largest norm after scaling (`max_norm/keys_scaled`, `max_norm/average_key_norm`,
//! `max_norm/max_key_norm`), as [`MaxNormStats`] does.
//!
//! `‖up·down‖²_F` is computed as `Σ (upᵀup) ⊙ (down·downᵀ)`, two `rank × rank` products instead
//! of the `out × in` one kohya forms (the same value; `rank²·(out + in)` work instead of
//! `rank·out·in`), and every module's norm reaches the host in one copy.

use candle_core::{DType, Result, Tensor, Var};
use serde::Serialize;

use super::factors::Algo;
use super::lora::LoraModule;

/// What one regularization pass did: kohya's three logged numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MaxNormStats {
    /// Modules whose factors were scaled down.
    pub keys_scaled: usize,
    /// The mean and largest `‖ΔW‖_F` over the modules, after scaling.
    pub average_key_norm: f64,
    pub max_key_norm: f64,
}

/// One module's factors as matrices: `up` `[out, rank]`, `down` `[rank, in·k·k]`.
fn factors(m: &LoraModule) -> Option<(&Var, &Var)> {
    if m.algo != Algo::LowRank || m.var("dora_scale").is_some() {
        return None;
    }
    Some((m.var("lora_up.weight")?, m.var("lora_down.weight")?))
}

/// `‖up·down‖²_F` as a 0-d f32 tensor, through the two `rank × rank` Gram matrices.
fn product_norm_sq(up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let rank = down.dim(0)?;
    let up = up.to_dtype(DType::F32)?.reshape((up.dim(0)?, rank))?;
    let down = down.to_dtype(DType::F32)?.reshape((rank, ()))?;
    let uu = up.t()?.matmul(&up)?;
    let dd = down.matmul(&down.t()?)?;
    (uu * dd)?.sum_all()
}

/// kohya's ratio for a module whose update has norm `norm`: 1 below `max_norm`.
pub fn max_norm_ratio(norm: f64, max_norm: f64) -> f64 {
    let clamped = norm.max(max_norm / 2.0);
    clamped.min(max_norm) / clamped
}

/// Applies the regularization to every LoRA/LoCon module of `modules` (others are skipped).
/// `None` when none is a LoRA/LoCon module.
pub fn apply_max_norm(
    modules: &[std::sync::Arc<LoraModule>],
    max_norm: f64,
) -> Result<Option<MaxNormStats>> {
    let picked: Vec<(&Var, &Var, f64)> = modules
        .iter()
        .filter_map(|m| factors(m).map(|(u, d)| (u, d, m.scale())))
        .collect();
    if picked.is_empty() {
        return Ok(None);
    }
    regularize(&picked, max_norm).map(Some)
}

/// The regularization of `(up, down, alpha/rank)` factor pairs (at least one).
pub fn regularize(pairs: &[(&Var, &Var, f64)], max_norm: f64) -> Result<MaxNormStats> {
    let squares = pairs
        .iter()
        .map(|(up, down, _)| product_norm_sq(up.as_tensor(), down.as_tensor()))
        .collect::<Result<Vec<_>>>()?;
    let squares: Vec<f32> = Tensor::stack(&squares, 0)?.to_vec1()?;
    let (mut scaled, mut sum, mut largest) = (0usize, 0f64, 0f64);
    for ((up, down, scale), sq) in pairs.iter().zip(squares) {
        let norm = f64::from(sq.max(0.0)).sqrt() * scale;
        let ratio = max_norm_ratio(norm, max_norm);
        if ratio != 1.0 {
            scaled += 1;
            let root = ratio.sqrt();
            for v in [up, down] {
                v.set(&(v.as_tensor() * root)?)?;
            }
        }
        let after = norm * ratio;
        sum += after;
        largest = largest.max(after);
    }
    Ok(MaxNormStats {
        keys_scaled: scaled,
        average_key_norm: sum / pairs.len().max(1) as f64,
        max_key_norm: largest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_gram_form_is_the_products_norm() {
        let dev = Device::Cpu;
        let up = Tensor::new(&[[1f32, 2.0], [0.5, -1.0], [3.0, 0.0]], &dev).unwrap();
        let down = Tensor::new(&[[1f32, 0.0, -2.0, 1.0], [0.5, 1.5, 0.0, -1.0]], &dev).unwrap();
        let direct: f32 = up
            .matmul(&down)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let gram: f32 = product_norm_sq(&up, &down).unwrap().to_scalar().unwrap();
        assert!((direct - gram).abs() < 1e-5 * direct, "{direct} {gram}");
        // a conv's factors, flattened
        let up4 = up.reshape((3, 2, 1, 1)).unwrap();
        let down4 = down.reshape((2, 1, 2, 2)).unwrap();
        let conv: f32 = product_norm_sq(&up4, &down4).unwrap().to_scalar().unwrap();
        assert_eq!(conv, gram);
    }

    #[test]
    fn ratios_cap_the_norm_and_leave_small_ones() {
        assert_eq!(max_norm_ratio(0.1, 1.0), 1.0);
        assert_eq!(max_norm_ratio(0.9, 1.0), 1.0);
        assert_eq!(max_norm_ratio(1.0, 1.0), 1.0);
        assert!((max_norm_ratio(4.0, 1.0) - 0.25).abs() < 1e-15);
    }
}
