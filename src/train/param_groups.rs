//! The run's optimizer groups, as EveryDream2's optimizer.json splits them: the UNet and, when
//! trained, the text encoder(s), each under its own optimizer and learning-rate schedule. In
//! adapter modes the groups hold the adapters' parameters, with `adapter.unet_lr` and
//! `adapter.text_encoder_lr` overriding the groups' learning rates.

use anyhow::Context;
use candle_core::Var;

use super::adapters::TrainedAdapters;
use super::te_freeze::text_encoder_param_trains;
use crate::config::{OptimizerKind, ParamGroupPlan, ScheduleSpec, TrainPlan};
use crate::model::files::Component;
use crate::model::pipeline::StableDiffusion;
use crate::optim::{
    AdaCoor, AdaCoorParams, Adafactor, AdafactorParams, AdamW, AdamW8bit, AdamWParams,
    AdamWScheduleFree, Came, CameParams, CoordinateDowg, DAdaptAdam, DAdaptAdamParams, DAdaptAdan,
    DAdaptAdanParams, DAdaptLion, DAdaptLionParams, DAdaptSgd, DAdaptSgdParams, DowgParams,
    GroupOptimizer, Lion, LionParams, LrSchedule, Optimizer, Prodigy, ProdigyParams, ScalarDowg,
    ScheduleFreeParams, UpdateRule,
};

/// One optimizer over one parameter group, with its schedule.
pub(super) struct Group {
    pub name: &'static str,
    pub optimizer: GroupOptimizer,
    /// The group's parameters, for clipping and the gradient check.
    pub vars: Vec<Var>,
    /// Their names in the optimizer state (and, prefixed by the group, in a save point).
    pub names: Vec<String>,
    pub schedule: LrSchedule,
    /// The schedule as configured, before the run's length resolved it.
    pub spec: ScheduleSpec,
    pub base_lr: f64,
}

/// The optimizer a group's plan names, over `params`.
pub(crate) fn build_optimizer(
    plan: &ParamGroupPlan,
    params: Vec<(String, Var)>,
) -> crate::optim::Result<GroupOptimizer> {
    GroupOptimizer::new(update_rule(plan)?, params, plan.lr)
}

/// The update rule a group's plan names.
pub(crate) fn update_rule(plan: &ParamGroupPlan) -> crate::optim::Result<Box<dyn UpdateRule>> {
    let adam = AdamWParams {
        lr: plan.lr,
        beta1: plan.betas.0,
        beta2: plan.betas.1,
        eps: plan.epsilon,
        weight_decay: plan.weight_decay,
    };
    let lion = LionParams {
        beta1: plan.betas.0,
        beta2: plan.betas.1,
        weight_decay: plan.weight_decay,
    };
    Ok(match plan.optimizer {
        OptimizerKind::AdamW => Box::new(AdamW::rule(adam)?),
        OptimizerKind::AdamW8bit => Box::new(AdamW8bit::rule(adam)?),
        OptimizerKind::Lion => Box::new(Lion::rule(lion, false)?),
        OptimizerKind::Lion8bit => Box::new(Lion::rule(lion, true)?),
        OptimizerKind::Adafactor => Box::new(Adafactor::rule(AdafactorParams {
            eps: plan.adafactor.eps,
            clip_threshold: plan.adafactor.clip_threshold,
            decay_rate: plan.adafactor.decay_rate,
            beta1: plan.adafactor.beta1,
            weight_decay: plan.weight_decay,
            scale_parameter: plan.adafactor.scale_parameter,
        })?),
        OptimizerKind::AdamWScheduleFree => {
            Box::new(AdamWScheduleFree::rule(ScheduleFreeParams {
                beta1: plan.betas.0,
                beta2: plan.betas.1,
                eps: plan.epsilon,
                weight_decay: plan.weight_decay,
                warmup_steps: plan.schedulefree.warmup_steps,
                r: plan.schedulefree.r,
                weight_lr_power: plan.schedulefree.weight_lr_power,
            })?)
        }
        OptimizerKind::Came | OptimizerKind::Came8bit => {
            let betas = (
                plan.betas.0,
                plan.betas.1,
                plan.estimator
                    .beta3
                    .unwrap_or(crate::config::CAME_BETAS_DEFAULT.2),
            );
            let params = CameParams {
                betas,
                eps: plan.came.eps,
                clip_threshold: plan.came.clip_threshold,
                weight_decay: plan.weight_decay,
            };
            Box::new(Came::rule(
                params,
                plan.optimizer == OptimizerKind::Came8bit,
            )?)
        }
        kind => estimator_rule(kind, plan)?,
    })
}

