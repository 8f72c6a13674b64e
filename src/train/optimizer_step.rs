//! One optimizer step, straight down (nanoGPT's shape):
//! 1. forward and backward over the step's samples, a chunk of at most the micro-batch at a time
//!    ([`SampleCursor`]), each chunk's loss weighted by its share of the effective batch, and the
//!    gradients summed ([`GradAccumulator`]); an out-of-memory error halves the micro-batch and
//!    retries the same samples ([`halve_after_oom`]);
//! 2. clipping, per group, as EveryDream2's `clip_grad_norm` does, or over every trained
//!    parameter at once, as kohya's `max_grad_norm` does;
//! 3. the step's one device→host sync: the loss and every gradient's sum of squares;
//! 4. the loss scaler's update and, when everything is finite, each group's update, one
//!    parameter at a time so an out-of-memory error retries that parameter alone.

use std::time::Instant;

use anyhow::{anyhow, Context};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use super::accumulate::{Accumulated, GradAccumulator};
use super::data_feed::StepData;
use super::data_parallel::{
    agree_micro, check_same_weights, reduce_step, RankLink, CHUNK_ELEMS, WEIGHT_CHECK_EVERY,
};
use super::micro_batch::MicroBatching;
use super::oom::{injected, OutOfMemory};
use super::oom_policy::{halve_after_oom, retry_once_on_oom};
use super::param_groups::Group;
use super::sample_cursor::{Chunk, SampleCursor};
use super::step::{forward_backward, prepare_batch, sample_rngs, StepSettings};
use crate::model::pipeline::StableDiffusion;
use crate::optim::{clip_grad_norm, ClipScope, Finite, GradClip, StepCheck};
use crate::precision::{LossScaler, ScaleChange};

/// The optimizer groups and the state one update needs.
pub(super) struct Optimization {
    pub groups: Vec<Group>,
    /// Every trainable parameter, over all groups.
    pub params: Vec<Var>,
    pub scaler: Box<dyn LossScaler>,
    /// The micro-batch size in force (halved by out-of-memory retries).
    pub micro: MicroBatching,
    /// The run's optimizer steps.
    pub total_steps: usize,
    /// `fused_backward_pass`: each parameter updated as its gradient completes
    /// ([`super::fused`]).
    pub fused: bool,
    /// Data parallel: this rank's link to the others ([`super::data_parallel`]).
    pub dist: Option<RankLink>,
    /// kohya's `stop_text_encoder_training`: from this step on the text encoders' group is left
    /// out (its gradients dropped before clipping, no update), as kohya's
    /// `text_encoder.requires_grad_(False)` leaves them without gradients.
    pub te_stop: Option<usize>,
}

/// The text encoders' group's name (`param_groups`).
const TEXT_ENCODER_GROUP: &str = "text_encoder";

/// What one optimizer step did.
pub(super) struct StepReport {
    pub loss: f64,
    pub grad_norm: f64,
    /// False when a gradient or the loss was non-finite and the update was skipped.
    pub applied: bool,
    pub lrs: Vec<f64>,
    pub images: usize,
    /// The step's image pixels (each sample's bucket area), the unit its time is judged in.
    pub pixels: usize,
    /// The step's wall time: forward, backward and update (the data is decoded ahead, on its
    /// own thread).
    pub secs: f64,
    pub scale: ScaleChange,
    /// One line per out-of-memory retry during the step.
    pub retries: Vec<String>,
    /// What `scale_weight_norms` did after the update (set by the trainer).
    pub max_norm: Option<crate::adapter::max_norm::MaxNormStats>,
}

impl Optimization {
    /// Whether a text encoder trains (it has its own group).
    pub fn text_encoder_trains(&self) -> bool {
        self.groups
            .iter()
            .any(|g| g.name == "text_encoder" || g.name == super::embeddings::GROUP)
    }

