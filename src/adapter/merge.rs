//! Folding a kohya-named adapter file (LoRA, LoCon, LoHa, LoKr, DoRA) into a model's frozen
//! weights, as A1111 and ComfyUI apply one for inference: `W += m · U` for each module of the
//! file, `U` the update it encodes ([`super::factors`]: `ΔW`, or DoRA's `W' − W`), taken over the
//! flattened factors and shaped like `W` (so a 1×1-conv LoRA fits a linear layer and the other
//! way round). `m` is the user's multiplier; `m = 0` leaves the base weights.
//!
//! DoRA with a multiplier is A1111's and ComfyUI's `W + m·(W' − W)`. LyCORIS's own merge scales
//! the magnitude ratio instead, `W' = (W + ΔW)·(m·(‖·‖ratio − 1) + 1)`, which at `m = 0` leaves
//! `W + ΔW`, not `W`; the two agree at `m = 1`.
//!
//! The sum is done in f32 and rounded once to the weight's dtype (an fp8 base's weight is
//! dequantised, summed and quantised again, its row scales made anew). A module the model does not
//! have, or a shape that does not fit, is an error naming the file and the module; nothing is
//! changed then.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use super::kohya_file::KohyaFile;
use super::kohya_names::{KohyaComponent, KohyaNaming, KohyaResolver};
use crate::model::pipeline::StableDiffusion;
use crate::nn::{LayerMut, VisitLayers};

#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error(
        "{file}: {} modules name nothing in this model ({naming} naming), e.g. {}",
        names.len(),
        names.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
    )]
    Unknown {
        file: String,
        naming: &'static str,
        names: Vec<String>,
    },
    #[error("{file}: module `{name}`: {problem}")]
    Shape {
        file: String,
        name: String,
        problem: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// A layer's weight as stored: itself, or an fp8 base's e4m3 codes and row scales.
struct Stored<'a> {
    weight: &'a mut Tensor,
    scale: &'a mut Option<Tensor>,
}

impl Stored<'_> {
    /// The stored tensors (cheap handles), to read in f32 later with [`weight_f32`].
    fn handles(&self) -> (Tensor, Option<Tensor>) {
        (self.weight.clone(), self.scale.clone())
    }
}

/// `merged` (f32) stored as `like` is: in its dtype, or requantised to fp8 when it has a scale.
fn stored_as(
    merged: &Tensor,
    like: &(Tensor, Option<Tensor>),
    name: &str,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    match like.1 {
        Some(_) => {
            let (codes, scale) = crate::nn::fp8::quantize(merged, name)?;
            Ok((codes, Some(scale)))
        }
        None => Ok((merged.to_dtype(like.0.dtype())?, None)),
    }
}

/// A stored weight in f32 (dequantised from fp8).
fn weight_f32(weight: &Tensor, scale: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match scale {
        Some(s) => crate::nn::fp8::dequantize(weight, s, DType::F32),
        None => weight.to_dtype(DType::F32),
    }
}

/// Visits every Linear and Conv2d of the UNet and the text encoders with its component, path
/// and stored weight.
fn visit_weights(sd: &mut StableDiffusion, f: &mut dyn FnMut(KohyaComponent, &str, Stored<'_>)) {
    let mut each = |c: KohyaComponent, l: LayerMut<'_>| match l {
        LayerMut::Linear(m) => f(
            c,
            &m.path,
            Stored {
                weight: &mut m.weight,
                scale: &mut m.weight_scale,
            },
        ),
        LayerMut::Conv2d(m) => f(
            c,
            &m.path,
            Stored {
                weight: &mut m.weight,
                scale: &mut m.weight_scale,
            },
        ),
    };
    sd.unet.visit_layers(&mut |l| each(KohyaComponent::Unet, l));
    let comps = [KohyaComponent::TextEncoder, KohyaComponent::TextEncoder2];
    for (te, c) in sd.text_encoders.iter_mut().zip(comps) {
        te.model.visit_layers(&mut |l| each(c, l));
    }
}