/// The learning-rate-free rules, with the settings EveryDream2's `_create_optimizer` passes
/// (`betas`, `epsilon` and `weight_decay` from the group; `d0`, `decouple`, `growth_rate`,
/// `momentum`, `no_prox`, `safeguard_warmup`, `use_bias_correction` from the same section).
fn estimator_rule(
    kind: OptimizerKind,
    plan: &ParamGroupPlan,
) -> crate::optim::Result<Box<dyn UpdateRule>> {
    let e = &plan.estimator;
    let (beta1, beta2) = plan.betas;
    Ok(match kind {
        OptimizerKind::Prodigy => Box::new(Prodigy::rule(ProdigyParams {
            beta1,
            beta2,
            beta3: e.beta3,
            eps: plan.epsilon,
            weight_decay: plan.weight_decay,
            decouple: e.decouple,
            use_bias_correction: e.use_bias_correction.unwrap_or(true),
            safeguard_warmup: e.safeguard_warmup,
            d0: e.d0,
            d_coef: 1.0,
            growth_rate: e.growth_rate,
        })?),
        OptimizerKind::DadaptAdam => Box::new(DAdaptAdam::rule(DAdaptAdamParams {
            beta1,
            beta2,
            eps: plan.epsilon,
            weight_decay: plan.weight_decay,
            decouple: e.decouple,
            use_bias_correction: e.use_bias_correction.unwrap_or(false),
            d0: e.d0,
            growth_rate: e.growth_rate,
        })?),
        OptimizerKind::DadaptAdan => Box::new(DAdaptAdan::rule(DAdaptAdanParams {
            beta1,
            beta2,
            beta3: e.beta3.unwrap_or(crate::config::ADAN_BETA3_DEFAULT),
            eps: plan.epsilon,
            weight_decay: plan.weight_decay,
            no_prox: e.no_prox,
            d0: e.d0,
            growth_rate: e.growth_rate,
        })?),
        OptimizerKind::DadaptLion => Box::new(DAdaptLion::rule(DAdaptLionParams {
            beta1,
            beta2,
            weight_decay: plan.weight_decay,
            d0: e.d0,
        })?),
        OptimizerKind::DadaptSgd => Box::new(DAdaptSgd::rule(DAdaptSgdParams {
            momentum: e.momentum,
            weight_decay: plan.weight_decay,
            d0: e.d0,
            growth_rate: e.growth_rate,
        })?),
        OptimizerKind::CoordinateDowg | OptimizerKind::ScalarDowg => {
            let p = DowgParams {
                eps: plan.epsilon,
                ..DowgParams::default()
            };
            if kind == OptimizerKind::ScalarDowg {
                Box::new(ScalarDowg::rule(p)?)
            } else {
                Box::new(CoordinateDowg::rule(p)?)
            }
        }
        OptimizerKind::Adacoor => Box::new(AdaCoor::rule(AdaCoorParams { eps: plan.epsilon })?),
        OptimizerKind::AdamW
        | OptimizerKind::AdamW8bit
        | OptimizerKind::Lion
        | OptimizerKind::Lion8bit
        | OptimizerKind::Adafactor
        | OptimizerKind::AdamWScheduleFree
        | OptimizerKind::Came
        | OptimizerKind::Came8bit => {
            return Err(crate::optim::OptimError::Pass(
                "not a learning-rate-free optimizer (built by update_rule)",
            ))
        }
    })
}

/// What every group of a run shares: its length in steps (for the schedules) and the seed its
/// bf16/f16 weights are rounded with.
#[derive(Debug, Clone, Copy)]
pub(super) struct GroupShape {
    pub total_steps: u64,
    pub rounding_seed: u64,
}

