//! [`OptimizerPlan`]: the two fully resolved parameter groups (`unet`, `text_encoder`) built from
//! an [`OptimizerFile`] and train.json's `lr`, following EveryDream2's
//! `EveryDreamOptimizer.get_final_optimizer_configs` and `_create_optimizer`
//! (optimizer/optimizers.py):
//!
//! - UNet = `base`; text encoder = `text_encoder_overrides`, each `null` inheriting from `base`.
//!   Unlike EveryDream2's Python `or`, an explicit 0 is kept (STYLE.md).
//! - An `lr` in train.json overrides the lr of **both** groups, the text encoder's override
//!   included ("override for legacy support reasons" in EveryDream2).
//! - Defaults when neither file sets a value: lr 1e-6, betas (0.9, 0.999), epsilon 1e-8,
//!   weight_decay 0.01, scheduler constant (EveryDream2's `LR_DEFAULT`, `BETAS_DEFAULT`,
//!   `EPSILON_DEFAULT`, `WEIGHT_DECAY_DEFAULT` and `--lr_scheduler` default). The optimizer
//!   defaults to adamw8bit, as in EveryDream2; Lion's betas default to the paper's (0.9, 0.99).
//! - Warmup and decay lengths that are not set are automatic, and only become numbers once the
//!   training length is known: see [`ScheduleSpec::resolve`].

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Serialize, Serializer};

use super::error::ConfigError;
use super::optimizer_file::{GroupFile, OptimizerFile};
use super::sf_came_plan::{
    check_came, check_schedule, check_schedulefree, CamePlan, ScheduleFreePlan, CAME_BETAS_DEFAULT,
};
use crate::optim::AdafactorParams;

/// EveryDream2's `LR_DEFAULT`.
pub const LR_DEFAULT: f64 = 1e-6;
/// EveryDream2's `BETAS_DEFAULT`.
pub const BETAS_DEFAULT: (f64, f64) = (0.9, 0.999);
/// EveryDream2's `EPSILON_DEFAULT`.
pub const EPSILON_DEFAULT: f64 = 1e-8;
/// EveryDream2's `WEIGHT_DECAY_DEFAULT`.
pub const WEIGHT_DECAY_DEFAULT: f64 = 0.01;
/// An automatic decay length is this times the training length (EveryDream2 train.py: "sets
/// cosine so the zero crossing is past the end of training, this results in a terminal LR that is
/// about 25% of the nominal LR").
pub const AUTO_DECAY_FACTOR: f64 = 1.5;
/// An automatic warmup is the automatic decay length divided by this (EveryDream2: "set warmup to
/// 2% of decay").
pub const AUTO_WARMUP_DIVISOR: u64 = 50;

/// The optimizers sdtrain implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// torch.optim.AdamW semantics (decoupled weight decay, bias correction, amsgrad off).
    #[serde(rename = "adamw")]
    AdamW,
    /// bitsandbytes' AdamW8bit: blockwise 8-bit moments (EveryDream2's default).
    #[serde(rename = "adamw8bit")]
    AdamW8bit,
    /// Lion with an f32 momentum (lucidrains' lion-pytorch, EveryDream2's `lion`).
    Lion,
    /// Lion with a blockwise 8-bit momentum (bitsandbytes' Lion8bit).
    Lion8bit,
    /// transformers' Adafactor with an external lr.
    Adafactor,
    /// prodigyopt's Prodigy (lr is a multiplier of the estimated step, 1 by default).
    Prodigy,
    /// The dadaptation package's D-Adaptation Adam, Adan, Lion and SGD.
    DadaptAdam,
    DadaptAdan,
    DadaptLion,
    DadaptSgd,
    /// The dowg package's coordinate-wise and scalar DoWG (no lr).
    CoordinateDowg,
    ScalarDowg,
    /// EveryDream2's AdaCoor (no lr).
    Adacoor,
    /// The schedulefree package's AdamWScheduleFree (its own warmup; no lr schedule).
    #[serde(rename = "adamw_schedulefree")]
    AdamWScheduleFree,
    /// came-pytorch's CAME, and the same with 8-bit full-size moments.
    Came,
    #[serde(rename = "came8bit")]
    Came8bit,
}

impl OptimizerKind {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::AdamW8bit => "adamw8bit",
            OptimizerKind::Lion => "lion",
            OptimizerKind::Lion8bit => "lion8bit",
            OptimizerKind::Adafactor => "adafactor",
            OptimizerKind::Prodigy => "prodigy",
            OptimizerKind::DadaptAdam => "dadapt_adam",
            OptimizerKind::DadaptAdan => "dadapt_adan",
            OptimizerKind::DadaptLion => "dadapt_lion",
            OptimizerKind::DadaptSgd => "dadapt_sgd",
            OptimizerKind::CoordinateDowg => "coordinate_dowg",
            OptimizerKind::ScalarDowg => "scalar_dowg",
            OptimizerKind::Adacoor => "adacoor",
            OptimizerKind::AdamWScheduleFree => "adamw_schedulefree",
            OptimizerKind::Came => "came",
            OptimizerKind::Came8bit => "came8bit",
        }
    }

    /// Every optimizer, in the order the docs list them.
    pub const ALL: [OptimizerKind; 16] = [
        OptimizerKind::AdamW,
        OptimizerKind::AdamW8bit,
        OptimizerKind::Lion,
        OptimizerKind::Lion8bit,
        OptimizerKind::Adafactor,
        OptimizerKind::Prodigy,
        OptimizerKind::DadaptAdam,
        OptimizerKind::DadaptAdan,
        OptimizerKind::DadaptLion,
        OptimizerKind::DadaptSgd,
        OptimizerKind::CoordinateDowg,
        OptimizerKind::ScalarDowg,
        OptimizerKind::Adacoor,
        OptimizerKind::AdamWScheduleFree,
        OptimizerKind::Came,
        OptimizerKind::Came8bit,
    ];

    /// Whether a parameter's learning rate can be scaled on its own (LoRA+): the optimizers
    /// whose step uses the learning rate directly, with no group-wide step scalars (the
    /// learning-rate-free ones estimate the step for the whole group; schedule-free AdamW
    /// weighs its average by the group's largest rate).
    pub fn scales_per_parameter(self) -> bool {
        matches!(
            self,
            OptimizerKind::AdamW
                | OptimizerKind::AdamW8bit
                | OptimizerKind::Lion
                | OptimizerKind::Lion8bit
                | OptimizerKind::Adafactor
                | OptimizerKind::Came
                | OptimizerKind::Came8bit
        )
    }

    /// Why the optimizer cannot run inside a fused backward pass, if it cannot: its update
    /// needs sums over every gradient of the step before it changes any parameter.
    pub fn refuses_fused_backward(self) -> Option<&'static str> {
        match self {
            OptimizerKind::DadaptSgd => {
                Some("its first step scales every update by the norm of all the gradients together")
            }
            OptimizerKind::ScalarDowg => {
                Some("each update is divided by a sum over all the gradients of the step")
            }
            _ => None,
        }
    }

    /// The betas when neither group sets them: Lion's paper values for Lion, EveryDream2's
    /// `BETAS_DEFAULT` otherwise (Adafactor uses no betas).
    pub fn default_betas(self) -> (f64, f64) {
        match self {
            OptimizerKind::Lion | OptimizerKind::Lion8bit => (0.9, 0.99),
            OptimizerKind::DadaptAdan => (0.98, 0.92),
            _ => BETAS_DEFAULT,
        }
    }
}

