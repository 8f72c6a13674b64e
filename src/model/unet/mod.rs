//! UNet2DConditionModel for SD1.x, SD2.x and SDXL, built from the component's own config.json.

pub mod blocks;
pub mod checkpoint_blocks;
pub mod config;
pub mod embeddings;
pub mod model;
pub mod transformer;

pub use checkpoint_blocks::{block_widths, BlockRef, BlockWidth, CheckpointedBlocks};
pub use config::{BlockKind, UnetConfig, UnetConfigError};
pub use model::{AddedConditions, UNet2DConditionModel};
