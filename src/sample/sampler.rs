//! The samplers' common interface and the names that choose them.

use candle_core::{Result, Tensor};

use super::ddim::Ddim;
use super::ddpm::Ddpm;
use super::dpm_sde::DpmSde;
use super::dpm_singlestep::DpmSinglestep;
use super::dpm_solver::{DpmSolver, DpmVariant};
use super::euler::Euler;
use super::euler_ancestral::EulerAncestral;
use super::kdpm2_ancestral::Kdpm2Ancestral;
use super::lms::Lms;
use super::pndm::Pndm;
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
    /// The σ table as diffusers' scheduler keeps it (`scheduler.sigmas`), for the samplers that
    /// have one.
    fn sigmas(&self) -> Option<&[f64]>;
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
    /// `ddpm`: DDPM's ancestral sampling.
    Ddpm,
    /// `pndm`: PLMS (or F-PNDM when the config keeps the Runge–Kutta steps).
    Pndm,
    /// `euler`: Euler.
    Euler,
    /// `euler_a`: Euler ancestral.
    EulerAncestral,
    /// `lms`: linear multistep.
    Lms,
    /// `kdpm2`: DPM-Solver-2 ancestral (EveryDream2 builds diffusers' ancestral class).
    Kdpm2Ancestral,
    /// `dpm++` / `dpm++_2m`, `dpm++_2m_k`, `dpm++_2m_sde`, `dpm++_2m_sde_k`: DPM-Solver++
    /// multistep (`sde`: its stochastic form; `karras`: Karras sigmas).
    DpmSolver(DpmVariant),
    /// `dpm++_2s`, `dpm++_2s_k`: DPM-Solver++ single-step (`karras`: Karras sigmas).
    DpmSinglestep { karras: bool },
    /// `dpm++_sde`, `dpm++_sde_k`: DPM-Solver++ SDE (`karras`: Karras sigmas).
    DpmSde { karras: bool },
}

impl SamplerKind {
    pub const NAMES: &'static str = "\"ddim\", \"ddpm\", \"pndm\", \"euler\", \"euler_a\", \
        \"lms\", \"kdpm2\", \"dpm++\" (\"dpm++_2m\"), \"dpm++_2m_k\", \"dpm++_2m_sde\", \"dpm++_2m_sde_k\", \
        \"dpm++_2s\", \"dpm++_2s_k\", \"dpm++_sde\" or \"dpm++_sde_k\"";

    pub fn parse(name: &str) -> Option<Self> {
        let dpm = |sde, karras| Some(Self::DpmSolver(DpmVariant { sde, karras }));
        match name.to_ascii_lowercase().as_str() {
            "ddim" => Some(Self::Ddim),
            "ddpm" => Some(Self::Ddpm),
            "pndm" | "plms" => Some(Self::Pndm),
            "euler" => Some(Self::Euler),
            "lms" => Some(Self::Lms),
            "kdpm2" | "kdpm2_a" | "kdpm2_ancestral" => Some(Self::Kdpm2Ancestral),
            "euler_a" | "euler_ancestral" | "euler-ancestral" => Some(Self::EulerAncestral),
            "dpm++" | "dpm++_2m" | "dpmpp_2m" => dpm(false, false),
            "dpm++_2m_k" | "dpmpp_2m_karras" => dpm(false, true),
            "dpm++_2m_sde" | "dpmpp_2m_sde" => dpm(true, false),
            "dpm++_2m_sde_k" | "dpmpp_2m_sde_karras" => dpm(true, true),
            "dpm++_2s" | "dpmpp_2s" => Some(Self::DpmSinglestep { karras: false }),
            "dpm++_2s_k" | "dpmpp_2s_karras" => Some(Self::DpmSinglestep { karras: true }),
            "dpm++_sde" | "dpmpp_sde" => Some(Self::DpmSde { karras: false }),
            "dpm++_sde_k" | "dpmpp_sde_karras" => Some(Self::DpmSde { karras: true }),
            _ => None,
        }
    }