/// Adafactor's settings (the `adafactor` object of a group). The defaults are the optimizer's
/// own, [`AdafactorParams::default`]: transformers' with `scale_parameter` off for an external
/// lr (kohya's recommendation). The weight decay is the group's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdafactorPlan {
    pub eps: (f64, f64),
    pub clip_threshold: f64,
    pub decay_rate: f64,
    pub beta1: Option<f64>,
    pub scale_parameter: bool,
}

impl From<AdafactorParams> for AdafactorPlan {
    fn from(p: AdafactorParams) -> Self {
        Self {
            eps: p.eps,
            clip_threshold: p.clip_threshold,
            decay_rate: p.decay_rate,
            beta1: p.beta1,
            scale_parameter: p.scale_parameter,
        }
    }
}

impl Default for AdafactorPlan {
    fn default() -> Self {
        AdafactorParams::default().into()
    }
}

/// The names accepted in `optimizer`, for error messages.
const OPTIMIZER_NAMES: &str = "adamw, adamw8bit, lion, lion8bit, adafactor, prodigy, dadapt_adam, \
     dadapt_adan, dadapt_lion, dadapt_sgd, coordinate_dowg, scalar_dowg, adacoor, adamw_schedulefree, \
     came, came8bit";

/// D-Adaptation Adan's third beta when `betas` is not set (the dadaptation package's).
pub const ADAN_BETA3_DEFAULT: f64 = 0.99;

/// The step-size estimators' settings (Prodigy, D-Adaptation), read from the group's section
/// as EveryDream2 reads them. Defaults are EveryDream2's `_create_optimizer` values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EstimatorPlan {
    /// The starting estimate of the step (1e-6).
    pub d0: f64,
    /// Decoupled weight decay (true; prodigy and dadapt_adam).
    pub decouple: bool,
    /// The most `d` may grow per step (∞, written `null`).
    pub growth_rate: f64,
    /// dadapt_sgd's momentum (0).
    pub momentum: f64,
    /// dadapt_adan's decay form (false).
    pub no_prox: bool,
    /// prodigy's `safeguard_warmup` (true).
    pub safeguard_warmup: bool,
    /// Bias correction in `d·lr`: `None` is the optimizer's EveryDream2 default (true for
    /// prodigy, which EveryDream2 passes; false for dadapt_adam, which it does not).
    pub use_bias_correction: Option<bool>,
    /// The third beta, when `betas` has three numbers (dadapt_adan's β3, prodigy's β3, which
    /// defaults to √β2).
    pub beta3: Option<f64>,
}

impl Default for EstimatorPlan {
    fn default() -> Self {
        Self {
            d0: 1e-6,
            decouple: true,
            growth_rate: f64::INFINITY,
            momentum: 0.0,
            no_prox: false,
            safeguard_warmup: true,
            use_bias_correction: None,
            beta3: None,
        }
    }
}

/// LR schedules (diffusers' `get_scheduler` names), each with a linear warmup from 0: the
/// optimizer's own enum, so the plan and the schedule cannot drift apart.
pub use crate::optim::{Ramp, ScheduleKind, ScheduleShape};

/// A warmup or decay length: a number of steps, or automatic (decided by the training length).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepCount {
    Auto,
    Steps(u64),
    /// The run's length (kohya's and diffusers' `num_training_steps`).
    Run,
    /// This fraction of the run's length, rounded down (kohya's float `lr_warmup_steps`:
    /// `int(ratio · num_training_steps)`).
    RunFraction(f64),
}

impl Serialize for StepCount {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StepCount::Auto => s.serialize_str("auto"),
            StepCount::Steps(n) => s.serialize_u64(*n),
            StepCount::Run => s.serialize_str("run"),
            StepCount::RunFraction(f) => s.serialize_str(&format!("{f} of the run")),
        }
    }
}

impl fmt::Display for StepCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepCount::Auto => f.write_str("auto"),
            StepCount::Steps(n) => write!(f, "{n}"),
            StepCount::Run => f.write_str("the run's steps"),
            StepCount::RunFraction(x) => write!(f, "{x} of the run's steps"),
        }
    }
}

/// A learning-rate schedule as configured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScheduleSpec {
    pub kind: ScheduleKind,
    pub warmup_steps: StepCount,
    pub decay_steps: StepCount,
    /// `cosine_with_restarts`' cycles, `cosine_with_min_lr`'s and `warmup_stable_decay`'s half
    /// cosines (1 for the other kinds).
    pub num_cycles: f64,
    /// polynomial's power (1 for the other kinds).
    pub power: f64,
    /// warmup_stable_decay's final decay (`lr_wsd_decay_steps`); `Steps(0)` for the other kinds.
    pub decay_phase: StepCount,
    /// The other kinds' settings; `shape.decay_phase_steps` is set by [`Self::resolve`].
    pub shape: ScheduleShape,
}

/// A schedule with every length a number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ResolvedSchedule {
    pub kind: ScheduleKind,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub num_cycles: f64,
    pub power: f64,
    pub shape: ScheduleShape,
}

impl ResolvedSchedule {
    /// The optimizer's schedule of these lengths and settings.
    pub fn lr_schedule(&self) -> crate::optim::LrSchedule {
        crate::optim::LrSchedule {
            kind: self.kind,
            warmup_steps: self.warmup_steps as usize,
            decay_steps: self.decay_steps as usize,
            num_cycles: self.num_cycles,
            power: self.power,
            shape: self.shape,
        }
    }
}

impl ScheduleSpec {
    /// Fixes the automatic lengths for a run of `total_steps` scheduler steps, as EveryDream2
    /// (train.py/optimizers.py) does:
    /// - decay: `floor(1.5 · total_steps)`, so a cosine ends near 25% of the peak lr instead of 0;
    /// - warmup: `floor(auto_decay / 50)` (≈ 3% of training), computed from the automatic decay
    ///   even when the decay is set, as EveryDream2 does; 0 for `constant`, because EveryDream2's
    ///   `constant` (diffusers) has no warmup. An explicit warmup applies to every kind.
    pub fn resolve(&self, total_steps: u64) -> ResolvedSchedule {
        let auto_decay = ((total_steps as f64) * AUTO_DECAY_FACTOR).floor() as u64;
        let of_run = |f: f64| ((total_steps as f64) * f).floor() as u64;
        let decay_steps = match self.decay_steps {
            StepCount::Steps(n) => n,
            // warmup_stable_decay's decay is the run's last steps, so it ends with the run.
            StepCount::Auto if self.kind == ScheduleKind::WarmupStableDecay => total_steps,
            StepCount::Auto => auto_decay,
            StepCount::Run => total_steps,
            StepCount::RunFraction(f) => of_run(f),
        };
        let warmup_steps = match (self.warmup_steps, self.kind) {
            (StepCount::Steps(n), _) => n,
            (StepCount::Run, _) => total_steps,
            (StepCount::RunFraction(f), _) => of_run(f),
            (StepCount::Auto, ScheduleKind::Constant) => 0,
            (StepCount::Auto, _) => auto_decay / AUTO_WARMUP_DIVISOR,
        };
        let shape = ScheduleShape {
            decay_phase_steps: match self.decay_phase {
                StepCount::Steps(n) => n,
                StepCount::Run => decay_steps,
                StepCount::RunFraction(f) => of_run(f),
                StepCount::Auto => 0,
            },
            ..self.shape
        };
        ResolvedSchedule {
            kind: self.kind,
            warmup_steps,
            decay_steps,
            num_cycles: self.num_cycles,
            power: self.power,
            shape,
        }
    }
}

