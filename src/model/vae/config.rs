//! The VAE's `vae/config.json`, as diffusers' `AutoencoderKL.__init__` takes it (diffusers 0.42,
//! `models/autoencoders/autoencoder_kl.py`). Absent keys take that constructor's defaults, so a
//! config saved by any diffusers version reads the same way; unknown keys (`_class_name`,
//! `_diffusers_version`, …) are ignored.
//!
//! Mirrors, at full size:
//! - SD1.5 `runwayml/stable-diffusion-v1-5/vae/config.json` and SD2.1
//!   `stabilityai/stable-diffusion-2-1/vae/config.json`: block_out_channels [128, 256, 512, 512],
//!   layers_per_block 2, norm_num_groups 32, scaling_factor 0.18215;
//! - SDXL `stabilityai/stable-diffusion-xl-base-1.0/vae/config.json`: the same shape with
//!   scaling_factor 0.13025 and force_upcast true.
//!
//! Only the plain SD architecture is accepted: every down block `DownEncoderBlock2D`, every up
//! block `UpDecoderBlock2D`, `act_fn` silu. Anything else is an error naming the file and value.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A `vae/config.json` that cannot be read, parsed, or built.
#[derive(Debug, thiserror::Error)]
pub enum VaeConfigError {
    #[error("cannot read VAE config {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse VAE config {path}{field}")]
    Parse {
        path: PathBuf,
        /// `: field `key``, where the error names one ([`crate::py_json::field_at`]).
        field: String,
        source: serde_json::Error,
    },
    #[error("unsupported VAE config {origin}: {message}")]
    Unsupported { origin: String, message: String },
}

/// `sample_size` is an int in SD configs and an `[h, w]` pair in some others. Only tiling uses it
/// in diffusers, and sdtrain does not tile, so it is kept for completeness.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum SampleSize {
    Square(usize),
    Rect([usize; 2]),
}

/// diffusers' `AutoencoderKL` config. Defaults are the constructor's.
#[derive(Debug, Clone, Deserialize)]
pub struct VaeConfig {
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    #[serde(default = "default_in_channels")]
    pub out_channels: usize,
    #[serde(default = "default_down_block_types")]
    pub down_block_types: Vec<String>,
    #[serde(default = "default_up_block_types")]
    pub up_block_types: Vec<String>,
    #[serde(default = "default_block_out_channels")]
    pub block_out_channels: Vec<usize>,
    #[serde(default = "default_layers_per_block")]
    pub layers_per_block: usize,
    #[serde(default = "default_act_fn")]
    pub act_fn: String,
    #[serde(default = "default_latent_channels")]
    pub latent_channels: usize,
    #[serde(default = "default_norm_num_groups")]
    pub norm_num_groups: usize,
    #[serde(default = "default_sample_size")]
    pub sample_size: SampleSize,
    #[serde(default = "default_scaling_factor")]
    pub scaling_factor: f64,
    /// `None` (JSON null) for SD1.x/2.x/SDXL.
    #[serde(default)]
    pub shift_factor: Option<f64>,
    /// Per-channel latent statistics some derived models set. diffusers' SD training scripts do
    /// not use them (only `scaling_factor`/`shift_factor`), and neither does sdtrain.
    #[serde(default)]
    pub latents_mean: Option<Vec<f64>>,
    #[serde(default)]
    pub latents_std: Option<Vec<f64>>,
    /// True where the VAE overflows in f16 (SD1.x/SDXL); the caller decides what to do with it.
    #[serde(
        default = "default_true",
        deserialize_with = "crate::py_json::null_is_false"
    )]
    pub force_upcast: bool,
    #[serde(
        default = "default_true",
        deserialize_with = "crate::py_json::null_is_false"
    )]
    pub use_quant_conv: bool,
    #[serde(
        default = "default_true",
        deserialize_with = "crate::py_json::null_is_false"
    )]
    pub use_post_quant_conv: bool,
    #[serde(
        default = "default_true",
        deserialize_with = "crate::py_json::null_is_false"
    )]
    pub mid_block_add_attention: bool,
}