/// Merges every module of `file` into `sd` with multiplier `multiplier`. Returns how many
/// modules were merged.
pub fn merge_kohya(
    sd: &mut StableDiffusion,
    naming: &KohyaNaming,
    file: &KohyaFile,
    multiplier: f64,
) -> Result<usize, MergeError> {
    merge_kohya_layers(sd, naming, file, multiplier).map(|changed| changed.len())
}

/// [`merge_kohya`], returning the layers it changed (component and module path).
pub fn merge_kohya_layers(
    sd: &mut StableDiffusion,
    naming: &KohyaNaming,
    file: &KohyaFile,
    multiplier: f64,
) -> Result<Vec<(KohyaComponent, String)>, MergeError> {
    let file_name = file.path.display().to_string();
    // Only the layers kohya can name; others (e.g. SDXL's added embedding) take no adapter.
    let mut slots: Vec<(KohyaComponent, String, (Tensor, Option<Tensor>))> = Vec::new();
    visit_weights(sd, &mut |c, path, w| {
        if naming.module_name(c, path).is_ok() {
            slots.push((c, path.to_string(), w.handles()));
        }
    });
    let resolver =
        KohyaResolver::new(naming, slots.iter().map(|s| (s.0, s.1.as_str()))).map_err(|e| {
            MergeError::Shape {
                file: file_name.clone(),
                name: "-".into(),
                problem: e.to_string(),
            }
        })?;
    let mut unknown = Vec::new();
    let mut updates: HashMap<(KohyaComponent, String), (Tensor, Option<Tensor>)> = HashMap::new();
    for m in &file.modules {
        let Some(k) = resolver.resolve(&m.name) else {
            unknown.push(m.name.clone());
            continue;
        };
        let (component, path, weight) = &slots[k];
        let bad = |problem: String| MergeError::Shape {
            file: file_name.clone(),
            name: m.name.clone(),
            problem,
        };
        let w32 = weight_f32(&weight.0, weight.1.as_ref())?;
        let update = m
            .weight_update(w32.dims(), Some(&w32))
            .map_err(|e| bad(e.to_string()))?;
        let merged = (&w32 + (update * multiplier)?)?;
        let stored = stored_as(&merged, weight, path).map_err(|e| bad(e.to_string()))?;
        updates.insert((*component, path.clone()), stored);
    }
    if !unknown.is_empty() {
        return Err(MergeError::Unknown {
            file: file_name,
            naming: if naming.is_sdxl() { "SDXL" } else { "SD1/SD2" },
            names: unknown,
        });
    }
    let mut changed: Vec<(KohyaComponent, String)> = updates.keys().cloned().collect();
    changed.sort();
    visit_weights(sd, &mut |c, path, w| {
        if let Some((weight, scale)) = updates.remove(&(c, path.to_string())) {
            *w.weight = weight;
            *w.scale = scale;
        }
    });
    Ok(changed)
}

/// The stored weights of the `wanted` Linear and Conv2d layers (component and module path), in
/// f32 (an fp8 base dequantised).
pub fn layer_weights(
    sd: &mut StableDiffusion,
    wanted: &[(KohyaComponent, String)],
) -> Result<HashMap<(KohyaComponent, String), Tensor>, MergeError> {
    let wanted: std::collections::HashSet<&(KohyaComponent, String)> = wanted.iter().collect();
    let mut handles = Vec::new();
    visit_weights(sd, &mut |c, path, w| {
        if wanted.contains(&(c, path.to_string())) {
            handles.push((c, path.to_string(), w.handles()))
        }
    });
    let mut out = HashMap::with_capacity(handles.len());
    for (c, path, (weight, scale)) in handles {
        out.insert((c, path), weight_f32(&weight, scale.as_ref())?);
    }
    Ok(out)
}