/// One parameter group's optimizer settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ParamGroupPlan {
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub betas: (f64, f64),
    pub epsilon: f64,
    pub weight_decay: f64,
    pub schedule: ScheduleSpec,
    pub adafactor: AdafactorPlan,
    pub estimator: EstimatorPlan,
    pub schedulefree: ScheduleFreePlan,
    pub came: CamePlan,
}

impl fmt::Display for ParamGroupPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} lr {:e}, betas ({}, {}), epsilon {:e}, weight_decay {}; {} schedule, warmup {}, \
             decay {}",
            self.optimizer.name(),
            self.lr,
            self.betas.0,
            self.betas.1,
            self.epsilon,
            self.weight_decay,
            self.schedule.kind.name(),
            self.schedule.warmup_steps,
            self.schedule.decay_steps
        )?;
        let s = &self.schedule;
        if s.kind.takes_cycles() {
            write!(f, ", {} cycles", s.num_cycles)?;
        }
        if s.kind == ScheduleKind::Polynomial {
            write!(f, ", power {}", s.power)?;
            if s.shape.lr_end != crate::optim::LrSchedule::POLYNOMIAL_LR_END {
                write!(f, ", end lr {:e}", s.shape.lr_end)?;
            }
        }
        if s.kind.takes_min_lr() && s.shape.min_lr_ratio > 0.0 {
            write!(f, ", floor {} of the lr", s.shape.min_lr_ratio)?;
        }
        if let (ScheduleKind::InverseSqrt, Some(t)) = (s.kind, s.shape.timescale) {
            write!(f, ", timescale {t}")?;
        }
        if s.kind == ScheduleKind::WarmupStableDecay {
            write!(
                f,
                ", {} warmup, {} decay over {}",
                s.shape.warmup_ramp, s.shape.decay_ramp, s.decay_phase
            )?;
        }
        Ok(())
    }
}

/// Both parameter groups, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OptimizerPlan {
    /// The optimizer.json read; `None` when the built-in default was used.
    pub source: Option<PathBuf>,
    pub unet: ParamGroupPlan,
    pub text_encoder: ParamGroupPlan,
    /// EveryDream2's `apply_grad_scaler_step_tweaks`: retune the fp16 loss scaler at steps 500,
    /// 1000, 2000 and 4000 (no effect in bf16 or f32, which have no scaler).
    pub grad_scaler_step_tweaks: bool,
    /// Log the gradient norm of each step (EveryDream2's `log_grad_norm`, default true).
    pub log_grad_norm: bool,
}

impl OptimizerPlan {
    /// kohya's schedule lengths: every group decays over the run, and warms up for
    /// `warmup_fraction` of the run when given, instead of its written steps.
    pub fn with_run_lengths(mut self, warmup_fraction: Option<f64>) -> Self {
        for g in [&mut self.unet, &mut self.text_encoder] {
            g.schedule.decay_steps = StepCount::Run;
            if let Some(f) = warmup_fraction {
                g.schedule.warmup_steps = StepCount::RunFraction(f);
            }
        }
        self
    }
}

/// train.json's `lr_scheduler`, `lr_warmup_steps` and `lr_decay_steps`: the values the
/// optimizer config's `base` section falls back to (EveryDream2's `get_final_optimizer_configs`:
/// `base_config.get(key) or args.key`), and through it the text encoder.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrainScheduleKeys {
    pub lr_scheduler: Option<ScheduleKind>,
    pub lr_warmup_steps: Option<u64>,
    pub lr_decay_steps: Option<u64>,
}

impl TrainScheduleKeys {
    /// Checks the three keys of train.json (`file`).
    pub fn check(
        lr_scheduler: Option<&str>,
        lr_warmup_steps: Option<i64>,
        lr_decay_steps: Option<i64>,
        file: &Path,
    ) -> Result<Self, ConfigError> {
        let steps = |key: &str, v: Option<i64>| match v {
            Some(n) if n < 0 => Err(invalid(file, key, &format!("must be 0 or more (got {n})"))),
            _ => Ok(v.map(i64::unsigned_abs)),
        };
        Ok(Self {
            lr_scheduler: lr_scheduler
                .map(|name| parse_schedule(name, file, "lr_scheduler"))
                .transpose()?,
            lr_warmup_steps: steps("lr_warmup_steps", lr_warmup_steps)?,
            lr_decay_steps: steps("lr_decay_steps", lr_decay_steps)?,
        })
    }

    /// As a section of the optimizer config: only the schedule is set.
    fn as_group(&self) -> CheckedGroup {
        CheckedGroup {
            schedule: self.lr_scheduler,
            warmup: self.lr_warmup_steps.map(StepCount::Steps),
            decay: self.lr_decay_steps.map(|n| match n {
                0 => StepCount::Auto,
                n => StepCount::Steps(n),
            }),
            ..CheckedGroup::default()
        }
    }
}

/// A section's values after validation; `None` inherits.
#[derive(Default)]
struct CheckedGroup {
    optimizer: Option<OptimizerKind>,
    lr: Option<f64>,
    schedule: Option<ScheduleKind>,
    warmup: Option<StepCount>,
    decay: Option<StepCount>,
    num_cycles: Option<f64>,
    power: Option<f64>,
    min_lr_ratio: Option<f64>,
    timescale: Option<u64>,
    decay_phase: Option<StepCount>,
    warmup_ramp: Option<Ramp>,
    decay_ramp: Option<Ramp>,
    lr_end: Option<f64>,
    betas: Option<(f64, f64, Option<f64>)>,
    epsilon: Option<f64>,
    weight_decay: Option<f64>,
    adafactor: Option<AdafactorPlan>,
    schedulefree: Option<ScheduleFreePlan>,
    came: Option<CamePlan>,
    d0: Option<f64>,
    decouple: Option<bool>,
    growth_rate: Option<f64>,
    momentum: Option<f64>,
    no_prox: Option<bool>,
    safeguard_warmup: Option<bool>,
    use_bias_correction: Option<bool>,
}

impl OptimizerPlan {
    /// Resolves both groups. `file` names the optimizer config in errors; `source` is recorded in
    /// the plan. `train_lr` is train.json's `lr`, already validated, which overrides both groups;
    /// `train_schedule` holds train.json's schedule keys, which `base` falls back to.
    pub fn resolve(
        config: &OptimizerFile,
        file: &Path,
        source: Option<PathBuf>,
        train_lr: Option<f64>,
        train_schedule: TrainScheduleKeys,
    ) -> Result<OptimizerPlan, ConfigError> {
        let empty = GroupFile::default();
        let base = check_group(config.base.as_ref().unwrap_or(&empty), "base", file)?;
        let base = base.over(&train_schedule.as_group());
        let text = check_group(
            config.text_encoder_overrides.as_ref().unwrap_or(&empty),
            "text_encoder_overrides",
            file,
        )?;
        let no_parent = CheckedGroup::default();
        let unet = merge(&base, &no_parent, train_lr, file, "base")?;
        let mut text_encoder = merge(&text, &base, train_lr, file, "text_encoder_overrides")?;
        if let Some(scale) = config.text_encoder_lr_scale {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(invalid(
                    file,
                    "text_encoder_lr_scale",
                    &format!("must be greater than 0 (got {scale})"),
                ));
            }
            // Only a learning rate copied from the UNet's is scaled (doc/OPTIMIZER.md).
            if train_lr.is_some() || text.lr.is_none() {
                text_encoder.lr = unet.lr * scale;
            }
        }
        Ok(OptimizerPlan {
            source,
            unet,
            text_encoder,
            grad_scaler_step_tweaks: config.apply_grad_scaler_step_tweaks.unwrap_or(false),
            log_grad_norm: config.log_grad_norm.unwrap_or(true),
        })
    }
}

