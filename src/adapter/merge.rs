//! Folding a kohya LoRA/LoCon file into a model's frozen weights, as A1111 and ComfyUI apply
//! one for inference: `W += m · (alpha/rank) · up·down` for each module of the file, with
//! `up·down` taken over the flattened `[out, r]` and `[r, in·kh·kw]` and shaped like `W` (so a
//! 1×1-conv LoRA fits a linear layer and the other way round). `m` is the user's multiplier.
//!
//! The sum is done in f32 and rounded once to the weight's dtype. A module the model does not
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

/// Visits every Linear and Conv2d of the UNet and the text encoders with its component, path
/// and weight.
fn visit_weights(sd: &mut StableDiffusion, f: &mut dyn FnMut(KohyaComponent, &str, &mut Tensor)) {
    let mut each = |c: KohyaComponent, l: LayerMut<'_>| match l {
        LayerMut::Linear(m) => f(c, &m.path, &mut m.weight),
        LayerMut::Conv2d(m) => f(c, &m.path, &mut m.weight),
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
    let file_name = file.path.display().to_string();
    // Only the layers kohya can name; others (e.g. SDXL's added embedding) take no adapter.
    let mut slots: Vec<(KohyaComponent, String, Tensor)> = Vec::new();
    visit_weights(sd, &mut |c, path, w| {
        if naming.module_name(c, path).is_ok() {
            slots.push((c, path.to_string(), w.clone()));
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
    let mut updates: HashMap<(KohyaComponent, String), Tensor> = HashMap::new();
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
        let (rank, out_dim) = (m.rank(), m.up.dims().first().copied().unwrap_or(0));
        let up = m.up.to_dtype(DType::F32)?.reshape((out_dim, ()))?;
        let down = m.down.to_dtype(DType::F32)?.reshape((rank, ()))?;
        if up.dim(1)? != rank {
            return Err(bad(format!(
                "up {:?} and down {:?} disagree on the rank",
                m.up.dims(),
                m.down.dims()
            )));
        }
        let delta = up.matmul(&down)?;
        if delta.elem_count() != weight.elem_count() || out_dim != weight.dim(0)? {
            return Err(bad(format!(
                "up {:?} · down {:?} does not fit the weight {:?}",
                m.up.dims(),
                m.down.dims(),
                weight.dims()
            )));
        }
        let scale = multiplier * f64::from(m.alpha) / rank.max(1) as f64;
        let merged = (weight.to_dtype(DType::F32)? + (delta.reshape(weight.shape())? * scale)?)?
            .to_dtype(weight.dtype())?;
        updates.insert((*component, path.clone()), merged);
    }
    if !unknown.is_empty() {
        return Err(MergeError::Unknown {
            file: file_name,
            naming: if naming.is_sdxl() { "SDXL" } else { "SD1/SD2" },
            names: unknown,
        });
    }
    let n = updates.len();
    visit_weights(sd, &mut |c, path, w| {
        if let Some(new) = updates.remove(&(c, path.to_string())) {
            *w = new;
        }
    });
    Ok(n)
}