impl Group {
    /// `lr_scale`: each parameter's multiple of the group's rate, by name (LoRA+'s ratio for
    /// `lora_up` weights, kohya's block weights).
    fn new(
        name: &'static str,
        params: Vec<(String, Var)>,
        plan: &ParamGroupPlan,
        shape: GroupShape,
        lr_scale: Option<super::adapter_blocks::LrScale<'_>>,
    ) -> anyhow::Result<Self> {
        let schedule = lr_schedule(&plan.schedule, shape.total_steps);
        schedule
            .validate(plan.lr)
            .with_context(|| format!("{name} lr schedule"))?;
        let vars = params.iter().map(|(_, v)| v.clone()).collect();
        let names = params.iter().map(|(n, _)| n.clone()).collect();
        // Stochastic rounding touches only bf16/f16 parameters (`weight_dtype`); f32 ones, and
        // every adapter, update as before.
        let optimizer = build_optimizer(plan, params)
            .with_context(|| format!("{name} optimizer"))?
            .with_stochastic_rounding(shape.rounding_seed)
            .with_context(|| format!("{name} optimizer"))?;
        let optimizer = match lr_scale {
            Some(scale) => optimizer
                .scale_lr(scale)
                .with_context(|| format!("{name} optimizer (per-parameter learning rates)"))?,
            None => optimizer,
        };
        Ok(Self {
            name,
            optimizer,
            vars,
            names,
            schedule,
            spec: plan.schedule,
            base_lr: plan.lr,
        })
    }

    /// Sets the optimizer's learning rate for (0-based) `step` from the schedule; returns it.
    pub fn set_lr_for_step(&mut self, step: usize) -> f64 {
        let lr = self.schedule.lr_at(self.base_lr, step);
        self.optimizer.set_learning_rate(lr);
        lr
    }
}

/// `spec` resolved for a run of `total_steps` (automatic warmup and decay lengths).
fn lr_schedule(spec: &ScheduleSpec, total_steps: u64) -> LrSchedule {
    spec.resolve(total_steps).lr_schedule()
}

/// What a resumed run's learning rates do when its length changed from `saved_total` steps
/// to this run's: one line per group whose rate at `step` differs, or one saying the rates
/// continue unchanged.
pub(super) fn schedule_change(groups: &[Group], saved_total: usize, step: usize) -> String {
    let changed: Vec<String> = groups
        .iter()
        .filter_map(|g| {
            let before = lr_schedule(&g.spec, saved_total as u64).lr_at(g.base_lr, step);
            let now = g.schedule.lr_at(g.base_lr, step);
            (before != now).then(|| {
                format!(
                    "{} lr at step {step} is {now:e} (the saved schedule had {before:e})",
                    g.name
                )
            })
        })
        .collect();
    match changed.is_empty() {
        true => "the learning rates continue unchanged (their schedule does not depend on the \
                 run's length)"
            .into(),
        false => format!(
            "the schedule is recomputed for the new length and continues from there: {}",
            changed.join("; ")
        ),
    }
}

/// Every trained parameter, named `<group>/<name>` as a save point stores it.
pub(super) fn named_params(groups: &[Group]) -> Vec<(String, Var)> {
    groups
        .iter()
        .flat_map(|g| {
            g.names
                .iter()
                .zip(&g.vars)
                .map(|(n, v)| (format!("{}/{n}", g.name), v.clone()))
        })
        .collect()
}

/// The groups' names, in order, as a save point records them.
pub(super) fn group_names(groups: &[Group]) -> Vec<String> {
    groups.iter().map(|g| g.name.to_string()).collect()
}

/// The optimizer groups: the UNet and, when trained, the text encoder(s); for adapter modes, the
/// adapter parameters with `adapter.unet_lr`/`text_encoder_lr` overriding the groups' lr.
/// What trains besides the model's own weights.
#[derive(Clone, Copy, Default)]
pub(super) struct Trained<'a> {
    pub adapters: Option<&'a TrainedAdapters>,
    pub embedding: Option<&'a super::embeddings::TrainedEmbedding>,
}