impl CheckedGroup {
    /// `self` with its unset schedule keys taken from `defaults`.
    fn over(mut self, defaults: &CheckedGroup) -> CheckedGroup {
        self.schedule = self.schedule.or(defaults.schedule);
        self.warmup = self.warmup.or(defaults.warmup);
        self.decay = self.decay.or(defaults.decay);
        self
    }
}

/// `own` over `parent` over the defaults; `train_lr` over everything. `section` names the
/// group in errors about its betas.
fn merge(
    own: &CheckedGroup,
    parent: &CheckedGroup,
    train_lr: Option<f64>,
    file: &Path,
    section: &str,
) -> Result<ParamGroupPlan, ConfigError> {
    let optimizer = own
        .optimizer
        .or(parent.optimizer)
        .unwrap_or(OptimizerKind::AdamW8bit);
    let (b1, b2, beta3) = merged_betas(optimizer, own.betas.or(parent.betas), file, section)?;
    let pick = |a: Option<f64>, b: Option<f64>| a.or(b);
    let flag = |a: Option<bool>, b: Option<bool>| a.or(b);
    let d = EstimatorPlan::default();
    let estimator = EstimatorPlan {
        d0: pick(own.d0, parent.d0).unwrap_or(d.d0),
        decouple: flag(own.decouple, parent.decouple).unwrap_or(d.decouple),
        growth_rate: pick(own.growth_rate, parent.growth_rate).unwrap_or(d.growth_rate),
        momentum: pick(own.momentum, parent.momentum).unwrap_or(d.momentum),
        no_prox: flag(own.no_prox, parent.no_prox).unwrap_or(d.no_prox),
        safeguard_warmup: flag(own.safeguard_warmup, parent.safeguard_warmup)
            .unwrap_or(d.safeguard_warmup),
        use_bias_correction: flag(own.use_bias_correction, parent.use_bias_correction),
        beta3,
    };
    let plan = ParamGroupPlan {
        optimizer,
        lr: train_lr.or(own.lr).or(parent.lr).unwrap_or(LR_DEFAULT),
        betas: (b1, b2),
        estimator,
        adafactor: own.adafactor.or(parent.adafactor).unwrap_or_default(),
        schedulefree: own.schedulefree.or(parent.schedulefree).unwrap_or_default(),
        came: own.came.or(parent.came).unwrap_or_default(),
        epsilon: own.epsilon.or(parent.epsilon).unwrap_or(EPSILON_DEFAULT),
        weight_decay: own
            .weight_decay
            .or(parent.weight_decay)
            .unwrap_or(WEIGHT_DECAY_DEFAULT),
        schedule: ScheduleSpec {
            kind: own
                .schedule
                .or(parent.schedule)
                .unwrap_or(ScheduleKind::Constant),
            warmup_steps: own.warmup.or(parent.warmup).unwrap_or(StepCount::Auto),
            decay_steps: own.decay.or(parent.decay).unwrap_or(StepCount::Auto),
            num_cycles: own.num_cycles.or(parent.num_cycles).unwrap_or(1.0),
            power: own
                .power
                .or(parent.power)
                .unwrap_or(crate::optim::LrSchedule::POLYNOMIAL_POWER),
            decay_phase: own
                .decay_phase
                .or(parent.decay_phase)
                .unwrap_or(StepCount::Steps(0)),
            shape: merged_shape(own, parent),
        },
    };
    check_schedule_keys(own, plan.schedule.kind, file, section)?;
    if plan.schedule.kind == ScheduleKind::WarmupStableDecay
        && plan.schedule.decay_phase == StepCount::Steps(0)
    {
        return Err(invalid(
            file,
            &format!("{section}.lr_wsd_decay_steps"),
            "is not set: warmup_stable_decay needs the length of its final decay, in steps or \
             as a fraction (below 1) of the run",
        ));
    }
    check_schedule(optimizer, &plan.schedule, file, section)?;
    Ok(plan)
}

/// The schedule settings `own` over `parent` over the defaults.
fn merged_shape(own: &CheckedGroup, parent: &CheckedGroup) -> ScheduleShape {
    let d = ScheduleShape::default();
    ScheduleShape {
        min_lr_ratio: own
            .min_lr_ratio
            .or(parent.min_lr_ratio)
            .unwrap_or(d.min_lr_ratio),
        timescale: own.timescale.or(parent.timescale),
        decay_phase_steps: 0,
        warmup_ramp: own
            .warmup_ramp
            .or(parent.warmup_ramp)
            .unwrap_or(d.warmup_ramp),
        decay_ramp: own.decay_ramp.or(parent.decay_ramp).unwrap_or(d.decay_ramp),
        lr_end: own.lr_end.or(parent.lr_end).unwrap_or(d.lr_end),
    }
}

/// A schedule setting a section writes must belong to the section's schedule (`kind`, its own
/// or inherited): anything else is a mistake the user should hear about.
fn check_schedule_keys(
    own: &CheckedGroup,
    kind: ScheduleKind,
    file: &Path,
    section: &str,
) -> Result<(), ConfigError> {
    use ScheduleKind as K;
    let keys: [(&str, bool, bool, &str); 7] = [
        ("lr_scheduler_power", own.power.is_some(), kind == K::Polynomial, "the power of \"polynomial\""),
        ("lr_scheduler_lr_end", own.lr_end.is_some(), kind == K::Polynomial, "the end lr of \"polynomial\""),
        ("lr_scheduler_num_cycles", own.num_cycles.is_some(), kind.takes_cycles(), "the cycles of cosine_with_restarts, cosine_with_min_lr and warmup_stable_decay"),
        ("lr_scheduler_min_lr_ratio", own.min_lr_ratio.is_some(), kind.takes_min_lr(), "the floor of linear, cosine, cosine_with_restarts, cosine_with_min_lr, rex and warmup_stable_decay"),
        ("lr_scheduler_timescale", own.timescale.is_some(), kind == K::InverseSqrt, "the timescale of \"inverse_sqrt\""),
        ("lr_wsd_decay_steps", own.decay_phase.is_some(), kind == K::WarmupStableDecay, "the decay of \"warmup_stable_decay\""),
        ("lr_wsd_warmup_type", own.warmup_ramp.is_some() || own.decay_ramp.is_some(), kind == K::WarmupStableDecay, "a ramp of \"warmup_stable_decay\""),
    ];
    for (key, written, fits, what) in keys {
        if written && !fits {
            let key = match (key, own.warmup_ramp) {
                ("lr_wsd_warmup_type", None) => "lr_wsd_decay_type",
                _ => key,
            };
            return Err(invalid(
                file,
                &format!("{section}.{key}"),
                &format!(
                    "is {what}, but this section's lr_scheduler is \"{}\"; remove it or set \
                     lr_scheduler",
                    kind.name()
                ),
            ));
        }
    }
    Ok(())
}

