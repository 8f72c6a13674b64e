//! Attaching adapter modules to the layers kohya sd-scripts targets (`networks/lora.py`,
//! `LoRANetwork`); LoHa, LoKr and DoRA take LoCon's targets (LyCORIS's kohya network attaches to
//! the same blocks), with conv_rank/conv_alpha on the 3×3 convs:
//!
//! - "lora": every Linear and 1×1 conv inside a `Transformer2DModel` of the UNet
//!   (`UNET_TARGET_REPLACE_MODULE = ["Transformer2DModel"]`): proj_in, proj_out, attn1/attn2
//!   to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2;
//! - "locon" adds `UNET_TARGET_REPLACE_MODULE_CONV2D_3X3 = ["ResnetBlock2D", "Downsample2D",
//!   "Upsample2D"]`: their 3×3 convs (conv1, conv2, downsamplers.0.conv, upsamplers.0.conv) at
//!   conv_rank/conv_alpha, and their Linear/1×1 children (time_emb_proj, conv_shortcut) at
//!   rank/alpha. conv_in, conv_out, time_embedding and add_embedding are in none of those blocks,
//!   so they get nothing, as in kohya;
//! - text encoders (`TEXT_ENCODER_TARGET_REPLACE_MODULE = ["CLIPAttention", "CLIPMLP"]`):
//!   q_proj, k_proj, v_proj, out_proj, fc1, fc2 of every encoder layer.
//!
//! Modules come back in the model's layer-visit order (construction order), which is
//! deterministic, and their `down` weights are drawn in that order from one RNG per component.

use std::sync::Arc;

use candle_core::Device;
use rand::{rngs::StdRng, SeedableRng};

use super::factors::Algo;
use super::layer_filter::LayerFilter;
use super::lora::{AdapterComponent, LoraKind, LoraModule, LoraShape, ModuleAlgo};
use crate::model::clip::ClipTextModel;
use crate::model::unet::UNet2DConditionModel;
use crate::nn::{LayerMut, VisitLayers};

/// Which layers get adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterMode {
    /// Transformer blocks' Linear and 1×1 conv layers.
    Lora,
    /// `Lora` plus the resnets, downsamplers and upsamplers.
    Locon,
    /// LyCORIS LoHa on LoCon's targets.
    Loha,
    /// LyCORIS LoKr on LoCon's targets.
    Lokr,
    /// DoRA (LoCon with a trained magnitude per input channel) on LoCon's targets.
    Dora,
}

impl AdapterMode {
    /// The module type this mode attaches; `factor` is LoKr's.
    pub fn module_algo(self, factor: i64) -> ModuleAlgo {
        let (algo, dora) = match self {
            AdapterMode::Lora | AdapterMode::Locon => (Algo::LowRank, false),
            AdapterMode::Loha => (Algo::Hadamard, false),
            AdapterMode::Lokr => (Algo::Kron, false),
            AdapterMode::Dora => (Algo::LowRank, true),
        };
        ModuleAlgo { algo, factor, dora }
    }
}

/// Sizes and seeds for a set of adapters. An alpha of 0 means "= rank" (scale 1), as in kohya.
#[derive(Debug, Clone, Copy)]
pub struct AdapterSpec {
    pub mode: AdapterMode,
    pub rank: usize,
    pub alpha: f64,
    /// Rank of the 3×3 conv modules ("locon" only).
    pub conv_rank: usize,
    pub conv_alpha: f64,
    pub dropout: f64,
    /// LoKr's factorisation bound (LyCORIS `factor`; -1 = most balanced).
    pub factor: i64,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("{component:?}: layer `{path}` already has an adapter attached")]
    AlreadyAttached {
        component: AdapterComponent,
        path: String,
    },
    #[error("{component:?}: no layer matches the {mode:?} targets")]
    NoTargets {
        component: AdapterComponent,
        mode: AdapterMode,
    },
    #[error(
        "adapter.layer_filter: {patterns:?} match no UNet layer that the {mode:?} mode adapts \
         (paths such as `{example}`; conv_in, conv_out and the time embedding are never adapted)"
    )]
    FilterUnmatched {
        patterns: Vec<String>,
        mode: AdapterMode,
        example: String,
    },
    #[error("cannot create the adapter for `{path}`")]
    Create {
        path: String,
        source: candle_core::Error,
    },
}

