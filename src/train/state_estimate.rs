//! The optimizer state a plan will hold, from the model's safetensors headers alone (no weights
//! are read): the trained tensors of each group, as the trainer would choose them, priced by the
//! group's optimizer. `--dry-run` prints it.

use std::collections::BTreeMap;
use std::fmt;

use crate::adapter::attach::{text_encoder_target, unet_target_in, AdapterSpec, LayerGeometry};
use crate::adapter::block_weights::BlockTable;
use crate::adapter::factors;
use crate::adapter::kohya_names::{KohyaComponent, KohyaNaming};
use crate::adapter::kohya_naming_for;
use crate::adapter::lora::LoraKind;
use crate::config::TrainMode;
use crate::config::{ParamGroupPlan, TrainPlan};
use crate::model::family::ModelFamily;
use crate::model::files::{Component, ComponentFiles};
use crate::model::layout::ModelLayout;
use crate::model::unet::UnetConfig;

use super::memory_plan::Census;
use super::param_groups::update_rule;
use super::te_freeze::text_encoder_param_trains;

/// One group's trained parameters and the bytes of optimizer state they take.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupState {
    pub name: &'static str,
    pub optimizer: &'static str,
    pub params: u64,
    pub bytes: u64,
}

/// Every group of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct StateEstimate(pub Vec<GroupState>);

impl fmt::Display for StateEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for g in &self.0 {
            let per = if g.params == 0 {
                0.0
            } else {
                g.bytes as f64 / g.params as f64
            };
            writeln!(
                f,
                "{:<15}{}: {}, {} trained parameters, {:.2} MiB ({per:.2} bytes/parameter)",
                "optim. state",
                g.name,
                g.optimizer,
                g.params,
                g.bytes as f64 / (1u64 << 20) as f64
            )?;
        }
        Ok(())
    }
}

/// Tensor name → shape over a component's files (for a single file, its diffusers view).
fn shapes(files: &ComponentFiles) -> anyhow::Result<BTreeMap<String, Vec<usize>>> {
    Ok(files
        .tensor_shapes()?
        .into_iter()
        .map(|(n, (shape, _))| (n, shape))
        .collect())
}

/// What `--dry-run` reads from the model's headers: each group's optimizer state, the element
/// count of each component, and the model's layout.
pub struct ModelEstimate {
    pub state: StateEstimate,
    pub census: Census,
    pub layout: ModelLayout,
}

/// Resolves the plan's model (offline from a local folder or the hub cache) and prices each
/// group's trained tensors.
pub fn estimate(plan: &TrainPlan) -> anyhow::Result<ModelEstimate> {
    let layout = super::setup::open_model(plan, false)?;
    let mut unet = Vec::new();
    let mut text = Vec::new();
    let mut vectors = Vec::new();
    let mut census = Census::default();
    for files in &layout.components {
        let component = files.component;
        let is_te = matches!(component, Component::TextEncoder | Component::TextEncoder2);
        if component == Component::Vae {
            census.vae = elements(&shapes(files)?);
        }
        if !(component == Component::Unet || is_te) {
            continue;
        }
        let tensors = shapes(files)?;
        let layers = fp8_layers(&tensors);
        census.largest_layer = census.largest_layer.max(layers.largest);
        if is_te {
            census.text_encoders += elements(&tensors);
            census.text_encoder_layers += layers.elements;
            census.text_encoder_layer_rows += layers.rows;
        } else {
            census.unet = elements(&tensors);
            census.unet_layers = layers.elements;
            census.unet_layer_rows = layers.rows;
        }
        let trained = if is_te {
            text_encoder_shapes(&tensors, plan)
        } else {
            let blocks = unet_blocks(files, &layout, plan)?;
            unet_shapes(&tensors, plan, blocks.as_ref())
        };
        if is_te {
            text.extend(trained);
            vectors.extend(embedding_shapes(&tensors, plan));
        } else {
            unet.extend(trained);
        }
    }
    let price =
        |name, group: &ParamGroupPlan, shapes: &[Vec<usize>]| -> anyhow::Result<GroupState> {
            let rule = update_rule(group)?;
            Ok(GroupState {
                name,
                optimizer: group.optimizer.name(),
                params: shapes
                    .iter()
                    .map(|s| s.iter().product::<usize>() as u64)
                    .sum(),
                bytes: shapes.iter().map(|s| rule.state_bytes(s) as u64).sum(),
            })
        };
    let mut groups = Vec::new();
    if plan.train_unet {
        groups.push(price("unet", &plan.optimizer.unet, &unet)?);
    }
    if !text.is_empty() {
        groups.push(price("text_encoder", &plan.optimizer.text_encoder, &text)?);
    }
    if plan.embedding.is_some() {
        // The token's vectors, at the base settings (param_groups).
        groups.push(price(
            super::embeddings::GROUP,
            &plan.optimizer.unet,
            &vectors,
        )?);
    }
    census.trained = groups.iter().map(|g| g.params).sum();
    census.largest_trained = unet
        .iter()
        .chain(&text)
        .chain(&vectors)
        .map(|s| s.iter().product::<usize>() as u64)
        .max()
        .unwrap_or(0);
    census.state_bytes = groups.iter().map(|g| g.bytes).sum();
    Ok(ModelEstimate {
        state: StateEstimate(groups),
        census,
        layout,
    })
}

