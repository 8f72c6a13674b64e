//! kohya LoRA module names: diffusers/transformers module path ↔ the name kohya's sd-scripts
//! writes into a LoRA file, for SD1, SD2 and SDXL.
//!
//! - A name is `<prefix>_<path with . replaced by _>`. The prefix is `lora_unet`, `lora_te` (the
//!   single text encoder of SD1/SD2) or `lora_te1`/`lora_te2` (SDXL's two encoders).
//! - SD1/SD2 UNet paths are the diffusers ones (`lora_unet_down_blocks_0_attentions_0_…`):
//!   kohya trains those families on a diffusers-layout UNet.
//! - SDXL UNet paths are the original LDM/sgm ones (`lora_unet_input_blocks_4_1_…`): kohya trains
//!   SDXL on its own sgm-layout UNet (`library/sdxl_original_unet.py`), and A1111 and ComfyUI
//!   expect those names. The map is computed from the UNet structure ([`UnetLayout`]), by the
//!   same rules as ComfyUI's `comfy/utils.py::unet_to_diffusers` and diffusers'
//!   `scripts/convert_diffusers_to_original_sdxl.py`:
//!   - level `i` of the down path owns `layers[i]` entries of `input_blocks` after
//!     `input_blocks.0` (conv_in), plus one for its downsampler unless it is the last level:
//!     `down_blocks.i.resnets.j` → `input_blocks.n.0`, `down_blocks.i.attentions.j` →
//!     `input_blocks.n.1` with `n = 1 + Σ_{k<i}(layers[k] + 1) + j`;
//!     `down_blocks.i.downsamplers.0.conv` → `input_blocks.(n_last + 1).0.op`.
//!   - `mid_block.resnets.j` → `middle_block.(2j)`, `mid_block.attentions.0` → `middle_block.1`.
//!   - up level `i` owns `layers + 1` entries of `output_blocks`: `up_blocks.i.resnets.j` →
//!     `output_blocks.n.0`, `…attentions.j` → `output_blocks.n.1`; its upsampler sits in the
//!     level's last entry after the resnet (and the attention, if any):
//!     `up_blocks.i.upsamplers.0.conv` → `output_blocks.n_last.1.conv` (no attention) or
//!     `output_blocks.n_last.2.conv`.
//!   - inside a resnet: norm1 → in_layers.0, conv1 → in_layers.2, norm2 → out_layers.0,
//!     conv2 → out_layers.3, time_emb_proj → emb_layers.1, conv_shortcut → skip_connection.
//!   - transformer internals (proj_in, transformer_blocks.k.attn1.to_q, ff.net.0.proj, …) keep
//!     their names.
//!   - conv_in → input_blocks.0.0, time_embedding.linear_1/2 → time_embed.0/2,
//!     add_embedding.linear_1/2 → label_emb.0.0/0.2, conv_norm_out → out.0, conv_out → out.2.
//! - Checked against diffusers 0.42.1's SDXL kohya loader (`_maybe_map_sgm_blocks_to_diffusers`
//!   and `_convert_non_diffusers_lora_to_diffusers`): all 786 LoCon modules of an SDXL-structured
//!   UNet map back to their paths (`tests/fixtures/kohya_reference.py sdxl-check`, manual); in CI,
//!   every UNet module of tiny-sdxl against the converter's map
//!   (tests/lycoris_sdxl_parity.rs, `sdtrain_sgm_names_are_diffusers_converter_names`).
//! - Loading inverts the map by building the forward name of every known module path
//!   ([`KohyaResolver`]): `_` is ambiguous (`to_out_0` vs `to_out.0`, `text_model`), so names are
//!   never split back. Two other UNet spellings are accepted as aliases, as ComfyUI
//!   (`comfy/lora.py::model_lora_keys_unet`) accepts them:
//!   - for SDXL, the diffusers path under `lora_unet_` (`lora_unet_down_blocks_1_attentions_0_…`):
//!     LyCORIS's own `create_lycoris` on a diffusers UNet (with kohya's prefix) writes that;
//!   - for every family, the diffusers path under LyCORIS's default prefix `lycoris_`: SimpleTuner
//!     calls `create_lycoris` on the bare UNet and saves its network as is.
//!
//!   Text-encoder names are saved with transformers 4's `text_model.` level
//!   (`lora_te_text_model_encoder_…`); on load the same name without it (`lora_te_encoder_…`,
//!   `lora_te1_encoder_…`, `lora_te2_encoder_…`), which kohya writes when run under
//!   transformers 5 (whose CLIPTextModel has no `text_model.` level), is an alias.