fn default_in_channels() -> usize {
    3
}
fn default_down_block_types() -> Vec<String> {
    vec![DOWN_BLOCK.to_string()]
}
fn default_up_block_types() -> Vec<String> {
    vec![UP_BLOCK.to_string()]
}
fn default_block_out_channels() -> Vec<usize> {
    vec![64]
}
fn default_layers_per_block() -> usize {
    1
}
fn default_act_fn() -> String {
    "silu".to_string()
}
fn default_latent_channels() -> usize {
    4
}
fn default_norm_num_groups() -> usize {
    32
}
fn default_sample_size() -> SampleSize {
    SampleSize::Square(32)
}
fn default_scaling_factor() -> f64 {
    0.18215
}
fn default_true() -> bool {
    true
}

const DOWN_BLOCK: &str = "DownEncoderBlock2D";
const UP_BLOCK: &str = "UpDecoderBlock2D";

impl Default for VaeConfig {
    /// diffusers' `AutoencoderKL()` with no arguments (a one-block toy, not an SD VAE).
    fn default() -> Self {
        Self {
            in_channels: default_in_channels(),
            out_channels: default_in_channels(),
            down_block_types: default_down_block_types(),
            up_block_types: default_up_block_types(),
            block_out_channels: default_block_out_channels(),
            layers_per_block: default_layers_per_block(),
            act_fn: default_act_fn(),
            latent_channels: default_latent_channels(),
            norm_num_groups: default_norm_num_groups(),
            sample_size: default_sample_size(),
            scaling_factor: default_scaling_factor(),
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl VaeConfig {
    /// Reads and validates `vae/config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, VaeConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| VaeConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses and validates `text`; `origin` names where it came from in errors.
    pub fn from_json(text: &str, origin: &Path) -> Result<Self, VaeConfigError> {
        let cfg: Self = crate::py_json::from_str(text).map_err(|source| VaeConfigError::Parse {
            path: origin.to_path_buf(),
            field: crate::py_json::field_at(text, &source),
            source,
        })?;
        cfg.validate(&origin.display().to_string())?;
        Ok(cfg)
    }

    /// Checks that this is the plain SD AutoencoderKL sdtrain implements. `origin` names where the
    /// config came from (a file path) in the error.
    pub fn validate(&self, origin: &str) -> Result<(), VaeConfigError> {
        let fail = |message: String| {
            Err(VaeConfigError::Unsupported {
                origin: origin.to_string(),
                message,
            })
        };
        let n = self.block_out_channels.len();
        if n == 0 {
            return fail("block_out_channels is empty".to_string());
        }
        for (field, types, want) in [
            ("down_block_types", &self.down_block_types, DOWN_BLOCK),
            ("up_block_types", &self.up_block_types, UP_BLOCK),
        ] {
            if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| t.as_str() != want) {
                return fail(format!("{field}[{i}] is {t:?}; only {want:?} is supported"));
            }
            if types.len() != n {
                return fail(format!(
                    "{field} has {} entries but block_out_channels has {n}",
                    types.len()
                ));
            }
        }
        if self.act_fn != "silu" {
            return fail(format!(
                "act_fn is {:?}; only \"silu\" is supported",
                self.act_fn
            ));
        }
        let groups = self.norm_num_groups;
        if let Some(c) = self
            .block_out_channels
            .iter()
            .find(|&&c| groups == 0 || c % groups != 0)
        {
            return fail(format!(
                "block_out_channels entry {c} is not divisible by norm_num_groups {groups}"
            ));
        }
        self.check_sizes().or_else(fail)?;
        self.check_factors().or_else(fail)
    }

    /// Refuses sizes no VAE has before anything is allocated for them, and block counts
    /// diffusers' AutoencoderKL cannot run with (no resnet in a block leaves its channels
    /// unchanged, so the next block gets the wrong width).
    fn check_sizes(&self) -> Result<(), String> {
        use crate::model::size_limits::{check, check_each, MAX_DEPTH, MAX_WIDTH};
        let named = |field: &str, r: Result<(), String>| r.map_err(|m| format!("{field} {m}"));
        named(
            "block_out_channels",
            check(self.block_out_channels.len(), 1, 8)
                .map_err(|m| format!("has {} entries; {m}", self.block_out_channels.len()))
                .and_then(|()| check_each(&self.block_out_channels, 1, MAX_WIDTH)),
        )?;
        named(
            "layers_per_block",
            check(self.layers_per_block, 1, MAX_DEPTH),
        )?;
        for (field, v) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
        ] {
            named(field, check(v, 1, MAX_WIDTH))?;
        }
        Ok(())
    }

    /// `scaling_factor` and `shift_factor` within what a latent can be scaled by and stay finite
    /// (SD's are 0.18215 and 0.13025; SD3's 1.5305 and 0.0609).
    fn check_factors(&self) -> Result<(), String> {
        let s = self.scaling_factor;
        if !(s.is_finite() && (1e-4..=1e4).contains(&s.abs())) {
            return Err(format!(
                "scaling_factor is {s}; sdtrain accepts a magnitude from 1e-4 to 1e4"
            ));
        }
        if let Some(shift) = self.shift_factor {
            if !(shift.is_finite() && shift.abs() <= 1e4) {
                return Err(format!(
                    "shift_factor is {shift}; sdtrain accepts -1e4 to 1e4 (or null)"
                ));
            }
        }
        Ok(())
    }

    /// How many image pixels one latent pixel spans per side: 2^(len(block_out_channels) − 1),
    /// 8 for every SD VAE.
    pub fn downscale_factor(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_diffusers_constructor() {
        let cfg: VaeConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg.block_out_channels, vec![64]);
        assert_eq!(cfg.scaling_factor, 0.18215);
        assert_eq!(cfg.shift_factor, None);
        assert!(cfg.use_quant_conv && cfg.use_post_quant_conv && cfg.mid_block_add_attention);
        // null is Python's None: false in diffusers' constructor, not the default.
        let cfg: VaeConfig = serde_json::from_str(
            r#"{"use_quant_conv": null, "force_upcast": null, "mid_block_add_attention": null}"#,
        )
        .unwrap();
        assert!(!cfg.use_quant_conv && !cfg.force_upcast && !cfg.mid_block_add_attention);
        assert!(cfg.use_post_quant_conv);
        assert_eq!(cfg.downscale_factor(), 1);
        cfg.validate("test").unwrap();
    }

    #[test]
    fn sd_shape_has_downscale_8_and_accepts_rect_sample_size() {
        let cfg: VaeConfig = serde_json::from_str(
            r#"{"block_out_channels": [128, 256, 512, 512], "sample_size": [64, 96],
                "down_block_types": ["DownEncoderBlock2D","DownEncoderBlock2D","DownEncoderBlock2D","DownEncoderBlock2D"],
                "up_block_types": ["UpDecoderBlock2D","UpDecoderBlock2D","UpDecoderBlock2D","UpDecoderBlock2D"],
                "shift_factor": null, "some_future_key": 1}"#,
        )
        .unwrap();
        assert_eq!(cfg.downscale_factor(), 8);
        assert_eq!(cfg.sample_size, SampleSize::Rect([64, 96]));
        cfg.validate("test").unwrap();
    }

