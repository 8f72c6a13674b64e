//! The loss of one micro-batch: a per-element loss of the prediction error `d = pred − target`,
//! an optional loss mask, a mean per sample, per-sample weights, and the batch mean:
//!
//! `L = (1/B) Σ_i w_i · mean_{c,h,w}( m_i ⊙ ℓ(d_i) )`, all in f32.
//!
//! The per-element losses `ℓ`:
//! - `mse`: `d²` (EveryDream2 `"mse"`, kohya `"l2"`);
//! - `huber`: torch `huber_loss(δ = 1)`, `½d²` for `|d| < 1`, else `|d| − ½` (EveryDream2);
//! - `mse_huber`: `b·d² + (1 − b)·huber` with `b = t/T` per sample, `T` the schedule's
//!   `num_train_timesteps`; `huber_mse` swaps the two weights (EveryDream2 `train.py`
//!   `get_model_prediction_and_target`, whose `loss_mse.mean() + loss_huber.mean()` is this mean,
//!   as both terms have the same shape);
//! - `l1`: `|d|` (kohya);
//! - a weighted sum (OneTrainer's `mse_strength`, `mae_strength`, `huber_strength` with
//!   `huber_delta`, `log_cosh_strength`: `modules/modelSetup/mixin/ModelSetupDiffusionLossMixin.py`):
//!   `a·d² + b·|d| + h·huber_δ(d) + g·log cosh(d)`, with torch's `huber_loss(δ)` (`½d²` for
//!   `|d| < δ`, else `δ(|d| − ½δ)`) and `log cosh d = |d| + ln(1 + e^(−2|d|)) − ln 2` (OneTrainer's
//!   `d + softplus(−2d) − ln 2`, the same function written so it cannot overflow);
//! - `pseudo_huber`: `2c(√(d² + c²) − c)` and `smooth_l1`: `2(√(d² + c²) − c)` with a threshold
//!   `c` per sample from kohya's `huber_schedule` (kohya sd-scripts `library/train_util.py`
//!   `conditional_loss` and `get_huber_threshold_if_needed`):
//!   - `constant`: `c = huber_c · huber_scale`;
//!   - `exponential`: `c = exp(ln(huber_c) · t/T) · huber_scale`;
//!   - `snr`: `c = (1 − huber_c)/(1 + σ_t)² + huber_c` with `σ_t = √((1 − ᾱ_t)/ᾱ_t)` (kohya
//!     does not apply `huber_scale` here).
//!
//! The weights `w_i` multiply: min-SNR-γ (see [`super::objective`]), kohya's debiased
//! estimation (`custom_train_functions.py` `apply_debiased_estimation`, after arXiv 2310.08442):
//! `1/√SNR'` for an ε target and `1/(SNR' + 1)` for a v target, with `SNR' = min(SNR, 1000)`
//! (OneTrainer's `__debiased_estimation_weight` takes `1/√(SNR' + 1)` for a v target),
//! OneTrainer's P2 weighting `(1 + SNR'')^(−γ)` with `SNR'' = SNR` for an ε target and `SNR + 1`
//! for a v target (its `__p2_loss_weight`; Choi et al., arXiv 2204.00227, with k = 1),
//! and each sample's own weight (`prior_loss_weight` for a regularization image, 1 for the
//! others: kohya's `loss_weights`, applied before its SNR weights, which is the same product).
//! kohya's two v-prediction scalings, with `s = SNR'/(SNR' + 1)` (`get_snr_scale`):
//! `scale_v_pred_loss_like_noise_pred` multiplies a v-prediction loss by `s`, and
//! `v_pred_like_loss` `v` adds `v·loss/s` to an ε-prediction loss (a weight `1 + v/s`).
//!
//! The loss is then multiplied by `scale` (OneTrainer's `loss_scaler`: the batch size, the
//! accumulation steps, both, or 1).
//!
//! The mask `m` `[B, 1, h, w]` (latent size) is clamped to `[unmasked_weight, 1]`, and with
//! `normalize` each sample's loss is divided by its clamped mask's mean (OneTrainer
//! `modules/util/loss/masked_loss.py`; kohya's `apply_masked_loss` is `unmasked_weight = 0`
//! without normalising). With OneTrainer's masked prior preservation `p` and a prior
//! prediction `q` (the model's without its adapters), `p·(1 − m) ⊙ ℓ(pred − q)` is added, divided
//! by the mean of `1 − m` when normalising (`masked_losses_with_prior`; where that mean is 0,
//! OneTrainer's division gives NaN and sdtrain's term is 0).