use std::collections::HashMap;

/// Which model a LoRA module belongs to (kept apart from the adapter's own component type so
/// that naming depends on plain data only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KohyaComponent {
    Unet,
    /// `text_encoder` (CLIP ViT-L for SD1 and SDXL, OpenCLIP ViT-H for SD2).
    TextEncoder,
    /// SDXL's `text_encoder_2` (OpenCLIP ViT-bigG).
    TextEncoder2,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KohyaNameError {
    #[error("UNet module `{path}` has no place in the SDXL (LDM) block layout {layout}")]
    UnmappedUnetPath { path: String, layout: String },
    #[error("SD1/SD2 models have one text encoder; `{path}` is tagged as text_encoder_2")]
    NoSecondTextEncoder { path: String },
    #[error("modules `{first}` and `{second}` would both be saved as `{name}`")]
    Collision {
        name: String,
        first: String,
        second: String,
    },
}

/// The block structure of a UNet that the LDM names are computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnetLayout {
    /// Resnets per down level (diffusers `layers_per_block`); up level `i` has
    /// `layers[len - 1 - i] + 1`.
    pub layers: Vec<usize>,
    /// Whether down level `i` is a CrossAttnDownBlock2D.
    pub down_attention: Vec<bool>,
    /// Whether up level `i` (in up order) is a CrossAttnUpBlock2D.
    pub up_attention: Vec<bool>,
}

impl UnetLayout {
    /// SDXL base 1.0: `layers_per_block` 2, down blocks (DownBlock2D, CrossAttnDownBlock2D,
    /// CrossAttnDownBlock2D), up blocks (CrossAttnUpBlock2D, CrossAttnUpBlock2D, UpBlock2D)
    /// (stabilityai/stable-diffusion-xl-base-1.0 `unet/config.json`).
    pub fn sdxl_base() -> Self {
        Self::mirrored(2, &[false, true, true])
    }

    /// `layers_per_block` resnets on every level, cross-attention on the down levels flagged, and
    /// the up path the mirror image of the down path (as in every SD/SDXL config).
    pub fn mirrored(layers_per_block: usize, down_attention: &[bool]) -> Self {
        Self {
            layers: vec![layers_per_block; down_attention.len()],
            down_attention: down_attention.to_vec(),
            up_attention: down_attention.iter().rev().copied().collect(),
        }
    }

    fn levels(&self) -> usize {
        self.layers.len()
    }

    /// Resnets in up level `i`.
    fn up_layers(&self, i: usize) -> Option<usize> {
        let n = self.levels();
        (i < n).then(|| self.layers[n - 1 - i] + 1)
    }

    fn describe(&self) -> String {
        format!(
            "(layers {:?}, down attention {:?}, up attention {:?})",
            self.layers, self.down_attention, self.up_attention
        )
    }
}

/// How UNet module paths are spelled in a kohya file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KohyaNaming {
    /// SD1/SD2: diffusers paths, one text encoder (`lora_te_`).
    Diffusers,
    /// SDXL: LDM block names for the UNet, two text encoders (`lora_te1_`, `lora_te2_`).
    Ldm(UnetLayout),
}

impl KohyaNaming {
    /// The naming kohya uses for a family; SDXL gets the SDXL base 1.0 layout. Prefer
    /// `KohyaNaming::Ldm(layout)` with the layout of the actual UNet config where one is at hand.
    pub fn for_family(family_is_sdxl: bool) -> Self {
        if family_is_sdxl {
            KohyaNaming::Ldm(UnetLayout::sdxl_base())
        } else {
            KohyaNaming::Diffusers
        }
    }

    pub fn is_sdxl(&self) -> bool {
        matches!(self, KohyaNaming::Ldm(_))
    }