/// The Linear and Conv2d weights of a component (what an fp8 base stores in one byte each):
/// their elements, their rows (one f32 scale each) and the largest one's elements.
#[derive(Default)]
struct LayerWeights {
    elements: u64,
    rows: u64,
    largest: u64,
}

/// Rank-2 and rank-4 `*.weight` tensors, less the text encoders' embedding tables (looked up,
/// not multiplied: they stay in the compute dtype).
fn fp8_layers(tensors: &BTreeMap<String, Vec<usize>>) -> LayerWeights {
    let mut out = LayerWeights::default();
    for (name, shape) in tensors {
        let layer = name.ends_with(".weight")
            && matches!(shape.len(), 2 | 4)
            && !name.contains("token_embedding")
            && !name.contains("position_embedding");
        if layer {
            let n = shape.iter().product::<usize>() as u64;
            out.elements += n;
            out.rows += shape[0] as u64;
            out.largest = out.largest.max(n);
        }
    }
    out
}

fn elements(tensors: &BTreeMap<String, Vec<usize>>) -> u64 {
    tensors
        .values()
        .map(|s| s.iter().product::<usize>() as u64)
        .sum()
}

fn spec(plan: &TrainPlan) -> Option<AdapterSpec> {
    super::adapters::adapter_spec(plan.mode, plan.adapter.as_ref()?, 0)
}

/// The adapter's tensors for a base layer of weight shape `w` at `rank` (LoRA's two, LoHa's
/// four, LoKr's two or three, DoRA's three; [`factors::param_shapes`]).
fn adapter_shapes(w: &[usize], rank: usize, spec: &AdapterSpec) -> Vec<Vec<usize>> {
    if !matches!(w.len(), 2 | 4) {
        return Vec::new();
    }
    let a = spec.mode.module_algo(spec.factor);
    factors::param_shapes(a.algo, w, rank, a.factor, a.dora)
        .into_iter()
        .map(|p| p.dims)
        .collect()
}

fn geometry(w: &[usize]) -> Option<LayerGeometry> {
    match w {
        [out, inp] => Some(LayerGeometry {
            kind: LoraKind::Linear,
            in_dim: *inp,
            out_dim: *out,
        }),
        [out, inp, k, _] => Some(LayerGeometry {
            kind: LoraKind::Conv {
                kernel: *k,
                stride: 1,
                padding: k / 2,
            },
            in_dim: *inp,
            out_dim: *out,
        }),
        _ => None,
    }
}

