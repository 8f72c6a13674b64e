//! The fused backward pass (`fused_backward_pass: true`, kohya's `--fused_backward_pass`,
//! OneTrainer's fused back pass): each trained parameter is updated as soon as its gradient is
//! complete, and the gradient is dropped, so the gradients of the whole model never sit in memory
//! at once.
//!
//! - The step's last chunk of samples runs its backward with [`FusedSink`] installed
//!   (`nn::grad_sink`). The outer backward hands over each parameter's gradient when its walk
//!   reaches the parameter (`Tensor::backward_with`), and each checkpointed segment's inner
//!   backward hands over the parts of the gradients of the parameters it uses; the sink waits
//!   for every part (one per segment that used the parameter, one from the outer graph), then
//!   updates the parameter with its group's optimizer (`GroupOptimizer::update_one`).
//! - Earlier chunks (gradient accumulation, or a micro-batch halved after an out-of-memory
//!   error) accumulate as without fusion; the sink adds their sum to the last chunk's gradient
//!   before the update, in the order the unfused step adds them. With clipping off, a fused step
//!   therefore updates every parameter bit for bit as the unfused step does.
//! - Clipping is per tensor (OneTrainer's rule): the global norm is not known until backward
//!   ends, so each gradient is clipped to `clip_grad_norm` by its own L2 norm, with torch's
//!   `clip_grad_norm_` coefficient `max / (norm + 1e-6)`, capped at 1. The logged norm is still
//!   the global one, summed from the tensors' norms.
//! - A non-finite gradient leaves its parameter untouched; the step goes on for the others and
//!   is reported as skipped (the unfused step skips every parameter, having seen all gradients
//!   first). fp16 is refused: its loss scaler must see every gradient before any update.
//! - An out-of-memory error before the first update retries the same samples at half the
//!   micro-batch, exactly as without fusion. After some parameters were updated, the step cannot
//!   be redone exactly (their old values are gone): the remaining parameters are updated from
//!   gradients recomputed at half the micro-batch with those updates in place, and the retry's
//!   line says so. The parameters already updated are not updated twice.

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId, Var};

use super::param_groups::Group;
use crate::nn::grad_sink::GradSink;
use crate::optim::grad::check_one;

/// torch's `clip_grad_norm_` guard against a zero norm.
const CLIP_EPS: f64 = 1e-6;

/// `g` scaled so its L2 norm (`√sumsq`, from the step check's sum of squares) is at most `max`:
/// torch's `clip_grad_norm_` on one tensor.
pub fn clip_tensor(g: &Tensor, sumsq: f64, max: f64) -> Result<Tensor> {
    let coef = max / (sumsq.sqrt() + CLIP_EPS);
    if coef < 1.0 {
        g * coef
    } else {
        Ok(g.clone())
    }
}

/// The fused step's updates: it owns the optimizer groups while the backward runs.
pub(super) struct FusedSink {
    pub groups: Vec<Group>,
    /// Each trained parameter: its group and Var.
    owner: HashMap<TensorId, (usize, Var)>,
    /// Parts each parameter's gradient comes in, in the current chunk.
    expected: HashMap<TensorId, usize>,
    /// Parts received so far, summed.
    pending: HashMap<TensorId, (Tensor, usize)>,
    /// The step's earlier chunks' summed gradients.
    pub earlier: GradStore,
    loss_scale: f64,
    unscale: f64,
    clip: Option<f64>,
    /// Parameters updated this step.
    pub done: HashSet<TensorId>,
    /// Σ‖g‖² over the updated (and the non-finite) gradients, before clipping.
    pub sumsq: f64,
    /// Parameters whose gradient was not finite.
    pub nonfinite: Vec<String>,
    /// The first error an update raised (the backward stops there).
    pub error: Option<anyhow::Error>,
}

