//! [`ObjectivePlan`]: the diffusion objective's keys of train.json resolved: the timestep range
//! (EveryDream2's or kohya's names) and distribution, the noise offset, pyramid noise, input and
//! embedding perturbation, the loss ([`super::loss_plan`]), min-SNR-γ, zero terminal SNR, the
//! training noise scheduler and clip skip (EveryDream2's defaults).

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::loss_plan::{resolve_loss, LossPlan};
use super::timestep_plan::{resolve_distribution, resolve_shift};
use super::train_file::TrainFile;
use crate::diffusion::objective::OffsetVariant;
use crate::diffusion::perturbation::InputPerturbation;
use crate::diffusion::pyramid_noise::{PyramidNoise, PyramidStyle, EVERYDREAM2_LEVELS};
use crate::diffusion::timesteps::TimestepDistribution;
use crate::diffusion::train_sampler::TrainSampler;

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
    /// How timesteps are drawn from the range (uniform, or one of OneTrainer's).
    pub timestep_distribution: TimestepDistribution,
    /// OneTrainer's `timestep_shift` (1 leaves timesteps in place).
    pub timestep_shift: f64,
    /// Noise offset: this fraction of a per-channel constant is added to the noise, in [0, 1]
    /// (`zero_frequency_noise_ratio`, or kohya's `noise_offset`).
    pub zero_frequency_noise_ratio: f64,
    /// kohya's `noise_offset_random_strength` and `adaptive_noise_scale`.
    pub offset_variant: OffsetVariant,
    /// Pyramid noise: EveryDream2's `pyramid_noise_discount` or kohya's
    /// `multires_noise_iterations`/`multires_noise_discount`; `None` is off.
    pub pyramid_noise: Option<PyramidNoise>,
    /// Min-SNR-γ loss weighting (arXiv 2303.09556); `None` disables it.
    pub min_snr_gamma: Option<f64>,
    /// The loss function, debiased estimation and the loss mask.
    pub loss: LossPlan,
    /// kohya's `ip_noise_gamma` / diffusers' `input_perturbation`; `None` is off.
    pub input_perturbation: Option<InputPerturbation>,
    /// EveryDream2's `embedding_perturbation` (0 is off).
    pub embedding_perturbation: f64,
    /// OneTrainer's generalized offset noise: the noise offset scaled by `ψ_t`.
    pub generalized_offset_noise: bool,
    /// OneTrainer's `perturbation_noise_weight` (0 is off).
    pub perturbation_noise_weight: f64,
    /// EveryDream2's `train_sampler`: the scheduler class the training noise comes from.
    pub train_sampler: TrainSampler,
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
    let (start_key, start) = timestep_key(
        ctx,
        ("timestep_start", file.timestep_start),
        ("min_timestep", file.min_timestep),
    )?;
    let (end_key, end) = timestep_key(
        ctx,
        ("timestep_end", file.timestep_end),
        ("max_timestep", file.max_timestep),
    )?;
    let start = ctx.at_least(start_key, start, 0, 0)?;
    let end = ctx.at_least(end_key, end, MAX_TIMESTEP, 1)?;
    if end > MAX_TIMESTEP {
        return Err(ctx.invalid(
            end_key,
            format!("must be at most {MAX_TIMESTEP} (got {end}); it is exclusive"),
        ));
    }
    if start >= end {
        return Err(ctx.invalid(
            start_key,
            format!("must be less than {end_key} (got {start} and {end}; the end is exclusive)"),
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
    let zero_frequency_noise_ratio = noise_offset(file, ctx)?;
    Ok(ObjectivePlan {
        timestep_start: start as usize,
        timestep_end: end as usize,
        timestep_distribution: resolve_distribution(file, ctx, start as u32, end as u32)?,
        timestep_shift: resolve_shift(file, ctx)?,
        loss: resolve_loss(file, ctx)?,
        input_perturbation: resolve_input_perturbation(file, ctx)?,
        embedding_perturbation: non_negative(
            ctx,
            "embedding_perturbation",
            file.embedding_perturbation,
        )?
        .unwrap_or(0.0),
        train_sampler: match file.train_sampler.as_deref() {
            None => TrainSampler::Ddpm,
            Some(name) => TrainSampler::parse(name).ok_or_else(|| {
                ctx.invalid(
                    "train_sampler",
                    format!("is \"{name}\"; it must be \"ddpm\", \"ddim\" or \"pndm\""),
                )
            })?,
        },
        generalized_offset_noise: generalized_offset(file, ctx, zero_frequency_noise_ratio)?,
        perturbation_noise_weight: non_negative(
            ctx,
            "perturbation_noise_weight",
            file.perturbation_noise_weight,
        )?
        .unwrap_or(0.0),
        zero_frequency_noise_ratio,
        offset_variant: offset_variant(file, ctx, zero_frequency_noise_ratio)?,
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

/// OneTrainer's `generalized_offset_noise`: it scales the noise offset, so it needs one, and
/// its ψ schedule is not finite with zero terminal SNR.
fn generalized_offset(file: &TrainFile, ctx: &Ctx<'_>, offset: f64) -> Result<bool, ConfigError> {
    if !file.generalized_offset_noise.unwrap_or(false) {
        return Ok(false);
    }
    let why = if offset == 0.0 {
        "scales the noise offset, which is 0 (set noise_offset or zero_frequency_noise_ratio)"
    } else if file.zero_terminal_snr.or(file.enable_zero_terminal_snr) == Some(true) {
        "divides by α_t, which zero terminal SNR makes 0 at the last timestep; turn one of them off"
    } else {
        return Ok(true);
    };
    Err(ctx.invalid("generalized_offset_noise", why.to_string()))
}

/// The noise offset: EveryDream2's `zero_frequency_noise_ratio` (default 0.02) or kohya's
/// `noise_offset`, the same offset; both at different values is refused.
fn noise_offset(file: &TrainFile, ctx: &Ctx<'_>) -> Result<f64, ConfigError> {
    let ed2 = "zero_frequency_noise_ratio";
    match (file.zero_frequency_noise_ratio, file.noise_offset) {
        (Some(a), Some(b)) if a != b => Err(ctx.invalid(
            "noise_offset",
            format!(
                "is {b} but {ed2} is {a}: kohya's noise_offset is EveryDream2's {ed2}; give one"
            ),
        )),
        (None, Some(b)) => {
            ctx.fraction("noise_offset", Some(b), DEFAULT_ZERO_FREQUENCY_NOISE_RATIO)
        }
        (a, _) => ctx.fraction(ed2, a, DEFAULT_ZERO_FREQUENCY_NOISE_RATIO),
    }
}

/// kohya's `noise_offset_random_strength` and `adaptive_noise_scale`, which vary a noise offset
/// and so need one (kohya refuses the adaptive scale without `noise_offset`).
fn offset_variant(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    offset: f64,
) -> Result<OffsetVariant, ConfigError> {
    let random_strength = file.noise_offset_random_strength.unwrap_or(false);
    let adaptive_scale = match file.adaptive_noise_scale {
        Some(a) if !a.is_finite() => {
            return Err(ctx.invalid(
                "adaptive_noise_scale",
                format!("must be a number (got {a})"),
            ))
        }
        a => a,
    };
    let needs = [
        ("noise_offset_random_strength", random_strength),
        ("adaptive_noise_scale", adaptive_scale.is_some()),
    ];
    if let Some((key, _)) = needs.iter().find(|(_, on)| *on).filter(|_| offset == 0.0) {
        return Err(ctx.invalid(
            key,
            "varies the noise offset, which is 0; set noise_offset (or \
             zero_frequency_noise_ratio), kohya suggests 0.05–0.1"
                .to_string(),
        ));
    }
    Ok(OffsetVariant {
        random_strength,
        adaptive_scale,
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

/// EveryDream2's name or kohya's for one end of the timestep range: the same thing, so both set
/// to different values is refused.
fn timestep_key<'k>(
    ctx: &Ctx<'_>,
    ed2: (&'k str, Option<i64>),
    kohya: (&'k str, Option<i64>),
) -> Result<(&'k str, Option<i64>), ConfigError> {
    match (ed2.1, kohya.1) {
        (Some(a), Some(b)) if a != b => Err(ctx.invalid(
            kohya.0,
            format!(
                "is {b} but {} is {a}: kohya's {} is EveryDream2's {}; give one",
                ed2.0, kohya.0, ed2.0
            ),
        )),
        (Some(a), _) => Ok((ed2.0, Some(a))),
        (None, Some(b)) => Ok((kohya.0, Some(b))),
        (None, None) => Ok((ed2.0, None)),
    }
}

/// kohya's `ip_noise_gamma` or diffusers' `input_perturbation` (the same γ; 0 or null is off),
/// with kohya's `ip_noise_gamma_random_strength`.
fn resolve_input_perturbation(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<InputPerturbation>, ConfigError> {
    let gamma = match (file.ip_noise_gamma, file.input_perturbation) {
        (Some(a), Some(b)) if a != b => {
            return Err(ctx.invalid(
                "input_perturbation",
                format!(
                    "is {b} but ip_noise_gamma is {a}: diffusers' input_perturbation is kohya's \
                     ip_noise_gamma; give one"
                ),
            ))
        }
        (Some(a), _) => non_negative(ctx, "ip_noise_gamma", Some(a))?,
        (None, b) => non_negative(ctx, "input_perturbation", b)?,
    };
    let random_strength = file.ip_noise_gamma_random_strength.unwrap_or(false);
    match gamma {
        Some(g) if g > 0.0 => Ok(Some(InputPerturbation {
            gamma: g,
            random_strength,
        })),
        _ if random_strength => Err(ctx.invalid(
            "ip_noise_gamma_random_strength",
            "needs ip_noise_gamma (or input_perturbation) above 0".to_string(),
        )),
        _ => Ok(None),
    }
}

/// `v` when it is finite and at least 0.
fn non_negative(ctx: &Ctx<'_>, field: &str, v: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match v {
        Some(x) if !(x.is_finite() && x >= 0.0) => {
            Err(ctx.invalid(field, format!("must be 0 or more (got {x})")))
        }
        x => Ok(x),
    }
}