use candle_core::{DType, Tensor};
use serde::Serialize;

use super::noise_schedule::{NoiseSchedule, ScheduleError};
use crate::model::family::PredictionType;

/// kohya's cap on the SNR in `apply_debiased_estimation` (the SNR at t = 0 can be huge).
pub const DEBIASED_SNR_CAP: f64 = 1000.0;

/// How kohya's pseudo-Huber threshold `c` depends on the timestep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HuberScheduleKind {
    Constant,
    Exponential,
    Snr,
}

/// kohya's `huber_schedule`, `huber_c` and `huber_scale`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HuberSchedule {
    pub kind: HuberScheduleKind,
    pub c: f64,
    pub scale: f64,
}

impl HuberSchedule {
    /// The threshold `c` for each timestep (module header).
    pub fn thresholds(
        &self,
        schedule: &NoiseSchedule,
        timesteps: &[u32],
    ) -> Result<Vec<f64>, ScheduleError> {
        let n = schedule.num_train_timesteps() as f64;
        timesteps
            .iter()
            .map(|&t| {
                Ok(match self.kind {
                    HuberScheduleKind::Constant => self.c * self.scale,
                    HuberScheduleKind::Exponential => {
                        let alpha = -self.c.ln() / n;
                        (-alpha * f64::from(t)).exp() * self.scale
                    }
                    HuberScheduleKind::Snr => {
                        let ab = schedule.alphas_cumprod()[schedule_index(schedule, t)?];
                        let sigma = ((1.0 - ab) / ab).sqrt();
                        (1.0 - self.c) / (1.0 + sigma).powi(2) + self.c
                    }
                })
            })
            .collect()
    }
}

fn schedule_index(schedule: &NoiseSchedule, t: u32) -> Result<usize, ScheduleError> {
    let n = schedule.num_train_timesteps();
    if (t as usize) < n {
        Ok(t as usize)
    } else {
        Err(ScheduleError::Timestep { t, n })
    }
}

/// The per-element loss (module header).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum LossType {
    Mse,
    Huber,
    MseHuber,
    HuberMse,
    L1,
    PseudoHuber(HuberSchedule),
    SmoothL1(HuberSchedule),
    /// OneTrainer's weighted sum of losses.
    Mix(LossMix),
}

/// The strengths of OneTrainer's four losses (0 leaves one out) and its Huber δ.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossMix {
    pub mse: f64,
    pub mae: f64,
    pub huber: f64,
    pub huber_delta: f64,
    pub log_cosh: f64,
}

/// The loss mask's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MaskWeighting {
    /// The mask is clamped to at least this (0: kohya; OneTrainer's default 0.1).
    pub unmasked_weight: f64,
    /// Divide each sample's loss by its clamped mask's mean (OneTrainer's
    /// `normalize_masked_area_loss`).
    pub normalize: bool,
    /// OneTrainer's `masked_prior_preservation_weight` `p` (0 is off): outside the mask the
    /// prediction is also pulled toward the model's own prediction without its adapters.
    pub prior_preservation: f64,
}

/// kohya's loss scalings between ε and v prediction (module header).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct VPredScaling {
    /// `scale_v_pred_loss_like_noise_pred` (v-prediction models).
    pub like_noise: bool,
    /// `v_pred_like_loss` (ε-prediction models; 0 is off).
    pub like_v: f64,
}

