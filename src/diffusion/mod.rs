//! The diffusion training objective: DDPM noise schedule, targets and loss weighting, and the
//! seeded host noise that training and sampling draw.

pub mod noise;
pub mod noise_schedule;
pub mod objective;
pub mod pyramid_noise;

pub use noise::host_randn;
pub use noise_schedule::{NoiseSchedule, ScheduleError};
pub use objective::{NoisedBatch, Objective, ObjectiveConfig, ObjectiveError};
pub use pyramid_noise::{PyramidNoise, PyramidStyle};
