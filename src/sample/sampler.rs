//! The samplers' common interface and the names that choose them.

use candle_core::{Result, Tensor};

use super::ddim::Ddim;
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
}

impl SamplerKind {
    pub const NAMES: &'static str = "\"ddim\" or \"euler_a\"";

    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "ddim" => Some(Self::Ddim),
            "euler_a" | "euler_ancestral" | "euler-ancestral" => Some(Self::EulerAncestral),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Ddim => "ddim",
            Self::EulerAncestral => "euler_a",
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
        })
    }
}

impl std::fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