    /// Sizes and factors no VAE has are refused naming the file and the key: a
    /// `layers_per_block` of 0 failed in the first group norm with no file named, a
    /// `shift_factor` of -1e30 made every loss non-finite, and 2^40 channels would abort.
    #[test]
    fn absurd_sizes_and_factors_name_the_key() {
        type Spoil = fn(&mut VaeConfig);
        let cases: [(&str, Spoil); 6] = [
            ("layers_per_block", |c| c.layers_per_block = 0),
            ("layers_per_block", |c| c.layers_per_block = 1 << 40),
            ("latent_channels", |c| c.latent_channels = 1 << 40),
            ("block_out_channels", |c| {
                c.block_out_channels = vec![1 << 40]
            }),
            ("scaling_factor", |c| c.scaling_factor = 1e30),
            ("shift_factor", |c| c.shift_factor = Some(-1e30)),
        ];
        for (field, spoil) in cases {
            let mut cfg = VaeConfig {
                norm_num_groups: 1,
                ..VaeConfig::default()
            };
            cfg.validate("ok").unwrap();
            spoil(&mut cfg);
            let msg = cfg.validate("m/vae/config.json").unwrap_err().to_string();
            assert!(
                msg.contains("m/vae/config.json") && msg.contains(field),
                "{field}: {msg}"
            );
        }
    }

    #[test]
    fn rejects_other_activation_and_mismatched_block_counts() {
        let cfg = VaeConfig {
            act_fn: "gelu".into(),
            ..VaeConfig::default()
        };
        assert!(cfg.validate("x").unwrap_err().to_string().contains("gelu"));
        let cfg = VaeConfig {
            block_out_channels: vec![64, 64],
            ..VaeConfig::default()
        };
        let msg = cfg.validate("x").unwrap_err().to_string();
        assert!(msg.contains("down_block_types has 1 entries"), "{msg}");
    }
}