/// The group's betas for its optimizer: two numbers, or three for dadapt_adan (which needs a
/// third: two written for it are refused) and prodigy (whose third defaults to √β2).
fn merged_betas(
    optimizer: OptimizerKind,
    written: Option<(f64, f64, Option<f64>)>,
    file: &Path,
    section: &str,
) -> Result<(f64, f64, Option<f64>), ConfigError> {
    let field = format!("{section}.betas");
    match (optimizer, written) {
        (OptimizerKind::DadaptAdan, None) => {
            let (b1, b2) = optimizer.default_betas();
            Ok((b1, b2, Some(ADAN_BETA3_DEFAULT)))
        }
        (OptimizerKind::DadaptAdan, Some((_, _, None))) => Err(invalid(
            file,
            &field,
            "has two numbers; dadapt_adan takes three [beta1, beta2, beta3] (its defaults are \
             [0.98, 0.92, 0.99]; EveryDream2 passes two and so cannot build it)",
        )),
        (OptimizerKind::Came | OptimizerKind::Came8bit, None) => {
            let (b1, b2, b3) = CAME_BETAS_DEFAULT;
            Ok((b1, b2, Some(b3)))
        }
        (OptimizerKind::Came | OptimizerKind::Came8bit, Some((_, _, None))) => Err(invalid(
            file,
            &field,
            &format!(
                "has two numbers; {} takes three [beta1, beta2, beta3] (came-pytorch's defaults \
                 are [0.9, 0.999, 0.9999])",
                optimizer.name()
            ),
        )),
        (
            OptimizerKind::DadaptAdan
            | OptimizerKind::Prodigy
            | OptimizerKind::Came
            | OptimizerKind::Came8bit,
            Some(b),
        ) => Ok(b),
        (_, Some((_, _, Some(_)))) => Err(invalid(
            file,
            &field,
            &format!(
                "has three numbers; {} takes two [beta1, beta2] (three are for dadapt_adan, \
                 prodigy, came and came8bit)",
                optimizer.name()
            ),
        )),
        (_, Some(b)) => Ok(b),
        (_, None) => {
            let (b1, b2) = optimizer.default_betas();
            Ok((b1, b2, None))
        }
    }
}

fn check_group(g: &GroupFile, section: &str, file: &Path) -> Result<CheckedGroup, ConfigError> {
    let field = |key: &str| format!("{section}.{key}");
    let positive = |key: &str, v: Option<f64>| match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(invalid(
            file,
            &field(key),
            &format!("must be greater than 0 (got {x})"),
        )),
        _ => Ok(v),
    };
    let steps = |key: &str, v: Option<i64>| -> Result<Option<u64>, ConfigError> {
        match v {
            Some(n) if n < 0 => Err(invalid(
                file,
                &field(key),
                &format!("must be 0 or more (got {n})"),
            )),
            _ => Ok(v.map(|n| n.unsigned_abs())),
        }
    };
    let weight_decay = match g.weight_decay {
        Some(x) if !(x.is_finite() && x >= 0.0) => {
            return Err(invalid(
                file,
                &field("weight_decay"),
                &format!("must be 0 or more (got {x})"),
            ))
        }
        other => other,
    };
    Ok(CheckedGroup {
        optimizer: g
            .optimizer
            .as_deref()
            .map(|name| parse_optimizer(name, file, &field("optimizer")))
            .transpose()?,
        lr: positive("lr", g.lr)?,
        schedule: g
            .lr_scheduler
            .as_deref()
            .map(|name| parse_schedule(name, file, &field("lr_scheduler")))
            .transpose()?,
        warmup: steps("lr_warmup_steps", g.lr_warmup_steps)?.map(StepCount::Steps),
        // 0 means automatic, as EveryDream2's `lr_decay_steps < 1`.
        decay: steps("lr_decay_steps", g.lr_decay_steps)?.map(|n| match n {
            0 => StepCount::Auto,
            n => StepCount::Steps(n),
        }),
        num_cycles: match g.lr_scheduler_num_cycles {
            Some(n) if !(n > 0.0 && n <= 100_000.0) => {
                return Err(invalid(
                    file,
                    &field("lr_scheduler_num_cycles"),
                    &format!("must be a number of cycles above 0, at most 100000 (got {n})"),
                ))
            }
            n => n,
        },
        lr_end: match g.lr_scheduler_lr_end {
            Some(x) if !(x.is_finite() && x >= 0.0) => {
                return Err(invalid(
                    file,
                    &field("lr_scheduler_lr_end"),
                    &format!("must be 0 or more (got {x})"),
                ))
            }
            x => x,
        },
        min_lr_ratio: match g.lr_scheduler_min_lr_ratio {
            Some(x) if !(0.0..=1.0).contains(&x) => {
                return Err(invalid(
                    file,
                    &field("lr_scheduler_min_lr_ratio"),
                    &format!("must be from 0 to 1, a fraction of lr (got {x})"),
                ))
            }
            x => x,
        },
        timescale: match g.lr_scheduler_timescale {
            Some(n) if n < 1 => {
                return Err(invalid(
                    file,
                    &field("lr_scheduler_timescale"),
                    &format!("must be at least 1 step (got {n})"),
                ))
            }
            n => n.map(|n| n.unsigned_abs()),
        },
        decay_phase: g
            .lr_wsd_decay_steps
            .map(|x| wsd_decay_steps(x, file, &field("lr_wsd_decay_steps")))
            .transpose()?,
        warmup_ramp: g
            .lr_wsd_warmup_type
            .as_deref()
            .map(|x| ramp(x, file, &field("lr_wsd_warmup_type")))
            .transpose()?,
        decay_ramp: g
            .lr_wsd_decay_type
            .as_deref()
            .map(|x| ramp(x, file, &field("lr_wsd_decay_type")))
            .transpose()?,
        power: match g.lr_scheduler_power {
            Some(p) if !(p.is_finite() && p > 0.0) => {
                return Err(invalid(
                    file,
                    &field("lr_scheduler_power"),
                    &format!("must be a number greater than 0 (got {p})"),
                ))
            }
            p => p,
        },
        betas: g
            .betas
            .as_deref()
            .map(|b| check_betas(b, file, &field("betas")))
            .transpose()?,
        epsilon: positive("epsilon", g.epsilon)?,
        weight_decay,
        adafactor: g
            .adafactor
            .as_ref()
            .map(|a| check_adafactor(a, file, &field("adafactor")))
            .transpose()?,
        schedulefree: g
            .schedulefree
            .as_ref()
            .map(|x| check_schedulefree(x, file, &field("schedulefree")))
            .transpose()?,
        came: g
            .came
            .as_ref()
            .map(|x| check_came(x, file, &field("came")))
            .transpose()?,
        d0: positive("d0", g.d0)?,
        decouple: g.decouple,
        growth_rate: match g.growth_rate {
            Some(x) if x.is_nan() || x < 1.0 => {
                return Err(invalid(
                    file,
                    &field("growth_rate"),
                    &format!("must be 1 or more, or null for no bound (got {x})"),
                ))
            }
            other => other,
        },
        momentum: match g.momentum {
            Some(x) if !(0.0..1.0).contains(&x) => {
                return Err(invalid(
                    file,
                    &field("momentum"),
                    &format!("must be in [0, 1) (got {x})"),
                ))
            }
            other => other,
        },
        no_prox: g.no_prox,
        safeguard_warmup: g.safeguard_warmup,
        use_bias_correction: g.use_bias_correction,
    })
}

