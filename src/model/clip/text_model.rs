//! transformers' `CLIPTextModel` / `CLIPTextModelWithProjection`, written for training.
//!
//! A pre-LN transformer with a causal mask and no padding mask (SD pipelines pass none; compel's
//! prompt weighting passes one, see [`ClipTextModel::forward_masked`]):
//! ```text
//! h₀ = token_embedding(ids) + position_embedding(0..L)
//! hᵢ = hᵢ₋₁ + out_proj(attn(layer_norm1(hᵢ₋₁)))      (causal)
//! hᵢ = hᵢ  + fc2(act(fc1(layer_norm2(hᵢ))))
//! last_hidden_state = final_layer_norm(h_N)
//! pooled = last_hidden_state[b, eos position of row b]
//! text_embeds = text_projection(pooled)               (no bias; WithProjection only)
//! ```
//! Tensor names are transformers' (`text_model.encoder.layers.N.self_attn.q_proj.weight`, …).
//! Files hold them in one of two layouts, told apart by where the token embedding is:
//! - `text_model.*` (+ `text_projection.weight`): transformers 4, every SD/SDXL checkpoint, and
//!   transformers 5's `CLIPTextModelWithProjection` or a `CLIPTextModel` it loaded from such a file;
//! - no `text_model.` prefix (+ `text_projection.weight`): transformers 5's `CLIPTextModel` built
//!   from a config or saved with `save_original_format=False`. transformers 5 loads it into either
//!   class.
//!
//! Parameter and layer names are `text_model.*` either way (LoRA names, freezing rules and resume
//! state do not depend on the file). Not read: the `position_ids` buffer transformers < 4.31
//! saved (positions are `0..L`, as transformers computes them now), and a full `CLIPModel` file's
//! vision tower and `logit_scale`.

use candle_core::{bail, DType, Tensor};

use super::config::{ClipActivation, ClipTextConfig};
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{
    attention, causal_attention, causal_mask, gelu_erf, quick_gelu, CausalMask, Embedding,
    LayerMut, LayerNorm, Linear, VisitLayers,
};

/// The self-attention mask: causal, or causal with some keys masked out as well (transformers'
/// `attention_mask` of zeros and ones).
#[derive(Debug, Clone)]
pub enum TextMask {
    Causal(CausalMask),
    /// Additive `[B, 1, L, L]`: the most negative f32 above the diagonal and at masked keys.
    CausalKeys(Tensor),
}

impl TextMask {
    /// `keep[b][j]`: whether row `b` attends to key `j` (besides the causal rule).
    pub fn with_keys(
        keep: &[Vec<bool>],
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        let (b, len) = (keep.len(), keep.first().map_or(0, Vec::len));
        if keep.iter().all(|row| row.iter().all(|&k| k)) {
            return Ok(Self::Causal(causal_mask(len, device)?));
        }
        let mut m = Vec::with_capacity(b * len * len);
        for row in keep {
            if row.len() != len {
                bail!("CLIP text model: key mask rows of different lengths");
            }
            for i in 0..len {
                m.extend((0..len).map(|j| if j > i || !row[j] { f32::MIN } else { 0.0 }));
            }
        }
        Ok(Self::CausalKeys(Tensor::from_vec(
            m,
            (b, 1, len, len),
            device,
        )?))
    }
}

/// What one forward returns.
#[derive(Debug, Clone)]
pub struct ClipTextOutput {
    /// transformers' `hidden_states[-(skip + 1)]`: skip 0 is the last layer's output, skip 1 the
    /// penultimate one; not passed through `final_layer_norm`.
    pub hidden: Tensor,
    /// `final_layer_norm` of the last layer's output, `[B, L, D]`.
    pub last_hidden_state: Tensor,
    /// `last_hidden_state` at each row's EOS token, `[B, D]` (transformers' `pooler_output`).
    pub pooled: Tensor,
    /// `text_projection(pooled)`, `[B, projection_dim]`, when the model has a projection.
    pub text_embeds: Option<Tensor>,
}

/// `self_attn`: multi-head causal self-attention with biased q/k/v/out projections.
#[derive(Debug, Clone)]
pub struct ClipAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub out_proj: Linear,
    pub heads: usize,
}