/// What the selection rules see of one layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerGeometry {
    pub kind: LoraKind,
    pub in_dim: usize,
    pub out_dim: usize,
}

/// The `(rank, alpha)` a UNet layer gets under `spec`, or `None` when kohya leaves it alone.
pub fn unet_target(path: &str, g: &LayerGeometry, spec: &AdapterSpec) -> Option<(usize, f64)> {
    let in_blocks = ["down_blocks.", "mid_block.", "up_blocks."]
        .iter()
        .any(|p| path.starts_with(p));
    if !in_blocks {
        return None;
    }
    let plain = (spec.rank, alpha_or_rank(spec.alpha, spec.rank));
    if path.contains(".attentions.") {
        return Some(plain);
    }
    let conv_blocks = [".resnets.", ".downsamplers.", ".upsamplers."]
        .iter()
        .any(|b| path.contains(b));
    match spec.mode {
        AdapterMode::Lora => None,
        AdapterMode::Locon | AdapterMode::Loha | AdapterMode::Lokr | AdapterMode::Dora
            if !conv_blocks =>
        {
            None
        }
        AdapterMode::Locon | AdapterMode::Loha | AdapterMode::Lokr | AdapterMode::Dora => {
            match g.kind {
                LoraKind::Conv { kernel, .. } if kernel > 1 => Some((
                    spec.conv_rank,
                    alpha_or_rank(spec.conv_alpha, spec.conv_rank),
                )),
                _ => Some(plain),
            }
        }
    }
}

/// [`unet_target`] narrowed by OneTrainer's layer filter (`None`: no filter).
pub fn unet_target_in(
    path: &str,
    g: &LayerGeometry,
    spec: &AdapterSpec,
    filter: Option<&LayerFilter>,
) -> Option<(usize, f64)> {
    if filter.is_some_and(|f| !f.matches(path)) {
        return None;
    }
    unet_target(path, g, spec)
}

/// Refuses a layer filter with a pattern that matches none of the layers `spec.mode` adapts in
/// the UNet (OneTrainer raises an error for a filter that matches no module).
pub fn check_layer_filter(
    unet: &mut UNet2DConditionModel,
    spec: &AdapterSpec,
    filter: &LayerFilter,
) -> Result<(), AttachError> {
    let mut targets = Vec::new();
    unet.visit_layers(&mut |layer| {
        let (path, g, _, _) = layer_info(&layer);
        if unet_target(&path, &g, spec).is_some() {
            targets.push(path);
        }
    });
    let unmatched = filter.unmatched(targets.iter().map(String::as_str));
    if unmatched.is_empty() {
        return Ok(());
    }
    Err(AttachError::FilterUnmatched {
        patterns: unmatched,
        mode: spec.mode,
        example: targets.first().cloned().unwrap_or_default(),
    })
}

/// The `(rank, alpha)` a text-encoder layer gets, or `None`.
pub fn text_encoder_target(path: &str, spec: &AdapterSpec) -> Option<(usize, f64)> {
    const LEAVES: [&str; 6] = [
        ".self_attn.q_proj",
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.out_proj",
        ".mlp.fc1",
        ".mlp.fc2",
    ];
    (path.contains(".encoder.layers.") && LEAVES.iter().any(|l| path.ends_with(l)))
        .then(|| (spec.rank, alpha_or_rank(spec.alpha, spec.rank)))
}

fn alpha_or_rank(alpha: f64, rank: usize) -> f64 {
    if alpha == 0.0 {
        rank as f64
    } else {
        alpha
    }
}

