//! The samplers' common interface and the names that choose them.

use candle_core::{Result, Tensor};

use super::ddim::Ddim;
use super::dpm_solver::{DpmSolver, DpmVariant};
use super::euler_ancestral::EulerAncestral;
use super::scheduler_config::SchedulerConfig;

/// Draws standard normal noise of a shape (the ancestral sampler's per-step noise).
pub type NoiseFn<'a> = dyn FnMut(&[usize]) -> Result<Tensor> + 'a;

/// One inference schedule, set for a number of steps: what diffusers' schedulers do after
/// `set_timesteps`.
pub trait Sampler {
    /// The timestep the model sees at each step (descending; fractional for Euler).
    fn timesteps(&self) -> &[f64];
    /// The initial latents are standard normal noise times this.
    fn init_noise_sigma(&self) -> f64;
    /// The model's input at step `i` for the current latents.
    fn scale_model_input(&self, sample: &Tensor, i: usize) -> Result<Tensor>;
    /// The latents after step `i`, from the model's (guided) output. `noise` is called once per
    /// step by samplers that add noise.
    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor>;
}

/// A sampler by name: EveryDream2's sample-config names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerKind {
    /// `ddim`: deterministic DDIM (η = 0), EveryDream2's default.
    Ddim,
    /// `euler_a`: Euler ancestral.
    EulerAncestral,
    /// `dpm++` / `dpm++_2m`, `dpm++_2m_k`, `dpm++_2m_sde`, `dpm++_2m_sde_k`: DPM-Solver++
    /// multistep (`sde`: its stochastic form; `karras`: Karras sigmas).
    DpmSolver(DpmVariant),
}

/// EveryDream2's sampler names that sdtrain does not draw with yet, and what to use instead.
const NOT_YET: [&str; 9] = [
    "pndm",
    "ddpm",
    "lms",
    "euler",
    "kdpm2",
    "dpm++_2s",
    "dpm++_2s_k",
    "dpm++_sde",
    "dpm++_sde_k",
];

impl SamplerKind {
    pub const NAMES: &'static str = "\"ddim\", \"euler_a\", \"dpm++\" (\"dpm++_2m\"), \
        \"dpm++_2m_k\", \"dpm++_2m_sde\" or \"dpm++_2m_sde_k\"";

    pub fn parse(name: &str) -> Option<Self> {
        let dpm = |sde, karras| Some(Self::DpmSolver(DpmVariant { sde, karras }));
        match name.to_ascii_lowercase().as_str() {
            "ddim" => Some(Self::Ddim),
            "euler_a" | "euler_ancestral" | "euler-ancestral" => Some(Self::EulerAncestral),
            "dpm++" | "dpm++_2m" | "dpmpp_2m" => dpm(false, false),
            "dpm++_2m_k" | "dpmpp_2m_karras" => dpm(false, true),
            "dpm++_2m_sde" | "dpmpp_2m_sde" => dpm(true, false),
            "dpm++_2m_sde_k" | "dpmpp_2m_sde_karras" => dpm(true, true),
            _ => None,
        }
    }

    /// Why `name` is not a sampler: an EveryDream2 name sdtrain does not draw with yet, or an
    /// unknown one; both list the ones it has.
    pub fn unknown(name: &str) -> String {
        if NOT_YET.contains(&name.to_ascii_lowercase().as_str()) {
            format!(
                "is \"{name}\", an EveryDream2 sampler sdtrain does not draw with yet; the samplers \
                 are {}",
                Self::NAMES
            )
        } else {
            format!("is \"{name}\"; the samplers are {}", Self::NAMES)
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Ddim => "ddim",
            Self::EulerAncestral => "euler_a",
            Self::DpmSolver(DpmVariant { sde, karras }) => match (sde, karras) {
                (false, false) => "dpm++_2m",
                (false, true) => "dpm++_2m_k",
                (true, false) => "dpm++_2m_sde",
                (true, true) => "dpm++_2m_sde_k",
            },
        }
    }

    /// The sampler for `steps` inference steps on the model's schedule.
    pub fn build(
        self,
        config: &SchedulerConfig,
        steps: usize,
    ) -> std::result::Result<Box<dyn Sampler>, String> {
        let train = config.schedule.num_train_timesteps();
        if steps == 0 || steps > train {
            return Err(format!(
                "{steps} sampling steps: the model's schedule ({}) has {train}, and at least one \
                 is needed",
                config.file.display()
            ));
        }
        Ok(match self {
            Self::Ddim => Box::new(Ddim::new(config, steps)),
            Self::EulerAncestral => Box::new(EulerAncestral::new(config, steps)),
            Self::DpmSolver(v) => Box::new(DpmSolver::new(config, steps, v)),
        })
    }
}

impl std::fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