/// kohya's block table for the UNet and the names it is read by, when the adapter has
/// block-wise ranks (not with `dim_from_weights`, whose ranks are the file's).
fn unet_blocks(
    files: &ComponentFiles,
    layout: &ModelLayout,
    plan: &TrainPlan,
) -> anyhow::Result<Option<(KohyaNaming, BlockTable)>> {
    let Some(a) = plan.adapter.as_ref().filter(|a| !a.dim_from_weights) else {
        return Ok(None);
    };
    let Some(settings) = &a.blocks else {
        return Ok(None);
    };
    let (text, origin) = files.config_text()?;
    let cfg = UnetConfig::from_json(&text, &origin.display().to_string())?;
    let sdxl = layout.family == ModelFamily::Sdxl;
    let conv = (plan.mode == TrainMode::Locon).then_some((a.conv_rank, a.conv_alpha));
    let (table, _) = settings.resolve(sdxl, (a.rank, a.alpha), conv)?;
    Ok(Some((kohya_naming_for(layout.family, &cfg), table)))
}

fn unet_shapes(
    tensors: &BTreeMap<String, Vec<usize>>,
    plan: &TrainPlan,
    blocks: Option<&(KohyaNaming, BlockTable)>,
) -> Vec<Vec<usize>> {
    if !plan.train_unet {
        return Vec::new();
    }
    let Some(spec) = spec(plan) else {
        return tensors.values().cloned().collect();
    };
    tensors
        .iter()
        .filter_map(|(name, w)| {
            let path = name.strip_suffix(".weight")?;
            let g = geometry(w)?;
            let filter = plan.adapter.as_ref().and_then(|a| a.layer_filter.as_ref());
            let (mut rank, _) = unet_target_in(path, &g, &spec, filter)?;
            if let Some((naming, table)) = blocks {
                let name = naming.module_name(KohyaComponent::Unet, path).ok()?;
                let conv3x3 = w.len() == 4 && w[2] > 1;
                rank = table.target(&name, conv3x3).ok()??.0;
            }
            Some(adapter_shapes(w, rank, &spec))
        })
        .flatten()
        .collect()
}

/// A token's vectors (`embedding`): `[vectors, width]` beside a text encoder's token embedding.
fn embedding_shapes(tensors: &BTreeMap<String, Vec<usize>>, plan: &TrainPlan) -> Vec<Vec<usize>> {
    let Some(e) = &plan.embedding else {
        return Vec::new();
    };
    tensors
        .iter()
        .filter(|(name, s)| name.ends_with("token_embedding.weight") && s.len() == 2)
        .map(|(_, s)| vec![e.num_vectors, s[1]])
        .collect()
}

fn text_encoder_shapes(
    tensors: &BTreeMap<String, Vec<usize>>,
    plan: &TrainPlan,
) -> Vec<Vec<usize>> {
    // transformers writes the names with or without the `text_model.` prefix.
    let named = |name: &String| {
        if name.starts_with("text_model.") || name.starts_with("text_projection") {
            name.clone()
        } else {
            format!("text_model.{name}")
        }
    };
    if plan.mode == crate::config::TrainMode::TextualInversion {
        // The encoders' own weights stay frozen: only the token's vectors train.
        return Vec::new();
    }
    match spec(plan) {
        Some(spec) => {
            if !plan.adapter.as_ref().is_some_and(|a| a.train_text_encoder) {
                return Vec::new();
            }
            tensors
                .iter()
                .filter_map(|(name, w)| {
                    let full = named(name);
                    let path = full.strip_suffix(".weight")?;
                    let (rank, _) = text_encoder_target(path, &spec)?;
                    Some(adapter_shapes(w, rank, &spec))
                })
                .flatten()
                .collect()
        }
        None if !plan.train_text_encoder => Vec::new(),
        None => {
            let layers = tensors
                .keys()
                .filter_map(|n| {
                    let rest = named(n);
                    let rest = rest.strip_prefix("text_model.encoder.layers.")?.to_string();
                    rest.split('.').next()?.parse::<usize>().ok()
                })
                .max()
                .map_or(0, |m| m + 1);
            tensors
                .iter()
                .filter(|(name, _)| {
                    text_encoder_param_trains(&named(name), layers, &plan.text_encoder_freeze)
                })
                .map(|(_, s)| s.clone())
                .collect()
        }
    }
}