/// Attaches adapters to the UNet's kohya targets for `spec.mode`. Seeded with `spec.seed`.
pub fn attach_unet(
    unet: &mut UNet2DConditionModel,
    spec: &AdapterSpec,
) -> Result<Vec<Arc<LoraModule>>, AttachError> {
    attach(unet, AdapterComponent::Unet, spec, &|path, g| {
        unet_target(path, g, spec)
    })
}

/// Attaches LoRA to a CLIP text encoder's attention and MLP projections. `component` is
/// `TextEncoder` (SD1/SD2, SDXL's first) or `TextEncoder2`; each draws from its own RNG
/// (`spec.seed + 1`, `spec.seed + 2`), so attaching one does not shift the other's init.
pub fn attach_text_encoder(
    te: &mut ClipTextModel,
    component: AdapterComponent,
    spec: &AdapterSpec,
) -> Result<Vec<Arc<LoraModule>>, AttachError> {
    attach(te, component, spec, &|path, _| {
        text_encoder_target(path, spec)
    })
}

/// Attaches adapters to the layers `select` picks, each at the `(rank, alpha)` it returns (a
/// file's own ranks, module by module: kohya's `--dim_from_weights`).
pub fn attach_selected(
    model: &mut dyn VisitLayers,
    component: AdapterComponent,
    spec: &AdapterSpec,
    select: &Select<'_>,
) -> Result<Vec<Arc<LoraModule>>, AttachError> {
    attach(model, component, spec, select)
}

fn component_seed(component: AdapterComponent, seed: u64) -> u64 {
    match component {
        AdapterComponent::Unet => seed,
        AdapterComponent::TextEncoder => seed.wrapping_add(1),
        AdapterComponent::TextEncoder2 => seed.wrapping_add(2),
    }
}

/// A layer's `(rank, alpha)` by its path and geometry, or `None` to leave it alone.
pub type Select<'a> = dyn Fn(&str, &LayerGeometry) -> Option<(usize, f64)> + 'a;

/// The layer's weight in f32 (dequantised when stored as fp8), for DoRA's initial magnitude.
fn layer_weight(layer: &LayerMut<'_>) -> candle_core::Result<candle_core::Tensor> {
    match layer {
        LayerMut::Linear(l) => l.base_weight().get(candle_core::DType::F32),
        LayerMut::Conv2d(c) => c.base_weight().get(candle_core::DType::F32),
    }
}

fn layer_info(layer: &LayerMut<'_>) -> (String, LayerGeometry, Device, bool) {
    match layer {
        LayerMut::Linear(l) => (
            l.path.clone(),
            LayerGeometry {
                kind: LoraKind::Linear,
                in_dim: l.in_dim(),
                out_dim: l.out_dim(),
            },
            l.weight.device().clone(),
            l.adapter.is_some(),
        ),
        LayerMut::Conv2d(c) => (
            c.path.clone(),
            LayerGeometry {
                kind: LoraKind::Conv {
                    kernel: c.cfg.kernel,
                    stride: c.cfg.stride,
                    padding: c.cfg.padding,
                },
                in_dim: c.in_channels(),
                out_dim: c.out_channels(),
            },
            c.weight.device().clone(),
            c.adapter.is_some(),
        ),
    }
}

