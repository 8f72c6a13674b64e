//! kohya's block-wise LoRA (`networks/lora.py`, `network_args`): a rank, an alpha and a
//! learning-rate weight for each block of the UNet.
//!
//! - **Blocks.** SD1/SD2 have 25 (kohya's `NUM_OF_BLOCKS` 12 down, 1 mid, 12 up): block 0 is
//!   IN00 (conv_in, never adapted), `down_blocks.i.{resnets,attentions}.j` is block `1 + 3i + j`
//!   and `down_blocks.i.downsamplers` block `3 + 3i`; the mid block is 12;
//!   `up_blocks.i.{resnets,attentions}.j` is `13 + 3i + j` and its upsampler `15 + 3i`. SDXL has
//!   23 (`SDXL_NUM_OF_BLOCKS` 9, 3 mid blocks, and a block at each end): kohya's own names
//!   (`input_blocks.n` → `1 + n`, `middle_block.n` → `10 + n`, `output_blocks.n` → `13 + n`;
//!   `time_embed` 0 and `out` 22, neither adapted). [`block_index`] is kohya's `get_block_index`.
//! - **Ranks** (`block_dims`, `block_alphas`, `conv_block_dims`, `conv_block_alphas`), one per
//!   block. The Linear and 1×1 layers of a block take `block_dims`; its 3×3 convs (LoCon)
//!   `conv_block_dims`, else the adapter's `conv_rank` in every block. A rank of 0 leaves the
//!   block's layers without adapters.
//! - **Learning-rate weights** (`down_lr_weight`, `mid_lr_weight`, `up_lr_weight`): a list per
//!   part, or for down and up one of kohya's curves (`cosine`, `sine`, `linear`,
//!   `reverse_linear`, `zeros`) with an optional `+offset`. A short list is filled with 1 and a
//!   long one cut, each with kohya's warning. A weight at or below `block_lr_zero_threshold`
//!   (default 0) is 0, and a block of weight 0 gets no adapters (kohya's
//!   `remove_block_dims_and_alphas`). Each block's parameters learn at the group's rate times
//!   the weight; SDXL's two end blocks weigh 1.
//!
//! Checked against kohya's functions, run as they are by
//! tests/fixtures/kohya_block_weights_reference.py (tests/kohya_block_weights_parity.rs).

use serde::Serialize;

/// Down (or up) blocks and mid blocks, for SD1/SD2 and for SDXL (kohya's `NUM_OF_BLOCKS`,
/// `NUM_OF_MID_BLOCKS`, `SDXL_NUM_OF_BLOCKS`, `SDXL_NUM_OF_MID_BLOCKS`).
const SD_SIDE: usize = 12;
const SD_MID: usize = 1;
const SDXL_SIDE: usize = 9;
const SDXL_MID: usize = 3;

/// The number of blocks kohya counts: 25 for SD1/SD2, 23 for SDXL.
pub fn block_count(sdxl: bool) -> usize {
    match sdxl {
        false => 2 * SD_SIDE + SD_MID,
        true => 1 + 2 * SDXL_SIDE + SDXL_MID + 1,
    }
}

/// kohya's learning-rate curves for the down or up blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Curve {
    Cosine,
    Sine,
    Linear,
    ReverseLinear,
    Zeros,
}

impl Curve {
    const ALL: [(&'static str, Curve); 5] = [
        ("cosine", Curve::Cosine),
        ("sine", Curve::Sine),
        ("linear", Curve::Linear),
        ("reverse_linear", Curve::ReverseLinear),
        ("zeros", Curve::Zeros),
    ];

    fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, c)| *c == self)
            .map_or("", |p| p.0)
    }

    /// kohya's `get_list`: `n` weights from the shallowest block to the deepest.
    fn weights(self, n: usize, offset: f64) -> Vec<f64> {
        let last = n.saturating_sub(1).max(1) as f64;
        let sine = |i: usize| (std::f64::consts::PI * (i as f64 / last) / 2.0).sin();
        (0..n)
            .map(|i| {
                offset
                    + match self {
                        Curve::Cosine => sine(n - 1 - i),
                        Curve::Sine => sine(i),
                        Curve::Linear => i as f64 / last,
                        Curve::ReverseLinear => (n - 1 - i) as f64 / last,
                        Curve::Zeros => 0.0,
                    }
            })
            .collect()
    }
}

/// The weights of the down or up blocks: a list, or a curve plus an offset.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum LrWeights {
    List(Vec<f64>),
    Curve { curve: Curve, offset: f64 },
}