impl ClipAttention {
    pub fn new(w: &Weights, cfg: &ClipTextConfig) -> std::result::Result<Self, WeightsError> {
        let d = cfg.hidden_size;
        Ok(Self {
            q_proj: Linear::new(&w.pp("q_proj"), d, d, true)?,
            k_proj: Linear::new(&w.pp("k_proj"), d, d, true)?,
            v_proj: Linear::new(&w.pp("v_proj"), d, d, true)?,
            out_proj: Linear::new(&w.pp("out_proj"), d, d, true)?,
            heads: cfg.num_attention_heads,
        })
    }

    /// `x` `[B, L, D]`, `mask` for `L` tokens.
    pub fn forward(&self, x: &Tensor, mask: &TextMask) -> candle_core::Result<Tensor> {
        let q = self.q_proj.forward(x)?;
        let k = self.k_proj.forward(x)?;
        let v = self.v_proj.forward(x)?;
        let out = match mask {
            TextMask::Causal(m) => causal_attention(&q, &k, &v, self.heads, m)?,
            TextMask::CausalKeys(m) => attention(&q, &k, &v, self.heads, Some(m))?,
        };
        self.out_proj.forward(&out)
    }
}

/// `mlp`: `fc2(act(fc1(x)))`.
#[derive(Debug, Clone)]
pub struct ClipMlp {
    pub fc1: Linear,
    pub fc2: Linear,
    pub act: ClipActivation,
}

