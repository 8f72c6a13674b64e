//! Image sampling: DDIM, Euler ancestral and DPM-Solver++ samplers with classifier-free guidance, the sample
//! prompts file, and the PNGs a run or `sdtrain sample` writes.

pub mod command;
pub mod ddim;
pub mod dpm_solver;
pub mod euler_ancestral;
pub mod generate;
pub mod image_out;
pub mod jobs;
pub mod prompts;
pub mod sampler;
pub mod scheduler_config;

pub use generate::{generate, PromptConds, SampleRequest, UnetRun};
pub use sampler::{NoiseFn, Sampler, SamplerKind};
pub use scheduler_config::{SchedulerConfig, Spacing};
