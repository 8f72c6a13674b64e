//! kohya's `block_lr` in a run (`config::block_lr_plan`): each trained UNet parameter's block,
//! found from its LDM name as sdxl_train.py's `get_block_params_to_optimize` finds it, and its
//! learning rate as a multiple of the UNet group's. Blocks at 0 are left out of the optimizer.

use std::collections::HashMap;

use candle_core::Var;

use crate::model::family::ModelFamily;
use crate::model::pipeline::StableDiffusion;
use crate::model::single_file::names::unet_to_ldm;
use crate::model::single_file::unet_blocks;

/// kohya's block of an LDM UNet name (without `model.diffusion_model.`): 0 the time and label
/// embeddings, `1 + n` `input_blocks.n`, `10 + n` `middle_block.n`, `13 + n` `output_blocks.n`,
/// 22 `out`.
pub(super) fn kohya_block(ldm: &str) -> Option<usize> {
    let index = |rest: &str| rest.split('.').next()?.parse::<usize>().ok();
    if ldm.starts_with("time_embed.") || ldm.starts_with("label_emb.") {
        return Some(0);
    }
    if let Some(rest) = ldm.strip_prefix("input_blocks.") {
        return index(rest).map(|n| 1 + n);
    }
    if let Some(rest) = ldm.strip_prefix("middle_block.") {
        return index(rest).map(|n| 10 + n);
    }
    if let Some(rest) = ldm.strip_prefix("output_blocks.") {
        return index(rest).map(|n| 13 + n);
    }
    ldm.starts_with("out.").then_some(22)
}

/// The UNet parameters that train, and each one's learning-rate multiple by name.
pub(super) type BlockParams = (Vec<(String, Var)>, HashMap<String, f64>);

/// The UNet parameters that train under `rates` (those of blocks above 0) and each one's
/// multiple of `base_lr`, by name.
pub(super) fn by_block(
    sd: &StableDiffusion,
    params: Vec<(String, Var)>,
    rates: &[f64],
    base_lr: f64,
) -> anyhow::Result<BlockParams> {
    if sd.family() != ModelFamily::Sdxl {
        anyhow::bail!(
            "block_lr is for SDXL (kohya's sdxl_train.py numbers the SDXL UNet's 23 blocks); \
             this model is {}",
            sd.family()
        );
    }
    let blocks = unet_blocks(&sd.unet.config).map_err(anyhow::Error::msg)?;
    let mut kept = Vec::with_capacity(params.len());
    let mut scale = HashMap::new();
    for (name, var) in params {
        let block = unet_to_ldm(&name, &blocks)
            .as_deref()
            .and_then(kohya_block)
            .filter(|b| *b < rates.len());
        let Some(block) = block else {
            anyhow::bail!(
                "block_lr: the UNet parameter {name} is in none of kohya's {} SDXL blocks",
                rates.len()
            );
        };
        if rates[block] > 0.0 {
            scale.insert(name.clone(), rates[block] / base_lr);
            kept.push((name, var));
        }
    }
    Ok((kept, scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kohya's numbering (sdxl_train.py): catches a block off by one at each boundary.
    #[test]
    fn blocks_are_numbered_as_kohyas() {
        for (name, want) in [
            ("time_embed.0.weight", Some(0)),
            ("label_emb.0.2.bias", Some(0)),
            ("input_blocks.0.0.weight", Some(1)),
            ("input_blocks.8.1.proj_in.weight", Some(9)),
            ("middle_block.0.in_layers.0.weight", Some(10)),
            ("middle_block.2.out_layers.3.bias", Some(12)),
            ("output_blocks.0.0.skip_connection.weight", Some(13)),
            ("output_blocks.8.1.norm.weight", Some(21)),
            ("out.0.weight", Some(22)),
            ("out.2.bias", Some(22)),
            ("outer.weight", None),
        ] {
            assert_eq!(kohya_block(name), want, "{name}");
        }
    }
}