/// Everything that decides the loss of a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossConfig {
    pub loss_type: LossType,
    pub min_snr_gamma: Option<f64>,
    /// kohya's `debiased_estimation_loss`.
    pub debiased_estimation: bool,
    /// OneTrainer's debiased weight for a v target, `1/√(SNR' + 1)` (kohya's `1/(SNR' + 1)`).
    pub debiased_v_sqrt: bool,
    /// kohya's v-prediction scalings.
    pub v_pred: VPredScaling,
    /// How a sample's loss mask weighs it, when the batch carries masks.
    pub mask: MaskWeighting,
    /// OneTrainer's P2 weighting γ (`None` is off).
    pub p2_gamma: Option<f64>,
    /// The loss is multiplied by this (OneTrainer's `loss_scaler`; 1 is off).
    pub scale: f64,
}

impl LossConfig {
    /// Plain MSE, no weighting.
    pub fn mse() -> Self {
        Self {
            loss_type: LossType::Mse,
            min_snr_gamma: None,
            debiased_estimation: false,
            debiased_v_sqrt: false,
            v_pred: VPredScaling::default(),
            mask: MaskWeighting {
                unmasked_weight: 0.0,
                normalize: false,
                prior_preservation: 0.0,
            },
            p2_gamma: None,
            scale: 1.0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LossError {
    #[error("loss: prediction {pred:?} and target {target:?} differ in shape")]
    Shape {
        pred: Vec<usize>,
        target: Vec<usize>,
    },
    #[error("loss: {got} {what} for a batch of {batch}")]
    PerSample {
        what: &'static str,
        got: usize,
        batch: usize,
    },
    #[error("loss: mask {mask:?} does not fit the prediction {pred:?}; want [B, 1, h, w]")]
    Mask { mask: Vec<usize>, pred: Vec<usize> },
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Per-sample min-SNR-γ weights (`γ > 0`, checked where the config is built; formula in
/// [`super::objective`]).
pub fn min_snr_weights(
    schedule: &NoiseSchedule,
    timesteps: &[u32],
    prediction_type: PredictionType,
    gamma: f64,
) -> Result<Vec<f64>, ScheduleError> {
    timesteps
        .iter()
        .map(|&t| {
            let snr = schedule.snr(t)?;
            Ok(match prediction_type {
                PredictionType::Epsilon if snr == 0.0 => 1.0,
                PredictionType::Epsilon => snr.min(gamma) / snr,
                PredictionType::VPrediction => snr.min(gamma) / (snr + 1.0),
            })
        })
        .collect()
}

/// Per-sample debiased-estimation weights (module header).
pub fn debiased_weights(
    schedule: &NoiseSchedule,
    timesteps: &[u32],
    prediction_type: PredictionType,
    v_sqrt: bool,
) -> Result<Vec<f64>, ScheduleError> {
    timesteps
        .iter()
        .map(|&t| {
            let snr = schedule.snr(t)?.min(DEBIASED_SNR_CAP);
            Ok(match prediction_type {
                PredictionType::Epsilon => 1.0 / snr.sqrt(),
                PredictionType::VPrediction if v_sqrt => 1.0 / (snr + 1.0).sqrt(),
                PredictionType::VPrediction => 1.0 / (snr + 1.0),
            })
        })
        .collect()
}

/// Per-sample P2 weights (module header).
pub fn p2_weights(
    schedule: &NoiseSchedule,
    timesteps: &[u32],
    prediction_type: PredictionType,
    gamma: f64,
) -> Result<Vec<f64>, ScheduleError> {
    timesteps
        .iter()
        .map(|&t| {
            let snr = match prediction_type {
                PredictionType::Epsilon => schedule.snr(t)?,
                PredictionType::VPrediction => schedule.snr(t)? + 1.0,
            };
            Ok((1.0 + snr).powf(-gamma))
        })
        .collect()
}

/// kohya's `get_snr_scale`: `SNR'/(SNR' + 1)` with `SNR' = min(SNR, 1000)`.
fn snr_scale(schedule: &NoiseSchedule, t: u32) -> Result<f64, ScheduleError> {
    let snr = schedule.snr(t)?.min(DEBIASED_SNR_CAP);
    Ok(snr / (snr + 1.0))
}

/// Per-sample weights of kohya's v-prediction scalings (module header), `None` when both are
/// off.
pub fn v_pred_weights(
    schedule: &NoiseSchedule,
    timesteps: &[u32],
    v: VPredScaling,
) -> Result<Option<Vec<f64>>, ScheduleError> {
    if !v.like_noise && v.like_v == 0.0 {
        return Ok(None);
    }
    let weights = timesteps
        .iter()
        .map(|&t| {
            let s = snr_scale(schedule, t)?;
            let mut w = 1.0;
            if v.like_noise {
                w *= s;
            }
            if v.like_v != 0.0 {
                w *= 1.0 + v.like_v / s;
            }
            Ok(w)
        })
        .collect::<Result<Vec<f64>, ScheduleError>>()?;
    Ok(Some(weights))
}

/// A `[B, 1, …, 1]` f32 column of per-sample values, to broadcast over `[B, …]`.
fn column(values: &[f64], like: &Tensor) -> candle_core::Result<Tensor> {
    let mut dims = vec![1usize; like.rank()];
    dims[0] = values.len();
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    Tensor::from_vec(v, dims, like.device())
}

/// torch's `huber_loss` with δ = 1, written `½q² + (|d| − q)` with `q = min(|d|, 1)` so the
/// gradient is `d` inside and `sign(d)` outside.
fn huber1(d: &Tensor) -> candle_core::Result<Tensor> {
    let a = d.abs()?;
    let q = a.minimum(1f32)?;
    (q.sqr()?.affine(0.5, 0.0)? + (a - q)?)?.contiguous()
}

/// torch's `huber_loss` with `delta`: `½q² + δ(|d| − q)` with `q = min(|d|, δ)`.
fn huber_delta(d: &Tensor, delta: f64) -> candle_core::Result<Tensor> {
    let a = d.abs()?;
    let q = a.minimum(delta as f32)?;
    q.sqr()?.affine(0.5, 0.0)? + (a - q)?.affine(delta, 0.0)?
}

/// `log cosh d` as `|d| + ln(1 + e^(−2|d|)) − ln 2` (module header).
fn log_cosh(d: &Tensor) -> candle_core::Result<Tensor> {
    let a = d.abs()?;
    let tail = a.affine(-2.0, 0.0)?.exp()?.affine(1.0, 1.0)?.log()?;
    (a + tail)?.affine(1.0, -std::f64::consts::LN_2)
}

impl LossMix {
    /// The weighted sum per element (module header); no term when every strength is 0.
    fn per_element(&self, d: &Tensor) -> candle_core::Result<Tensor> {
        let mut sum: Option<Tensor> = None;
        let mut add = |term: Tensor, strength: f64| -> candle_core::Result<()> {
            let term = term.affine(strength, 0.0)?;
            sum = Some(match sum.take() {
                Some(s) => (s + term)?,
                None => term,
            });
            Ok(())
        };
        if self.mse != 0.0 {
            add(d.sqr()?, self.mse)?;
        }
        if self.mae != 0.0 {
            add(d.abs()?, self.mae)?;
        }
        if self.huber != 0.0 {
            add(huber_delta(d, self.huber_delta)?, self.huber)?;
        }
        if self.log_cosh != 0.0 {
            add(log_cosh(d)?, self.log_cosh)?;
        }
        match sum {
            Some(s) => Ok(s),
            None => d.zeros_like(),
        }
    }
}

/// `2(√(d² + c²) − c)` with `c` `[B, 1, …]`.
fn soft_l1(d: &Tensor, c: &Tensor) -> candle_core::Result<Tensor> {
    let root = d.sqr()?.broadcast_add(&c.sqr()?)?.sqrt()?;
    root.broadcast_sub(c)?.affine(2.0, 0.0)
}

impl LossType {
    /// `ℓ(d)` per element, `d` f32 `[B, …]`.
    pub fn per_element(
        &self,
        d: &Tensor,
        schedule: &NoiseSchedule,
        timesteps: &[u32],
    ) -> Result<Tensor, LossError> {
        let t_over_n = || {
            let n = schedule.num_train_timesteps() as f64;
            let b: Vec<f64> = timesteps.iter().map(|&t| f64::from(t) / n).collect();
            column(&b, d)
        };
        let mix = |mse_weight: &Tensor| -> candle_core::Result<Tensor> {
            let huber_weight = mse_weight.affine(-1.0, 1.0)?;
            d.sqr()?
                .broadcast_mul(mse_weight)?
                .add(&huber1(d)?.broadcast_mul(&huber_weight)?)
        };
        Ok(match self {
            Self::Mse => d.sqr()?,
            Self::Huber => huber1(d)?,
            Self::L1 => d.abs()?,
            Self::MseHuber => mix(&t_over_n()?)?,
            Self::HuberMse => mix(&t_over_n()?.affine(-1.0, 1.0)?)?,
            Self::PseudoHuber(s) => {
                let c = column(&s.thresholds(schedule, timesteps)?, d)?;
                soft_l1(d, &c)?.broadcast_mul(&c)?
            }
            Self::SmoothL1(s) => {
                let c = column(&s.thresholds(schedule, timesteps)?, d)?;
                soft_l1(d, &c)?
            }
            Self::Mix(m) => m.per_element(d)?,
        })
    }
}

/// What the loss is computed from: the UNet output, its target, the timesteps, and an optional
/// `[B, 1, h, w]` loss mask.
pub struct LossInputs<'a> {
    pub pred: &'a Tensor,
    pub target: &'a Tensor,
    pub timesteps: &'a [u32],
    pub mask: Option<&'a Tensor>,
    /// Each sample's own loss weight (regularization images), `None` when all are 1.
    pub sample_weights: Option<&'a [f64]>,
}

impl LossConfig {
    /// The per-sample weights `w_i` (min-SNR, kohya's v-prediction scalings, debiased
    /// estimation and P2), `None` when all are off.
    pub fn sample_weights(
        &self,
        schedule: &NoiseSchedule,
        prediction_type: PredictionType,
        timesteps: &[u32],
    ) -> Result<Option<Vec<f64>>, LossError> {
        let mut w: Option<Vec<f64>> = None;
        let mut fold = |ws: Vec<f64>| match &mut w {
            Some(acc) => acc.iter_mut().zip(ws).for_each(|(a, b)| *a *= b),
            None => w = Some(ws),
        };
        if let Some(gamma) = self.min_snr_gamma {
            fold(min_snr_weights(
                schedule,
                timesteps,
                prediction_type,
                gamma,
            )?);
        }
        if let Some(ws) = v_pred_weights(schedule, timesteps, self.v_pred)? {
            fold(ws);
        }
        if self.debiased_estimation {
            fold(debiased_weights(
                schedule,
                timesteps,
                prediction_type,
                self.debiased_v_sqrt,
            )?);
        }
        if let Some(gamma) = self.p2_gamma {
            fold(p2_weights(schedule, timesteps, prediction_type, gamma)?);
        }
        Ok(w)
    }

    /// `L` (module header): a 0-d f32 tensor that back-propagates into `pred`.
    pub fn loss(
        &self,
        schedule: &NoiseSchedule,
        prediction_type: PredictionType,
        inputs: &LossInputs<'_>,
    ) -> Result<Tensor, LossError> {
        self.loss_with_prior(schedule, prediction_type, inputs, None)
    }

    /// [`Self::loss`] with a prior prediction for masked prior preservation (module header);
    /// `None`, or no mask, or a weight of 0 leave it out.
    pub fn loss_with_prior(
        &self,
        schedule: &NoiseSchedule,
        prediction_type: PredictionType,
        inputs: &LossInputs<'_>,
        prior: Option<&Tensor>,
    ) -> Result<Tensor, LossError> {
        let loss = self.unscaled(schedule, prediction_type, inputs, prior)?;
        if self.scale == 1.0 {
            return Ok(loss);
        }
        Ok(loss.affine(self.scale, 0.0)?)
    }

    /// `L` before `scale`.
    fn unscaled(
        &self,
        schedule: &NoiseSchedule,
        prediction_type: PredictionType,
        inputs: &LossInputs<'_>,
        prior: Option<&Tensor>,
    ) -> Result<Tensor, LossError> {
        let (pred, target) = (inputs.pred, inputs.target);
        if pred.dims() != target.dims() || pred.rank() == 0 {
            return Err(LossError::Shape {
                pred: pred.dims().to_vec(),
                target: target.dims().to_vec(),
            });
        }
        let batch = pred.dims()[0];
        if inputs.timesteps.len() != batch {
            return Err(LossError::PerSample {
                what: "timesteps",
                got: inputs.timesteps.len(),
                batch,
            });
        }
        // The target is a constant: no gradient is stored for it.
        let d = crate::nn::sub_const(&pred.to_dtype(DType::F32)?, &target.to_dtype(DType::F32)?)?;
        let mut elem = self.loss_type.per_element(&d, schedule, inputs.timesteps)?;
        if let Some(mask) = inputs.mask {
            elem = self.apply_mask(&elem, mask)?;
            if let Some(q) = prior.filter(|_| self.mask.prior_preservation > 0.0) {
                let dq =
                    crate::nn::sub_const(&pred.to_dtype(DType::F32)?, &q.to_dtype(DType::F32)?)?;
                let lq = self
                    .loss_type
                    .per_element(&dq, schedule, inputs.timesteps)?;
                elem = (elem + self.apply_prior_mask(&lq, mask)?)?;
            }
        }
        let mut weights = self.sample_weights(schedule, prediction_type, inputs.timesteps)?;
        if let Some(own) = inputs.sample_weights {
            if own.len() != batch {
                return Err(LossError::PerSample {
                    what: "sample weights",
                    got: own.len(),
                    batch,
                });
            }
            weights = Some(match weights {
                Some(w) => w.iter().zip(own).map(|(a, b)| a * b).collect(),
                None => own.to_vec(),
            });
        }
        let Some(weights) = weights else {
            return Ok(elem.mean_all()?);
        };
        let per_sample = elem.flatten_from(1)?.mean(1)?;
        let w: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
        let w = Tensor::from_vec(w, batch, pred.device())?;
        Ok((per_sample * w)?.mean_all()?)
    }

    /// `p·(1 − clamp(m)) ⊙ ℓ_q`, divided by the per-sample mean of `1 − clamp(m)` when
    /// normalising (0 where that mean is 0). The mask is a constant.
    fn apply_prior_mask(&self, elem: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
        let dims = elem.dims();
        let w = self.mask.unmasked_weight as f32;
        let outside = mask
            .detach()
            .to_dtype(DType::F32)?
            .to_device(elem.device())?
            .clamp(w, 1f32)?
            .affine(-1.0, 1.0)?;
        let out = elem
            .broadcast_mul(&outside)?
            .affine(self.mask.prior_preservation, 0.0)?;
        if !self.mask.normalize {
            return Ok(out);
        }
        let mean = outside
            .flatten_from(1)?
            .mean_keepdim(1)?
            .reshape((dims[0], 1, 1, 1))?
            .maximum(f32::MIN_POSITIVE)?;
        Ok(out.broadcast_div(&mean)?)
    }

    /// `clamp(m, unmasked_weight, 1) ⊙ ℓ`, divided by the clamped mask's per-sample mean when
    /// normalising. The mask is a constant.
    fn apply_mask(&self, elem: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
        let (dims, mdims) = (elem.dims(), mask.dims());
        let fits = mdims.len() == dims.len()
            && mdims.len() == 4
            && mdims[0] == dims[0]
            && mdims[1] == 1
            && mdims[2..] == dims[2..];
        if !fits {
            return Err(LossError::Mask {
                mask: mdims.to_vec(),
                pred: dims.to_vec(),
            });
        }
        let w = self.mask.unmasked_weight as f32;
        let m = mask
            .detach()
            .to_dtype(DType::F32)?
            .to_device(elem.device())?
            .clamp(w, 1f32)?;
        let out = elem.broadcast_mul(&m)?;
        if !self.mask.normalize {
            return Ok(out);
        }
        let mean = m
            .flatten_from(1)?
            .mean_keepdim(1)?
            .reshape((dims[0], 1, 1, 1))?;
        Ok(out.broadcast_div(&mean)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn sd() -> NoiseSchedule {
        NoiseSchedule::sd_for_tests(PredictionType::Epsilon)
    }

    fn scalar(t: &Tensor) -> f32 {
        t.to_scalar::<f32>().unwrap()
    }

    #[test]
    fn huber_is_quadratic_inside_and_linear_outside() {
        let d = Tensor::new(&[0.5f32, -2.0, 1.0, 0.0], &Device::Cpu).unwrap();
        let h = huber1(&d).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(h, vec![0.125, 1.5, 0.5, 0.0]);
    }

    /// A sample whose mask is all ones has nothing outside it: its normalised prior term is 0
    /// (OneTrainer's division gives NaN there), and the loss is the plain masked loss.
    #[test]
    fn a_prior_outside_an_all_ones_mask_adds_nothing() {
        let dev = Device::Cpu;
        let pred = Tensor::new(&[[[[0.5f32, -1.0], [2.0, 0.0]]]], &dev).unwrap();
        let target = pred.zeros_like().unwrap();
        let prior = pred.affine(-1.0, 0.3).unwrap();
        let mask = pred.ones_like().unwrap();
        let mut cfg = LossConfig::mse();
        cfg.mask = MaskWeighting {
            unmasked_weight: 0.1,
            normalize: true,
            prior_preservation: 2.0,
        };
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &[10],
            mask: Some(&mask),
            sample_weights: None,
        };
        let with = cfg
            .loss_with_prior(&sd(), PredictionType::Epsilon, &inputs, Some(&prior))
            .unwrap();
        let without = cfg.loss(&sd(), PredictionType::Epsilon, &inputs).unwrap();
        assert_eq!(scalar(&with), scalar(&without));
        assert!(scalar(&with).is_finite());
    }

    /// log cosh stays finite far out (OneTrainer's `d + softplus(−2d)` form, written with
    /// `e^(2|d|)`, would overflow) and its gradient is tanh d.
    #[test]
    fn log_cosh_is_finite_far_out_and_its_gradient_is_tanh() {
        let v = candle_core::Var::new(&[0.0f32, 0.5, -3.0, 200.0], &Device::Cpu).unwrap();
        let l = log_cosh(v.as_tensor()).unwrap();
        let vals = l.to_vec1::<f32>().unwrap();
        let want = [
            0.0f64,
            0.5f64.cosh().ln(),
            3.0f64.cosh().ln(),
            200.0 - 2f64.ln(),
        ];
        for (a, b) in vals.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-5, "{vals:?}");
        }
        let g = l.sum_all().unwrap().backward().unwrap();
        let g = g.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        for (a, d) in g.iter().zip([0.0f64, 0.5, -3.0, 200.0]) {
            assert!((*a as f64 - d.tanh()).abs() < 1e-6, "{g:?}");
        }
    }

    #[test]
    fn huber_gradient_is_d_inside_and_sign_outside() {
        let v = candle_core::Var::new(&[0.5f32, -2.0, 3.0], &Device::Cpu).unwrap();
        let g = huber1(v.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = g.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, vec![0.5, -1.0, 1.0]);
    }

    #[test]
    fn mse_without_weights_is_the_plain_mean() {
        let dev = Device::Cpu;
        let pred = Tensor::new(&[[1f32, 1.0], [0.0, 2.0]], &dev).unwrap();
        let target = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &[1, 2],
            mask: None,
            sample_weights: None,
        };
        let l = LossConfig::mse().loss(&sd(), PredictionType::Epsilon, &inputs);
        assert_eq!(scalar(&l.unwrap()), 1.5);
    }

    /// A regularization sample's weight multiplies its own loss only, and the mean stays over
    /// the batch (not over the weights' sum).
    #[test]
    fn sample_weights_multiply_each_samples_loss() {
        let dev = Device::Cpu;
        let pred = Tensor::new(&[[1f32, 1.0], [0.0, 2.0]], &dev).unwrap();
        let target = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &[1, 2],
            mask: None,
            sample_weights: Some(&[1.0, 0.25]),
        };
        let l = LossConfig::mse().loss(&sd(), PredictionType::Epsilon, &inputs);
        assert_eq!(scalar(&l.unwrap()), (1.0 + 0.25 * 2.0) / 2.0);
        let bad = LossInputs {
            sample_weights: Some(&[1.0]),
            ..inputs
        };
        assert!(LossConfig::mse()
            .loss(&sd(), PredictionType::Epsilon, &bad)
            .is_err());
    }

    #[test]
    fn the_mask_weighs_and_normalises_each_sample() {
        let dev = Device::Cpu;
        let pred = Tensor::ones((1, 1, 1, 2), DType::F32, &dev).unwrap();
        let target = Tensor::zeros((1, 1, 1, 2), DType::F32, &dev).unwrap();
        let mask = Tensor::new(&[[[[1f32, 0.0]]]], &dev).unwrap();
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &[0],
            mask: Some(&mask),
            sample_weights: None,
        };
        let mut cfg = LossConfig::mse();
        let s = sd();
        assert_eq!(
            scalar(&cfg.loss(&s, PredictionType::Epsilon, &inputs).unwrap()),
            0.5
        );
        cfg.mask.unmasked_weight = 0.5;
        assert_eq!(
            scalar(&cfg.loss(&s, PredictionType::Epsilon, &inputs).unwrap()),
            0.75
        );
        cfg.mask.normalize = true;
        assert_eq!(
            scalar(&cfg.loss(&s, PredictionType::Epsilon, &inputs).unwrap()),
            1.0
        );
        let wrong = Tensor::ones((1, 1, 2, 2), DType::F32, &dev).unwrap();
        let bad = LossInputs {
            mask: Some(&wrong),
            ..inputs
        };
        assert!(cfg.loss(&s, PredictionType::Epsilon, &bad).is_err());
    }

    #[test]
    fn debiased_weights_cap_the_snr() {
        let s = sd();
        let w = debiased_weights(&s, &[0, 999], PredictionType::Epsilon, false).unwrap();
        assert!((w[0] - 1.0 / 1000f64.sqrt()).abs() < 1e-12);
        let snr = s.snr(999).unwrap();
        assert!((w[1] - 1.0 / snr.sqrt()).abs() < 1e-12);
        let v = debiased_weights(&s, &[999], PredictionType::VPrediction, false).unwrap();
        assert!((v[0] - 1.0 / (snr + 1.0)).abs() < 1e-12);
    }
}
