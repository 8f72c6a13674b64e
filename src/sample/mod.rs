//! Image sampling: EveryDream2's samplers (DDIM, DDPM, PNDM, Euler, Euler ancestral, DPM-Solver++
//! and the others named in `sampler.rs`) with classifier-free guidance, the sample prompts file,
//! and the PNGs a run or `sdtrain sample` writes.

pub mod a1111_syntax;
pub mod command;
pub mod compel_syntax;
pub mod ddim;
pub mod ddpm;
pub mod dpm_sde;
pub mod dpm_singlestep;
pub mod dpm_solver;
pub mod euler;
pub mod euler_ancestral;
pub mod generate;
pub mod image_out;
pub mod jobs;
pub mod kdpm2_ancestral;
pub mod kohya_prompts;
pub mod kohya_weighting;
pub mod lms;
pub mod onetrainer_samples;
pub mod pndm;
pub mod prompts;
pub mod sampler;
pub mod scheduler_config;
pub mod sigmas;
pub mod weighted_prompt;

pub use generate::{generate, PromptConds, SampleRequest, UnetRun};
pub use sampler::{NoiseFn, Sampler, SamplerKind};
pub use scheduler_config::{SchedulerConfig, Spacing};
