//! `gradient_checkpointing: "auto"`: the fewest UNet blocks to checkpoint, largest activations
//! first, whose memory plan fits the card (`vram_limit_gb`, else the card's free memory at the
//! start of a run; `--dry-run` checks against the same card its plan does).
//!
//! Largest activations first, as issue 21 asks: the fewest blocks. The plan prices each block by
//! its share of the UNet's activation width (`unet::block_widths`): a checkpointed block keeps
//! κ(on) per unit of width, the others κ(off); on the CPU the step's peak with 1, 2 and 4 blocks
//! checkpointed was within 5% of that (docs/BENCHMARKS.md). The fewest blocks is not the
//! cheapest recomputation: on the CPU, SD1.5's outermost up block alone cost 9 of the 10 s that
//! checkpointing every block adds (its attention over 4,096 tokens), for a third of the memory.
//! The mid block, at the smallest resolution, and the text encoders are checkpointed only with
//! every other block.

use crate::config::CheckpointChoice;
use crate::model::unet::{block_widths, CheckpointedBlocks, UnetConfig};

/// The blocks checkpointed, and for `"auto"` the reason, which `--dry-run` and the run print.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointDecision {
    /// `None`: no checkpointing.
    pub blocks: Option<CheckpointedBlocks>,
    /// What `"auto"` chose and why.
    pub note: Option<String>,
}

impl CheckpointDecision {
    /// `off`, `on`, or `auto: N of M blocks`.
    pub fn summary(&self) -> String {
        match (&self.blocks, &self.note) {
            (None, None) => "off".into(),
            (Some(_), None) => "on".into(),
            (None, Some(_)) => "auto: none".into(),
            (Some(b), Some(_)) => {
                let n = b.down.iter().chain(&b.up).filter(|&&x| x).count();
                format!("auto: {n} of {} blocks", b.down.len() + b.up.len())
            }
        }
    }
}

/// The blocks for `choice`; under `"auto"`, the fewest whose planned peak (`total`) fits `card`.
pub fn decide(
    choice: CheckpointChoice,
    cfg: &UnetConfig,
    card: Option<&(f64, String)>,
    total: impl Fn(&CheckpointedBlocks) -> f64,
) -> CheckpointDecision {
    match choice {
        CheckpointChoice::Off => CheckpointDecision::default(),
        CheckpointChoice::On => CheckpointDecision {
            blocks: Some(CheckpointedBlocks::all(cfg)),
            note: None,
        },
        CheckpointChoice::Auto => auto(cfg, card, total),
    }
}

fn gib(b: f64) -> String {
    format!("{:.2} GiB", b / (1u64 << 30) as f64)
}

fn auto(
    cfg: &UnetConfig,
    card: Option<&(f64, String)>,
    total: impl Fn(&CheckpointedBlocks) -> f64,
) -> CheckpointDecision {
    let Some((budget, source)) = card else {
        return CheckpointDecision {
            blocks: None,
            note: Some(
                "auto: no block (no card to fit, and no vram_limit_gb; on the CPU set \
                 vram_limit_gb to size it to a card)"
                    .into(),
            ),
        };
    };
    let mut blocks = CheckpointedBlocks::none(cfg);
    let none = total(&blocks);
    if none <= *budget {
        return CheckpointDecision {
            blocks: None,
            note: Some(format!(
                "auto: no block (the plan, {}, fits {} ({source}) without)",
                gib(none),
                gib(*budget)
            )),
        };
    }
    let mut order = block_widths(cfg);
    // Stable: equal widths keep block order.
    order.sort_by(|a, b| b.width.total_cmp(&a.width));
    for w in &order {
        blocks.add(w.block);
        let t = total(&blocks);
        if t <= *budget {
            let names = blocks.names();
            return CheckpointDecision {
                note: Some(format!(
                    "auto: {} ({} of {} blocks, largest activations first): the plan, {}, \
                     fits {} ({source}); {} without checkpointing",
                    names.join(", "),
                    names.len(),
                    order.len(),
                    gib(t),
                    gib(*budget),
                    gib(none)
                )),
                blocks: Some(blocks),
            };
        }
    }
    let all = CheckpointedBlocks::all(cfg);
    CheckpointDecision {
        note: Some(format!(
            "auto: every block, and the plan, {}, still does not fit {} ({source})",
            gib(total(&all)),
            gib(*budget)
        )),
        blocks: Some(all),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::reference_configs::SD15_UNET;
    use crate::model::unet::BlockRef;

    fn sd15() -> UnetConfig {
        UnetConfig::from_json(SD15_UNET, "test").unwrap()
    }

    /// A plan whose peak is 20,000 less each checkpointed block's width: every budget picks the
    /// shortest prefix of the blocks ordered by width, largest first. Catches the order
    /// reversed, a block too many, and `true`/`false` not meaning every block and none.
    #[test]
    fn auto_takes_the_largest_blocks_until_the_plan_fits() {
        let cfg = sd15();
        let widths = block_widths(&cfg);
        let total = |b: &CheckpointedBlocks| {
            20_000.0
                - widths
                    .iter()
                    .filter(|w| b.contains(w.block))
                    .map(|w| w.width)
                    .sum::<f64>()
        };
        // SD1.5's shares, largest first: up_blocks.3 (3840), down_blocks.0 (2560), up_blocks.2.
        let card = |b: f64| Some((b, "test".to_string()));
        let d = decide(CheckpointChoice::Auto, &cfg, card(20_000.0).as_ref(), total);
        assert_eq!(d.blocks, None);
        let d = decide(CheckpointChoice::Auto, &cfg, card(16_200.0).as_ref(), total);
        let b = d.blocks.clone().unwrap();
        assert_eq!(b.names(), vec!["up_blocks.3".to_string()]);
        let d = decide(CheckpointChoice::Auto, &cfg, card(16_000.0).as_ref(), total);
        let b = d.blocks.unwrap();
        assert!(b.contains(BlockRef::Up(3)) && b.contains(BlockRef::Down(0)));
        assert_eq!(b.names().len(), 2, "{:?}", d.note);
        assert!(d.note.unwrap().contains("2 of 8 blocks"));
        let d = decide(CheckpointChoice::Auto, &cfg, card(10.0).as_ref(), total);
        assert!(d.blocks.unwrap().is_all());
        assert!(d.note.unwrap().contains("does not fit"));
        let d = decide(CheckpointChoice::Auto, &cfg, None, total);
        assert_eq!(d.blocks, None);
        assert!(d.note.unwrap().contains("no card"));
        let on = decide(CheckpointChoice::On, &cfg, card(1e12).as_ref(), total);
        assert!(on.blocks.unwrap().is_all() && on.note.is_none());
        let off = decide(CheckpointChoice::Off, &cfg, card(1.0).as_ref(), total);
        assert_eq!(off, CheckpointDecision::default());
    }

    /// The blocks' shares sum to the plan's width and follow the architecture: SD1.5's up blocks
    /// have one resnet more than their down blocks. Catches an up block priced at the wrong
    /// level (the shares would not mirror the levels).
    #[test]
    fn block_shares_follow_the_levels() {
        let widths = block_widths(&sd15());
        let total: f64 = widths.iter().map(|w| w.width).sum();
        assert_eq!(total, 11300.0);
        let get = |b: BlockRef| widths.iter().find(|w| w.block == b).unwrap().width;
        assert_eq!(get(BlockRef::Down(0)), 2560.0);
        assert_eq!(get(BlockRef::Up(3)), 3840.0);
        assert_eq!(get(BlockRef::Down(3)), 40.0);
        assert_eq!(get(BlockRef::Up(0)), 60.0);
    }
}