    /// `lora_unet`, `lora_te`, `lora_te1` or `lora_te2`.
    pub fn prefix(&self, component: KohyaComponent) -> &'static str {
        kohya_prefix(self.is_sdxl(), component)
    }

    /// The kohya module name of `module_path` (a diffusers UNet path or a transformers text
    /// encoder path such as `text_model.encoder.layers.0.self_attn.q_proj`).
    pub fn module_name(
        &self,
        component: KohyaComponent,
        module_path: &str,
    ) -> Result<String, KohyaNameError> {
        let path = match (self, component) {
            (KohyaNaming::Ldm(layout), KohyaComponent::Unet) => {
                diffusers_to_ldm(layout, module_path).ok_or_else(|| {
                    KohyaNameError::UnmappedUnetPath {
                        path: module_path.to_string(),
                        layout: layout.describe(),
                    }
                })?
            }
            (KohyaNaming::Diffusers, KohyaComponent::TextEncoder2) => {
                return Err(KohyaNameError::NoSecondTextEncoder {
                    path: module_path.to_string(),
                })
            }
            (KohyaNaming::Diffusers, KohyaComponent::Unet | KohyaComponent::TextEncoder)
            | (KohyaNaming::Ldm(_), KohyaComponent::TextEncoder | KohyaComponent::TextEncoder2) => {
                module_path.to_string()
            }
        };
        Ok(underscored(self.prefix(component), &path))
    }

    /// Other spellings accepted on load: for a UNet module, its diffusers path under LyCORIS's
    /// default prefix (`lycoris_down_blocks_…`, what SimpleTuner's LyCORIS files hold; ComfyUI's
    /// "simpletuner lycoris format"), and for SDXL also under `lora_unet_` (LyCORIS or other
    /// trainers run on a diffusers UNet); for every module, diffusers' own dotted name
    /// `<component>.<path>` (`unet.down_blocks.0.…`, `text_encoder.text_model.…`), which its
    /// LoRA files use ([`super::diffusers_keys`]).
    fn aliases(&self, component: KohyaComponent, module_path: &str) -> Vec<String> {
        let lycoris = underscored(LYCORIS_PREFIX, module_path);
        let diffusers = format!("{}.{module_path}", diffusers_component(component));
        match (self, component) {
            (KohyaNaming::Ldm(_), KohyaComponent::Unet) => vec![
                underscored(self.prefix(component), module_path),
                lycoris,
                diffusers,
            ],
            (KohyaNaming::Diffusers, KohyaComponent::Unet) => vec![lycoris, diffusers],
            // transformers 5's CLIPTextModel has no `text_model.` level, so diffusers' files
            // made with it name `text_encoder.encoder.layers.…`, and kohya's
            // `lora_te_encoder_layers_…` (`lora_te1_…`/`lora_te2_…` for SDXL).
            (_, KohyaComponent::TextEncoder | KohyaComponent::TextEncoder2) => {
                let mut names = vec![diffusers];
                if let Some(inner) = module_path.strip_prefix("text_model.") {
                    names.push(format!("{}.{inner}", diffusers_component(component)));
                    names.push(underscored(self.prefix(component), inner));
                }
                names
            }
        }
    }
}

/// diffusers' pipeline attribute name of `component`, its LoRA files' key prefix.
pub fn diffusers_component(component: KohyaComponent) -> &'static str {
    match component {
        KohyaComponent::Unet => "unet",
        KohyaComponent::TextEncoder => "text_encoder",
        KohyaComponent::TextEncoder2 => "text_encoder_2",
    }
}

/// LyCORIS's default module-name prefix (`LycorisNetwork.LORA_PREFIX`), kept by trainers that call
/// `create_lycoris` on the bare UNet (SimpleTuner).
pub const LYCORIS_PREFIX: &str = "lycoris";

/// `lora_unet` | `lora_te` (SD1/SD2) | `lora_te1` / `lora_te2` (SDXL).
pub fn kohya_prefix(family_is_sdxl: bool, component: KohyaComponent) -> &'static str {
    match (family_is_sdxl, component) {
        (_, KohyaComponent::Unet) => "lora_unet",
        (false, KohyaComponent::TextEncoder | KohyaComponent::TextEncoder2) => "lora_te",
        (true, KohyaComponent::TextEncoder) => "lora_te1",
        (true, KohyaComponent::TextEncoder2) => "lora_te2",
    }
}

