//! A LoRA extracted from the difference between two models (`sdtrain extract-lora`), as kohya
//! sd-scripts' `networks/extract_lora_from_models.py` extracts it: the usual way to turn a full
//! fine-tune (EveryDream2's output) into a small file A1111 and ComfyUI load.
//!
//! For each module kohya's LoRA targets (LoCon's too with a conv rank,
//! [`super::attach::unet_target`]): `ΔW = W_tuned − W_base` in f32 (a 3×3 conv flattened to
//! `out × in·k·k`, a 1×1 squeezed), its top `rank` singular triplets (`rank` capped at the
//! layer's `out` and `in` channels), `up = U·diag(S)` and `down = Vᵀ`, both clamped to
//! `±quantile(concat(up, down), clamp_quantile)` (torch's linear quantile; kohya's 0.99), and
//! `alpha = rank` (scale 1). The text encoders are extracted only when some weight moved by more
//! than `min_diff` (kohya's 0.01), else the file adapts the UNet alone.
//!
//! One deliberate difference: an SVD leaves the sign of each singular pair free, and kohya's
//! result follows whatever LAPACK picks; here each pair is turned so that the largest entry of
//! its `U` column is positive ([`crate::linalg::truncated_svd`]). `up·down` is the same either
//! way; the clamp's quantile is taken over the signs chosen.

use candle_core::{DType, Device, Tensor};

use super::attach::{text_encoder_target, unet_target, AdapterMode, AdapterSpec, LayerGeometry};
use super::kohya_file::KohyaTensorSet;
use super::kohya_names::{KohyaComponent, KohyaNaming};
use super::lora::LoraKind;
use crate::linalg::{quantile, truncated_svd};
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::weights::Weights;

/// The extraction's settings (kohya's flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExtractOptions {
    /// `--dim`: rank of the Linear and 1×1 modules.
    pub rank: usize,
    /// `--conv_dim`: rank of the 3×3 convs (LoCon); `None` leaves them out.
    pub conv_rank: Option<usize>,
    /// `--clamp_quantile`.
    pub clamp_quantile: f64,
    /// `--min_diff`: the largest text-encoder change below which the text encoders are left
    /// out.
    pub min_diff: f64,
}

/// What an extraction found.
pub struct Extraction {
    pub modules: Vec<KohyaTensorSet>,
    /// The largest absolute change in any text-encoder target, and whether the text encoders
    /// were extracted (it is above `min_diff`).
    pub text_encoder_change: f32,
    pub text_encoders_extracted: bool,
}

/// One module's `(up, down)` from its weight change `delta` (`out × in` or `out × in × kh ×
/// kw`), f32, shaped as kohya stores them.
pub fn low_rank_factors(
    delta: &Tensor,
    rank: usize,
    clamp_quantile: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dims = delta.dims().to_vec();
    let (out_dim, in_dim) = match dims[..] {
        [o, i] | [o, i, _, _] => (o, i),
        _ => candle_core::bail!("a weight change of shape {dims:?}: not a Linear or Conv2d"),
    };
    let rank = rank.min(in_dim).min(out_dim);
    let mat = delta.flatten_from(1)?;
    let energy = mat
        .to_dtype(DType::F64)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f64>()?;
    if !energy.is_finite() {
        candle_core::bail!("the weight change holds NaN or infinite values (a broken weight)");
    }
    let (u, s, vt) = truncated_svd(&mat, rank)?;
    let s = Tensor::from_vec(s, (1, rank), delta.device())?;
    let up = u.broadcast_mul(&s)?;
    let mut dist: Vec<f64> = up.flatten_all()?.to_vec1()?;
    dist.extend(vt.flatten_all()?.to_vec1::<f64>()?);
    let hi = quantile(&dist, clamp_quantile);
    let (up, down) = (up.clamp(-hi, hi)?, vt.clamp(-hi, hi)?);
    let (up, down) = match dims.len() {
        4 => (
            up.reshape((out_dim, rank, 1, 1))?,
            down.reshape((rank, in_dim, dims[2], dims[3]))?,
        ),
        _ => (up, down),
    };
    Ok((up.to_dtype(DType::F32)?, down.to_dtype(DType::F32)?))
}