fn check_adafactor(
    a: &super::optimizer_file::AdafactorFile,
    file: &Path,
    field: &str,
) -> Result<AdafactorPlan, ConfigError> {
    let d = AdafactorPlan::default();
    let key = |k: &str| format!("{field}.{k}");
    let eps = match a.eps.as_deref() {
        None => d.eps,
        Some([e1, e2]) if *e1 >= 0.0 && *e2 >= 0.0 => (*e1, *e2),
        Some(other) => {
            return Err(invalid(
                file,
                &key("eps"),
                &format!("must be two numbers [eps1, eps2], each 0 or more (got {other:?})"),
            ))
        }
    };
    let clip_threshold = a.clip_threshold.unwrap_or(d.clip_threshold);
    if !(clip_threshold.is_finite() && clip_threshold > 0.0) {
        return Err(invalid(
            file,
            &key("clip_threshold"),
            &format!("must be greater than 0 (got {clip_threshold})"),
        ));
    }
    let decay_rate = a.decay_rate.unwrap_or(d.decay_rate);
    if !(decay_rate.is_finite() && decay_rate < 0.0) {
        return Err(invalid(
            file,
            &key("decay_rate"),
            &format!("must be below 0, e.g. -0.8 (got {decay_rate})"),
        ));
    }
    if let Some(b) = a.beta1.filter(|b| !(0.0..1.0).contains(b)) {
        return Err(invalid(
            file,
            &key("beta1"),
            &format!("must be in [0, 1), or null for no first moment (got {b})"),
        ));
    }
    Ok(AdafactorPlan {
        eps,
        clip_threshold,
        decay_rate,
        beta1: a.beta1,
        scale_parameter: a.scale_parameter.unwrap_or(d.scale_parameter),
    })
}

fn check_betas(
    betas: &[f64],
    file: &Path,
    field: &str,
) -> Result<(f64, f64, Option<f64>), ConfigError> {
    let in_range = betas.iter().all(|b| (0.0..1.0).contains(b));
    match betas {
        [b1, b2] if in_range => Ok((*b1, *b2, None)),
        [b1, b2, b3] if in_range => Ok((*b1, *b2, Some(*b3))),
        [_, _] | [_, _, _] => Err(invalid(
            file,
            field,
            &format!("must be numbers each in [0, 1) (got {betas:?})"),
        )),
        _ => Err(invalid(
            file,
            field,
            &format!(
                "must be two numbers [beta1, beta2], e.g. [0.9, 0.999] (three for dadapt_adan \
                 and prodigy; got {} numbers)",
                betas.len()
            ),
        )),
    }
}

fn parse_optimizer(name: &str, file: &Path, field: &str) -> Result<OptimizerKind, ConfigError> {
    let lower = name.to_ascii_lowercase();
    match OptimizerKind::ALL.iter().find(|k| k.name() == lower) {
        Some(k) => Ok(*k),
        None => Err(invalid(
            file,
            field,
            &format!(
                "is \"{name}\": unknown optimizer; valid names: {OPTIMIZER_NAMES} (EveryDream2 \
                 silently falls back to a default here; sdtrain does not)"
            ),
        )),
    }
}

/// `lr_wsd_decay_steps`: whole steps, or a fraction of the run below 1 (kohya's rule).
fn wsd_decay_steps(x: f64, file: &Path, field: &str) -> Result<StepCount, ConfigError> {
    match x {
        x if x > 0.0 && x < 1.0 => Ok(StepCount::RunFraction(x)),
        x if x >= 1.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => Ok(StepCount::Steps(x as u64)),
        x => Err(invalid(
            file,
            field,
            &format!(
                "must be a whole number of steps (at least 1), or a fraction of the run above 0 \
                 and below 1 (got {x})"
            ),
        )),
    }
}

fn ramp(name: &str, file: &Path, field: &str) -> Result<Ramp, ConfigError> {
    Ramp::parse(name).ok_or_else(|| {
        invalid(
            file,
            field,
            &format!("is \"{name}\": allowed are linear, cosine and 1-sqrt"),
        )
    })
}

fn parse_schedule(name: &str, file: &Path, field: &str) -> Result<ScheduleKind, ConfigError> {
    match name.to_ascii_lowercase().as_str() {
        "constant_with_warmup" => Err(invalid(
            file,
            field,
            "is \"constant_with_warmup\": use \"constant\" with lr_warmup_steps (every sdtrain \
             schedule has a warmup)",
        )),
        lower => lower.parse().map_err(|_| {
            invalid(
                file,
                field,
                &format!(
                    "is \"{name}\": unknown lr_scheduler; allowed: {}",
                    ScheduleKind::names()
                ),
            )
        }),
    }
}