impl LrWeights {
    /// kohya's string (`network_args`): a comma-separated list (an empty item is 0), or a curve's
    /// name with an optional `+offset` (`sine+.5`). The error completes "`…_lr_weight` …".
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.contains(',') {
            return parse_numbers(text).map(LrWeights::List);
        }
        let (name, offset) = match text.split_once('+') {
            Some((name, offset)) => (name, offset),
            None => (text, ""),
        };
        let Some(&(_, curve)) = Curve::ALL.iter().find(|(n, _)| *n == name.trim()) else {
            let names: Vec<&str> = Curve::ALL.iter().map(|p| p.0).collect();
            return Err(format!(
                "is \"{text}\": give a list of numbers (one per block, shallowest first), or \
                 one of {} with an optional +offset such as \"sine+0.5\"",
                names.join(", ")
            ));
        };
        let offset = match offset.trim() {
            "" => 0.0,
            o => python_float(o)
                .ok_or_else(|| format!("is \"{text}\": the offset \"{o}\" is not a number"))?,
        };
        Ok(LrWeights::Curve { curve, offset })
    }

    fn resolve(&self, n: usize) -> Vec<f64> {
        match self {
            LrWeights::List(v) => v.clone(),
            LrWeights::Curve { curve, offset } => curve.weights(n, *offset),
        }
    }

    /// kohya's string for it, as `ss_network_args` records it.
    pub fn kohya_text(&self) -> String {
        match self {
            LrWeights::List(v) => join_floats(v),
            LrWeights::Curve { curve, offset } if *offset == 0.0 => curve.name().to_string(),
            LrWeights::Curve { curve, offset } => {
                format!("{}+{}", curve.name(), crate::py_json::py_float(*offset))
            }
        }
    }

    /// Whether every weight it can give is 0 or 1 (a switch per block, no scaling).
    fn only_switches(&self, threshold: f64) -> bool {
        let switch = |w: f64| w <= threshold || w == 1.0;
        match self {
            LrWeights::List(v) => v.iter().all(|&w| switch(w)),
            LrWeights::Curve { curve, offset } => *curve == Curve::Zeros && switch(*offset),
        }
    }
}

/// Python's `float()` on a config string (`.5`, `1e-3`, ` 2 `).
fn python_float(s: &str) -> Option<f64> {
    s.trim().parse::<f64>().ok().filter(|v| v.is_finite())
}

/// A comma-separated list of numbers; an empty item is 0 (kohya's `float(s) if s else 0.0`).
pub fn parse_numbers(text: &str) -> Result<Vec<f64>, String> {
    text.split(',')
        .map(|s| match s.trim() {
            "" => Ok(0.0),
            s => python_float(s).ok_or_else(|| format!("is \"{text}\": \"{s}\" is not a number")),
        })
        .collect()
}

fn join_floats(v: &[f64]) -> String {
    let items: Vec<String> = v.iter().map(|&x| crate::py_json::py_float(x)).collect();
    items.join(",")
}

fn join_ints(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    items.join(",")
}

/// The block-wise settings as train.json gives them; their lengths are checked against the
/// model's family when it is known ([`BlockSettings::resolve`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BlockSettings {
    pub dims: Option<Vec<usize>>,
    pub alphas: Option<Vec<f64>>,
    pub conv_dims: Option<Vec<usize>>,
    pub conv_alphas: Option<Vec<f64>>,
    pub down_lr_weight: Option<LrWeights>,
    pub mid_lr_weight: Option<Vec<f64>>,
    pub up_lr_weight: Option<LrWeights>,
    /// kohya's `block_lr_zero_threshold`.
    pub zero_threshold: f64,
}

/// A block setting that does not fit the model, naming its key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("adapter.{key} {message}")]
pub struct BlockError {
    pub key: &'static str,
    pub message: String,
}

/// Each block's rank, alpha and learning-rate weight for one model family.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockTable {
    pub sdxl: bool,
    pub dims: Vec<usize>,
    pub alphas: Vec<f64>,
    /// The 3×3 convs' ranks and alphas (LoCon); `None` leaves them without adapters.
    pub conv: Option<(Vec<usize>, Vec<f64>)>,
    /// `None` when no weight is set (every block learns at its group's rate).
    pub lr_weight: Option<Vec<f64>>,
}

impl BlockSettings {
    /// Whether any block key is set (kohya turns block-wise ranks on only then).
    pub fn is_set(&self) -> bool {
        self.dims.is_some() || self.has_lr_weights()
    }

    pub fn has_lr_weights(&self) -> bool {
        self.down_lr_weight.is_some() || self.mid_lr_weight.is_some() || self.up_lr_weight.is_some()
    }

