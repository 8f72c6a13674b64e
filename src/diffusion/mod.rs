//! The diffusion training objective: DDPM noise schedule, targets, timestep draws, perturbations,
//! losses and their weighting, and the
//! seeded host noise that training and sampling draw.

pub mod generalized_offset;
pub mod loss;
pub mod noise;
pub mod noise_schedule;
pub mod objective;
pub mod perturbation;
pub mod pyramid_noise;
pub mod timesteps;
pub mod train_sampler;

pub use noise::host_randn;
pub use noise_schedule::{NoiseSchedule, ScheduleError};
pub use objective::{NoisedBatch, Objective, ObjectiveConfig, ObjectiveError};
pub use pyramid_noise::{PyramidNoise, PyramidStyle};
pub use timesteps::TimestepDistribution;