fn invalid(file: &Path, field: &str, message: &str) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field: field.to_string(),
        message: message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    fn plan(v: Value, train_lr: Option<f64>) -> Result<OptimizerPlan, ConfigError> {
        let Value::Object(obj) = v else {
            panic!("test input must be an object")
        };
        let file = Path::new("optimizer.json");
        let config = OptimizerFile::from_object(obj, file)?;
        OptimizerPlan::resolve(&config, file, None, train_lr, TrainScheduleKeys::default())
    }

    #[test]
    fn empty_file_gives_ed2_defaults() {
        let p = plan(json!({}), None).unwrap();
        for g in [p.unet, p.text_encoder] {
            assert_eq!(g.optimizer, OptimizerKind::AdamW8bit);
            assert_eq!(g.lr, 1e-6);
            assert_eq!(g.betas, (0.9, 0.999));
            assert_eq!(g.epsilon, 1e-8);
            assert_eq!(g.weight_decay, 0.01);
            assert_eq!(g.schedule.kind, ScheduleKind::Constant);
            assert_eq!(g.schedule.warmup_steps, StepCount::Auto);
            assert_eq!(g.schedule.decay_steps, StepCount::Auto);
        }
    }

    #[test]
    fn train_json_schedule_is_the_base_fallback() {
        // EveryDream2: `base_config.get(key) or args.key`, and the text encoder inherits base.
        let train =
            TrainScheduleKeys::check(Some("cosine"), Some(7), Some(300), Path::new("t")).unwrap();
        let config = OptimizerFile::from_object(
            json!({"base": {"lr_warmup_steps": 3}, "text_encoder_overrides": {"lr_decay_steps": 9}})
                .as_object()
                .unwrap()
                .clone(),
            Path::new("o"),
        )
        .unwrap();
        let p = OptimizerPlan::resolve(&config, Path::new("o"), None, None, train).unwrap();
        assert_eq!(p.unet.schedule.kind, ScheduleKind::Cosine);
        assert_eq!(p.unet.schedule.warmup_steps, StepCount::Steps(3));
        assert_eq!(p.unet.schedule.decay_steps, StepCount::Steps(300));
        assert_eq!(p.text_encoder.schedule.kind, ScheduleKind::Cosine);
        assert_eq!(p.text_encoder.schedule.warmup_steps, StepCount::Steps(3));
        assert_eq!(p.text_encoder.schedule.decay_steps, StepCount::Steps(9));
        let err = TrainScheduleKeys::check(Some("cosin"), None, None, Path::new("train.json"))
            .unwrap_err();
        assert!(err.to_string().contains("`lr_scheduler`"), "{err}");
        let err =
            TrainScheduleKeys::check(None, Some(-1), None, Path::new("train.json")).unwrap_err();
        assert!(err.to_string().contains("`lr_warmup_steps`"), "{err}");
    }

    #[test]
    fn text_encoder_lr_scale_scales_only_a_copied_lr() {
        let p = plan(
            json!({"base": {"lr": 2e-6}, "text_encoder_lr_scale": 0.5}),
            None,
        )
        .unwrap();
        assert_eq!((p.unet.lr, p.text_encoder.lr), (2e-6, 1e-6));
        let p = plan(
            json!({"base": {"lr": 2e-6}, "text_encoder_overrides": {"lr": 3e-7},
                   "text_encoder_lr_scale": 0.5}),
            None,
        )
        .unwrap();
        assert_eq!(p.text_encoder.lr, 3e-7);
        // train.json's lr is copied to both groups, so it is scaled for the text encoder.
        let p = plan(json!({"text_encoder_lr_scale": 0.25}), Some(4e-6)).unwrap();
        assert_eq!((p.unet.lr, p.text_encoder.lr), (4e-6, 1e-6));
        let err = plan(json!({"text_encoder_lr_scale": 0}), None).unwrap_err();
        assert!(err.to_string().contains("text_encoder_lr_scale"), "{err}");
        assert!(plan(json!({}), None).unwrap().log_grad_norm);
        assert!(
            !plan(json!({"log_grad_norm": false}), None)
                .unwrap()
                .log_grad_norm
        );
    }

    #[test]
    fn builtin_default_matches_empty_file() {
        let config = OptimizerFile::builtin().unwrap();
        let p = OptimizerPlan::resolve(&config, Path::new("x"), None, None, Default::default())
            .unwrap();
        assert_eq!(p, plan(json!({}), None).unwrap());
    }

    #[test]
    fn text_encoder_null_inherits_and_zero_means_zero() {
        let p = plan(
            json!({
                "base": {"lr": 2e-6, "weight_decay": 0.05, "epsilon": 1e-7, "betas": [0.8, 0.99],
                         "lr_scheduler": "cosine", "lr_warmup_steps": 10, "lr_decay_steps": 500},
                "text_encoder_overrides": {"weight_decay": 0, "lr_warmup_steps": 0,
                         "epsilon": null, "betas": null, "lr": null}
            }),
            None,
        )
        .unwrap();
        let te = p.text_encoder;
        assert_eq!(te.weight_decay, 0.0);
        assert_eq!(te.schedule.warmup_steps, StepCount::Steps(0));
        assert_eq!(te.lr, 2e-6);
        assert_eq!(te.epsilon, 1e-7);
        assert_eq!(te.betas, (0.8, 0.99));
        assert_eq!(te.schedule.kind, ScheduleKind::Cosine);
        assert_eq!(te.schedule.decay_steps, StepCount::Steps(500));
        assert_eq!(p.unet.weight_decay, 0.05);
        assert_eq!(p.unet.schedule.warmup_steps, StepCount::Steps(10));
    }

    #[test]
    fn train_lr_overrides_both_groups() {
        let v = json!({"base": {"lr": 2e-6}, "text_encoder_overrides": {"lr": 5e-7}});
        let p = plan(v.clone(), None).unwrap();
        assert_eq!((p.unet.lr, p.text_encoder.lr), (2e-6, 5e-7));
        let p = plan(v, Some(3e-6)).unwrap();
        assert_eq!((p.unet.lr, p.text_encoder.lr), (3e-6, 3e-6));
    }

    #[test]
    fn decay_zero_is_automatic() {
        let p = plan(json!({"base": {"lr_decay_steps": 0}}), None).unwrap();
        assert_eq!(p.unet.schedule.decay_steps, StepCount::Auto);
    }

    #[test]
    fn optimizer_names() {
        let p = plan(json!({"base": {"optimizer": "AdamW"}}), None).unwrap();
        assert_eq!(p.unet.optimizer, OptimizerKind::AdamW);
        for (name, kind) in [
            ("adamw8bit", OptimizerKind::AdamW8bit),
            ("Lion", OptimizerKind::Lion),
            ("lion8bit", OptimizerKind::Lion8bit),
            ("adafactor", OptimizerKind::Adafactor),
        ] {
            let p = plan(json!({"base": {"optimizer": name}}), None).unwrap();
            assert_eq!((p.unet.optimizer, p.text_encoder.optimizer), (kind, kind));
        }
        // Lion's betas default to the paper's; set betas win.
        let p = plan(json!({"base": {"optimizer": "lion"}}), None).unwrap();
        assert_eq!(p.unet.betas, (0.9, 0.99));
        let p = plan(
            json!({"base": {"optimizer": "lion", "betas": [0.8, 0.9]}}),
            None,
        )
        .unwrap();
        assert_eq!(p.unet.betas, (0.8, 0.9));
        // The text encoder may use another optimizer than the UNet.
        let p = plan(
            json!({"base": {"optimizer": "adamw"}, "text_encoder_overrides": {"optimizer": "lion8bit"}}),
            None,
        )
        .unwrap();
        assert_eq!(p.unet.optimizer, OptimizerKind::AdamW);
        assert_eq!(p.text_encoder.optimizer, OptimizerKind::Lion8bit);
        assert_eq!(p.text_encoder.betas, (0.9, 0.99));
        let err = plan(
            json!({"text_encoder_overrides": {"optimizer": "sgd"}}),
            None,
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`text_encoder_overrides.optimizer`"), "{msg}");
        assert!(
            msg.contains("unknown optimizer; valid names: adamw, adamw8bit, lion, lion8bit"),
            "{msg}"
        );
        // Every EveryDream2 optimizer name is one, with its estimator settings inherited.
        for kind in OptimizerKind::ALL {
            let p = plan(json!({"base": {"optimizer": kind.name()}}), None).unwrap();
            assert_eq!((p.unet.optimizer, p.text_encoder.optimizer), (kind, kind));
        }
        let p = plan(
            json!({"base": {"optimizer": "dadapt_adam", "d0": 1e-5, "growth_rate": 1.02,
                   "decouple": false, "use_bias_correction": true},
                   "text_encoder_overrides": {"d0": 1e-4}}),
            None,
        )
        .unwrap();
        assert_eq!(
            (p.unet.estimator.d0, p.text_encoder.estimator.d0),
            (1e-5, 1e-4)
        );
        assert_eq!(p.text_encoder.estimator.growth_rate, 1.02);
        assert!(!p.text_encoder.estimator.decouple);
        assert_eq!(p.unet.estimator.use_bias_correction, Some(true));
        // EveryDream2's defaults: decoupled, safeguard warmup, unbounded growth.
        let d = plan(json!({"base": {"optimizer": "prodigy"}}), None).unwrap();
        assert!(d.unet.estimator.decouple && d.unet.estimator.safeguard_warmup);
        assert_eq!(d.unet.estimator.growth_rate, f64::INFINITY);
        // dadapt_adan takes three betas: its defaults, or three written; two are refused.
        let adan = plan(json!({"base": {"optimizer": "dadapt_adan"}}), None).unwrap();
        assert_eq!(adan.unet.betas, (0.98, 0.92));
        assert_eq!(adan.unet.estimator.beta3, Some(0.99));
        let err = plan(
            json!({"base": {"optimizer": "dadapt_adan", "betas": [0.9, 0.999]}}),
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("takes three"), "{err}");
        let err = plan(
            json!({"base": {"optimizer": "adamw", "betas": [0.9, 0.99, 0.9]}}),
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("takes two"), "{err}");
        for (key, value) in [
            ("d0", json!(0.0)),
            ("growth_rate", json!(0.5)),
            ("momentum", json!(1.0)),
        ] {
            let err = plan(
                json!({"base": {"optimizer": "dadapt_sgd", key: value}}),
                None,
            )
            .unwrap_err();
            assert!(err.to_string().contains(&format!("base.{key}")), "{err}");
        }
    }

    #[test]
    fn scheduler_names() {
        for (name, kind) in [
            ("constant", ScheduleKind::Constant),
            ("linear", ScheduleKind::Linear),
            ("cosine", ScheduleKind::Cosine),
            ("polynomial", ScheduleKind::Polynomial),
            ("cosine_with_restarts", ScheduleKind::CosineWithRestarts),
        ] {
            let p = plan(json!({"base": {"lr_scheduler": name}}), None).unwrap();
            assert_eq!(p.unet.schedule.kind, kind);
        }
        let err = plan(
            json!({"base": {"lr_scheduler": "piecewise_constant"}}),
            None,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("allowed: constant, linear, cosine, polynomial, cosine_with_restarts"),
            "{err}"
        );
    }

    #[test]
    fn ranges_are_checked() {
        for (v, field) in [
            (json!({"base": {"lr": 0}}), "base.lr"),
            (json!({"base": {"lr": -1e-6}}), "base.lr"),
            (json!({"base": {"epsilon": 0}}), "base.epsilon"),
            (json!({"base": {"weight_decay": -0.1}}), "base.weight_decay"),
            (json!({"base": {"betas": [0.9, 1.0]}}), "base.betas"),
            (json!({"base": {"betas": [0.9]}}), "base.betas"),
            (
                json!({"base": {"lr_warmup_steps": -1}}),
                "base.lr_warmup_steps",
            ),
            (
                json!({"text_encoder_overrides": {"lr_decay_steps": -5}}),
                "text_encoder_overrides.lr_decay_steps",
            ),
            (
                json!({"text_encoder_overrides": {"lr": 0}}),
                "text_encoder_overrides.lr",
            ),
        ] {
            let err = plan(v, None).unwrap_err();
            let ConfigError::Invalid { field: got, .. } = &err else {
                panic!("{err}")
            };
            assert_eq!(got, field);
        }
    }

    #[test]
    fn grad_scaler_tweaks_are_read() {
        assert!(
            !plan(json!({"apply_grad_scaler_step_tweaks": null}), None)
                .unwrap()
                .grad_scaler_step_tweaks
        );
        assert!(
            plan(json!({"apply_grad_scaler_step_tweaks": true}), None)
                .unwrap()
                .grad_scaler_step_tweaks
        );
    }

    /// kohya's `lr_scheduler_power`: read for polynomial, inherited by the text encoder, and
    /// refused where it would do nothing or is not a positive number.
    #[test]
    fn polynomial_takes_its_power() {
        let p = plan(
            json!({"base": {"lr_scheduler": "polynomial", "lr_scheduler_power": 2.0}}),
            None,
        )
        .unwrap();
        assert_eq!(
            (p.unet.schedule.power, p.text_encoder.schedule.power),
            (2.0, 2.0)
        );
        assert!(p.unet.to_string().ends_with(", power 2"), "{}", p.unet);
        assert_eq!(p.unet.schedule.resolve(100).power, 2.0);
        for (base, says) in [
            (
                json!({"lr_scheduler": "cosine", "lr_scheduler_power": 2.0}),
                "polynomial",
            ),
            (
                json!({"lr_scheduler": "polynomial", "lr_scheduler_power": 0.0}),
                "greater than 0",
            ),
        ] {
            let msg = plan(json!({"base": base}), None).unwrap_err().to_string();
            assert!(
                msg.contains("lr_scheduler_power") && msg.contains(says),
                "{msg}"
            );
        }
    }

    /// kohya's `lr_scheduler_num_cycles`: read for cosine_with_restarts, inherited by the text
    /// encoder, and refused where it would do nothing.
    #[test]
    fn restarts_take_their_cycles() {
        let p = plan(
            json!({"base": {"lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 3}}),
            None,
        )
        .unwrap();
        assert_eq!(p.unet.schedule.kind, ScheduleKind::CosineWithRestarts);
        assert_eq!(
            (
                p.unet.schedule.num_cycles,
                p.text_encoder.schedule.num_cycles
            ),
            (3.0, 3.0)
        );
        assert!(p.unet.to_string().ends_with(", 3 cycles"), "{}", p.unet);
        let r = p.unet.schedule.resolve(100);
        assert_eq!((r.warmup_steps, r.decay_steps, r.num_cycles), (3, 150, 3.0));
        let p = plan(
            json!({"base": {"lr_scheduler": "cosine_with_restarts"}}),
            None,
        )
        .unwrap();
        assert_eq!(p.unet.schedule.num_cycles, 1.0);
        for (v, says) in [
            (
                json!({"base": {"lr_scheduler": "cosine", "lr_scheduler_num_cycles": 2}}),
                "cosine_with_restarts",
            ),
            (
                json!({"base": {"lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 0}}),
                "above 0",
            ),
        ] {
            let msg = plan(v.clone(), None).unwrap_err().to_string();
            assert!(
                msg.contains("lr_scheduler_num_cycles") && msg.contains(says),
                "{v}: {msg}"
            );
        }
    }

    #[test]
    fn automatic_lengths_follow_ed2() {
        let spec = |kind, warmup, decay| ScheduleSpec {
            kind,
            warmup_steps: warmup,
            decay_steps: decay,
            num_cycles: 1.0,
            power: 1.0,
            decay_phase: StepCount::Steps(0),
            shape: ScheduleShape::default(),
        };
        let r = spec(ScheduleKind::Cosine, StepCount::Auto, StepCount::Auto).resolve(1000);
        assert_eq!((r.warmup_steps, r.decay_steps), (30, 1500));
        let r = spec(ScheduleKind::Constant, StepCount::Auto, StepCount::Auto).resolve(1000);
        assert_eq!((r.warmup_steps, r.decay_steps), (0, 1500));
        // The automatic warmup comes from the automatic decay even when decay is set.
        let r = spec(ScheduleKind::Linear, StepCount::Auto, StepCount::Steps(100)).resolve(1000);
        assert_eq!((r.warmup_steps, r.decay_steps), (30, 100));
        let r = spec(ScheduleKind::Constant, StepCount::Steps(7), StepCount::Auto).resolve(3);
        assert_eq!((r.warmup_steps, r.decay_steps), (7, 4));
    }

    #[test]
    fn step_count_serializes_as_auto_or_number() {
        assert_eq!(
            serde_json::to_value(StepCount::Auto).unwrap(),
            json!("auto")
        );
        assert_eq!(serde_json::to_value(StepCount::Steps(5)).unwrap(), json!(5));
    }
}