impl FusedSink {
    /// A sink over `groups` for a step whose loss was scaled by `loss_scale`.
    pub fn new(groups: Vec<Group>, loss_scale: f64, clip: Option<f64>) -> Self {
        let owner = groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| {
                g.vars
                    .iter()
                    .map(move |v| (v.as_tensor().id(), (gi, v.clone())))
            })
            .collect();
        Self {
            groups,
            owner,
            expected: HashMap::new(),
            pending: HashMap::new(),
            earlier: GradStore::default(),
            loss_scale,
            unscale: 1.0 / loss_scale,
            clip,
            done: HashSet::new(),
            sumsq: 0.0,
            nonfinite: Vec::new(),
            error: None,
        }
    }

    /// The factor the step's loss is multiplied by before backward.
    pub fn loss_scale(&self) -> f64 {
        self.loss_scale
    }

    /// Expects, in the chunk about to run backward, `segment_uses[p]` parts from checkpointed
    /// segments and one more for each parameter in `outer` (the outer graph's variables).
    pub fn expect(&mut self, segment_uses: &HashMap<TensorId, usize>, outer: &HashSet<TensorId>) {
        self.pending.clear();
        self.expected = self
            .owner
            .keys()
            .map(|id| {
                let parts =
                    segment_uses.get(id).copied().unwrap_or(0) + usize::from(outer.contains(id));
                (*id, parts)
            })
            .filter(|(_, parts)| *parts > 0)
            .collect();
    }

    /// Updates every parameter with a gradient from the earlier chunks only (none in the last).
    pub fn finish_earlier(&mut self) -> anyhow::Result<()> {
        let left: Vec<Var> = self
            .owner
            .iter()
            .filter(|(id, _)| !self.done.contains(id))
            .filter(|(_, (_, v))| self.earlier.get(v.as_tensor()).is_some())
            .map(|(_, (_, v))| v.clone())
            .collect();
        for v in left {
            if let Some(g) = self.earlier.remove(v.as_tensor()) {
                self.update(v.as_tensor().id(), g)?;
            }
        }
        let waiting = self.pending.len();
        if waiting > 0 {
            anyhow::bail!("fused backward: {waiting} parameter gradient(s) never completed");
        }
        Ok(())
    }

    /// The complete gradient `g` of parameter `id` (the last chunk's): the earlier chunks' sum
    /// added, the loss scale divided out, checked, clipped, applied.
    fn update(&mut self, id: TensorId, g: Tensor) -> anyhow::Result<()> {
        let Some((gi, var)) = self.owner.get(&id).cloned() else {
            return Ok(());
        };
        #[cfg(test)]
        if inject::fires(self.done.len()) {
            return Err(super::oom::OutOfMemory {
                detail: "injected into a fused update by a test".into(),
            }
            .into());
        }
        if !self.done.insert(id) {
            return Ok(());
        }
        let g = match self.earlier.remove(var.as_tensor()) {
            Some(a) => (a + g)?.detach(),
            None => g,
        };
        let g = if self.unscale != 1.0 {
            (g * self.unscale)?
        } else {
            g
        };
        // The step's check, for this one gradient: its norm, and whether every value is finite
        // (huge but finite gradients are applied, as torch and the unfused step do).
        let (sq, finite) = check_one(&g)?;
        self.sumsq += sq;
        let group = &mut self.groups[gi];
        let Some(finite) = finite else {
            let name = group.vars.iter().position(|v| v.as_tensor().id() == id);
            let name = name.map_or_else(|| format!("{:?}", var.dims()), |i| group.names[i].clone());
            self.nonfinite.push(format!("{}/{name}", group.name));
            return Ok(());
        };
        let g = match self.clip {
            Some(max) => clip_tensor(&g, sq, max)?,
            None => g,
        };
        group.optimizer.update_one_checked(&var, &g, finite)?;
        Ok(())
    }
}

impl GradSink for FusedSink {
    fn deliver(&mut self, param: &Tensor, grad: Tensor) -> Result<()> {
        let id = param.id();
        let Some(&parts) = self.expected.get(&id) else {
            return Ok(());
        };
        let (sum, got) = match self.pending.remove(&id) {
            None => (grad, 1),
            Some((sum, got)) => ((sum + grad)?.detach(), got + 1),
        };
        if got < parts {
            self.pending.insert(id, (sum, got));
            return Ok(());
        }
        if let Err(e) = self.update(id, sum) {
            let msg = format!("{e:#}");
            self.error = Some(e);
            candle_core::bail!("fused backward: {msg}");
        }
        Ok(())
    }
}

/// An out-of-memory error injected into a fused update, once, for the tests.
#[cfg(test)]
pub(super) mod inject {
    use std::cell::Cell;

    thread_local! {
        static AFTER: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// The next fused update after `n` parameters were updated fails with an OOM, once.
    pub fn after(n: Option<usize>) {
        AFTER.with(|a| a.set(n));
    }

    pub(super) fn fires(done: usize) -> bool {
        AFTER.with(|a| {
            let hit = a.get() == Some(done);
            if hit {
                a.set(None);
            }
            hit
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// torch's `clip_grad_norm_` on one tensor: `coef = max / (norm + 1e-6)`, applied when below
    /// 1 (torch/nn/utils/clip_grad.py). A gradient of norm 5 clipped to 1 scales by 1/5.000001;
    /// one of norm 0.5 is left alone. Catches a missing epsilon, clipping up, or the sum of
    /// squares taken for the norm (a mutation sweep found that at the call site, untested).
    #[test]
    fn per_tensor_clipping_is_torchs_rule() {
        let g = Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap();
        let c = clip_tensor(&g, 25.0, 1.0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let coef = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(c, vec![3.0 * coef, 4.0 * coef]);
        let small = Tensor::new(&[0.3f32, 0.4], &Device::Cpu).unwrap();
        let c = clip_tensor(&small, 0.25, 1.0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(c, vec![0.3, 0.4]);
    }
}
