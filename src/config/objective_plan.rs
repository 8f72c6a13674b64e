//! [`ObjectivePlan`]: the diffusion objective's keys of train.json resolved: the timestep range,
//! the noise offset, min-SNR-γ, zero terminal SNR and clip skip (EveryDream2's defaults).

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::diffusion::pyramid_noise::{PyramidNoise, PyramidStyle, EVERYDREAM2_LEVELS};

/// EveryDream2's `--zero_frequency_noise_ratio` default.
pub const DEFAULT_ZERO_FREQUENCY_NOISE_RATIO: f64 = 0.02;
/// DDPM's training timesteps in every Stable Diffusion scheduler_config.json; the upper end of
/// `timestep_end` (EveryDream2 checks the same bound).
pub const MAX_TIMESTEP: u64 = 1000;
/// kohya's recommended `multires_noise_discount` (its help text), used when only the iterations
/// are set.
pub const KOHYA_MULTIRES_DISCOUNT: f64 = 0.3;
/// EveryDream2's `--clip_skip` choices are 0–4.
pub const MAX_CLIP_SKIP: u64 = 4;

/// The diffusion training objective.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ObjectivePlan {
    /// Timesteps are drawn uniformly from `[timestep_start, timestep_end)`. The end is exclusive
    /// (torch.randint, as EveryDream2) and is checked again against the model's
    /// `num_train_timesteps` once the model is loaded.
    pub timestep_start: usize,
    pub timestep_end: usize,
    /// Noise offset: this fraction of a per-channel constant is added to the noise, in [0, 1].
    pub zero_frequency_noise_ratio: f64,
    /// Pyramid noise: EveryDream2's `pyramid_noise_discount` or kohya's
    /// `multires_noise_iterations`/`multires_noise_discount`; `None` is off.
    pub pyramid_noise: Option<PyramidNoise>,
    /// Min-SNR-γ loss weighting (arXiv 2303.09556); `None` disables it.
    pub min_snr_gamma: Option<f64>,
    /// Train on the schedule rescaled to zero terminal SNR (arXiv 2305.08891); `zero_terminal_snr`
    /// or EveryDream2's `enable_zero_terminal_snr`.
    pub zero_terminal_snr: bool,
    /// As written (EveryDream2): 0 or 1 use the last layer, 2 the penultimate, … up to 4.
    pub clip_skip: usize,
    /// Text-encoder layers dropped from the end: `max(clip_skip, 1) − 1`. EveryDream2 applies
    /// the final layer norm to the chosen layer's hidden state.
    pub clip_skip_layers: usize,
}

pub(super) fn resolve_objective(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<ObjectivePlan, ConfigError> {
    let start = ctx.at_least("timestep_start", file.timestep_start, 0, 0)?;
    let end = ctx.at_least("timestep_end", file.timestep_end, MAX_TIMESTEP, 1)?;
    if end > MAX_TIMESTEP {
        return Err(ctx.invalid(
            "timestep_end",
            format!("must be at most {MAX_TIMESTEP} (got {end}); it is exclusive"),
        ));
    }
    if start >= end {
        return Err(ctx.invalid(
            "timestep_start",
            format!("must be less than timestep_end (got {start} and {end}; the end is exclusive)"),
        ));
    }
    let clip_skip = ctx.at_least("clip_skip", file.clip_skip, 0, 0)?;
    if clip_skip > MAX_CLIP_SKIP {
        return Err(ctx.invalid(
            "clip_skip",
            format!("must be between 0 and {MAX_CLIP_SKIP} (got {clip_skip})"),
        ));
    }
    let min_snr_gamma = match file.min_snr_gamma {
        Some(g) if !(g.is_finite() && g > 0.0) => {
            return Err(ctx.invalid(
                "min_snr_gamma",
                format!("must be greater than 0, or null to disable (got {g})"),
            ))
        }
        g => g,
    };
    Ok(ObjectivePlan {
        timestep_start: start as usize,
        timestep_end: end as usize,
        zero_frequency_noise_ratio: ctx.fraction(
            "zero_frequency_noise_ratio",
            file.zero_frequency_noise_ratio,
            DEFAULT_ZERO_FREQUENCY_NOISE_RATIO,
        )?,
        min_snr_gamma,
        pyramid_noise: resolve_pyramid(file, ctx)?,
        zero_terminal_snr: match (file.zero_terminal_snr, file.enable_zero_terminal_snr) {
            (Some(a), Some(b)) if a != b => {
                return Err(ctx.invalid(
                    "zero_terminal_snr",
                    format!("is {a} but EveryDream2's `enable_zero_terminal_snr` is {b}; give one"),
                ))
            }
            (a, b) => a.or(b).unwrap_or(false),
        },
        clip_skip: clip_skip as usize,
        clip_skip_layers: clip_skip.max(1) as usize - 1,
    })
}

/// EveryDream2's `pyramid_noise_discount` (a discount in (0, 1]; 0 or null is off, as its
/// `0 < discount` test), or kohya's `multires_noise_iterations` with `multires_noise_discount`.
/// Both at once is refused: they are two forms of the same noise.
fn resolve_pyramid(file: &TrainFile, ctx: &Ctx<'_>) -> Result<Option<PyramidNoise>, ConfigError> {
    let discount = |key: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v <= 1.0 {
            Ok(v)
        } else {
            Err(ctx.invalid(key, format!("must be in (0, 1] (got {v})")))
        }
    };
    let ed2 = match file.pyramid_noise_discount {
        Some(d) if d != 0.0 => Some(PyramidNoise {
            style: PyramidStyle::EveryDream2,
            discount: discount("pyramid_noise_discount", d)?,
            iterations: EVERYDREAM2_LEVELS,
        }),
        _ => None,
    };
    let kohya = match file.multires_noise_iterations {
        Some(n) if n < 0 => {
            return Err(ctx.invalid(
                "multires_noise_iterations",
                format!("must be 0 or more (got {n}); kohya uses 6 to 10"),
            ))
        }
        Some(n) if n > 0 => Some(PyramidNoise {
            style: PyramidStyle::Kohya,
            discount: discount(
                "multires_noise_discount",
                file.multires_noise_discount
                    .unwrap_or(KOHYA_MULTIRES_DISCOUNT),
            )?,
            iterations: n as usize,
        }),
        _ => None,
    };
    match (ed2, kohya) {
        (Some(_), Some(_)) => Err(ctx.invalid(
            "multires_noise_iterations",
            "is set beside EveryDream2's pyramid_noise_discount: they are two forms of the same \
             pyramid noise; give one"
                .to_string(),
        )),
        (a, b) => Ok(a.or(b)),
    }
}
