//! The denoising training objective: what one step draws, and the loss it minimises.
//!
//! For a batch of clean latents `x₀` `[B, C, H, W]`:
//! 1. noise `ε ~ N(0, I)`, drawn on the host from the seeded RNG (candle's CPU `randn` cannot be
//!    seeded), plus EveryDream2's noise offset (`zero_frequency_noise_ratio`, after
//!    crosslabs.org/blog/diffusion-with-offset-noise): `ε += r · n₂` with `n₂ ~ N(0, I)` of shape
//!    `[B, C, 1, 1]`, i.e. one constant per sample and channel (EveryDream2 `train.py`
//!    `get_noise`), the offset scaled by `ψ_t` with OneTrainer's generalized offset noise
//!    ([`super::generalized_offset`]), and `w·ξ` more with its perturbation noise;
//! 2. timesteps in `[timestep_start, timestep_end)`, one per sample, uniform (EveryDream2
//!    `get_timesteps`, `torch.randint(start, end)`) or one of OneTrainer's distributions, with
//!    its timestep shift ([`super::timesteps`]);
//! 3. `x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε` (with input perturbation, `ε + γ·ξ` there:
//!    [`super::perturbation`]), and the target `ε` or `v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀`
//!    ([`NoiseSchedule`]);
//! 4. the loss `L = (1/B) Σ_i w_i · mean_{c,h,w} ℓ(pred_i − target_i)`, in f32 ([`super::loss`]:
//!    MSE by default, EveryDream2's Huber mixes, kohya's scheduled pseudo-Huber, a loss mask).
//!
//! Each sample draws, from its own generator and in this order: its noise (the perturbation
//! noise last, when on), its timestep, the input perturbation's strength and noise (when on),
//! and its embedding-noise seed (when on). With generalized offset noise the timestep comes
//! first, since `ψ_t` scales the offset.
//!
//! Min-SNR-γ weighting (Hang et al., arXiv 2303.09556, Section 3.4 and 4.2), as in diffusers'
//! `examples/text_to_image/train_text_to_image.py` with `training_utils.compute_snr`:
//! `w = min(SNR, γ)/SNR` for an ε target and `w = min(SNR, γ)/(SNR + 1)` for a v target, with
//! `SNR(t) = ᾱ_t/(1 − ᾱ_t)`; without γ, `w = 1`. At a zero-terminal-SNR step (`SNR = 0`) the ε
//! weight is its limit 1, where diffusers computes 0/0 = NaN (EveryDream2 clamps SNR to 1e-9,
//! which gives the same 1).

use candle_core::{DType, Device, Tensor};
use rand::Rng;
use rand_distr::StandardNormal;
use serde::Serialize;

use super::generalized_offset::psi_schedule;
use super::loss::{LossConfig, LossError, LossInputs};
use super::noise_schedule::{NoiseSchedule, ScheduleError};
use super::perturbation::{embedding_seed, perturb_embeddings, perturbed_noise, InputPerturbation};
use super::pyramid_noise::{PyramidNoise, PyramidStyle};
use super::timesteps::{TimestepDistribution, TimestepRange};
use crate::model::family::PredictionType;