    /// `f` with the weights to evaluate and save in the parameters (schedule-free AdamW's `x`;
    /// the training weights for every other optimizer), and the training weights put back
    /// exactly afterwards, whether `f` failed or not. Sampling, validation and the saved weights
    /// go through here; the resume save point does not (it keeps the training weights).
    pub fn with_eval_weights<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let swapped = self.swap_eval();
        let result = swapped.and_then(|()| f(self));
        let back = self.swap_train();
        let value = result?;
        back?;
        Ok(value)
    }

    fn swap_eval(&mut self) -> anyhow::Result<()> {
        for g in self.groups.iter_mut() {
            g.optimizer
                .eval_weights()
                .with_context(|| format!("{} optimizer: evaluation weights", g.name))?;
        }
        Ok(())
    }

    fn swap_train(&mut self) -> anyhow::Result<()> {
        for g in self.groups.iter_mut() {
            g.optimizer
                .train_weights()
                .with_context(|| format!("{} optimizer: training weights", g.name))?;
        }
        Ok(())
    }

    /// One optimizer step over `data` (the step's micro-batches, each of one bucket, and their
    /// samples), (0-based) `step` of the run.
    pub fn step(
        &mut self,
        sd: &StableDiffusion,
        settings: &StepSettings<'_>,
        data: &StepData,
        step: usize,
        clip: Option<GradClip>,
        device: &Device,
    ) -> anyhow::Result<StepReport> {
        if self.fused {
            if self.dist.is_some() {
                anyhow::bail!("fused_backward_pass does not run data-parallel");
            }
            // Per tensor whatever the scope: no norm over many tensors is known until the
            // backward pass ends (kohya's fused pass clips each tensor too).
            let max = clip.map(|c| c.max);
            return self.step_fused(sd, settings, data, step, max, device);
        }
        let started = Instant::now();
        self.scaler.begin_step(step);
        let loss_scale = self.scaler.scale();
        let mut micro = self.micro;
        let shard = self.dist.as_ref().map_or((0, 1), |l| (l.rank(), l.world()));
        let result = accumulate_grads(
            sd,
            settings,
            data,
            (&self.params, shard),
            step,
            &mut micro,
            loss_scale,
            device,
        );
        // Kept whether the step succeeded or ran out of memory at batch 1: the save says so.
        self.micro = micro;
        let (done, retries) = result?;
        let mut done = self
            .combine(done, device)?
            .ok_or_else(|| anyhow!("optimizer step {} had no micro-batches", step + 1))?;
        let te_stopped = self.te_stop.is_some_and(|n| step >= n);
        if te_stopped {
            for g in self.groups.iter().filter(|g| g.name == TEXT_ENCODER_GROUP) {
                for v in &g.vars {
                    done.grads.remove(v.as_tensor());
                }
            }
        }
        let pre_clip = match clip {
            Some(c) => Some(self.clip(&mut done.grads, c)?),
            None => None,
        };
        // The step's one device→host sync: the loss and every gradient's sum of squares.
        let present: Vec<&Tensor> = self
            .params
            .iter()
            .filter_map(|v| done.grads.get(v))
            .collect();
        let check = StepCheck::fetch(&done.loss, &present)?;
        let lrs: Vec<f64> = self
            .groups
            .iter_mut()
            .map(|g| g.set_lr_for_step(step))
            .collect();
        let finite = check.finite();
        let scale = self.scaler.update(finite.is_some());
        if let Some(finite) = finite {
            for g in self.groups.iter_mut() {
                if te_stopped && g.name == TEXT_ENCODER_GROUP {
                    continue;
                }
                update_group(g, &done.grads, finite, device, step)?;
            }
        }
        if let Some(link) = self.dist.as_mut() {
            if cfg!(debug_assertions) && step.is_multiple_of(WEIGHT_CHECK_EVERY) {
                check_same_weights(link.coll.as_mut(), &self.params, step)?;
            }
        }
        Ok(StepReport {
            loss: check.loss,
            grad_norm: pre_clip.unwrap_or(f64::from(check.grad_norm)),
            applied: finite.is_some(),
            lrs,
            images: done.samples,
            pixels: data.pixels(),
            secs: started.elapsed().as_secs_f64(),
            scale,
            retries,
            max_norm: None,
        })
    }

    /// The step's loss and gradients over every rank (this rank's alone without data
    /// parallel); `None` when no rank had a micro-batch.
    fn combine(
        &mut self,
        done: Option<Accumulated>,
        device: &Device,
    ) -> anyhow::Result<Option<Accumulated>> {
        let Some(link) = self.dist.as_mut() else {
            return Ok(done);
        };
        let mut done = match done {
            Some(d) => d,
            None => Accumulated {
                loss: Tensor::new(0f32, device)?,
                grads: GradStore::default(),
                micro_batches: 0,
                samples: 0,
            },
        };
        reduce_step(link, &self.params, &mut done, CHUNK_ELEMS)?;
        agree_micro(link.coll.as_mut(), &mut self.micro)?;
        Ok((done.micro_batches > 0).then_some(done))
    }

    fn clip(&self, grads: &mut GradStore, clip: GradClip) -> anyhow::Result<f64> {
        clip_groups(
            self.groups.iter().map(|g| (g.name, g.vars.as_slice())),
            grads,
            clip,
        )
    }
}