/// The kohya module name of `module_path`, SDXL with the SDXL base 1.0 layout.
pub fn kohya_module_name(
    family_is_sdxl: bool,
    component: KohyaComponent,
    module_path: &str,
) -> Result<String, KohyaNameError> {
    KohyaNaming::for_family(family_is_sdxl).module_name(component, module_path)
}

fn underscored(prefix: &str, path: &str) -> String {
    format!("{prefix}_{}", path.replace('.', "_"))
}

/// `base` followed by the remaining path segments.
fn join(base: String, rest: &[&str]) -> String {
    rest.iter().fold(base, |mut acc, seg| {
        acc.push('.');
        acc.push_str(seg);
        acc
    })
}

/// The LDM name of a child of a diffusers ResnetBlock2D.
fn resnet_child(rest: &[&str]) -> Option<String> {
    let (first, tail) = rest.split_first()?;
    let ldm = match *first {
        "norm1" => "in_layers.0",
        "conv1" => "in_layers.2",
        "norm2" => "out_layers.0",
        "conv2" => "out_layers.3",
        "time_emb_proj" => "emb_layers.1",
        "conv_shortcut" => "skip_connection",
        _ => return None,
    };
    Some(join(ldm.to_string(), tail))
}

/// The LDM (sgm) path of a diffusers UNet module path, or None when it has no place in `layout`.
pub fn diffusers_to_ldm(layout: &UnetLayout, path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split('.').collect();
    let num = |s: &str| s.parse::<usize>().ok();
    let levels = layout.levels();
    let simple = |ldm: &str, rest: &[&str]| Some(join(ldm.to_string(), rest));
    match parts.as_slice() {
        ["conv_in", rest @ ..] => simple("input_blocks.0.0", rest),
        ["time_embedding", "linear_1", rest @ ..] => simple("time_embed.0", rest),
        ["time_embedding", "linear_2", rest @ ..] => simple("time_embed.2", rest),
        ["add_embedding", "linear_1", rest @ ..] => simple("label_emb.0.0", rest),
        ["add_embedding", "linear_2", rest @ ..] => simple("label_emb.0.2", rest),
        ["conv_norm_out", rest @ ..] => simple("out.0", rest),
        ["conv_out", rest @ ..] => simple("out.2", rest),
        ["down_blocks", i, kind, j, rest @ ..] => {
            let (i, j) = (num(i)?, num(j)?);
            let layers = *layout.layers.get(i)?;
            let first = 1 + layout.layers[..i].iter().map(|l| l + 1).sum::<usize>();
            match *kind {
                "resnets" if j < layers => Some(format!(
                    "input_blocks.{}.0.{}",
                    first + j,
                    resnet_child(rest)?
                )),
                "attentions" if j < layers && layout.down_attention.get(i) == Some(&true) => {
                    Some(join(format!("input_blocks.{}.1", first + j), rest))
                }
                "downsamplers" if j == 0 && i + 1 < levels => match rest {
                    ["conv", tail @ ..] => {
                        Some(join(format!("input_blocks.{}.0.op", first + layers), tail))
                    }
                    _ => None,
                },
                _ => None,
            }
        }
        ["mid_block", kind, j, rest @ ..] => match (*kind, num(j)?) {
            ("resnets", j @ 0..=1) => {
                Some(format!("middle_block.{}.{}", 2 * j, resnet_child(rest)?))
            }
            ("attentions", 0) => Some(join("middle_block.1".to_string(), rest)),
            _ => None,
        },
        ["up_blocks", i, kind, j, rest @ ..] => {
            let (i, j) = (num(i)?, num(j)?);
            let layers = layout.up_layers(i)?;
            let first: usize = (0..i).filter_map(|k| layout.up_layers(k)).sum();
            let attention = layout.up_attention.get(i) == Some(&true);
            match *kind {
                "resnets" if j < layers => Some(format!(
                    "output_blocks.{}.0.{}",
                    first + j,
                    resnet_child(rest)?
                )),
                "attentions" if j < layers && attention => {
                    Some(join(format!("output_blocks.{}.1", first + j), rest))
                }
                "upsamplers" if j == 0 && i + 1 < levels => match rest {
                    ["conv", tail @ ..] => {
                        let slot = if attention { 2 } else { 1 };
                        let base = format!("output_blocks.{}.{slot}.conv", first + layers - 1);
                        Some(join(base, tail))
                    }
                    _ => None,
                },
                _ => None,
            }
        }
        _ => None,
    }
}

