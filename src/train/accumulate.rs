//! Gradient accumulation over the micro-batches of one optimizer step.
//!
//! Each micro-batch's loss is weighted by its share of the effective batch (`len / effective`,
//! see [`super::step::forward_backward`]), so the summed gradients equal those of one batch of
//! the same samples, whatever the micro-batch sizes. Gradients are summed, never overwritten,
//! and detached (a Var's gradient still references the graph that made it). With a loss scale,
//! [`GradAccumulator::finish`] divides it back out once, after the last micro-batch.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// The summed loss and gradients of one optimizer step.
pub struct Accumulated {
    /// Σ weight·loss over the micro-batches: the effective batch's mean loss (0-d f32).
    pub loss: Tensor,
    pub grads: GradStore,
    pub micro_batches: usize,
    pub samples: usize,
}

/// Sums micro-batch gradients for a fixed set of parameters.
pub struct GradAccumulator<'a> {
    params: &'a [Var],
    loss: Option<Tensor>,
    grads: GradStore,
    micro_batches: usize,
    samples: usize,
}

impl<'a> GradAccumulator<'a> {
    /// Accumulates the gradients of `params` only; other entries of each store are dropped.
    pub fn new(params: &'a [Var]) -> Self {
        Self {
            params,
            loss: None,
            grads: GradStore::default(),
            micro_batches: 0,
            samples: 0,
        }
    }

    /// Adds one micro-batch of `samples` samples: its weighted loss and its gradients.
    pub fn add(&mut self, loss: Tensor, mut grads: GradStore, samples: usize) -> Result<()> {
        self.loss = Some(match self.loss.take() {
            None => loss,
            Some(sum) => (sum + loss)?,
        });
        for var in self.params {
            let Some(g) = grads.remove(var) else {
                continue;
            };
            let sum = match self.grads.remove(var) {
                Some(a) => (a + g)?.detach(),
                None => g.detach(),
            };
            self.grads.insert(var, sum);
        }
        self.micro_batches += 1;
        self.samples += samples;
        Ok(())
    }

    /// Moves the gradients summed so far out (a fused backward pass adds them to the last
    /// micro-batch's as each completes); [`GradAccumulator::put_back`] returns what is left.
    pub fn take_grads(&mut self) -> GradStore {
        std::mem::take(&mut self.grads)
    }

    /// Returns gradients taken with [`GradAccumulator::take_grads`] (those not used yet).
    pub fn put_back(&mut self, grads: GradStore) {
        self.grads = grads;
    }

    /// The summed loss so far (`None` before the first micro-batch).
    pub fn loss(&self) -> Option<&Tensor> {
        self.loss.as_ref()
    }

    /// The step's loss and gradients, divided by `loss_scale` (skipped when it is 1). `None`
    /// when nothing was added.
    pub fn finish(self, loss_scale: f64) -> Result<Option<Accumulated>> {
        let Some(loss) = self.loss else {
            return Ok(None);
        };
        let mut grads = self.grads;
        if loss_scale != 1.0 {
            let inv = 1.0 / loss_scale;
            for var in self.params {
                if let Some(g) = grads.remove(var) {
                    grads.insert(var, (g * inv)?);
                }
            }
        }
        Ok(Some(Accumulated {
            loss,
            grads,
            micro_batches: self.micro_batches,
            samples: self.samples,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn store(var: &Var, values: &[f32]) -> GradStore {
        let mut s = GradStore::default();
        let g = Tensor::new(values, &Device::Cpu).unwrap();
        s.insert(var, g);
        s
    }

    #[test]
    fn sums_losses_and_gradients_and_unscales_once() {
        let a = Var::new(&[0f32, 0.0], &Device::Cpu).unwrap();
        let b = Var::new(&[0f32], &Device::Cpu).unwrap();
        let params = vec![a.clone(), b.clone()];
        let mut acc = GradAccumulator::new(&params);
        let l = |v: f32| Tensor::new(v, &Device::Cpu).unwrap();
        acc.add(l(1.0), store(&a, &[2.0, 4.0]), 2).unwrap();
        acc.add(l(0.5), store(&a, &[6.0, 8.0]), 1).unwrap();
        acc.add(l(0.25), store(&b, &[10.0]), 1).unwrap();
        let out = acc.finish(2.0).unwrap().unwrap();
        assert_eq!(out.loss.to_scalar::<f32>().unwrap(), 1.75);
        let ga = out.grads.get(&a).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(ga, vec![4.0, 6.0]);
        assert_eq!(
            out.grads.get(&b).unwrap().to_vec1::<f32>().unwrap(),
            vec![5.0]
        );
        assert_eq!((out.micro_batches, out.samples), (3, 4));
    }

    #[test]
    fn keeps_only_the_parameters_it_was_given() {
        let a = Var::new(&[0f32], &Device::Cpu).unwrap();
        let other = Var::new(&[0f32], &Device::Cpu).unwrap();
        let params = vec![a.clone()];
        let mut acc = GradAccumulator::new(&params);
        let mut s = store(&a, &[1.0]);
        s.insert(&other, Tensor::new(&[3f32], &Device::Cpu).unwrap());
        acc.add(Tensor::new(0f32, &Device::Cpu).unwrap(), s, 1)
            .unwrap();
        let out = acc.finish(1.0).unwrap().unwrap();
        assert!(out.grads.get(&other).is_none());
        assert!(GradAccumulator::new(&params).finish(1.0).unwrap().is_none());
    }
}