#[derive(Debug, thiserror::Error)]
pub enum ObjectiveError {
    #[error(
        "timestep range [{start}, {end}) is empty or too wide: timestep_start must be below \
         timestep_end, and timestep_end at most the model's num_train_timesteps ({n})"
    )]
    TimestepRange { start: u32, end: u32, n: usize },
    #[error("timestep_shift is {0}; it must be a finite number > 0")]
    Shift(f64),
    #[error("timestep_distribution {0}")]
    Distribution(String),
    #[error(
        "generalized_offset_noise: its ψ schedule divides by α_t, which is 0 at the last \
         timestep of a zero-terminal-SNR schedule; turn one of them off"
    )]
    GeneralizedOffset,
    #[error("zero_frequency_noise_ratio is {0}; it must be a finite number ≥ 0")]
    NoiseRatio(f64),
    #[error("min_snr_gamma is {0}; it must be a finite number > 0")]
    SnrGamma(f64),
    #[error("loss: prediction {pred:?} and target {target:?} differ in shape")]
    Shape {
        pred: Vec<usize>,
        target: Vec<usize>,
    },
    #[error("loss: {weights} weights for a batch of {batch}")]
    Weights { weights: usize, batch: usize },
    #[error("noise: {rngs} per-sample generators for a batch of {batch}")]
    Generators { rngs: usize, batch: usize },
    #[error(
        "debiased_estimation_loss on an epsilon-prediction model with zero terminal SNR: its \
         weight 1/√SNR is infinite at timestep {t}; lower timestep_end to {t} or drop one of them"
    )]
    DebiasedAtZeroSnr { t: u32 },
    #[error("{what} is {value}; it must be a finite number ≥ 0")]
    Negative { what: &'static str, value: f64 },
    #[error(
        "{key} is for {wants} models (kohya refuses it otherwise); this model predicts {model}"
    )]
    PredictionType {
        key: &'static str,
        wants: &'static str,
        model: &'static str,
    },
    #[error(
        "v_pred_like_loss on a schedule with zero terminal SNR: its weight 1 + v·(SNR+1)/SNR is \
         infinite at timestep {t}; lower timestep_end to {t} or drop one of them"
    )]
    VPredLikeAtZeroSnr { t: u32 },
    #[error(transparent)]
    Loss(#[from] LossError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ObjectiveError {
    /// True when the settings are at fault (exit code 2), not the computation.
    pub fn is_usage(&self) -> bool {
        match self {
            ObjectiveError::TimestepRange { .. }
            | ObjectiveError::Shift(_)
            | ObjectiveError::Distribution(_)
            | ObjectiveError::GeneralizedOffset
            | ObjectiveError::NoiseRatio(_)
            | ObjectiveError::SnrGamma(_)
            | ObjectiveError::DebiasedAtZeroSnr { .. }
            | ObjectiveError::Negative { .. }
            | ObjectiveError::PredictionType { .. }
            | ObjectiveError::VPredLikeAtZeroSnr { .. } => true,
            ObjectiveError::Shape { .. }
            | ObjectiveError::Weights { .. }
            | ObjectiveError::Generators { .. }
            | ObjectiveError::Loss(_)
            | ObjectiveError::Schedule(_)
            | ObjectiveError::Candle(_) => false,
        }
    }
}

/// Draws `batch` timesteps uniformly from `start..end` (`end ≤ num_train_timesteps`).
pub fn sample_timesteps<R: Rng + ?Sized>(
    rng: &mut R,
    batch: usize,
    start: u32,
    end: u32,
    num_train_timesteps: usize,
) -> Result<Vec<u32>, ObjectiveError> {
    check_timestep_range(start, end, num_train_timesteps)?;
    Ok((0..batch).map(|_| rng.random_range(start..end)).collect())
}

/// Where the objective draws its timesteps.
fn timestep_range(config: &ObjectiveConfig, schedule: &NoiseSchedule) -> TimestepRange {
    TimestepRange {
        start: config.timestep_start,
        end: config.timestep_end,
        num_train: schedule.num_train_timesteps() as u32,
        shift: config.timestep_shift,
    }
}

fn check_timestep_range(start: u32, end: u32, n: usize) -> Result<(), ObjectiveError> {
    if start >= end || end as usize > n {
        return Err(ObjectiveError::TimestepRange { start, end, n });
    }
    Ok(())
}

/// Standard normal noise of shape `dims` = `[B, C, H, W]`, plus `ratio` times a `[B, C, 1, 1]`
/// offset (EveryDream2's zero-frequency noise), drawn on the host and placed on `device` in
/// `dtype`. Samples are drawn in row-major order, the offset after the main noise.
pub fn sample_noise<R: Rng + ?Sized>(
    rng: &mut R,
    dims: (usize, usize, usize, usize),
    zero_frequency_noise_ratio: f64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor, ObjectiveError> {
    sample_noise_with(rng, dims, zero_frequency_noise_ratio, None, dtype, device)
}

/// kohya's variations of the noise offset `r` (`library/custom_train_functions.py`
/// `apply_noise_offset`, `train_util.get_noise_noisy_latents_and_timesteps`):
/// - `noise_offset_random_strength`: the offset is `u·r`, `u ~ U[0, 1)`; kohya draws `u` once per
///   batch, sdtrain once per sample (after its noise, from its own generator), so that a batch
///   split by the OOM retry draws the same;
/// - `adaptive_noise_scale` `a`: each channel's offset scale is `max(r' + a·|mean(x₀_c)|, 0)`, the
///   mean over the sample's latent plane.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OffsetVariant {
    pub random_strength: bool,
    pub adaptive_scale: Option<f64>,
}

/// The offset scale of each channel of one sample: `strength` (the offset after its random
/// strength), plus `a·|mean|` for kohya's adaptive noise scale, at least 0.
pub fn offset_scales(strength: f32, adaptive: Option<f64>, channel_means: &[f32]) -> Vec<f32> {
    channel_means
        .iter()
        .map(|m| match adaptive {
            Some(a) => (strength + a as f32 * m.abs()).max(0.0),
            None => strength,
        })
        .collect()
}