    /// Whether the learning-rate weights only switch blocks off (every weight 0 or 1), so an
    /// optimizer without per-parameter rates can still take them.
    pub fn lr_weights_only_switch(&self) -> bool {
        let t = self.zero_threshold;
        self.down_lr_weight
            .iter()
            .chain(&self.up_lr_weight)
            .all(|w| w.only_switches(t))
            && self
                .mid_lr_weight
                .iter()
                .flatten()
                .all(|&w| w <= t || w == 1.0)
    }

    /// The table for a family, from the adapter's own `(rank, alpha)` and, for LoCon, its
    /// `(conv_rank, conv_alpha)` (kohya's `get_block_dims_and_alphas`,
    /// `get_block_lr_weight` and `remove_block_dims_and_alphas`). Warnings (a list filled or
    /// cut) come back beside it.
    pub fn resolve(
        &self,
        sdxl: bool,
        base: (usize, f64),
        conv: Option<(usize, f64)>,
    ) -> Result<(BlockTable, Vec<String>), BlockError> {
        let n = block_count(sdxl);
        let family = if sdxl { "SDXL" } else { "SD1/SD2" };
        let exact = |key: &'static str, len: Option<usize>| match len {
            Some(len) if len != n => Err(BlockError {
                key,
                message: format!(
                    "has {len} entries; {family} has {n} blocks (kohya's IN00…, MID…, OUT…), \
                     one entry each"
                ),
            }),
            _ => Ok(()),
        };
        exact("block_dims", self.dims.as_ref().map(Vec::len))?;
        exact("block_alphas", self.alphas.as_ref().map(Vec::len))?;
        exact("conv_block_dims", self.conv_dims.as_ref().map(Vec::len))?;
        exact("conv_block_alphas", self.conv_alphas.as_ref().map(Vec::len))?;
        let mut warnings = Vec::new();
        let lr_weight = self.lr_weights(sdxl, &mut warnings);
        let mut dims = self.dims.clone().unwrap_or_else(|| vec![base.0; n]);
        let alphas = self.alphas.clone().unwrap_or_else(|| vec![base.1; n]);
        let mut conv = match (&self.conv_dims, conv) {
            (Some(d), Some((_, alpha))) => Some((
                d.clone(),
                self.conv_alphas.clone().unwrap_or(vec![alpha; n]),
            )),
            (None, Some((rank, alpha))) => Some((vec![rank; n], vec![alpha; n])),
            (_, None) => None,
        };
        if let Some(weights) = &lr_weight {
            for (i, _) in weights.iter().enumerate().filter(|(_, &w)| w == 0.0) {
                dims[i] = 0;
                if let Some((d, _)) = &mut conv {
                    d[i] = 0;
                }
            }
        }
        let table = BlockTable {
            sdxl,
            dims,
            alphas,
            conv,
            lr_weight,
        };
        Ok((table, warnings))
    }

    /// kohya's `get_block_lr_weight`: down, mid and up weights (filled with 1, cut to length,
    /// zeroed at the threshold), with SDXL's end blocks at 1; `None` when none is set.
    fn lr_weights(&self, sdxl: bool, warnings: &mut Vec<String>) -> Option<Vec<f64>> {
        if !self.has_lr_weights() {
            return None;
        }
        let (side, mid) = if sdxl {
            (SDXL_SIDE, SDXL_MID)
        } else {
            (SD_SIDE, SD_MID)
        };
        let threshold = self.zero_threshold;
        let mut fit = |key: &str, given: Option<Vec<f64>>, len: usize| -> Vec<f64> {
            let Some(mut v) = given else {
                return vec![1.0; len];
            };
            if v.len() > len {
                warnings.push(format!(
                    "adapter.{key} has {} entries; the model has {len} such blocks, so the \
                     rest are ignored (as kohya does)",
                    v.len()
                ));
                v.truncate(len);
            } else if v.len() < len {
                warnings.push(format!(
                    "adapter.{key} has {} entries; the model has {len} such blocks, so the \
                     rest are 1 (as kohya does)",
                    v.len()
                ));
                v.resize(len, 1.0);
            }
            v.into_iter()
                .map(|w| if w > threshold { w } else { 0.0 })
                .collect()
        };
        let down = fit(
            "down_lr_weight",
            self.down_lr_weight.as_ref().map(|w| w.resolve(side)),
            side,
        );
        let middle = fit("mid_lr_weight", self.mid_lr_weight.clone(), mid);
        let up = fit(
            "up_lr_weight",
            self.up_lr_weight.as_ref().map(|w| w.resolve(side)),
            side,
        );
        let mut all = Vec::with_capacity(block_count(sdxl));
        if sdxl {
            all.push(1.0);
        }
        all.extend(down);
        all.extend(middle);
        all.extend(up);
        if sdxl {
            all.push(1.0);
        }
        Some(all)
    }

    /// The settings as kohya's `network_args` strings, for `ss_network_args`.
    pub fn network_args(&self) -> Vec<(String, String)> {
        let mut args = Vec::new();
        let mut push = |key: &str, value: Option<String>| {
            if let Some(v) = value {
                args.push((key.to_string(), v));
            }
        };
        push("block_dims", self.dims.as_deref().map(join_ints));
        push("block_alphas", self.alphas.as_deref().map(join_floats));
        push("conv_block_dims", self.conv_dims.as_deref().map(join_ints));
        push(
            "conv_block_alphas",
            self.conv_alphas.as_deref().map(join_floats),
        );
        push(
            "down_lr_weight",
            self.down_lr_weight.as_ref().map(LrWeights::kohya_text),
        );
        push(
            "mid_lr_weight",
            self.mid_lr_weight.as_deref().map(join_floats),
        );
        push(
            "up_lr_weight",
            self.up_lr_weight.as_ref().map(LrWeights::kohya_text),
        );
        if self.has_lr_weights() && self.zero_threshold != 0.0 {
            push(
                "block_lr_zero_threshold",
                Some(crate::py_json::py_float(self.zero_threshold)),
            );
        }
        args
    }
}