pub(super) fn param_groups(
    sd: &StableDiffusion,
    plan: &TrainPlan,
    trained: Trained<'_>,
    shape: GroupShape,
) -> anyhow::Result<Vec<Group>> {
    // The token's vectors: a group at the run's base settings (train.json's `lr`), as kohya's
    // train_textual_inversion trains them at `learning_rate`; after the adapters' groups when a
    // LoRA trains with them.
    let embedding = match trained.embedding {
        Some(e) => Some(Group::new(
            super::embeddings::GROUP,
            e.params(),
            &plan.optimizer.unet,
            shape,
            None,
        )?),
        None => None,
    };
    if trained.adapters.is_none() {
        if let Some(group) = embedding {
            return Ok(vec![group]);
        }
    }
    let adapters = trained.adapters;
    let (unet_params, te_params, unet_plan, te_plan) = match adapters {
        None => (
            sd.unet_weights.params(),
            trainable_text_encoder_params(sd, plan)?,
            plan.optimizer.unet,
            plan.optimizer.text_encoder,
        ),
        Some(a) => {
            let mut unet_plan = plan.optimizer.unet;
            let mut te_plan = plan.optimizer.text_encoder;
            if let Some(lr) = a.plan.unet_lr {
                unet_plan.lr = lr;
            }
            if let Some(lr) = a.plan.text_encoder_lr {
                te_plan.lr = lr;
            }
            (a.params(false), a.params(true), unet_plan, te_plan)
        }
    };
    // kohya's `block_lr` (a full fine-tune): blocks at 0 leave the group, the others scale it.
    let (unet_params, block_scale) = match (&plan.block_lr, adapters) {
        (Some(rates), None) => {
            let (kept, scale) = super::block_lr::by_block(sd, unet_params, rates, unet_plan.lr)?;
            (kept, Some(scale))
        }
        _ => (unet_params, None),
    };
    let mut groups = Vec::new();
    // `disable_unet_training`: the UNet is frozen and has no group.
    if plan.train_unet {
        if unet_params.is_empty() {
            anyhow::bail!(
                "every UNet adapter is in a block of learning-rate weight 0, so the UNet has \
                 nothing to train (adapter.down_lr_weight, mid_lr_weight, up_lr_weight)"
            );
        }
        // Rates of 0 and the group's own only switch blocks off: nothing to scale (which the
        // learning-rate-free optimizers could not do).
        let block_scale = block_scale.filter(|s| s.values().any(|x| *x != 1.0));
        let lr_scale: Option<super::adapter_blocks::LrScale<'_>> = match &block_scale {
            Some(scale) => Some(Box::new(move |name: &str| {
                scale.get(name).copied().unwrap_or(1.0)
            })),
            None => adapters.and_then(|a| a.lr_scale(false)),
        };
        groups.push(
            Group::new("unet", unet_params, &unet_plan, shape, lr_scale).with_context(|| {
                match block_scale {
                    Some(_) => "block_lr",
                    None => "the UNet's parameters",
                }
            })?,
        );
    }
    if !te_params.is_empty() {
        groups.push(Group::new(
            "text_encoder",
            te_params,
            &te_plan,
            shape,
            adapters.and_then(|a| a.lr_scale(true)),
        )?);
    }
    groups.extend(embedding);
    Ok(groups)
}

/// The trainable text-encoder parameters: all of them unless `text_encoder_freezing` freezes
/// some, as EveryDream2 does. An encoder with every layer frozen is refused.
fn trainable_text_encoder_params(
    sd: &StableDiffusion,
    plan: &TrainPlan,
) -> anyhow::Result<Vec<(String, Var)>> {
    if !plan.train_text_encoder {
        return Ok(Vec::new());
    }
    let freeze = &plan.text_encoder_freeze;
    for te in &sd.text_encoders {
        if let Some(why) = freeze.check(te.model.num_layers()) {
            anyhow::bail!("{why}");
        }
    }
    let folders = [Component::TextEncoder, Component::TextEncoder2];
    Ok(sd
        .text_encoders
        .iter()
        .zip(folders)
        .flat_map(|(te, folder)| {
            let layers = te.model.num_layers();
            // Prefixed by the component: SDXL's two encoders share checkpoint names.
            te.weights
                .params()
                .into_iter()
                .filter_map(move |(name, var)| {
                    text_encoder_param_trains(&name, layers, freeze)
                        .then(|| (format!("{folder}.{name}"), var))
                })
        })
        .collect())
}

#[cfg(test)]
mod lr_scale_tests {
    use super::*;
    use crate::config::{ScheduleKind, StepCount};
    use crate::optim::Optimizer;
    use candle_core::{Device, Tensor};