fn attach(
    model: &mut dyn VisitLayers,
    component: AdapterComponent,
    spec: &AdapterSpec,
    select: &Select<'_>,
) -> Result<Vec<Arc<LoraModule>>, AttachError> {
    // Pass 1: refuse a model that already carries adapters, before changing anything.
    let mut attached = None;
    model.visit_layers(&mut |layer| {
        let (path, _, _, has) = layer_info(&layer);
        if has && attached.is_none() {
            attached = Some(path);
        }
    });
    if let Some(path) = attached {
        return Err(AttachError::AlreadyAttached { component, path });
    }
    // Pass 2: create and attach, in visit order.
    let mut rng = StdRng::seed_from_u64(component_seed(component, spec.seed));
    let mut modules = Vec::new();
    let mut error = None;
    model.visit_layers(&mut |layer| {
        if error.is_some() {
            return;
        }
        let (path, g, device, _) = layer_info(&layer);
        let Some((rank, alpha)) = select(&path, &g) else {
            return;
        };
        let shape = LoraShape {
            module_path: path.clone(),
            component,
            kind: g.kind,
            in_dim: g.in_dim,
            out_dim: g.out_dim,
        };
        let algo = spec.mode.module_algo(spec.factor);
        let created = if algo.dora {
            layer_weight(&layer).and_then(|w| {
                LoraModule::with_algo(
                    shape,
                    algo,
                    rank,
                    alpha,
                    spec.dropout,
                    Some(&w),
                    &mut rng,
                    &device,
                )
            })
        } else {
            LoraModule::with_algo(
                shape,
                algo,
                rank,
                alpha,
                spec.dropout,
                None,
                &mut rng,
                &device,
            )
        };
        match created {
            Ok(m) => {
                let m = Arc::new(m);
                match layer {
                    LayerMut::Linear(l) => l.adapter = Some(m.clone()),
                    LayerMut::Conv2d(c) => c.adapter = Some(m.clone()),
                }
                modules.push(m);
            }
            Err(source) => error = Some(AttachError::Create { path, source }),
        }
    });
    if let Some(e) = error {
        return Err(e);
    }
    if modules.is_empty() {
        return Err(AttachError::NoTargets {
            component,
            mode: spec.mode,
        });
    }
    Ok(modules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mode: AdapterMode) -> AdapterSpec {
        AdapterSpec {
            mode,
            rank: 4,
            alpha: 1.0,
            conv_rank: 8,
            conv_alpha: 0.0,
            dropout: 0.0,
            factor: -1,
            seed: 0,
        }
    }

    fn conv(kernel: usize) -> LayerGeometry {
        LayerGeometry {
            kind: LoraKind::Conv {
                kernel,
                stride: 1,
                padding: kernel / 2,
            },
            in_dim: 8,
            out_dim: 8,
        }
    }

    #[test]
    fn unet_rules_follow_kohya() {
        let lin = LayerGeometry {
            kind: LoraKind::Linear,
            in_dim: 8,
            out_dim: 8,
        };
        let lora = spec(AdapterMode::Lora);
        let locon = spec(AdapterMode::Locon);
        let q = "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q";
        assert_eq!(unet_target(q, &lin, &lora), Some((4, 1.0)));
        let p = "mid_block.attentions.0.proj_in";
        assert_eq!(unet_target(p, &conv(1), &lora), Some((4, 1.0)));
        let c1 = "up_blocks.1.resnets.2.conv1";
        assert_eq!(unet_target(c1, &conv(3), &lora), None);
        assert_eq!(unet_target(c1, &conv(3), &locon), Some((8, 8.0)));
        let t = "down_blocks.1.resnets.0.time_emb_proj";
        assert_eq!(unet_target(t, &lin, &locon), Some((4, 1.0)));
        let s = "down_blocks.1.resnets.0.conv_shortcut";
        assert_eq!(unet_target(s, &conv(1), &locon), Some((4, 1.0)));
        let d = "down_blocks.0.downsamplers.0.conv";
        assert_eq!(unet_target(d, &conv(3), &locon), Some((8, 8.0)));
        for other in [
            "conv_in",
            "conv_out",
            "time_embedding.linear_1",
            "add_embedding.linear_2",
        ] {
            assert_eq!(unet_target(other, &conv(3), &locon), None, "{other}");
            assert_eq!(unet_target(other, &lin, &locon), None, "{other}");
        }
    }

    #[test]
    fn text_encoder_rules() {
        let s = spec(AdapterMode::Lora);
        let base = "text_model.encoder.layers.3";
        for leaf in [
            "self_attn.q_proj",
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        ] {
            assert!(text_encoder_target(&format!("{base}.{leaf}"), &s).is_some());
        }
        assert!(text_encoder_target("text_projection", &s).is_none());
    }
}
