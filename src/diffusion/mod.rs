//! The diffusion training objective: DDPM noise schedule, targets and loss weighting.

pub mod noise_schedule;
pub mod objective;

pub use noise_schedule::{NoiseSchedule, ScheduleError};
pub use objective::{NoisedBatch, Objective, ObjectiveConfig, ObjectiveError};
