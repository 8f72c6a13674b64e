//! kohya's block-wise LoRA in a run ([`crate::adapter::block_weights`]): the settings resolved
//! for the model's family, the UNet's adapters attached at each block's rank, and each
//! parameter's learning-rate multiple (the block's weight times LoRA+'s ratio).

use std::cell::RefCell;
use std::sync::Arc;

use crate::adapter::attach::{attach_selected, unet_target_in, AdapterSpec, LayerGeometry};
use crate::adapter::block_weights::BlockTable;
use crate::adapter::kohya_names::{KohyaComponent, KohyaNaming};
use crate::adapter::layer_filter::LayerFilter;
use crate::adapter::{AdapterComponent, AdapterMode, LoraKind, LoraModule};
use crate::config::AdapterPlan;
use crate::model::unet::UNet2DConditionModel;

/// The block table for the run's model, or `None` without block-wise settings. Warnings (a
/// weight list filled or cut, as kohya's) and the table go to the console.
pub(super) fn resolve_table(
    a: &AdapterPlan,
    mode: AdapterMode,
    sdxl: bool,
) -> anyhow::Result<Option<BlockTable>> {
    let Some(settings) = &a.blocks else {
        return Ok(None);
    };
    let conv = (mode == AdapterMode::Locon).then_some((a.conv_rank, a.conv_alpha));
    let (table, warnings) = settings.resolve(sdxl, (a.rank, a.alpha), conv)?;
    for w in warnings {
        crate::console::say(format_args!("{w}"));
    }
    crate::console::say(format_args!(
        "adapter: block-wise (kohya's blocks, IN00 first): {}",
        table.describe(!a.dim_from_weights)
    ));
    Ok(Some(table))
}

/// The UNet's adapters on the mode's targets (narrowed by the layer filter), each at its block's rank and alpha (an alpha of 0
/// is the rank, as kohya's); a block of rank 0 gets none.
pub(super) fn attach_unet_blocks(
    unet: &mut UNet2DConditionModel,
    (spec, filter): (&AdapterSpec, Option<&LayerFilter>),
    naming: &KohyaNaming,
    table: &BlockTable,
) -> anyhow::Result<Vec<Arc<LoraModule>>> {
    let failure = RefCell::new(None);
    let select = |path: &str, g: &LayerGeometry| {
        unet_target_in(path, g, spec, filter)?;
        let name = match naming.module_name(KohyaComponent::Unet, path) {
            Ok(n) => n,
            Err(e) => {
                failure.borrow_mut().get_or_insert(e.to_string());
                return None;
            }
        };
        let conv3x3 = matches!(g.kind, LoraKind::Conv { kernel, .. } if kernel > 1);
        match table.target(&name, conv3x3) {
            Ok(Some((rank, alpha))) => Some((rank, if alpha == 0.0 { rank as f64 } else { alpha })),
            Ok(None) => None,
            Err(e) => {
                failure.borrow_mut().get_or_insert(e);
                None
            }
        }
    };
    let attached = attach_selected(unet, AdapterComponent::Unet, spec, &select);
    if let Some(why) = failure.into_inner() {
        anyhow::bail!("adapter block-wise settings: {why}");
    }
    match attached {
        Err(crate::adapter::AttachError::NoTargets { .. }) => anyhow::bail!(
            "adapter block-wise settings: every UNet block the mode adapts has rank 0 (or \
             learning-rate weight 0), so the UNet would get no adapters"
        ),
        other => Ok(other?),
    }
}

/// A parameter's learning-rate multiple in its group, by its name (`<kohya module>.<tensor>`).
pub(super) type LrScale<'a> = Box<dyn Fn(&str) -> f64 + 'a>;

/// The multiple for the UNet's (`blocks`: its table) or the text encoders' parameters: the
/// block's weight times LoRA+'s `up_ratio` for `lora_up` weights (kohya's `assemble_params`
/// gives the `plus` group `lr * weight * ratio`). `None` when every multiple is 1.
pub(super) fn lr_scale<'a>(
    blocks: Option<&'a BlockTable>,
    up_ratio: Option<f64>,
) -> Option<LrScale<'a>> {
    let weighted = blocks
        .and_then(|t| t.lr_weight.as_ref())
        .is_some_and(|w| w.iter().any(|&x| x != 0.0 && x != 1.0));
    if up_ratio.is_none() && !weighted {
        return None;
    }
    Some(Box::new(move |name: &str| {
        let block = blocks.map_or(1.0, |t| t.lr_weight(name));
        // kohya's LoRA+ test: the parameter's name holds `lora_up`.
        let plus = match up_ratio {
            Some(r) if name.contains("lora_up") => r,
            _ => 1.0,
        };
        block * plus
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::block_weights::{BlockSettings, LrWeights};

    fn table(up: &str) -> BlockTable {
        BlockSettings {
            up_lr_weight: Some(LrWeights::parse(up).unwrap()),
            ..Default::default()
        }
        .resolve(false, (4, 1.0), None)
        .unwrap()
        .0
    }

    #[test]
    fn a_parameter_learns_at_its_blocks_weight_times_loraplus() {
        let t = table("0.5,1,2");
        let scale = lr_scale(Some(&t), Some(16.0)).unwrap();
        // up_blocks.0.resnets.0 is OUT00 (block 13), weight 0.5.
        assert_eq!(
            scale("lora_unet_up_blocks_0_attentions_0_proj_in.lora_down.weight"),
            0.5
        );
        assert_eq!(
            scale("lora_unet_up_blocks_0_attentions_0_proj_in.lora_up.weight"),
            8.0
        );
        assert_eq!(
            scale("lora_unet_up_blocks_0_attentions_2_proj_in.lora_up.weight"),
            32.0
        );
        assert_eq!(
            scale("lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"),
            16.0
        );
        assert_eq!(scale("lora_unet_mid_block_attentions_0_proj_in.alpha"), 1.0);
        let no_plus = lr_scale(Some(&t), None).unwrap();
        assert_eq!(
            no_plus("lora_unet_up_blocks_0_attentions_1_proj_in.lora_up.weight"),
            1.0
        );
    }

    #[test]
    fn weights_that_only_switch_blocks_off_scale_nothing() {
        let t = table("0,1,0");
        assert!(lr_scale(Some(&t), None).is_none());
        assert!(lr_scale(None, None).is_none());
        assert!(lr_scale(None, Some(4.0)).is_some());
    }
}