/// Inverse of [`KohyaNaming::module_name`] over a fixed set of known modules: each known
/// `(component, module_path)` is named forwards once, and names from a file are looked up.
#[derive(Debug, Clone)]
pub struct KohyaResolver {
    by_name: HashMap<String, usize>,
}

impl KohyaResolver {
    /// Indexes `known` (the model's adapter-able modules). Fails if a known path cannot be named
    /// or two paths share a name.
    pub fn new<'a>(
        naming: &KohyaNaming,
        known: impl IntoIterator<Item = (KohyaComponent, &'a str)>,
    ) -> Result<Self, KohyaNameError> {
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut paths: Vec<&str> = Vec::new();
        for (index, (component, path)) in known.into_iter().enumerate() {
            paths.push(path);
            let name = naming.module_name(component, path)?;
            if let Some(&other) = by_name.get(&name) {
                return Err(KohyaNameError::Collision {
                    name,
                    first: paths[other].to_string(),
                    second: path.to_string(),
                });
            }
            by_name.insert(name, index);
            for alias in naming.aliases(component, path) {
                by_name.entry(alias).or_insert(index);
            }
        }
        Ok(Self { by_name })
    }

    /// The index (into the `known` list given to [`new`](Self::new)) that `kohya_name` names.
    pub fn resolve(&self, kohya_name: &str) -> Option<usize> {
        self.by_name.get(kohya_name).copied()
    }
}

