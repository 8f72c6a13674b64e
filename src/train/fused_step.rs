//! One optimizer step with the fused backward pass ([`super::fused`]): the step's chunks as
//! [`super::optimizer_step`] runs them, the last one's backward updating each parameter as its
//! gradient completes.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Instant;

use anyhow::{anyhow, Context};
use candle_core::{DType, Device, Tensor, TensorId};

use super::accumulate::GradAccumulator;
use super::data_feed::StepData;
use super::fused::FusedSink;
use super::oom::{injected, OutOfMemory};
use super::oom_policy::halve_after_oom;
use super::optimizer_step::{train_chunk, Optimization, StepReport};
use super::sample_cursor::{Chunk, SampleCursor};
use super::step::{forward_loss, prepare_batch, sample_rngs, StepSettings};
use crate::model::pipeline::StableDiffusion;
use crate::nn::grad_sink::{self, GradSink};

/// The installed form of the sink: the step keeps the other reference and takes the sink back
/// after the backward.
struct Shared(Rc<RefCell<FusedSink>>);

impl GradSink for Shared {
    fn deliver(&mut self, param: &Tensor, grad: Tensor) -> candle_core::Result<()> {
        self.0.borrow_mut().deliver(param, grad)
    }
}

impl Optimization {
    /// [`Optimization::step`] with the fused backward pass.
    pub(super) fn step_fused(
        &mut self,
        sd: &StableDiffusion,
        settings: &StepSettings<'_>,
        data: &StepData,
        step: usize,
        clip: Option<f64>,
        device: &Device,
    ) -> anyhow::Result<StepReport> {
        let started = Instant::now();
        self.scaler.begin_step(step);
        let loss_scale = self.scaler.scale();
        let lrs: Vec<f64> = self
            .groups
            .iter_mut()
            .map(|g| g.set_lr_for_step(step))
            .collect();
        let groups = std::mem::take(&mut self.groups);
        let sink = Rc::new(RefCell::new(FusedSink::new(groups, loss_scale, clip)));
        let mut micro = self.micro;
        let result = run_chunks(
            sd,
            settings,
            data,
            &self.params,
            step,
            &mut micro,
            &sink,
            device,
        );
        self.micro = micro;
        // The groups come back whatever happened.
        let sink = Rc::try_unwrap(sink)
            .map_err(|_| anyhow!("fused backward: the sink is still installed"))?
            .into_inner();
        let FusedSink {
            groups,
            sumsq,
            nonfinite,
            ..
        } = sink;
        self.groups = groups;
        for g in &mut self.groups {
            // A two-pass rule's estimate takes the step's sums once every update is done.
            g.optimizer
                .end_fused_step()
                .with_context(|| format!("{} optimizer step", g.name))?;
        }
        let (loss, retries, samples) = result?;
        let applied = nonfinite.is_empty();
        if !applied {
            eprintln!(
                "step {}: non-finite gradient for {} parameter(s), left unchanged: {}",
                step + 1,
                nonfinite.len(),
                nonfinite.join(", ")
            );
        }
        let scale = self.scaler.update(applied);
        Ok(StepReport {
            loss: f64::from(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?),
            grad_norm: sumsq.sqrt(),
            applied,
            lrs,
            images: samples,
            pixels: data.pixels(),
            secs: started.elapsed().as_secs_f64(),
            scale,
            retries,
            max_norm: None,
        })
    }
}

/// Every chunk of the step: the earlier ones accumulated, the last one fused. Returns the step's
/// loss, the retry lines and the samples trained.
#[allow(clippy::too_many_arguments)]
fn run_chunks(
    sd: &StableDiffusion,
    settings: &StepSettings<'_>,
    data: &StepData,
    params: &[candle_core::Var],
    step: usize,
    micro: &mut super::micro_batch::MicroBatching,
    sink: &Rc<RefCell<FusedSink>>,
    device: &Device,
) -> anyhow::Result<(Tensor, Vec<String>, usize)> {
    let mut acc = GradAccumulator::new(params);
    let mut retries = Vec::new();
    let mut cursor = SampleCursor::new(&data.micro);
    let mut samples = 0;
    while let Some(chunk) = cursor.peek(micro.size) {
        if !cursor.is_last(&chunk) {
            match train_chunk(sd, settings, data, &chunk, step, sink.borrow().loss_scale()) {
                Ok((loss, grads)) => {
                    acc.add(loss, grads, chunk.range.len())?;
                    samples += chunk.range.len();
                    cursor.advance(&chunk);
                }
                Err(e) => {
                    retries.push(halve_after_oom(e, micro, device, step, cursor.effective())?)
                }
            }
            continue;
        }
        sink.borrow_mut().earlier = acc.take_grads();
        let result = last_chunk(sd, settings, data, &chunk, step, sink);
        acc.put_back(std::mem::take(&mut sink.borrow_mut().earlier));
        match result {
            Ok(loss) => {
                let total = match acc.loss() {
                    Some(before) => (before + loss)?,
                    None => loss,
                };
                samples += chunk.range.len();
                return Ok((total, retries, samples));
            }
            Err(e) => {
                let updated = sink.borrow().done.len();
                let mut line = halve_after_oom(e, micro, device, step, cursor.effective())?;
                if updated > 0 {
                    line.push_str(&format!(
                        "; {updated} parameter(s) were already updated by the fused backward \
                         pass, so this step's other parameters are updated from gradients \
                         recomputed with those updates in place (this step is not exact)"
                    ));
                }
                retries.push(line);
            }
        }
    }
    Err(anyhow!("optimizer step {} had no micro-batches", step + 1))
}

/// The last chunk: forward, then the backward with the sink installed, then every parameter
/// whose gradient came from the earlier chunks alone. Returns the chunk's weighted loss.
fn last_chunk(
    sd: &StableDiffusion,
    settings: &StepSettings<'_>,
    data: &StepData,
    chunk: &Chunk<'_>,
    step: usize,
    sink: &Rc<RefCell<FusedSink>>,
) -> anyhow::Result<Tensor> {
    if let Some(ck) = settings.checkpointing {
        // Counts from the earlier chunks' forwards are not this backward's.
        ck.take_uses()?;
    }
    let samples = data.chunk_samples(chunk.range.clone())?;
    let mut rngs = sample_rngs(&data.seeds[chunk.range.clone()]);
    let batch = prepare_batch(sd, &samples, settings, &mut rngs)?;
    let loss = forward_loss(sd, &batch, settings)?;
    if injected(step, chunk.ids) {
        return Err(OutOfMemory {
            detail: "injected by a test".into(),
        }
        .into());
    }
    let value = (loss.detach().to_dtype(DType::F32)? * chunk.share)?;
    let scaled = (loss * (chunk.share / sink.borrow().loss_scale()))?;
    let outer: HashSet<TensorId> = scaled
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable())
        .map(|n| n.id())
        .collect();
    let uses = match settings.checkpointing {
        Some(ck) => ck.take_uses()?,
        None => Default::default(),
    };
    sink.borrow_mut().expect(&uses, &outer);
    grad_sink::install(Box::new(Shared(sink.clone())));
    let backward = scaled.into_backward_with(&mut |node, g| grad_sink::deliver(node, g));
    drop(grad_sink::take());
    if let Err(e) = backward {
        return Err(match sink.borrow_mut().error.take() {
            Some(update) => update,
            None => anyhow::Error::new(e).context("fused backward pass"),
        });
    }
    sink.borrow_mut()
        .finish_earlier()
        .context("fused backward pass")?;
    Ok(value)
}