/// The kohya-named module sets of `tuned − base` under `opts`. `progress` is told each
/// module's name as it starts, with its index and the total.
pub fn extract(
    base: &ModelLayout,
    tuned: &ModelLayout,
    naming: &KohyaNaming,
    opts: &ExtractOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> anyhow::Result<Extraction> {
    if base.family != tuned.family {
        anyhow::bail!(
            "{} is {:?} and {} is {:?}: a LoRA is extracted between two models of one family",
            base.root.display(),
            base.family,
            tuned.root.display(),
            tuned.family
        );
    }
    let spec = AdapterSpec {
        mode: match opts.conv_rank {
            Some(_) => AdapterMode::Locon,
            None => AdapterMode::Lora,
        },
        rank: opts.rank,
        alpha: opts.rank as f64,
        conv_rank: opts.conv_rank.unwrap_or(opts.rank),
        conv_alpha: opts.conv_rank.unwrap_or(opts.rank) as f64,
        dropout: 0.0,
        factor: -1,
        seed: 0,
    };
    let parts = [
        (Component::TextEncoder, KohyaComponent::TextEncoder),
        (Component::TextEncoder2, KohyaComponent::TextEncoder2),
        (Component::Unet, KohyaComponent::Unet),
    ];
    // Every target first: the text encoders are judged before any SVD, and progress knows
    // the total.
    let mut targets = Vec::new();
    for (component, kohya) in parts {
        let (Some(b), Some(t)) = (base.component(component), tuned.component(component)) else {
            continue;
        };
        let shapes = b.tensor_shapes()?;
        let tuned_shapes = t.tensor_shapes()?;
        for (name, (shape, _)) in &shapes {
            let Some(path) = name.strip_suffix(".weight") else {
                continue;
            };
            let kind = match shape.len() {
                2 => LoraKind::Linear,
                4 => LoraKind::Conv {
                    kernel: shape[2],
                    stride: 1,
                    padding: 0,
                },
                _ => continue,
            };
            let g = LayerGeometry {
                kind,
                in_dim: shape[1],
                out_dim: shape[0],
            };
            let selected = match kohya {
                KohyaComponent::Unet => unet_target(path, &g, &spec),
                _ => text_encoder_target(path, &spec),
            };
            let Some((rank, _)) = selected else {
                continue;
            };
            match tuned_shapes.get(name) {
                Some((s, _)) if s == shape => {}
                Some((s, _)) => anyhow::bail!(
                    "`{name}` is {shape:?} in {} and {s:?} in {}: not the same architecture",
                    base.root.display(),
                    tuned.root.display()
                ),
                None => anyhow::bail!("`{name}` is missing from {}", tuned.root.display()),
            }
            targets.push((
                component,
                kohya,
                name.clone(),
                path.to_string(),
                shape.clone(),
                rank,
            ));
        }
    }
    // kohya: "Text encoder is same. Extract U-Net only." Decided before any SVD.
    let mut weights = OpenWeights::default();
    let mut te_change = 0f32;
    let mut te_modules = 0;
    for (component, kohya, name, _, shape, _) in &targets {
        if *kohya != KohyaComponent::Unet {
            let delta = weights.delta(base, tuned, *component, name, shape)?;
            let moved = delta.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            te_change = te_change.max(moved);
            te_modules += 1;
        }
    }
    let text_encoders_extracted = te_modules > 0 && f64::from(te_change) > opts.min_diff;
    if !text_encoders_extracted {
        targets.retain(|t| t.1 == KohyaComponent::Unet);
    }
    let total = targets.len();
    let mut modules = Vec::with_capacity(total);
    for (i, (component, kohya, name, path, shape, rank)) in targets.into_iter().enumerate() {
        let module = naming.module_name(kohya, &path)?;
        progress(&module, i, total);
        let delta = weights.delta(base, tuned, component, &name, &shape)?;
        let (up, down) = low_rank_factors(&delta, rank, opts.clamp_quantile)
            .map_err(|e| anyhow::anyhow!("`{name}`: {e}"))?;
        let alpha = down.dim(0)? as f32;
        modules.push(KohyaTensorSet {
            name: module,
            tensors: vec![
                ("lora_up.weight".to_string(), up),
                ("lora_down.weight".to_string(), down),
            ],
            alpha,
        });
    }
    Ok(Extraction {
        modules,
        text_encoder_change: te_change,
        text_encoders_extracted,
    })
}

/// Each component's weights in both models, opened (memory-mapped) on first use.
#[derive(Default)]
struct OpenWeights {
    open: Vec<(Component, Weights, Weights)>,
}

impl OpenWeights {
    /// `tuned − base` for tensor `name` of `component`, f32 on the CPU.
    fn delta(
        &mut self,
        base: &ModelLayout,
        tuned: &ModelLayout,
        component: Component,
        name: &str,
        shape: &[usize],
    ) -> anyhow::Result<Tensor> {
        if !self.open.iter().any(|(c, _, _)| *c == component) {
            let weights = |layout: &ModelLayout| -> anyhow::Result<Weights> {
                let files = layout.component(component).ok_or_else(|| {
                    anyhow::anyhow!("{} has no {component:?}", layout.root.display())
                })?;
                Ok(crate::model::pipeline::component_weights(
                    files,
                    DType::F32,
                    &Device::Cpu,
                )?)
            };
            self.open.push((component, weights(base)?, weights(tuned)?));
        }
        let (_, b, t) = self
            .open
            .iter()
            .find(|(c, _, _)| *c == component)
            .ok_or_else(|| anyhow::anyhow!("{component:?} is not open"))?;
        Ok((t.get(shape, name)? - b.get(shape, name)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broken weight (NaN) or a tensor that is no layer's weight is an error, not a file of
    /// NaN factors or a panic.
    #[test]
    fn broken_changes_are_refused() {
        let nan = Tensor::new(&[[1f32, f32::NAN], [0.5, 2.0]], &Device::Cpu).unwrap();
        let err = low_rank_factors(&nan, 1, 0.99).unwrap_err().to_string();
        assert!(err.contains("NaN"), "{err}");
        let flat = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let err = low_rank_factors(&flat, 1, 0.99).unwrap_err().to_string();
        assert!(err.contains("not a Linear or Conv2d"), "{err}");
        // A rank above the channels is capped: 2 × 3 gives rank 2.
        let ok = Tensor::new(&[[1f32, 0.0, 2.0], [0.0, 3.0, 1.0]], &Device::Cpu).unwrap();
        let (up, down) = low_rank_factors(&ok, 8, 1.0).unwrap();
        assert_eq!((up.dims(), down.dims()), (&[2, 2][..], &[2, 3][..]));
    }
}
