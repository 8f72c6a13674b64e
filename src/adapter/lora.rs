//! One LoRA / LoCon module: `delta(x) = (alpha/rank) · up(dropout(down(x)))` (Hu et al., LoRA,
//! arXiv 2106.09685), laid out as kohya sd-scripts' `networks/lora.py` `LoRAModule`:
//!
//! - on a Linear: `down` `[r, in]`, `up` `[out, r]`, so `delta = s · x·downᵀ·upᵀ`;
//! - on a Conv2d (LoCon): `down` is a conv with the base's kernel, stride and padding
//!   `[r, in, kh, kw]`, `up` a 1×1 conv `[out, r, 1, 1]`.
//!
//! Init as kohya (and microsoft/LoRA): `down` kaiming-uniform with `a = √5`, i.e. uniform in
//! `±sqrt(6 / ((1 + a²)·fan_in)) = ±1/sqrt(fan_in)`, `up` zeros, so a fresh adapter is a no-op.
//! Dropout (kohya's `dropout`) acts on the `down` output, only while training.
//!
//! The Vars are f32 masters; `delta` casts them to the input's dtype, and the cast's backward
//! returns f32 gradients (the base layer stays in its loaded dtype).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::nn::{
    cast_like, cpu_bf16, frozen_conv2d_low_rank, frozen_linear_low_rank, FrozenBase, LayerAdapter,
    LowRank,
};

/// Which model an adapter module belongs to (kohya prefixes `lora_unet`, `lora_te`/`lora_te1`,
/// `lora_te2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdapterComponent {
    Unet,
    TextEncoder,
    TextEncoder2,
}

/// The shape of the wrapped layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraKind {
    Linear,
    /// The base conv's geometry; `down` copies it, `up` is 1×1.
    Conv {
        kernel: usize,
        stride: usize,
        padding: usize,
    },
}

/// A LoRA/LoCon module attached to one Linear or Conv2d.
#[derive(Debug)]
pub struct LoraModule {
    /// The diffusers/transformers path of the wrapped layer, e.g.
    /// `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`.
    pub module_path: String,
    pub component: AdapterComponent,
    /// `[r, in]` or `[r, in, kh, kw]`, f32.
    pub down: Var,
    /// `[out, r]` or `[out, r, 1, 1]`, f32.
    pub up: Var,
    pub alpha: f64,
    pub rank: usize,
    /// Probability of zeroing an element of `down(x)` while training (0 = off).
    pub dropout: f64,
    pub kind: LoraKind,
    training: AtomicBool,
    rng: Mutex<StdRng>,
    /// The dropout stream's seed: [`LoraModule::begin_step`] restarts the stream from it.
    dropout_seed: u64,
}

/// Where and how big one module is; see [`LoraModule::new`].
#[derive(Debug, Clone)]
pub struct LoraShape {
    pub module_path: String,
    pub component: AdapterComponent,
    pub kind: LoraKind,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl LoraModule {
    /// A fresh module: `down` kaiming-uniform (a = √5) drawn from `rng`, `up` zeros. The
    /// dropout mask stream is seeded from `rng` too, so a run is reproducible.
    pub fn new(
        shape: LoraShape,
        rank: usize,
        alpha: f64,
        dropout: f64,
        rng: &mut StdRng,
        device: &Device,
    ) -> Result<Self> {
        if rank == 0 {
            candle_core::bail!("{}: LoRA rank must be at least 1", shape.module_path);
        }
        if !(0.0..1.0).contains(&dropout) {
            candle_core::bail!("{}: dropout {dropout} is not in [0, 1)", shape.module_path);
        }
        let (down_dims, up_dims, fan_in) = match shape.kind {
            LoraKind::Linear => (
                vec![rank, shape.in_dim],
                vec![shape.out_dim, rank],
                shape.in_dim,
            ),
            LoraKind::Conv { kernel, .. } => (
                vec![rank, shape.in_dim, kernel, kernel],
                vec![shape.out_dim, rank, 1, 1],
                shape.in_dim * kernel * kernel,
            ),
        };
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        let n: usize = down_dims.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let down = Var::from_vec(values, down_dims, device)?;
        let up = Var::zeros(up_dims, DType::F32, device)?;
        let dropout_seed = rng.random::<u64>();
        Ok(Self {
            module_path: shape.module_path,
            component: shape.component,
            down,
            up,
            alpha,
            rank,
            dropout,
            kind: shape.kind,
            training: AtomicBool::new(false),
            rng: Mutex::new(StdRng::seed_from_u64(dropout_seed)),
            dropout_seed,
        })
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// `[down, up]`, the trainable parameters.
    pub fn vars(&self) -> [&Var; 2] {
        [&self.down, &self.up]
    }

    /// Restarts the dropout mask stream for optimizer step `step`: the masks of a step depend
    /// only on the module's seed and the step, so a resumed run draws what the uninterrupted one
    /// drew.
    pub fn begin_step(&self, step: usize) {
        let mix = (step as u64)
            .wrapping_add(1)
            .wrapping_mul(0xD1B5_4A32_D192_ED03);
        if let Ok(mut rng) = self.rng.lock() {
            *rng = StdRng::seed_from_u64(self.dropout_seed ^ mix);
        }
    }

    /// Turns dropout on (training) or off (evaluation, sampling). Off by default.
    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed)
    }

    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// The inverted-dropout mask for `h`: each element 0 with probability `p`, else `1/(1-p)`,
    /// in `h`'s shape, dtype and device; `None` when dropout is off or the module evaluates. The
    /// mask comes from the module's seeded RNG on the CPU; `h` is the rank-r `down` output, so
    /// the mask is small.
    fn dropout_mask(&self, h: &Tensor) -> Result<Option<Tensor>> {
        let p = self.dropout;
        if p <= 0.0 || !self.is_training() {
            return Ok(None);
        }
        let keep = (1.0 / (1.0 - p)) as f32;
        let mask: Vec<f32> = {
            let mut rng = self
                .rng
                .lock()
                .map_err(|_| candle_core::Error::Msg("LoRA dropout: poisoned RNG lock".into()))?;
            // Recorded and replayed under gradient checkpointing: the recomputation draws the
            // same mask.
            crate::nn::replayable(&mut rng, |rng| {
                (0..h.elem_count())
                    .map(|_| if rng.random::<f64>() < p { 0.0 } else { keep })
                    .collect()
            })
        };
        Ok(Some(
            Tensor::from_vec(mask, h.shape(), h.device())?.to_dtype(h.dtype())?,
        ))
    }