    /// Why `name` is not a sampler: the samplers there are.
    pub fn unknown(name: &str) -> String {
        format!("is \"{name}\"; the samplers are {}", Self::NAMES)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Ddim => "ddim",
            Self::Ddpm => "ddpm",
            Self::Pndm => "pndm",
            Self::Euler => "euler",
            Self::Lms => "lms",
            Self::Kdpm2Ancestral => "kdpm2",
            Self::EulerAncestral => "euler_a",
            Self::DpmSolver(DpmVariant { sde, karras }) => match (sde, karras) {
                (false, false) => "dpm++_2m",
                (false, true) => "dpm++_2m_k",
                (true, false) => "dpm++_2m_sde",
                (true, true) => "dpm++_2m_sde_k",
            },
            Self::DpmSinglestep { karras: false } => "dpm++_2s",
            Self::DpmSinglestep { karras: true } => "dpm++_2s_k",
            Self::DpmSde { karras: false } => "dpm++_sde",
            Self::DpmSde { karras: true } => "dpm++_sde_k",
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
            Self::Ddpm => Box::new(Ddpm::new(config, steps)?),
            Self::Pndm => Box::new(Pndm::new(config, steps)?),
            Self::Euler => Box::new(Euler::new(config, steps)?),
            Self::Lms => Box::new(Lms::new(config, steps)?),
            Self::Kdpm2Ancestral => Box::new(Kdpm2Ancestral::new(config, steps)?),
            Self::EulerAncestral => Box::new(EulerAncestral::new(config, steps)),
            Self::DpmSolver(v) => Box::new(DpmSolver::new(config, steps, v)),
            Self::DpmSinglestep { karras } => Box::new(DpmSinglestep::new(config, steps, karras)?),
            Self::DpmSde { karras } => Box::new(DpmSde::new(config, steps, karras)?),
        })
    }
}

impl std::fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::scheduler_config::test_config;

    /// Config values a sampler's diffusers class would read but sdtrain does not follow are
    /// refused, naming the file and the field; the same config builds the samplers that do not
    /// read them. Catches a refusal dropped (the sampler would silently draw something else).
    #[test]
    fn config_values_a_sampler_cannot_follow_are_refused_naming_the_field() {
        let cases = [
            (
                "euler",
                serde_json::json!({"interpolation_type": "log_linear"}),
                10,
                "interpolation_type",
            ),
            (
                "euler",
                serde_json::json!({"timestep_type": "continuous", "prediction_type": "v_prediction"}),
                10,
                "timestep_type",
            ),
            (
                "ddpm",
                serde_json::json!({"variance_type": "learned_range"}),
                10,
                "variance_type",
            ),
            (
                "pndm",
                serde_json::json!({"rescale_betas_zero_snr": true}),
                10,
                "rescale_betas_zero_snr",
            ),
            (
                "pndm",
                serde_json::json!({"skip_prk_steps": false}),
                3,
                "skip_prk_steps",
            ),
            (
                "ddpm",
                serde_json::json!({"steps_offset": 200}),
                1000,
                "steps_offset",
            ),
        ];
        for (name, extra, steps, field) in cases {
            let cfg = test_config(extra);
            let kind = SamplerKind::parse(name).unwrap();
            let err = kind
                .build(&cfg, steps)
                .err()
                .unwrap_or_else(|| panic!("{name} built"));
            assert!(
                err.starts_with("m/scheduler_config.json: `") && err.contains(field),
                "{name}: {err}"
            );
            assert!(SamplerKind::Ddim.build(&cfg, steps.min(10)).is_ok());
        }
    }

    /// The configs diffusers writes for UniPC and DEIS (a model may ship either) build every
    /// sampler: their `solver_type` (`bh2`, `logrho`) is DPM-Solver's `midpoint`, as diffusers'
    /// DPM-Solver classes map it. Catches the DPM field check refusing the whole file.
    #[test]
    fn unipc_and_deis_configs_build_every_sampler() {
        for extra in [
            serde_json::json!({"solver_type": "bh2", "predict_x0": true, "disable_corrector": [],
                "solver_p": null, "solver_order": 2, "lower_order_final": true}),
            serde_json::json!({"solver_type": "logrho", "algorithm_type": "deis",
                "solver_order": 2, "lower_order_final": true}),
        ] {
            let cfg = test_config(extra.clone());
            assert_eq!(cfg.dpm.heun, Some(false), "{extra}");
            for name in [
                "ddim",
                "euler",
                "euler_a",
                "dpm++_2m",
                "dpm++_2m_k",
                "dpm++_2s",
            ] {
                let kind = SamplerKind::parse(name).unwrap();
                assert!(kind.build(&cfg, 10).is_ok(), "{name} on {extra}");
            }
        }
    }
}
