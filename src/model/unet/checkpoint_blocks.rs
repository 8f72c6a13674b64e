//! Which of the UNet's blocks gradient checkpointing recomputes, and each block's share of the
//! activations: `gradient_checkpointing: true` takes every block, `"auto"` the fewest blocks,
//! largest activations first, that make the memory plan fit (`train::memory_plan`).

use serde::Serialize;

use super::config::{BlockKind, UnetConfig};

/// The blocks whose resnets and transformer blocks are checkpointed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointedBlocks {
    pub down: Vec<bool>,
    pub mid: bool,
    pub up: Vec<bool>,
}

/// A down or up block, by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRef {
    Down(usize),
    Up(usize),
}

impl BlockRef {
    /// The block's diffusers name (`down_blocks.0`, `up_blocks.3`).
    pub fn name(self) -> String {
        match self {
            Self::Down(i) => format!("down_blocks.{i}"),
            Self::Up(i) => format!("up_blocks.{i}"),
        }
    }
}

/// One block's share of the UNet's activation width.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockWidth {
    pub block: BlockRef,
    pub width: f64,
}

impl CheckpointedBlocks {
    /// Every block of a UNet shaped by `cfg`.
    pub fn all(cfg: &UnetConfig) -> Self {
        Self::filled(cfg, true)
    }

    /// No block.
    pub fn none(cfg: &UnetConfig) -> Self {
        Self::filled(cfg, false)
    }

    fn filled(cfg: &UnetConfig, on: bool) -> Self {
        Self {
            down: vec![on; cfg.down_blocks.len()],
            mid: on,
            up: vec![on; cfg.up_kinds.len()],
        }
    }

    pub fn is_all(&self) -> bool {
        self.mid && self.down.iter().chain(&self.up).all(|&b| b)
    }

    pub fn is_none(&self) -> bool {
        !self.mid && !self.down.iter().chain(&self.up).any(|&b| b)
    }

    /// Checkpoints `block` too.
    pub fn add(&mut self, block: BlockRef) {
        let slot = match block {
            BlockRef::Down(i) => self.down.get_mut(i),
            BlockRef::Up(i) => self.up.get_mut(i),
        };
        if let Some(s) = slot {
            *s = true;
        }
    }

    pub fn contains(&self, block: BlockRef) -> bool {
        match block {
            BlockRef::Down(i) => self.down.get(i).copied().unwrap_or(false),
            BlockRef::Up(i) => self.up.get(i).copied().unwrap_or(false),
        }
    }

    /// The checkpointed blocks' diffusers names, down, mid, up.
    pub fn names(&self) -> Vec<String> {
        let down = (0..self.down.len())
            .filter(|&i| self.down[i])
            .map(BlockRef::Down);
        let up = (0..self.up.len()).filter(|&i| self.up[i]).map(BlockRef::Up);
        let mut names: Vec<String> = down.map(BlockRef::name).collect();
        if self.mid {
            names.push("mid_block".into());
        }
        names.extend(up.map(BlockRef::name));
        names
    }
}

/// Each down and up block's share of the activation width, in block order (down, then up): a
/// level's `channels / 4^level × (1 + 3·transformer depth)` per resnet, for the down block's
/// `layers` resnets and the up block's `layers + 1`. The shares sum to the width the memory
/// plan's activation term uses (the mid block, at the smallest resolution, is not counted).
pub fn block_widths(cfg: &UnetConfig) -> Vec<BlockWidth> {
    let per_resnet: Vec<f64> = cfg
        .block_out_channels
        .iter()
        .zip(&cfg.down_blocks)
        .enumerate()
        .map(|(level, (&c, b))| {
            let depth = match b.kind {
                BlockKind::CrossAttn => b.transformer_layers as f64,
                BlockKind::Plain => 0.0,
            };
            c as f64 / 4f64.powi(level as i32) * (1.0 + 3.0 * depth)
        })
        .collect();
    let levels = per_resnet.len();
    let down = cfg.down_blocks.iter().enumerate().map(|(l, b)| BlockWidth {
        block: BlockRef::Down(l),
        width: per_resnet[l] * b.layers as f64,
    });
    let up = (0..cfg.up_kinds.len().min(levels)).map(|j| {
        let l = levels - 1 - j;
        BlockWidth {
            block: BlockRef::Up(j),
            width: per_resnet[l] * (cfg.down_blocks[l].layers + 1) as f64,
        }
    });
    down.chain(up).collect()
}