/// Clips the gradients to `clip.max`: each group's norm on its own (EveryDream2's
/// clip_grad_norm), or one norm over every group (kohya's max_grad_norm). Returns the global
/// norm before clipping, which is what the log shows.
fn clip_groups<'a>(
    groups: impl IntoIterator<Item = (&'a str, &'a [Var])>,
    grads: &mut GradStore,
    clip: GradClip,
) -> anyhow::Result<f64> {
    match clip.scope {
        ClipScope::PerGroup => clip_each_group(groups, grads, clip.max),
        ClipScope::Global => {
            let vars = groups.into_iter().flat_map(|(_, vars)| vars.iter());
            let norm = clip_grad_norm(vars, grads, clip.max).context("gradient clipping")?;
            Ok(f64::from(norm))
        }
    }
}

/// EveryDream2's clip_grad_norm: each group (UNet, text encoder) clipped to the norm on its own.
/// Returns the global norm before clipping, which is what the log shows.
fn clip_each_group<'a>(
    groups: impl IntoIterator<Item = (&'a str, &'a [Var])>,
    grads: &mut GradStore,
    max: f64,
) -> anyhow::Result<f64> {
    let mut sq = 0f64;
    for (name, vars) in groups {
        let n = clip_grad_norm(vars, grads, max)
            .with_context(|| format!("{name} gradient clipping"))?;
        sq += f64::from(n).powi(2);
    }
    Ok(sq.sqrt())
}

/// Forward and backward over every sample of `data` (this rank's micro-batches of it, with
/// `shard` = (rank, world)), `micro.size` at a time within each micro-batch, halving `micro` on
/// an out-of-memory error and retrying the same samples. Returns the accumulated loss and
/// gradients (`None` when there was nothing to train), and one line per retry.
#[allow(clippy::too_many_arguments)]
fn accumulate_grads(
    sd: &StableDiffusion,
    settings: &StepSettings<'_>,
    data: &StepData,
    (params, shard): (&[Var], (usize, usize)),
    step: usize,
    micro: &mut MicroBatching,
    loss_scale: f64,
    device: &Device,
) -> anyhow::Result<(Option<Accumulated>, Vec<String>)> {
    let mut acc = GradAccumulator::new(params);
    let mut retries = Vec::new();
    let mut cursor = SampleCursor::for_rank(&data.micro, shard.0, shard.1);
    while let Some(chunk) = cursor.peek(micro.size) {
        match train_chunk(sd, settings, data, &chunk, step, loss_scale) {
            Ok((loss, grads)) => {
                acc.add(loss, grads, chunk.range.len())?;
                cursor.advance(&chunk);
            }
            Err(e) => retries.push(halve_after_oom(e, micro, device, step, cursor.effective())?),
        }
    }
    Ok((acc.finish(loss_scale)?, retries))
}

/// Draws, forward and backward for one chunk of the step's samples, with their own seeds; the
/// loss is weighted by the chunk's share of the step.
pub(super) fn train_chunk(
    sd: &StableDiffusion,
    settings: &StepSettings<'_>,
    data: &StepData,
    chunk: &Chunk<'_>,
    step: usize,
    loss_scale: f64,
) -> anyhow::Result<(Tensor, GradStore)> {
    let samples = data.chunk_samples(chunk.range.clone())?;
    let mut rngs = sample_rngs(&data.seeds[chunk.range.clone()]);
    let batch = prepare_batch(sd, &samples, settings, &mut rngs)?;
    let result = forward_backward(sd, &batch, settings, chunk.share, loss_scale)?;
    if injected(step, chunk.ids) {
        return Err(OutOfMemory {
            detail: "injected by a test".into(),
        }
        .into());
    }
    Ok(result)
}