/// One-shot lookup of `kohya_name` among `known` module paths (builds a [`KohyaResolver`]; build
/// one yourself to resolve many names).
pub fn resolve<'a>(
    naming: &KohyaNaming,
    kohya_name: &str,
    known: &[(KohyaComponent, &'a str)],
) -> Option<&'a str> {
    let resolver = KohyaResolver::new(naming, known.iter().copied()).ok()?;
    resolver.resolve(kohya_name).map(|i| known[i].1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: KohyaComponent = KohyaComponent::Unet;

    fn sdxl(path: &str) -> String {
        kohya_module_name(true, U, path).unwrap()
    }

    /// diffusers path → kohya SDXL name. Expected names follow ComfyUI's `unet_to_diffusers`
    /// for the SDXL config (num_res_blocks [2,2,2], transformer_depth [0,0,2,2,10,10]) and names
    /// in released kohya SDXL LoRAs.
    const SDXL_TABLE: &[(&str, &str)] = &[
        (
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
        ),
        (
            "down_blocks.1.attentions.1.proj_in",
            "lora_unet_input_blocks_5_1_proj_in",
        ),
        (
            "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_out.0",
            "lora_unet_input_blocks_8_1_transformer_blocks_9_attn2_to_out_0",
        ),
        (
            "down_blocks.2.attentions.0.transformer_blocks.3.ff.net.0.proj",
            "lora_unet_input_blocks_7_1_transformer_blocks_3_ff_net_0_proj",
        ),
        (
            "down_blocks.0.resnets.0.conv1",
            "lora_unet_input_blocks_1_0_in_layers_2",
        ),
        (
            "down_blocks.0.resnets.1.conv2",
            "lora_unet_input_blocks_2_0_out_layers_3",
        ),
        (
            "down_blocks.1.resnets.0.time_emb_proj",
            "lora_unet_input_blocks_4_0_emb_layers_1",
        ),
        (
            "down_blocks.1.resnets.0.conv_shortcut",
            "lora_unet_input_blocks_4_0_skip_connection",
        ),
        (
            "down_blocks.0.downsamplers.0.conv",
            "lora_unet_input_blocks_3_0_op",
        ),
        (
            "down_blocks.1.downsamplers.0.conv",
            "lora_unet_input_blocks_6_0_op",
        ),
        (
            "mid_block.resnets.0.conv1",
            "lora_unet_middle_block_0_in_layers_2",
        ),
        (
            "mid_block.attentions.0.transformer_blocks.5.attn1.to_k",
            "lora_unet_middle_block_1_transformer_blocks_5_attn1_to_k",
        ),
        (
            "mid_block.resnets.1.time_emb_proj",
            "lora_unet_middle_block_2_emb_layers_1",
        ),
        (
            "up_blocks.0.resnets.0.conv_shortcut",
            "lora_unet_output_blocks_0_0_skip_connection",
        ),
        (
            "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_v",
            "lora_unet_output_blocks_0_1_transformer_blocks_0_attn1_to_v",
        ),
        (
            "up_blocks.0.attentions.2.proj_out",
            "lora_unet_output_blocks_2_1_proj_out",
        ),
        (
            "up_blocks.0.upsamplers.0.conv",
            "lora_unet_output_blocks_2_2_conv",
        ),
        (
            "up_blocks.1.attentions.1.transformer_blocks.1.ff.net.2",
            "lora_unet_output_blocks_4_1_transformer_blocks_1_ff_net_2",
        ),
        (
            "up_blocks.1.upsamplers.0.conv",
            "lora_unet_output_blocks_5_2_conv",
        ),
        (
            "up_blocks.2.resnets.0.conv1",
            "lora_unet_output_blocks_6_0_in_layers_2",
        ),
        (
            "up_blocks.2.resnets.2.conv2",
            "lora_unet_output_blocks_8_0_out_layers_3",
        ),
        ("conv_in", "lora_unet_input_blocks_0_0"),
        ("conv_out", "lora_unet_out_2"),
        ("time_embedding.linear_1", "lora_unet_time_embed_0"),
        ("add_embedding.linear_2", "lora_unet_label_emb_0_2"),
    ];

    #[test]
    fn sdxl_names_match_the_ldm_table() {
        for (path, want) in SDXL_TABLE {
            assert_eq!(&sdxl(path), want, "for {path}");
        }
    }

    #[test]
    fn upsampler_without_attention_uses_slot_1() {
        // SD1-style up path: up_blocks.0 is UpBlock2D, so its upsampler follows the resnet
        // directly (ComfyUI: `c` counts only the resnet).
        let layout = UnetLayout::mirrored(2, &[true, true, true, false]);
        let naming = KohyaNaming::Ldm(layout);
        let name = naming
            .module_name(U, "up_blocks.0.upsamplers.0.conv")
            .unwrap();
        assert_eq!(name, "lora_unet_output_blocks_2_1_conv");
        let name = naming
            .module_name(U, "up_blocks.1.upsamplers.0.conv")
            .unwrap();
        assert_eq!(name, "lora_unet_output_blocks_5_2_conv");
        let name = naming
            .module_name(U, "down_blocks.2.downsamplers.0.conv")
            .unwrap();
        assert_eq!(name, "lora_unet_input_blocks_9_0_op");
    }

    #[test]
    fn sdxl_paths_outside_the_layout_are_errors() {
        for path in [
            "down_blocks.0.attentions.0.proj_in", // level 0 has no attention in SDXL
            "down_blocks.2.downsamplers.0.conv",  // the last level has no downsampler
            "up_blocks.2.upsamplers.0.conv",
            "up_blocks.2.attentions.0.proj_in",
            "down_blocks.3.resnets.0.conv1",
            "down_blocks.0.resnets.2.conv1",
            "up_blocks.0.resnets.3.conv1",
            "mid_block.resnets.2.conv1",
            "down_blocks.0.resnets.0.nonsense",
            "something_else",
        ] {
            let err = kohya_module_name(true, U, path).unwrap_err();
            assert!(
                matches!(err, KohyaNameError::UnmappedUnetPath { .. }),
                "{path}: {err}"
            );
        }
    }

    #[test]
    fn sd1_and_text_encoder_names_replace_dots() {
        assert_eq!(
            kohya_module_name(
                false,
                U,
                "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"
            )
            .unwrap(),
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0"
        );
        let te = "text_model.encoder.layers.11.self_attn.q_proj";
        assert_eq!(
            kohya_module_name(false, KohyaComponent::TextEncoder, te).unwrap(),
            "lora_te_text_model_encoder_layers_11_self_attn_q_proj"
        );
        assert_eq!(
            kohya_module_name(true, KohyaComponent::TextEncoder, te).unwrap(),
            "lora_te1_text_model_encoder_layers_11_self_attn_q_proj"
        );
        assert_eq!(
            kohya_module_name(
                true,
                KohyaComponent::TextEncoder2,
                "text_model.encoder.layers.0.mlp.fc2"
            )
            .unwrap(),
            "lora_te2_text_model_encoder_layers_0_mlp_fc2"
        );
        assert!(kohya_module_name(false, KohyaComponent::TextEncoder2, te).is_err());
    }

    #[test]
    fn prefixes() {
        assert_eq!(kohya_prefix(false, U), "lora_unet");
        assert_eq!(kohya_prefix(true, U), "lora_unet");
        assert_eq!(kohya_prefix(false, KohyaComponent::TextEncoder), "lora_te");
        assert_eq!(kohya_prefix(true, KohyaComponent::TextEncoder), "lora_te1");
        assert_eq!(kohya_prefix(true, KohyaComponent::TextEncoder2), "lora_te2");
    }

    /// Every UNet module path a LoCon run on SDXL would attach to, built from the layout.
    fn sdxl_locon_paths() -> Vec<String> {
        let mut paths = Vec::new();
        let tb = |p: &str, depth: usize, out: &mut Vec<String>| {
            out.push(format!("{p}.proj_in"));
            out.push(format!("{p}.proj_out"));
            for t in 0..depth {
                for a in ["attn1", "attn2"] {
                    for l in ["to_q", "to_k", "to_v", "to_out.0"] {
                        out.push(format!("{p}.transformer_blocks.{t}.{a}.{l}"));
                    }
                }
                out.push(format!("{p}.transformer_blocks.{t}.ff.net.0.proj"));
                out.push(format!("{p}.transformer_blocks.{t}.ff.net.2"));
            }
        };
        let res = |p: &str, out: &mut Vec<String>| {
            for c in ["conv1", "conv2", "time_emb_proj", "conv_shortcut"] {
                out.push(format!("{p}.{c}"));
            }
        };
        let depth = [0, 2, 10];
        for (i, &d) in depth.iter().enumerate() {
            for j in 0..2 {
                res(&format!("down_blocks.{i}.resnets.{j}"), &mut paths);
                if d > 0 {
                    tb(&format!("down_blocks.{i}.attentions.{j}"), d, &mut paths);
                }
            }
            if i < 2 {
                paths.push(format!("down_blocks.{i}.downsamplers.0.conv"));
            }
        }
        res("mid_block.resnets.0", &mut paths);
        tb("mid_block.attentions.0", 10, &mut paths);
        res("mid_block.resnets.1", &mut paths);
        for i in 0..3 {
            for j in 0..3 {
                res(&format!("up_blocks.{i}.resnets.{j}"), &mut paths);
                if depth[2 - i] > 0 {
                    tb(
                        &format!("up_blocks.{i}.attentions.{j}"),
                        depth[2 - i],
                        &mut paths,
                    );
                }
            }
            if i < 2 {
                paths.push(format!("up_blocks.{i}.upsamplers.0.conv"));
            }
        }
        paths
    }

    #[test]
    fn sdxl_names_are_unique_and_resolve_back() {
        let paths = sdxl_locon_paths();
        let naming = KohyaNaming::for_family(true);
        let known: Vec<(KohyaComponent, &str)> = paths.iter().map(|p| (U, p.as_str())).collect();
        let resolver = KohyaResolver::new(&naming, known.iter().copied()).unwrap();
        for (i, p) in paths.iter().enumerate() {
            let name = naming.module_name(U, p).unwrap();
            assert!(name.starts_with("lora_unet_"));
            assert!(
                !name.contains("down_blocks")
                    && !name.contains("up_blocks")
                    && !name.contains("mid_block"),
                "{name}"
            );
            assert_eq!(resolver.resolve(&name), Some(i), "{name}");
            // The diffusers spelling is accepted as an alias on load, under kohya's prefix and
            // under LyCORIS's default one (SimpleTuner).
            assert_eq!(resolver.resolve(&underscored("lora_unet", p)), Some(i));
            assert_eq!(resolver.resolve(&underscored("lycoris", p)), Some(i));
        }
        assert_eq!(
            resolver.resolve("lora_unet_input_blocks_99_1_proj_in"),
            None
        );
    }

    #[test]
    fn resolve_handles_underscores_inside_segments() {
        let known = [
            (
                U,
                "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0",
            ),
            (U, "down_blocks.0.attentions.0.proj_in"),
            (
                KohyaComponent::TextEncoder,
                "text_model.encoder.layers.0.self_attn.out_proj",
            ),
        ];
        let naming = KohyaNaming::Diffusers;
        assert_eq!(
            resolve(
                &naming,
                "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0",
                &known
            ),
            Some("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0")
        );
        assert_eq!(
            resolve(
                &naming,
                "lora_te_text_model_encoder_layers_0_self_attn_out_proj",
                &known
            ),
            Some("text_model.encoder.layers.0.self_attn.out_proj")
        );
        assert_eq!(
            resolve(
                &naming,
                "lora_te1_text_model_encoder_layers_0_self_attn_out_proj",
                &known
            ),
            None
        );
        assert_eq!(
            resolve(
                &naming,
                "lora_unet_down_blocks_0_attentions_0_proj_out",
                &known
            ),
            None
        );
    }

    #[test]
    fn lycoris_prefix_names_unet_modules_only() {
        let unet = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0";
        let te = "text_model.encoder.layers.0.self_attn.out_proj";
        let known = [(U, unet), (KohyaComponent::TextEncoder, te)];
        for naming in [KohyaNaming::Diffusers, KohyaNaming::for_family(true)] {
            assert_eq!(
                resolve(
                    &naming,
                    "lycoris_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_out_0",
                    &known
                ),
                Some(unet),
                "{naming:?}"
            );
            assert_eq!(
                resolve(
                    &naming,
                    "lycoris_text_model_encoder_layers_0_self_attn_out_proj",
                    &known
                ),
                None
            );
        }
        // SD1/SD2 have one UNet spelling under lora_unet_: the diffusers one.
        assert_eq!(
            resolve(
                &KohyaNaming::Diffusers,
                "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_out_0",
                &known
            ),
            None
        );
    }

    #[test]
    fn text_encoder_names_without_text_model_resolve_to_the_same_modules() {
        let te = "text_model.encoder.layers.0.self_attn.out_proj";
        let fc = "text_model.encoder.layers.1.mlp.fc1";
        let sd1 = [
            (KohyaComponent::TextEncoder, te),
            (KohyaComponent::TextEncoder, fc),
        ];
        let naming = KohyaNaming::Diffusers;
        assert_eq!(
            resolve(&naming, "lora_te_encoder_layers_0_self_attn_out_proj", &sd1),
            Some(te)
        );
        assert_eq!(
            resolve(&naming, "lora_te_encoder_layers_1_mlp_fc1", &sd1),
            Some(fc)
        );
        let sdxl = [
            (KohyaComponent::TextEncoder, te),
            (KohyaComponent::TextEncoder2, te),
        ];
        let naming = KohyaNaming::for_family(true);
        assert_eq!(
            resolve(
                &naming,
                "lora_te1_encoder_layers_0_self_attn_out_proj",
                &sdxl
            ),
            Some(te)
        );
        let resolver = KohyaResolver::new(&naming, sdxl).unwrap();
        assert_eq!(
            resolver.resolve("lora_te2_encoder_layers_0_self_attn_out_proj"),
            Some(1)
        );
        assert_eq!(
            resolver.resolve("lora_te1_encoder_layers_0_self_attn_out_proj"),
            Some(0)
        );
        // Saving keeps the standard name.
        assert_eq!(
            naming
                .module_name(KohyaComponent::TextEncoder2, te)
                .unwrap(),
            "lora_te2_text_model_encoder_layers_0_self_attn_out_proj"
        );
    }

    #[test]
    fn collisions_are_reported() {
        let known = [(U, "a.b_c"), (U, "a_b.c")];
        let err = KohyaResolver::new(&KohyaNaming::Diffusers, known).unwrap_err();
        assert!(matches!(err, KohyaNameError::Collision { .. }), "{err}");
    }
}