    /// Inverted dropout on `h` ([`LoraModule::dropout_mask`]).
    fn dropout(&self, h: &Tensor) -> Result<Tensor> {
        match self.dropout_mask(h)? {
            Some(mask) => h * mask,
            None => Ok(h.clone()),
        }
    }

    fn delta_in_dtype(&self, x: &Tensor) -> Result<Tensor> {
        let down = cast_like(self.down.as_tensor(), x)?;
        let up = cast_like(self.up.as_tensor(), x)?;
        let y = match self.kind {
            LoraKind::Linear => {
                let dims = x.dims().to_vec();
                let in_dim = dims[dims.len() - 1];
                let rows = x.elem_count() / in_dim.max(1);
                // A frozen layer's input is a constant: store no gradient for it.
                let h = crate::nn::matmul_const_lhs(&x.reshape((rows, in_dim))?, &down)?;
                let h = self.dropout(&h)?;
                let y = h.matmul(&up.t()?)?;
                let mut out_dims = dims;
                let last = out_dims.len() - 1;
                out_dims[last] = up.dim(0)?;
                y.reshape(out_dims)?
            }
            LoraKind::Conv {
                stride, padding, ..
            } => {
                let h = crate::nn::conv2d_const_input(x, &down, padding, stride)?;
                let h = self.dropout(&h)?;
                // Not candle's conv2d: its backward takes the input gradient through candle's
                // naive conv_transpose2d (248 µs per 320-channel 64×64 layer on an H100).
                crate::nn::conv2d_trainable(&h, &up, 0, 1)?
            }
        };
        y.affine(self.scale(), 0.0)
    }
}

impl LayerAdapter for LoraModule {
    fn delta(&self, x: &Tensor) -> Result<Tensor> {
        // No bf16 gemm/conv kernels on the CPU: compute in f32 and round once, like the base.
        if cpu_bf16(x) {
            return self
                .delta_in_dtype(&x.to_dtype(DType::F32)?)?
                .to_dtype(DType::BF16);
        }
        self.delta_in_dtype(x)
    }

    /// The frozen layer and this module as one op (`nn::low_rank`): what the backward keeps is
    /// the input and the rank-r `down` output, not three layer-output-sized tensors.
    fn forward_frozen(&self, x: &Tensor, base: FrozenBase<'_>) -> Option<Result<Tensor>> {
        let mask = |h: &Tensor| self.dropout_mask(h);
        let lr = LowRank {
            down: self.down.as_tensor(),
            up: self.up.as_tensor(),
            scale: self.scale(),
            dropout: &mask,
        };
        Some(match (self.kind, base) {
            (LoraKind::Linear, FrozenBase::Linear { w, b }) => frozen_linear_low_rank(x, &w, b, lr),
            (
                LoraKind::Conv {
                    stride, padding, ..
                },
                FrozenBase::Conv {
                    w,
                    b,
                    padding: base_padding,
                    stride: base_stride,
                },
            ) if (stride, padding) == (base_stride, base_padding) => {
                frozen_conv2d_low_rank(x, &w, b, padding, stride, lr)
            }
            (kind, base) => {
                let layer = match base {
                    FrozenBase::Linear { .. } => "a linear".to_string(),
                    FrozenBase::Conv {
                        padding, stride, ..
                    } => format!("a conv with padding {padding} and stride {stride}"),
                };
                Err(candle_core::Error::Msg(format!(
                    "{}: a LoRA module of kind {kind:?} does not fit its layer, {layer}",
                    self.module_path
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn module(dropout: f64) -> LoraModule {
        let shape = LoraShape {
            module_path: "t.to_q".into(),
            component: AdapterComponent::Unet,
            kind: LoraKind::Linear,
            in_dim: 4,
            out_dim: 4,
        };
        let mut rng = StdRng::seed_from_u64(1);
        LoraModule::new(shape, 2, 2.0, dropout, &mut rng, &Device::Cpu).unwrap()
    }

    #[test]
    fn dropout_scales_kept_elements_by_inverse_keep_probability() {
        let m = module(0.25);
        m.set_training(true);
        let h = Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap();
        let v = m
            .dropout(&h)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let kept: Vec<f32> = v.iter().copied().filter(|&x| x != 0.0).collect();
        assert!(
            kept.iter().all(|&x| (x - 1.0 / 0.75).abs() < 1e-6),
            "{:?}",
            &kept[..4]
        );
        let dropped = (v.len() - kept.len()) as f64 / v.len() as f64;
        assert!((dropped - 0.25).abs() < 0.03, "dropped fraction {dropped}");
        // The mean is preserved in expectation (inverted dropout).
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn dropout_is_identity_when_evaluating() {
        let m = module(0.5);
        let h = Tensor::ones((8, 8), DType::F32, &Device::Cpu).unwrap();
        let v = m
            .dropout(&h)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(v.iter().all(|&x| x == 1.0));
    }
}