/// The group's update, one parameter at a time (in each of the rule's passes), each under
/// [`retry_once_on_oom`]: a retry repeats only the parameter that failed, so none is updated
/// twice.
fn update_group(
    g: &mut Group,
    grads: &GradStore,
    finite: Finite,
    device: &Device,
    step: usize,
) -> anyhow::Result<()> {
    let name = g.name;
    let optimizer = &mut g.optimizer;
    let pending = optimizer.pending(grads)?;
    optimizer
        .begin_step(&pending)
        .with_context(|| format!("{name} optimizer step"))?;
    for &pass in optimizer.passes() {
        if !optimizer.start_pass(pass)? {
            break;
        }
        for &(slot, grad) in &pending {
            let place = || format!("in the {name} optimizer step at step {}", step + 1);
            retry_once_on_oom(device, place, || {
                optimizer
                    .apply_pass(pass, slot, grad, finite)
                    .with_context(|| format!("{name} optimizer step"))
            })?;
        }
    }
    Ok(())
}

/// The line printed for a skipped step.
pub(super) fn skipped_message(step: usize, scale: ScaleChange) -> String {
    match scale {
        ScaleChange::BackedOff(s) => format!(
            "step {step}: gradients overflowed in fp16, step skipped; loss scale lowered to {s}"
        ),
        ScaleChange::Unchanged | ScaleChange::Grew(_) => {
            format!("step {step}: non-finite loss or gradient, step skipped")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gradients of norms 3 (the UNet's, `[0, 3]`) and 4 (the text encoder's, `[4]`) clipped
    /// to `max` in `scope`: the norm returned, and the two gradients after.
    fn clipped(scope: ClipScope, max: f64) -> anyhow::Result<(f64, Vec<f32>, Vec<f32>)> {
        let dev = candle_core::Device::Cpu;
        let unet = [Var::zeros(2, candle_core::DType::F32, &dev)?];
        let te = [Var::zeros(1, candle_core::DType::F32, &dev)?];
        let mut grads = GradStore::default();
        grads.insert(unet[0].as_tensor(), Tensor::new(&[0.0f32, 3.0], &dev)?);
        grads.insert(te[0].as_tensor(), Tensor::new(&[4.0f32], &dev)?);
        let groups = [("unet", &unet[..]), ("text_encoder", &te[..])];
        let norm = clip_groups(groups, &mut grads, GradClip { max, scope })?;
        let get = |v: &Var| grads.get(v).map(|g| g.to_vec1::<f32>()).transpose();
        let (u, t) = (get(&unet[0])?, get(&te[0])?);
        Ok((norm, u.unwrap_or_default(), t.unwrap_or_default()))
    }

    /// Each group is clipped to `max` on its own, and the norm returned (the log's) is the
    /// global one before clipping: √(3² + 4²) = 5 for groups of norms 3 and 4 (an overwrite
    /// instead of a sum returns 4; one norm over both groups would clip them alike).
    #[test]
    fn each_group_is_clipped_alone_and_the_global_norm_is_logged() -> anyhow::Result<()> {
        let (norm, u, t) = clipped(ClipScope::PerGroup, 3.5)?;
        assert!((norm - 5.0).abs() < 1e-6, "{norm}");
        assert_eq!(u, vec![0.0, 3.0]);
        assert!((t[0] - 3.5).abs() < 1e-5, "{t:?}");
        Ok(())
    }

    /// kohya's global norm: both groups scale by the one coefficient 2.5 / (5 + 1e-6), torch's
    /// `clip_grad_norm_` over all of them. Per-group clipping would leave the UNet's (norm 3)
    /// alone at 3.5; clipping only one group would leave the other unscaled.
    #[test]
    fn the_global_scope_clips_every_group_by_one_norm() -> anyhow::Result<()> {
        let (norm, u, t) = clipped(ClipScope::Global, 2.5)?;
        assert!((norm - 5.0).abs() < 1e-6, "{norm}");
        let coef = 2.5 / (5.0 + 1e-6);
        assert!((f64::from(u[1]) - 3.0 * coef).abs() < 1e-6, "{u:?}");
        assert!((f64::from(t[0]) - 4.0 * coef).abs() < 1e-6, "{t:?}");
        Ok(())
    }
}