    fn plan(optimizer: OptimizerKind) -> ParamGroupPlan {
        ParamGroupPlan {
            optimizer,
            lr: 1e-3,
            betas: OptimizerKind::default_betas(optimizer),
            epsilon: 1e-8,
            weight_decay: 0.01,
            schedule: ScheduleSpec {
                kind: ScheduleKind::Constant,
                warmup_steps: StepCount::Auto,
                decay_steps: StepCount::Auto,
                num_cycles: 1.0,
                power: 1.0,
                decay_phase: StepCount::Steps(0),
                shape: Default::default(),
            },
            adafactor: Default::default(),
            estimator: Default::default(),
            schedulefree: Default::default(),
            came: Default::default(),
        }
    }

    fn var(seed: u64) -> Var {
        let v = crate::optim::test_values(seed, 64, 0.5);
        Var::from_tensor(&Tensor::from_vec(v, (8, 8), &Device::Cpu).unwrap()).unwrap()
    }

    /// Steps `opt` three times with fixed gradients for `vars` (the gradient of step `s` of var
    /// `i` is seeded by `(i, s)`).
    fn run(opt: &mut GroupOptimizer, vars: &[(usize, &Var)]) {
        for step in 0..3u64 {
            let mut loss = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu).unwrap();
            for &(i, v) in vars {
                let g = crate::optim::test_values(100 + 10 * i as u64 + step, 64, 1.0);
                let g = Tensor::from_vec(g, (8, 8), &Device::Cpu).unwrap();
                loss = (loss + (v.as_tensor() * g).unwrap().sum_all().unwrap()).unwrap();
            }
            opt.step(&loss.backward().unwrap()).unwrap();
        }
    }

    fn values(v: &Var) -> Vec<f32> {
        v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// LoRA+'s scaled parameter updates exactly as it would in a group of its own at the scaled
    /// rate (kohya's "plus" group), and the others as before, for every one-pass optimizer.
    /// Catches the scale ignored, applied to the wrong parameter, or applied twice.
    #[test]
    fn a_scaled_parameter_steps_as_its_own_group_at_the_scaled_rate() {
        let one_pass = [
            OptimizerKind::AdamW,
            OptimizerKind::AdamW8bit,
            OptimizerKind::Lion,
            OptimizerKind::Lion8bit,
            OptimizerKind::Adafactor,
            OptimizerKind::Came,
            OptimizerKind::Came8bit,
        ];
        assert!(OptimizerKind::ALL
            .iter()
            .all(|k| k.scales_per_parameter() == one_pass.contains(k)));
        for kind in one_pass {
            let p = plan(kind);
            let (down, up) = (var(1), var(2));
            let params = vec![
                ("m.lora_down.weight".to_string(), down.clone()),
                ("m.lora_up.weight".to_string(), up.clone()),
            ];
            let mut joint = build_optimizer(&p, params)
                .unwrap()
                .scale_lr(|n| if n.contains("lora_up") { 4.0 } else { 1.0 })
                .unwrap();
            run(&mut joint, &[(0, &down), (1, &up)]);
            let (down2, up2) = (var(1), var(2));
            let mut alone = build_optimizer(&p, vec![("d".into(), down2.clone())]).unwrap();
            run(&mut alone, &[(0, &down2)]);
            let scaled = ParamGroupPlan {
                lr: p.lr * 4.0,
                ..p
            };
            let mut plus = build_optimizer(&scaled, vec![("u".into(), up2.clone())]).unwrap();
            run(&mut plus, &[(1, &up2)]);
            assert_eq!(values(&down), values(&down2), "{kind:?} down");
            assert_eq!(values(&up), values(&up2), "{kind:?} up");
            assert_ne!(values(&up), values(&var(2)), "{kind:?} moved");
        }
        // A learning-rate-free optimizer, or schedule-free AdamW, has no per-parameter rate.
        for kind in [OptimizerKind::Prodigy, OptimizerKind::AdamWScheduleFree] {
            let opt = build_optimizer(&plan(kind), vec![("x".into(), var(3))]);
            assert!(opt.unwrap().scale_lr(|_| 2.0).is_err(), "{kind:?}");
        }
    }
}