impl BlockTable {
    /// The `(rank, alpha)` of a UNet module kohya adapts, by its kohya name: `None` when its
    /// block's rank is 0 (or its block has no 3×3-conv rank). `Err` names a module outside
    /// kohya's blocks (a UNet with more levels than SD's).
    pub fn target(&self, kohya_name: &str, conv3x3: bool) -> Result<Option<(usize, f64)>, String> {
        let i = self.index(kohya_name)?;
        let (dims, alphas) = match (&self.conv, conv3x3) {
            (_, false) => (&self.dims, &self.alphas),
            (Some((d, a)), true) => (d, a),
            (None, true) => return Ok(None),
        };
        Ok((dims[i] > 0).then_some((dims[i], alphas[i])))
    }

    /// The learning-rate weight of a UNet parameter, by its name (`<kohya module>.<tensor>`);
    /// 1 for a name outside the blocks.
    pub fn lr_weight(&self, param_name: &str) -> f64 {
        let module = param_name.split('.').next().unwrap_or(param_name);
        match (&self.lr_weight, self.index(module)) {
            (Some(w), Ok(i)) => w[i],
            _ => 1.0,
        }
    }

    fn index(&self, kohya_name: &str) -> Result<usize, String> {
        let n = block_count(self.sdxl);
        match block_index(kohya_name, self.sdxl) {
            Some(i) if i < n => Ok(i),
            Some(i) => Err(format!(
                "UNet module {kohya_name} falls in kohya's block {i}, but kohya counts {n} \
                 blocks; this UNet has more levels than block-wise settings can address"
            )),
            None => Err(format!(
                "UNet module {kohya_name} is in none of kohya's blocks (down, mid or up)"
            )),
        }
    }

    /// The settings by block for the console: ranks and 3×3 ranks (unless `ranks` is false:
    /// `dim_from_weights` takes them from its file), and weights.
    pub fn describe(&self, ranks: bool) -> String {
        let mut lines = Vec::new();
        if ranks {
            lines.push(format!("ranks {}", join_ints(&self.dims)));
            if let Some((d, _)) = &self.conv {
                lines.push(format!("3x3 ranks {}", join_ints(d)));
            }
        }
        if let Some(w) = &self.lr_weight {
            let items: Vec<String> = w.iter().map(|x| format!("{x:.3}")).collect();
            lines.push(format!("lr weights {}", items.join(",")));
        }
        lines.join("; ")
    }
}