impl ClipMlp {
    pub fn new(w: &Weights, cfg: &ClipTextConfig) -> std::result::Result<Self, WeightsError> {
        Ok(Self {
            fc1: Linear::new(&w.pp("fc1"), cfg.hidden_size, cfg.intermediate_size, true)?,
            fc2: Linear::new(&w.pp("fc2"), cfg.intermediate_size, cfg.hidden_size, true)?,
            act: cfg.hidden_act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.fc1.forward(x)?;
        let h = match self.act {
            ClipActivation::QuickGelu => quick_gelu(&h)?,
            ClipActivation::Gelu => gelu_erf(&h)?,
            ClipActivation::GeluTanh => h.gelu()?,
        };
        self.fc2.forward(&h)
    }
}

/// One pre-LN encoder layer (`text_model.encoder.layers.N`).
#[derive(Debug, Clone)]
pub struct ClipEncoderLayer {
    pub layer_norm1: LayerNorm,
    pub self_attn: ClipAttention,
    pub layer_norm2: LayerNorm,
    pub mlp: ClipMlp,
}

impl ClipEncoderLayer {
    pub fn new(w: &Weights, cfg: &ClipTextConfig) -> std::result::Result<Self, WeightsError> {
        let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        Ok(Self {
            layer_norm1: LayerNorm::new(&w.pp("layer_norm1"), d, eps)?,
            self_attn: ClipAttention::new(&w.pp("self_attn"), cfg)?,
            layer_norm2: LayerNorm::new(&w.pp("layer_norm2"), d, eps)?,
            mlp: ClipMlp::new(&w.pp("mlp"), cfg)?,
        })
    }

    pub fn forward(&self, x: &Tensor, mask: &TextMask) -> candle_core::Result<Tensor> {
        // `add_maybe_const`: below the first adapter the residual stream is a constant.
        let attn = self
            .self_attn
            .forward(&self.layer_norm1.forward(x)?, mask)?;
        let h = crate::nn::add_maybe_const(x, &attn)?;
        crate::nn::add_maybe_const(&h, &self.mlp.forward(&self.layer_norm2.forward(&h)?)?)
    }
}

impl VisitLayers for ClipEncoderLayer {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        let a = &mut self.self_attn;
        a.q_proj.visit_layers(f);
        a.k_proj.visit_layers(f);
        a.v_proj.visit_layers(f);
        a.out_proj.visit_layers(f);
        self.mlp.fc1.visit_layers(f);
        self.mlp.fc2.visit_layers(f);
    }
}

/// The CLIP text transformer, optionally with `text_projection` (SDXL's `text_encoder_2`).
#[derive(Debug, Clone)]
pub struct ClipTextModel {
    pub config: ClipTextConfig,
    pub token_embedding: Embedding,
    pub position_embedding: Embedding,
    pub layers: Vec<ClipEncoderLayer>,
    pub final_layer_norm: LayerNorm,
    pub text_projection: Option<Linear>,
    /// The dtype activations run in. Starts as the weights' dtype; set it to bf16/f16 over f32
    /// weights for mixed precision (each layer casts its weights, and the cast's backward
    /// returns f32 gradients).
    pub compute_dtype: DType,
    /// Gradient checkpointing of every encoder layer, when set.
    pub checkpointing: Option<crate::nn::Checkpointing>,
}

impl ClipTextModel {
    /// `w` is at the checkpoint root, in either layout (module header).
    pub fn new(
        w: &Weights,
        cfg: &ClipTextConfig,
        with_projection: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let tm = w.pp_or_flat("text_model", "embeddings.token_embedding.weight")?;
        let emb = tm.pp("embeddings");
        let enc = tm.pp("encoder").pp("layers");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ClipEncoderLayer::new(&enc.pp(i), cfg))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let text_projection = if with_projection {
            Some(Linear::new(
                &w.pp("text_projection"),
                cfg.hidden_size,
                cfg.projection_dim,
                false,
            )?)
        } else {
            None
        };
        Ok(Self {
            config: cfg.clone(),
            token_embedding: Embedding::new(
                &emb.pp("token_embedding"),
                cfg.vocab_size,
                cfg.hidden_size,
            )?,
            position_embedding: Embedding::new(
                &emb.pp("position_embedding"),
                cfg.max_position_embeddings,
                cfg.hidden_size,
            )?,
            layers,
            final_layer_norm: LayerNorm::new(
                &tm.pp("final_layer_norm"),
                cfg.hidden_size,
                cfg.layer_norm_eps,
            )?,
            text_projection,
            compute_dtype: w.dtype(),
            checkpointing: None,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// `ids` `[B, L]` (u32 or i64), on the CPU or the model's device. `skip` picks
    /// [`ClipTextOutput::hidden`]: 0 is the last layer, 1 the penultimate, up to `num_layers()`
    /// (the embeddings). Ids on the CPU (as the tokenizer makes them) cost no device sync: the
    /// pooled positions are read from them before they are uploaded.
    pub fn forward(&self, ids: &Tensor, skip: usize) -> candle_core::Result<ClipTextOutput> {
        self.forward_masked(ids, skip, None)
    }

    /// [`Self::forward`] with some keys masked out of every layer's self-attention: `keep[b][j]`
    /// false hides token `j` of row `b` from the tokens after it (transformers' `attention_mask`,
    /// which compel's down-weighting passes). `None`: the causal mask alone.
    pub fn forward_masked(
        &self,
        ids: &Tensor,
        skip: usize,
        keep: Option<&[Vec<bool>]>,
    ) -> candle_core::Result<ClipTextOutput> {
        let (b, len) = ids.dims2()?;
        if len > self.config.max_position_embeddings {
            bail!(
                "CLIP text model: sequence length {len} exceeds max_position_embeddings {}",
                self.config.max_position_embeddings
            );
        }
        let n = self.layers.len();
        if skip > n {
            bail!("CLIP text model: skip {skip} is more than its {n} layers");
        }
        // Read on the host before any work is queued: with ids already on a GPU this is the
        // forward's one device→host copy, with ids on the CPU it is free.
        let host = ids.to_dtype(DType::I64)?.to_vec2::<i64>()?;
        // An id past the embedding (a tokenizer with added tokens whose rows the text encoder
        // lacks) is an error on the CPU but not checked by the CUDA gather: refuse it here.
        let vocab = self.token_embedding.vocab_size();
        if let Some(&bad) = host
            .iter()
            .flatten()
            .find(|&&v| v < 0 || v as usize >= vocab)
        {
            bail!(
                "CLIP text model: token id {bad} is out of range for its {vocab}-row token \
                 embedding (`{}`); the tokenizer has more tokens (added_tokens.json or \
                 tokenizer.json's added_tokens) than the text encoder has embedding rows",
                self.token_embedding.path
            );
        }
        // With textual-inversion rows, the legacy argmax would pick their larger ids: the EOS
        // is looked for among the table's own ids (kohya's `pool_workaround` finds it by id).
        let rows = match self.token_embedding.added {
            None => eos_positions_of(&host, self.config.eos_token_id),
            Some(_) => {
                let base = self.token_embedding.base_vocab() as i64;
                let own: Vec<Vec<i64>> = host
                    .iter()
                    .map(|r| r.iter().map(|&v| if v < base { v } else { -1 }).collect())
                    .collect();
                eos_positions_of(&own, self.config.eos_token_id)
            }
        };
        let device = self.token_embedding.weight.device();
        let ids = &ids.to_device(device)?;
        let positions = Tensor::arange(0u32, len as u32, device)?;
        // The host ids again, for textual inversion's rows: no second device read.
        let flat_host: Option<Vec<i64>> = self
            .token_embedding
            .added
            .as_ref()
            .map(|_| host.iter().flatten().copied().collect());
        let tok = self
            .token_embedding
            .forward_known(ids, flat_host.as_deref())?
            .to_dtype(self.compute_dtype)?;
        let pos = self
            .position_embedding
            .forward(&positions)?
            .to_dtype(self.compute_dtype)?;
        let mut h = tok.broadcast_add(&pos)?;
        let mask = match keep {
            Some(keep) if keep.len() == b => TextMask::with_keys(keep, device)?,
            Some(keep) => bail!(
                "CLIP text model: {} key-mask rows for {b} prompts",
                keep.len()
            ),
            None => TextMask::Causal(causal_mask(len, device)?),
        };
        // hidden_states[k] is the input of layer k; we keep only the one `skip` asks for.
        let keep = n - skip;
        let mut hidden = if keep == 0 { Some(h.clone()) } else { None };
        for (i, layer) in self.layers.iter().enumerate() {
            h = match &self.checkpointing {
                None => layer.forward(&h, &mask)?,
                Some(ck) => {
                    let (layer, mask) = (layer.clone(), mask.clone());
                    ck.run(
                        &h,
                        None,
                        std::sync::Arc::new(move |x: &Tensor, _: Option<&Tensor>| {
                            layer.forward(x, &mask)
                        }),
                    )?
                }
            };
            if i + 1 == keep {
                hidden = Some(h.clone());
            }
        }
        let hidden = match hidden {
            Some(t) => t,
            None => bail!("CLIP text model: no hidden state kept for skip {skip}"),
        };
        let last_hidden_state = self.final_layer_norm.forward(&h)?;
        let flat_index: Vec<u32> = rows
            .iter()
            .enumerate()
            .map(|(row, &pos)| (row * len + pos) as u32)
            .collect();
        let flat_index = Tensor::from_vec(flat_index, b, device)?;
        let pooled = last_hidden_state
            .reshape((b * len, ()))?
            .index_select(&flat_index, 0)?;
        let text_embeds = match &self.text_projection {
            Some(p) => Some(p.forward(&pooled)?),
            None => None,
        };
        Ok(ClipTextOutput {
            hidden,
            last_hidden_state,
            pooled,
            text_embeds,
        })
    }
}

/// The pooled position of each row, as transformers picks it: with the legacy
/// `eos_token_id == 2` (configs written before transformers 4.31) the position of the largest
/// id (CLIP's EOS is the largest id in its vocab); otherwise the first id equal to
/// `eos_token_id`, or 0 when a row has none (torch's `argmax` of an all-false row).
/// Reads the ids back to the host, a small device sync per forward.
pub fn eos_positions(ids: &Tensor, eos_token_id: i64) -> candle_core::Result<Vec<usize>> {
    let rows = ids.to_dtype(DType::I64)?.to_vec2::<i64>()?;
    Ok(eos_positions_of(&rows, eos_token_id))
}

/// [`eos_positions`] of ids already on the host.
fn eos_positions_of(rows: &[Vec<i64>], eos_token_id: i64) -> Vec<usize> {
    rows.iter()
        .map(|row| {
            if eos_token_id == 2 {
                // First maximum, as torch.argmax returns.
                let mut best = 0;
                for (j, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = j;
                    }
                }
                best
            } else {
                row.iter().position(|&v| v == eos_token_id).unwrap_or(0)
            }
        })
        .collect()
}

impl VisitLayers for ClipTextModel {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.layers.visit_layers(f);
        self.text_projection.visit_layers(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn eos_rule_first_match_and_legacy_argmax() {
        let ids = Tensor::new(&[[5u32, 9, 7, 9, 1], [5, 1, 1, 1, 1]], &Device::Cpu).unwrap();
        assert_eq!(eos_positions(&ids, 9).unwrap(), vec![1, 0]);
        assert_eq!(eos_positions(&ids, 1).unwrap(), vec![4, 1]);
        // Legacy: argmax, first maximum.
        assert_eq!(eos_positions(&ids, 2).unwrap(), vec![1, 0]);
        let ids = ids.to_dtype(DType::I64).unwrap();
        assert_eq!(eos_positions(&ids, 9).unwrap(), vec![1, 0]);
    }

    fn tiny_config() -> ClipTextConfig {
        ClipTextConfig {
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 16,
            projection_dim: 4,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            max_position_embeddings: 6,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            bos_token_id: 13,
            eos_token_id: 14,
            pad_token_id: 14,
        }
    }

    #[test]
    fn layer_paths_and_skip_range() {
        let w = Weights::random(0, "text_encoder", DType::F32, &Device::Cpu, false);
        let mut m = ClipTextModel::new(&w, &tiny_config(), true).unwrap();
        let mut paths = Vec::new();
        m.visit_layers(&mut |l| {
            if let LayerMut::Linear(l) = l {
                paths.push(l.path.clone())
            }
        });
        assert_eq!(paths.len(), 2 * 6 + 1);
        assert_eq!(paths[0], "text_model.encoder.layers.0.self_attn.q_proj");
        assert_eq!(paths[5], "text_model.encoder.layers.0.mlp.fc2");
        assert_eq!(paths[12], "text_projection");
        let ids = Tensor::new(&[[13u32, 3, 4, 14, 14]], &Device::Cpu).unwrap();
        let out = m.forward(&ids, 2).unwrap();
        assert_eq!(out.hidden.dims(), &[1, 5, 8]);
        assert_eq!(out.text_embeds.unwrap().dims(), &[1, 4]);
        assert!(m.forward(&ids, 3).is_err());
        let long = Tensor::zeros((1, 7), DType::U32, &Device::Cpu).unwrap();
        assert!(m.forward(&long, 0).is_err());
    }

    #[test]
    fn legacy_eos_rule_ignores_added_token_rows() {
        // eos_token_id 2: transformers' argmax of the ids, which textual inversion's larger ids
        // would win; the EOS (14, the table's largest id) is pooled instead, at position 3.
        let cfg = ClipTextConfig {
            eos_token_id: 2,
            ..tiny_config()
        };
        let w = Weights::random(2, "text_encoder", DType::F32, &Device::Cpu, false);
        let mut m = ClipTextModel::new(&w, &cfg, false).unwrap();
        let rows = Tensor::ones((2, 8), DType::F32, &Device::Cpu).unwrap();
        m.token_embedding.add_rows(rows).unwrap();
        let ids = Tensor::new(&[[13u32, 16, 17, 14, 14]], &Device::Cpu).unwrap();
        let out = m.forward(&ids, 0).unwrap();
        let want = out.last_hidden_state.get(0).unwrap().get(3).unwrap();
        let got = out.pooled.get(0).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
        // An id past the added rows is still refused.
        let bad = Tensor::new(&[[13u32, 18, 14, 14, 14]], &Device::Cpu).unwrap();
        assert!(m.forward(&bad, 0).is_err());
    }

    #[test]
    fn every_parameter_gets_a_gradient() {
        let w = Weights::random(1, "text_encoder", DType::F32, &Device::Cpu, true);
        let m = ClipTextModel::new(&w, &tiny_config(), true).unwrap();
        let ids = Tensor::new(&[[13u32, 3, 4, 5, 14], [13, 7, 14, 14, 14]], &Device::Cpu).unwrap();
        let out = m.forward(&ids, 1).unwrap();
        let loss = (out.hidden.sqr().unwrap().mean_all().unwrap()
            + out.text_embeds.unwrap().sqr().unwrap().mean_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in w.params() {
            let g = grads.get(var.as_tensor());
            // hidden (skip 1) does not depend on the last layer: only the projection path does.
            let g = g.unwrap_or_else(|| panic!("no gradient for {name}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm.is_finite(), "{name}");
            if !name.contains("position_embedding") {
                assert!(norm > 0.0, "zero gradient for {name}");
            }
        }
    }
}
