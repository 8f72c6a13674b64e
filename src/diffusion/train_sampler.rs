//! EveryDream2's `train_sampler`: the diffusers scheduler class its training noise comes from,
//! built from the model's `scheduler_config.json` (EveryDream2 `train.py`
//! `get_training_noise_scheduler`: `PNDMScheduler`, `DDIMScheduler`, else `DDPMScheduler`).
//!
//! Training uses only `alphas_cumprod`, `add_noise` and `get_velocity`. In diffusers 0.42.1 the
//! three classes compute `add_noise` identically, and DDPM's and DDIM's `get_velocity` are
//! identical, from the same betas (tests/fixtures/loss_reference.py checks them on the fixture
//! configs, with and without zero-terminal-SNR `trained_betas`). Two differences remain:
//! - `PNDMScheduler` has no `get_velocity`, so EveryDream2 fails on a v-prediction model with
//!   `pndm`: refused here with that reason;
//! - `PNDMScheduler` does not take `rescale_betas_zero_snr` (diffusers drops the key with a
//!   warning), so a config that sets it trains on the schedule without the rescale, as
//!   EveryDream2 would. (`enable_zero_terminal_snr` is applied on top, as EveryDream2's
//!   `trained_betas`.)

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::noise_schedule::{NoiseSchedule, ScheduleError};
use crate::model::family::PredictionType;

/// The training noise scheduler's class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainSampler {
    Ddpm,
    Ddim,
    Pndm,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainSamplerError {
    #[error(
        "train_sampler \"pndm\" on a v-prediction model: diffusers' PNDMScheduler has no \
         get_velocity, so EveryDream2 fails here too; use \"ddpm\" or \"ddim\" (the same \
         training noise)"
    )]
    PndmVelocity,
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

impl TrainSampler {
    /// EveryDream2's names, any case (it lowercases them).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "ddpm" => Some(Self::Ddpm),
            "ddim" => Some(Self::Ddim),
            "pndm" => Some(Self::Pndm),
            _ => None,
        }
    }

    /// The training schedule this class builds from the scheduler config `config` (read from
    /// `file`).
    pub fn schedule(
        &self,
        config: &Value,
        file: &Path,
    ) -> Result<NoiseSchedule, TrainSamplerError> {
        let schedule = match self {
            Self::Ddpm | Self::Ddim => NoiseSchedule::from_config(config, file)?,
            Self::Pndm => {
                let mut config = config.clone();
                if let Some(map) = config.as_object_mut() {
                    map.remove("rescale_betas_zero_snr");
                }
                NoiseSchedule::from_config(&config, file)?
            }
        };
        if *self == Self::Pndm && schedule.prediction_type() == PredictionType::VPrediction {
            return Err(TrainSamplerError::PndmVelocity);
        }
        Ok(schedule)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pndm_drops_the_rescale_and_refuses_v_prediction() {
        let cfg = json!({
            "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
            "rescale_betas_zero_snr": true
        });
        let file = Path::new("scheduler_config.json");
        let ddpm = TrainSampler::Ddpm.schedule(&cfg, file).unwrap();
        let pndm = TrainSampler::Pndm.schedule(&cfg, file).unwrap();
        assert_eq!(ddpm.alphas_cumprod()[999], 0.0);
        assert!(pndm.alphas_cumprod()[999] > 0.004);
        let v = json!({"prediction_type": "v_prediction"});
        assert!(TrainSampler::Ddim.schedule(&v, file).is_ok());
        assert!(matches!(
            TrainSampler::Pndm.schedule(&v, file),
            Err(TrainSamplerError::PndmVelocity)
        ));
        assert_eq!(TrainSampler::parse("DDIM"), Some(TrainSampler::Ddim));
        assert_eq!(TrainSampler::parse("euler"), None);
    }
}