/// kohya's `get_block_index`: the block of a UNet module by its kohya name (`None` for kohya's
/// -1, a name in no block). SD1/SD2 names carry diffusers paths
/// (`lora_unet_down_blocks_1_attentions_0_…`), SDXL names kohya's own
/// (`lora_unet_input_blocks_4_1_…`).
pub fn block_index(kohya_name: &str, sdxl: bool) -> Option<usize> {
    if sdxl {
        let name = kohya_name.strip_prefix("lora_unet_")?;
        let number = |prefix: &str| -> Option<usize> {
            name.strip_prefix(prefix)?.split('_').next()?.parse().ok()
        };
        return if name.starts_with("time_embed_") || name.starts_with("label_emb_") {
            Some(0)
        } else if let Some(n) = number("input_blocks_") {
            Some(1 + n)
        } else if let Some(n) = number("middle_block_") {
            Some(10 + n)
        } else if let Some(n) = number("output_blocks_") {
            Some(13 + n)
        } else if name.starts_with("out_") {
            Some(22)
        } else {
            None
        };
    }
    if let Some((up, i, kind, j)) = up_down(kohya_name) {
        let idx = match kind {
            "upsamplers" | "downsamplers" => 3 * i + 2,
            _ => 3 * i + j,
        };
        return Some(if up { SD_SIDE + 1 + idx } else { 1 + idx });
    }
    kohya_name.contains("mid_block_").then_some(SD_SIDE)
}

/// kohya's `RE_UPDOWN` search, `(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|
/// attentions)_(\d+)_`, at its first match: (up, i, kind, j).
fn up_down(name: &str) -> Option<(bool, usize, &str, usize)> {
    (0..name.len())
        .filter(|&at| name.is_char_boundary(at))
        .find_map(|at| {
            let rest = &name[at..];
            let (up, rest) = match (
                rest.strip_prefix("up_blocks_"),
                rest.strip_prefix("down_blocks_"),
            ) {
                (Some(r), _) => (true, r),
                (None, Some(r)) => (false, r),
                (None, None) => return None,
            };
            let (i, rest) = leading_number(rest)?;
            let rest = rest.strip_prefix('_')?;
            let kind = ["resnets", "upsamplers", "downsamplers", "attentions"]
                .into_iter()
                .find(|k| rest.starts_with(k))?;
            let rest = rest[kind.len()..].strip_prefix('_')?;
            let (j, rest) = leading_number(rest)?;
            rest.starts_with('_').then_some((up, i, kind, j))
        })
}

fn leading_number(s: &str) -> Option<(usize, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    Some((s[..end].parse().ok()?, &s[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kohya_strings_parse_as_its_parser_reads_them() {
        assert_eq!(
            LrWeights::parse("0,0.5,,2").unwrap(),
            LrWeights::List(vec![0.0, 0.5, 0.0, 2.0])
        );
        assert_eq!(
            LrWeights::parse("sine+.5").unwrap(),
            LrWeights::Curve {
                curve: Curve::Sine,
                offset: 0.5
            }
        );
        assert_eq!(
            LrWeights::parse("reverse_linear").unwrap(),
            LrWeights::Curve {
                curve: Curve::ReverseLinear,
                offset: 0.0
            }
        );
        let e = LrWeights::parse("0.5").unwrap_err();
        assert!(
            e.contains("cosine, sine, linear, reverse_linear, zeros"),
            "{e}"
        );
        assert!(LrWeights::parse("sine+x").unwrap_err().contains("offset"));
        assert!(parse_numbers("1,a").unwrap_err().contains("\"a\""));
    }

    #[test]
    fn kohya_text_round_trips() {
        for text in ["sine+0.5", "cosine", "zeros+1.0", "0.0,0.5,1.0"] {
            let w = LrWeights::parse(text).unwrap();
            assert_eq!(LrWeights::parse(&w.kohya_text()).unwrap(), w, "{text}");
        }
    }

    #[test]
    fn switches_are_told_from_scales() {
        let s = |down: &str, threshold: f64| BlockSettings {
            down_lr_weight: Some(LrWeights::parse(down).unwrap()),
            zero_threshold: threshold,
            ..Default::default()
        };
        assert!(s("0,1,1,0", 0.0).lr_weights_only_switch());
        assert!(s("0.1,1", 0.2).lr_weights_only_switch());
        assert!(!s("0.5,1", 0.0).lr_weights_only_switch());
        assert!(!s("sine", 0.0).lr_weights_only_switch());
        assert!(s("zeros+1", 0.0).lr_weights_only_switch());
    }

    #[test]
    fn a_module_outside_the_blocks_is_an_error() {
        let (table, _) = BlockSettings {
            dims: Some(vec![4; 25]),
            ..Default::default()
        }
        .resolve(false, (4, 1.0), None)
        .unwrap();
        let e = table
            .target("lora_unet_up_blocks_4_resnets_0_conv1", true)
            .unwrap_err();
        assert!(e.contains("block 25"), "{e}");
        assert_eq!(
            table.target("lora_unet_up_blocks_0_resnets_0_conv1", true),
            Ok(None)
        );
    }
}