/// [`sample_noise`] with pyramid noise: EveryDream2's is added before the offset, kohya's after
/// it (each trainer's order), each sample's pyramid drawn after its offset.
pub fn sample_noise_with<R: Rng + ?Sized>(
    rng: &mut R,
    dims: (usize, usize, usize, usize),
    zero_frequency_noise_ratio: f64,
    pyramid: Option<&PyramidNoise>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor, ObjectiveError> {
    let offset = NoiseOffset {
        ratio: zero_frequency_noise_ratio,
        variant: OffsetVariant::default(),
        channel_means: &[],
        psi: 1.0,
    };
    sample_noise_offset(rng, dims, &offset, pyramid, dtype, device)
}

/// The noise offset of one draw: its ratio, kohya's variations, and (for the adaptive scale) the
/// latents' channel means, `[B·C]`.
pub struct NoiseOffset<'a> {
    pub ratio: f64,
    pub variant: OffsetVariant,
    pub channel_means: &'a [f32],
    /// Generalized offset noise's `ψ_t` of the sample's timestep (1 for the plain offset).
    pub psi: f32,
}

/// [`sample_noise_with`] with kohya's offset variations: the random strength is drawn after the
/// main noise, before the offsets.
pub fn sample_noise_offset<R: Rng + ?Sized>(
    rng: &mut R,
    dims: (usize, usize, usize, usize),
    offset: &NoiseOffset<'_>,
    pyramid: Option<&PyramidNoise>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor, ObjectiveError> {
    check_noise_ratio(offset.ratio)?;
    let (b, c, h, w) = dims;
    let mut data: Vec<f32> = (0..b * c * h * w)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect();
    let offsets: Vec<f32> = if offset.ratio > 0.0 && h * w > 0 {
        let mut strength = offset.ratio as f32;
        if offset.variant.random_strength {
            strength *= rng.random::<f32>();
        }
        let scales = match offset.variant.adaptive_scale {
            Some(_) if offset.channel_means.len() == b * c => offset_scales(
                strength,
                offset.variant.adaptive_scale,
                offset.channel_means,
            ),
            _ => vec![strength; b * c],
        };
        scales
            .iter()
            .map(|s| offset.psi * s * rng.sample::<f32, _>(StandardNormal))
            .collect()
    } else {
        Vec::new()
    };
    let add_offsets = |data: &mut [f32]| {
        for (plane, offset) in data.chunks_mut(h * w).zip(&offsets) {
            plane.iter_mut().for_each(|x| *x += offset);
        }
    };
    match pyramid {
        Some(p) if c * h * w > 0 => {
            if p.style == PyramidStyle::Kohya {
                add_offsets(&mut data);
            }
            for sample in data.chunks_mut(c * h * w) {
                p.apply(sample, c, h, w, rng);
            }
            if p.style == PyramidStyle::EveryDream2 {
                add_offsets(&mut data);
            }
        }
        _ => add_offsets(&mut data),
    }
    Ok(Tensor::from_vec(data, (b, c, h, w), device)?.to_dtype(dtype)?)
}

fn check_noise_ratio(r: f64) -> Result<(), ObjectiveError> {
    if !r.is_finite() || r < 0.0 {
        return Err(ObjectiveError::NoiseRatio(r));
    }
    Ok(())
}

/// Per-sample loss weights for min-SNR-γ (module header), one per timestep.
pub fn min_snr_weights(
    schedule: &NoiseSchedule,
    timesteps: &[u32],
    prediction_type: PredictionType,
    gamma: f64,
) -> Result<Vec<f64>, ObjectiveError> {
    if !gamma.is_finite() || gamma <= 0.0 {
        return Err(ObjectiveError::SnrGamma(gamma));
    }
    Ok(super::loss::min_snr_weights(
        schedule,
        timesteps,
        prediction_type,
        gamma,
    )?)
}

/// `(1/B) Σ_i w_i · mean_{c,h,w} (pred_i − target_i)²` in f32 (`w_i = 1` without weights), a
/// scalar that back-propagates into `pred`.
pub fn mse_loss(
    pred: &Tensor,
    target: &Tensor,
    weights: Option<&[f64]>,
) -> Result<Tensor, ObjectiveError> {
    if pred.dims() != target.dims() || pred.rank() == 0 {
        return Err(ObjectiveError::Shape {
            pred: pred.dims().to_vec(),
            target: target.dims().to_vec(),
        });
    }
    // The target is a constant: no gradient is stored for it.
    let sq =
        crate::nn::sub_const(&pred.to_dtype(DType::F32)?, &target.to_dtype(DType::F32)?)?.sqr()?;
    let Some(weights) = weights else {
        return Ok(sq.mean_all()?);
    };
    let batch = pred.dims()[0];
    if weights.len() != batch {
        return Err(ObjectiveError::Weights {
            weights: weights.len(),
            batch,
        });
    }
    let per_sample = sq.flatten_from(1)?.mean(1)?;
    let w: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
    let w = Tensor::from_vec(w, batch, pred.device())?;
    Ok((per_sample * w)?.mean_all()?)
}

/// The objective's settings (train.json: the timestep range and distribution, the noise
/// options, the loss and its weighting, the perturbations).
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectiveConfig {
    pub timestep_start: u32,
    pub timestep_end: u32,
    pub timestep_distribution: TimestepDistribution,
    /// OneTrainer's `timestep_shift` (1 leaves timesteps in place).
    pub timestep_shift: f64,
    pub zero_frequency_noise_ratio: f64,
    /// kohya's variations of the noise offset's strength.
    pub offset_variant: OffsetVariant,
    /// Pyramid (multi-resolution) noise added to each sample's noise.
    pub pyramid: Option<PyramidNoise>,
    /// The loss, min-SNR-γ and debiased weighting, and how a loss mask weighs.
    pub loss: LossConfig,
    /// Input perturbation of the UNet's noisy latents (training only).
    pub input_perturbation: Option<InputPerturbation>,
    /// EveryDream2's `embedding_perturbation` `p` (training only; 0 is off).
    pub embedding_perturbation: f64,
    /// OneTrainer's generalized offset noise: the offset scaled by `ψ_t`
    /// ([`super::generalized_offset`]).
    pub generalized_offset_noise: bool,
    /// OneTrainer's `perturbation_noise_weight`: this much more standard normal noise, in the
    /// input and the target alike (0 is off).
    pub perturbation_noise_weight: f64,
}

impl ObjectiveConfig {
    /// The whole schedule, no offset noise, plain MSE, no perturbation.
    pub fn plain(num_train_timesteps: usize) -> Self {
        Self {
            timestep_start: 0,
            timestep_end: num_train_timesteps as u32,
            timestep_distribution: TimestepDistribution::Uniform,
            timestep_shift: 1.0,
            zero_frequency_noise_ratio: 0.0,
            offset_variant: OffsetVariant::default(),
            pyramid: None,
            loss: LossConfig::mse(),
            input_perturbation: None,
            embedding_perturbation: 0.0,
            generalized_offset_noise: false,
            perturbation_noise_weight: 0.0,
        }
    }
}

/// One noised batch: the UNet input, its timesteps and what it should predict.
#[derive(Debug, Clone)]
pub struct NoisedBatch {
    pub timesteps: Vec<u32>,
    /// `x_t`, the UNet input, in x₀'s dtype.
    pub noisy: Tensor,
    /// ε or v, in x₀'s dtype.
    pub target: Tensor,
    /// The loss mask `[B, 1, h, w]` (latent size, f32), when masked loss is on.
    pub mask: Option<Tensor>,
    /// One embedding-noise seed per sample when embedding perturbation is on, else empty.
    pub embedding_seeds: Vec<u64>,
    /// Each sample's own loss weight (regularization images' `prior_loss_weight`), or empty
    /// when every sample weighs 1.
    pub sample_weights: Vec<f64>,
}

impl NoisedBatch {
    /// The timesteps as the UNet takes them: `[B]` f32.
    pub fn timesteps_tensor(&self, device: &Device) -> Result<Tensor, ObjectiveError> {
        let t: Vec<f32> = self.timesteps.iter().map(|&t| t as f32).collect();
        Ok(Tensor::from_vec(t, self.timesteps.len(), device)?)
    }

    /// Samples `start..start + len` (checked by the caller).
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Self> {
        Ok(Self {
            timesteps: self.timesteps[start..start + len].to_vec(),
            noisy: self.noisy.narrow(0, start, len)?,
            target: self.target.narrow(0, start, len)?,
            mask: match &self.mask {
                Some(m) => Some(m.narrow(0, start, len)?),
                None => None,
            },
            embedding_seeds: if self.embedding_seeds.is_empty() {
                Vec::new()
            } else {
                self.embedding_seeds[start..start + len].to_vec()
            },
            sample_weights: if self.sample_weights.is_empty() {
                Vec::new()
            } else {
                self.sample_weights[start..start + len].to_vec()
            },
        })
    }
}

/// The objective for one model: its noise schedule, prediction type and settings.
#[derive(Debug, Clone)]
pub struct Objective {
    schedule: NoiseSchedule,
    prediction_type: PredictionType,
    config: ObjectiveConfig,
    /// `ψ_t` of generalized offset noise, when it is on and there is an offset.
    psi: Option<Vec<f64>>,
}

fn check_non_negative(what: &'static str, value: f64) -> Result<(), ObjectiveError> {
    if !value.is_finite() || value < 0.0 {
        return Err(ObjectiveError::Negative { what, value });
    }
    Ok(())
}

/// kohya's v-prediction scalings fit one prediction type each (kohya's `verify_training_args`),
/// and `v_pred_like_loss`'s weight is infinite where the SNR is 0.
fn check_v_pred_scaling(
    schedule: &NoiseSchedule,
    loss: &LossConfig,
    last: u32,
) -> Result<(), ObjectiveError> {
    let model = schedule.prediction_type();
    let v = loss.v_pred;
    if v.like_noise && model != PredictionType::VPrediction {
        return Err(ObjectiveError::PredictionType {
            key: "scale_v_pred_loss_like_noise_pred",
            wants: "v-prediction",
            model: model.name(),
        });
    }
    if v.like_v != 0.0 {
        if model != PredictionType::Epsilon {
            return Err(ObjectiveError::PredictionType {
                key: "v_pred_like_loss",
                wants: "epsilon-prediction",
                model: model.name(),
            });
        }
        if schedule.snr(last)? == 0.0 {
            return Err(ObjectiveError::VPredLikeAtZeroSnr { t: last });
        }
    }
    Ok(())
}

impl Objective {
    /// Validates `config` against the schedule. The prediction type is the schedule's.
    pub fn new(schedule: NoiseSchedule, config: ObjectiveConfig) -> Result<Self, ObjectiveError> {
        check_timestep_range(
            config.timestep_start,
            config.timestep_end,
            schedule.num_train_timesteps(),
        )?;
        if !(config.timestep_shift.is_finite() && config.timestep_shift > 0.0) {
            return Err(ObjectiveError::Shift(config.timestep_shift));
        }
        let range = timestep_range(&config, &schedule);
        config
            .timestep_distribution
            .check(&range)
            .map_err(ObjectiveError::Distribution)?;
        check_noise_ratio(config.zero_frequency_noise_ratio)?;
        if let Some(g) = config.loss.min_snr_gamma {
            if !g.is_finite() || g <= 0.0 {
                return Err(ObjectiveError::SnrGamma(g));
            }
        }
        check_non_negative("embedding_perturbation", config.embedding_perturbation)?;
        if let Some(ip) = config.input_perturbation {
            check_non_negative("ip_noise_gamma", ip.gamma)?;
        }
        let last = config.timestep_end - 1;
        check_v_pred_scaling(&schedule, &config.loss, last)?;
        if config.loss.debiased_estimation
            && schedule.prediction_type() == PredictionType::Epsilon
            && schedule.snr(last)? == 0.0
        {
            return Err(ObjectiveError::DebiasedAtZeroSnr { t: last });
        }
        check_non_negative(
            "perturbation_noise_weight",
            config.perturbation_noise_weight,
        )?;
        let psi = match config.generalized_offset_noise && config.zero_frequency_noise_ratio > 0.0 {
            true => {
                let psi = psi_schedule(schedule.alphas_cumprod());
                if psi.iter().any(|p| !p.is_finite()) {
                    return Err(ObjectiveError::GeneralizedOffset);
                }
                Some(psi)
            }
            false => None,
        };
        Ok(Self {
            prediction_type: schedule.prediction_type(),
            schedule,
            config,
            psi,
        })
    }

    pub fn schedule(&self) -> &NoiseSchedule {
        &self.schedule
    }

    pub fn prediction_type(&self) -> PredictionType {
        self.prediction_type
    }

    pub fn config(&self) -> &ObjectiveConfig {
        &self.config
    }

    /// This objective without its training-only perturbations (input and embedding), for the
    /// validation loss: the same loss, with nothing random beyond the noise and timesteps.
    pub fn without_perturbations(&self) -> Self {
        let mut quiet = self.clone();
        quiet.config.input_perturbation = None;
        quiet.config.embedding_perturbation = 0.0;
        quiet
    }

    /// Draws noise, timesteps and perturbations for the latents `x0` `[B, C, H, W]` with one
    /// generator per sample: sample `i`'s draws (module header) come from `rngs[i]` alone, so any
    /// split of the batch draws the same values.
    pub fn noise_per_sample<R: Rng>(
        &self,
        rngs: &mut [R],
        x0: &Tensor,
    ) -> Result<NoisedBatch, ObjectiveError> {
        let (b, c, h, w) = x0.dims4()?;
        if rngs.len() != b {
            return Err(ObjectiveError::Generators {
                rngs: rngs.len(),
                batch: b,
            });
        }
        check_timestep_range(
            self.config.timestep_start,
            self.config.timestep_end,
            self.schedule.num_train_timesteps(),
        )?;
        let range = timestep_range(&self.config, &self.schedule);
        let mut noise = Vec::with_capacity(b);
        let mut input_noise = Vec::with_capacity(b);
        let mut timesteps = Vec::with_capacity(b);
        let mut embedding_seeds = Vec::new();
        // The adaptive noise scale reads each sample's channel means.
        let means: Vec<f32> = match self.config.offset_variant.adaptive_scale {
            Some(_) => x0
                .to_dtype(DType::F32)?
                .mean((2, 3))?
                .flatten_all()?
                .to_vec1()?,
            None => Vec::new(),
        };
        for (i, rng) in rngs.iter_mut().enumerate() {
            // Generalized offset noise scales the offset by ψ of the sample's timestep, which is
            // then drawn first; otherwise it is drawn after the noise.
            let early = self
                .psi
                .as_ref()
                .map(|_| self.config.timestep_distribution.draw(rng, &range));
            let psi = match (&self.psi, early) {
                (Some(psi), Some(t)) => psi.get(t as usize).copied().unwrap_or(1.0) as f32,
                _ => 1.0,
            };
            let offset = NoiseOffset {
                ratio: self.config.zero_frequency_noise_ratio,
                variant: self.config.offset_variant,
                channel_means: means.get(i * c..(i + 1) * c).unwrap_or(&[]),
                psi,
            };
            let mut n = sample_noise_offset(
                rng,
                (1, c, h, w),
                &offset,
                self.config.pyramid.as_ref(),
                DType::F32,
                x0.device(),
            )?;
            if self.config.perturbation_noise_weight > 0.0 {
                let xi = sample_noise(rng, (1, c, h, w), 0.0, DType::F32, x0.device())?;
                n = (n + xi.affine(self.config.perturbation_noise_weight, 0.0)?)?;
            }
            timesteps.push(match early {
                Some(t) => t,
                None => self.config.timestep_distribution.draw(rng, &range),
            });
            if let Some(ip) = self.config.input_perturbation {
                let strength = ip.strength(rng);
                let xi = sample_noise(rng, (1, c, h, w), 0.0, DType::F32, x0.device())?;
                input_noise.push(perturbed_noise(&n, &xi, strength)?);
            }
            if self.config.embedding_perturbation > 0.0 {
                embedding_seeds.push(embedding_seed(rng));
            }
            noise.push(n);
        }
        let noise = Tensor::cat(&noise, 0)?.to_dtype(x0.dtype())?;
        let mut batch = self.noise_with(x0, &noise, timesteps)?;
        if !input_noise.is_empty() {
            let perturbed = Tensor::cat(&input_noise, 0)?.to_dtype(x0.dtype())?;
            batch.noisy = self.schedule.add_noise(x0, &perturbed, &batch.timesteps)?;
        }
        batch.embedding_seeds = embedding_seeds;
        Ok(batch)
    }

    /// Noises `x0` with the given noise and timesteps (no randomness).
    pub fn noise_with(
        &self,
        x0: &Tensor,
        noise: &Tensor,
        timesteps: Vec<u32>,
    ) -> Result<NoisedBatch, ObjectiveError> {
        let noisy = self.schedule.add_noise(x0, noise, &timesteps)?;
        let target = self
            .schedule
            .target(self.prediction_type, x0, noise, &timesteps)?;
        Ok(NoisedBatch {
            timesteps,
            noisy,
            target,
            mask: None,
            embedding_seeds: Vec::new(),
            sample_weights: Vec::new(),
        })
    }

    /// The text conditioning `[B, L, D]` with the batch's embedding noise added (when on).
    pub fn perturb_context(
        &self,
        context: &Tensor,
        batch: &NoisedBatch,
    ) -> Result<Tensor, ObjectiveError> {
        let p = self.config.embedding_perturbation;
        if p == 0.0 || batch.embedding_seeds.is_empty() {
            return Ok(context.clone());
        }
        Ok(perturb_embeddings(context, p, &batch.embedding_seeds)?)
    }

    /// The loss of the UNet output `pred` for `batch` ([`super::loss`]).
    pub fn loss(&self, pred: &Tensor, batch: &NoisedBatch) -> Result<Tensor, ObjectiveError> {
        self.loss_with_prior(pred, batch, None)
    }

    /// [`Self::loss`] with the prior prediction of masked prior preservation
    /// (`crate::diffusion::loss`).
    pub fn loss_with_prior(
        &self,
        pred: &Tensor,
        batch: &NoisedBatch,
        prior: Option<&Tensor>,
    ) -> Result<Tensor, ObjectiveError> {
        let inputs = LossInputs {
            pred,
            target: &batch.target,
            timesteps: &batch.timesteps,
            mask: batch.mask.as_ref(),
            sample_weights: (!batch.sample_weights.is_empty())
                .then_some(batch.sample_weights.as_slice()),
        };
        Ok(self.config.loss.loss_with_prior(
            &self.schedule,
            self.prediction_type,
            &inputs,
            prior,
        )?)
    }

    /// Whether the loss reads a prior prediction (masked prior preservation is on).
    pub fn wants_prior(&self) -> bool {
        self.config.loss.mask.prior_preservation > 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn sd_schedule(p: PredictionType) -> NoiseSchedule {
        NoiseSchedule::sd_for_tests(p)
    }

    #[test]
    fn timesteps_are_seeded_and_in_range() {
        let mut a = StdRng::seed_from_u64(7);
        let mut b = StdRng::seed_from_u64(7);
        let ta = sample_timesteps(&mut a, 4096, 100, 300, 1000).unwrap();
        let tb = sample_timesteps(&mut b, 4096, 100, 300, 1000).unwrap();
        assert_eq!(ta, tb);
        assert!(ta.iter().all(|&t| (100..300).contains(&t)));
        assert!(ta.contains(&100) && ta.contains(&299));
        assert!(sample_timesteps(&mut a, 1, 0, 1001, 1000).is_err());
        assert!(sample_timesteps(&mut a, 1, 5, 5, 1000).is_err());
    }

    #[test]
    fn noise_is_seeded_standard_normal() {
        let dev = Device::Cpu;
        let mut a = StdRng::seed_from_u64(1);
        let mut b = StdRng::seed_from_u64(1);
        let na = sample_noise(&mut a, (4, 4, 32, 32), 0.0, DType::F32, &dev).unwrap();
        let nb = sample_noise(&mut b, (4, 4, 32, 32), 0.0, DType::F32, &dev).unwrap();
        let va = na.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(va, nb.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let n = va.len() as f64;
        let mean = va.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = va.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }

    #[test]
    fn zero_frequency_noise_shifts_each_channel_by_a_constant() {
        let dev = Device::Cpu;
        let mut a = StdRng::seed_from_u64(3);
        let mut b = StdRng::seed_from_u64(3);
        let plain = sample_noise(&mut a, (2, 3, 4, 4), 0.0, DType::F32, &dev).unwrap();
        let offset = sample_noise(&mut b, (2, 3, 4, 4), 0.5, DType::F32, &dev).unwrap();
        let d = (offset - plain).unwrap().flatten_from(2).unwrap();
        let d = d.to_vec3::<f32>().unwrap();
        // EveryDream2's offset is `ratio · N(0, 1)` per (image, channel), drawn after the
        // noise: the standard normals that follow the 96 noise values, scaled (a dropped ratio
        // fails).
        let mut after = StdRng::seed_from_u64(3);
        for _ in 0..2 * 3 * 4 * 4 {
            let _: f32 = after.sample(StandardNormal);
        }
        for sample in &d {
            for plane in sample {
                assert!(plane.iter().all(|&x| (x - plane[0]).abs() < 1e-6));
                let z: f32 = after.sample(StandardNormal);
                assert!(
                    (plane[0] - 0.5 * z).abs() < 1e-6,
                    "{} vs {}",
                    plane[0],
                    0.5 * z
                );
            }
        }
        assert!(sample_noise(&mut a, (1, 1, 1, 1), -0.1, DType::F32, &dev).is_err());
    }

    #[test]
    fn min_snr_weights_by_target() {
        let s = sd_schedule(PredictionType::Epsilon);
        let ts = [0u32, 500, 999];
        let eps = min_snr_weights(&s, &ts, PredictionType::Epsilon, 5.0).unwrap();
        let v = min_snr_weights(&s, &ts, PredictionType::VPrediction, 5.0).unwrap();
        for (i, &t) in ts.iter().enumerate() {
            let snr = s.snr(t).unwrap();
            assert!((eps[i] - snr.min(5.0) / snr).abs() < 1e-12);
            assert!((v[i] - snr.min(5.0) / (snr + 1.0)).abs() < 1e-12);
        }
        // t = 0 has SNR ≈ 1175: the weight is γ/SNR; at t = 999 SNR < γ: ε weight is 1.
        assert!(eps[0] < 0.01 && eps[2] == 1.0);
        assert!(min_snr_weights(&s, &ts, PredictionType::Epsilon, 0.0).is_err());
    }

    #[test]
    fn zero_terminal_snr_weights_are_finite() {
        let s = NoiseSchedule::from_betas(&[0.1, 1.0], PredictionType::Epsilon);
        assert_eq!(s.snr(1).unwrap(), 0.0);
        let eps = min_snr_weights(&s, &[1], PredictionType::Epsilon, 5.0).unwrap();
        let v = min_snr_weights(&s, &[1], PredictionType::VPrediction, 5.0).unwrap();
        assert_eq!((eps[0], v[0]), (1.0, 0.0));
    }

    #[test]
    fn loss_is_weighted_mean_of_per_sample_mse() {
        let dev = Device::Cpu;
        let pred = Tensor::new(&[[1f32, 1.0], [0.0, 2.0]], &dev).unwrap();
        let target = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
        let plain = mse_loss(&pred, &target, None)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(plain, 1.5);
        let w = mse_loss(&pred, &target, Some(&[2.0, 0.5]))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(w, (2.0 * 1.0 + 0.5 * 2.0) / 2.0);
        let bf = pred.to_dtype(DType::BF16).unwrap();
        assert_eq!(mse_loss(&bf, &target, None).unwrap().dtype(), DType::F32);
        assert!(mse_loss(&pred, &target, Some(&[1.0])).is_err());
        assert!(mse_loss(&pred, &target.reshape(4).unwrap(), None).is_err());
    }

    #[test]
    fn objective_validates_and_runs() {
        let s = sd_schedule(PredictionType::VPrediction);
        let bad = ObjectiveConfig {
            timestep_end: 1001,
            ..ObjectiveConfig::plain(1000)
        };
        assert!(Objective::new(s.clone(), bad).is_err());
        let mut cfg = ObjectiveConfig {
            zero_frequency_noise_ratio: 0.1,
            ..ObjectiveConfig::plain(1000)
        };
        cfg.loss.min_snr_gamma = Some(5.0);
        let obj = Objective::new(s, cfg).unwrap();
        let x0 = Tensor::ones((2, 4, 8, 8), DType::F32, &Device::Cpu).unwrap();
        let mut rngs = [StdRng::seed_from_u64(0), StdRng::seed_from_u64(1)];
        let batch = obj.noise_per_sample(&mut rngs, &x0).unwrap();
        assert_eq!(batch.noisy.dims(), x0.dims());
        assert_eq!(batch.timesteps_tensor(&Device::Cpu).unwrap().dims(), [2]);
        let loss = obj.loss(&batch.noisy, &batch).unwrap();
        assert!(loss.to_scalar::<f32>().unwrap().is_finite());
    }

    /// Input perturbation moves the UNet input only: the target, timesteps and the draws
    /// before it are those of the unperturbed run.
    #[test]
    fn input_perturbation_leaves_the_target_alone() {
        let s = sd_schedule(PredictionType::Epsilon);
        let x0 = Tensor::ones((2, 4, 8, 8), DType::F32, &Device::Cpu).unwrap();
        let rngs = || [StdRng::seed_from_u64(3), StdRng::seed_from_u64(4)];
        let plain = Objective::new(s.clone(), ObjectiveConfig::plain(1000)).unwrap();
        let ip = Objective::new(
            s,
            ObjectiveConfig {
                input_perturbation: Some(InputPerturbation {
                    gamma: 0.5,
                    random_strength: false,
                }),
                embedding_perturbation: 1.0,
                ..ObjectiveConfig::plain(1000)
            },
        )
        .unwrap();
        let a = plain.noise_per_sample(&mut rngs(), &x0).unwrap();
        let b = ip.noise_per_sample(&mut rngs(), &x0).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.timesteps, b.timesteps);
        assert_eq!(flat(&a.target), flat(&b.target));
        assert_ne!(flat(&a.noisy), flat(&b.noisy));
        assert_eq!(b.embedding_seeds.len(), 2);
        let quiet = ip
            .without_perturbations()
            .noise_per_sample(&mut rngs(), &x0)
            .unwrap();
        assert_eq!(flat(&quiet.noisy), flat(&a.noisy));
        assert!(quiet.embedding_seeds.is_empty());
        // On zero latents the UNet input is √(1−ᾱ)·noise, so per sample the perturbation over
        // the plain input is γ·ξ over ε: a deviation ratio of γ = 0.5 (ε and ξ swapped give
        // √(1 + (γ−1)²) ≈ 1.12).
        let zeros = x0.zeros_like().unwrap();
        let a = plain.noise_per_sample(&mut rngs(), &zeros).unwrap();
        let b = ip.noise_per_sample(&mut rngs(), &zeros).unwrap();
        let std = |t: &Tensor| {
            let v = flat(t);
            let m = v.iter().sum::<f32>() / v.len() as f32;
            (v.iter().map(|x| (x - m).powi(2)).sum::<f32>() / v.len() as f32).sqrt()
        };
        for i in 0..2 {
            let (pa, pb) = (a.noisy.get(i).unwrap(), b.noisy.get(i).unwrap());
            let ratio = std(&(&pb - &pa).unwrap()) / std(&pa);
            assert!((ratio - 0.5).abs() < 0.08, "sample {i}: {ratio}");
        }
    }
}
