//! Launch geometry of the norm and GEGLU kernels of src/nn/kernels/norm.cu, shared by the CUDA
//! path (`norm_cuda.rs`) and the kernels' emulation tests (`norm_kernels.rs`), so the tests run
//! the kernels as the GPU does, only with smaller blocks and chunks ([`Tuning`]).
//!
//! - Group norm, `x` `[B, C, spatial...]`, `G` groups of `N = C/G·HW` elements: each group is cut
//!   into `chunks` blocks of `chunk` elements, grid `(chunks, B·G)`; the parameter gradients take
//!   one block per channel, grid `(C)`.
//! - Layer norm over rows of `d`: one warp per row, grid `⌈rows / warps⌉`; the parameter
//!   gradients take tiles of 32 columns × `rows_per_chunk` rows, grid `(⌈d/32⌉, chunks)`, block
//!   `(32, tile_rows)`, then one thread per column, grid `⌈d / threads⌉`.
//! - GEGLU: one thread per output element, grid-stride over at most `max_blocks` blocks.

use candle_core::{bail, DType, Result};

/// Block and chunk sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// Threads per block of the 1-D kernels (a multiple of 32, at most 1024).
    pub threads: u32,
    /// Elements of a group per group-norm block (before capping the chunk count).
    pub gn_chunk: u32,
    /// The most blocks one group is cut into (each merges that many partials).
    pub gn_max_chunks: u32,
    /// Rows per block of the layer-norm parameter-gradient tiles.
    pub ln_rows_per_chunk: u32,
    /// `blockDim.y` of those tiles (`32 · tile_rows` threads, a multiple of 32, at most 32 rows).
    pub ln_tile_rows: u32,
    /// The most GEGLU blocks (a grid-stride loop covers the rest).
    pub geglu_max_blocks: u32,
}

impl Tuning {
    /// The GPU's: 256-thread blocks, 4096-element group chunks (SD's 40·4096-element groups make
    /// 40 blocks each), 64-row layer-norm tiles.
    pub(crate) const CUDA: Tuning = Tuning {
        threads: 256,
        gn_chunk: 4096,
        gn_max_chunks: 1024,
        ln_rows_per_chunk: 64,
        ln_tile_rows: 8,
        geglu_max_blocks: 65535,
    };
}

/// The entry point `stem` for activations of `dtype`: `gn_fwd_bf16` and the like.
pub(crate) fn entry(stem: &str, dtype: DType) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{stem}: no kernel for {other:?} activations"),
    };
    Ok(format!("{stem}_{suffix}"))
}

fn to_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} exceeds u32")))
}

/// A group norm launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GnGeometry {
    pub batch: u32,
    pub channels: u32,
    pub groups: u32,
    /// Channels per group.
    pub cpg: u32,
    /// Elements per channel (the product of the spatial dims).
    pub hw: u32,
    pub chunk: u32,
    pub chunks: u32,
}

impl GnGeometry {
    /// For `x` of `dims` `[B, C, ...]` in `groups` groups (already validated).
    pub(crate) fn new(dims: &[usize], groups: usize, t: Tuning) -> Result<Self> {
        let (b, c) = (dims[0], dims[1]);
        let hw: usize = dims[2..].iter().product();
        let n = c / groups * hw;
        // `begin + chunk` must not wrap in u32, nor the chunk count exceed the grid's y limit.
        if n > (u32::MAX / 2) as usize || b * groups > 65535 {
            bail!("group norm kernel: input {dims:?} in {groups} groups is too large");
        }
        let n = n.max(1);
        let mut chunk = (t.gn_chunk as usize).min(n);
        if n.div_ceil(chunk) > t.gn_max_chunks as usize {
            chunk = n.div_ceil(t.gn_max_chunks as usize);
        }
        Ok(Self {
            batch: to_u32("batch", b)?,
            channels: to_u32("channels", c)?,
            groups: to_u32("groups", groups)?,
            cpg: to_u32("channels per group", c / groups)?,
            hw: to_u32("spatial size", hw)?,
            chunk: to_u32("chunk", chunk)?,
            chunks: to_u32("chunks", n.div_ceil(chunk))?,
        })
    }

    /// Grid of the chunked kernels (`gn_stats`, `gn_fwd`, `gn_bwd_sums`, `gn_bwd_dx`).
    pub(crate) fn grid(&self) -> [u32; 3] {
        [self.chunks, self.batch * self.groups, 1]
    }

    /// Grid of `gn_bwd_params`.
    pub(crate) fn params_grid(&self) -> [u32; 3] {
        [self.channels, 1, 1]
    }

    /// Floats of the forward partials (3 per chunk) and the backward ones (2 per chunk).
    pub(crate) fn fwd_partials(&self) -> usize {
        3 * self.chunks as usize * (self.batch * self.groups) as usize
    }

    pub(crate) fn bwd_partials(&self) -> usize {
        2 * self.chunks as usize * (self.batch * self.groups) as usize
    }

    /// (Sample, group) pairs: the length of the saved mean and 1/σ.
    pub(crate) fn stats_len(&self) -> usize {
        (self.batch * self.groups) as usize
    }
}

/// A layer norm launch over `rows` rows of `d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LnGeometry {
    pub rows: u32,
    pub d: u32,
    pub rows_per_chunk: u32,
    pub chunks: u32,
    pub tile_rows: u32,
    pub threads: u32,
}

impl LnGeometry {
    pub(crate) fn new(rows: usize, d: usize, t: Tuning) -> Result<Self> {
        if rows.saturating_mul(d) > u32::MAX as usize / 2 || d == 0 {
            bail!("layer norm kernel: {rows} rows of {d} is out of range");
        }
        let rows_per_chunk = (t.ln_rows_per_chunk as usize).min(rows.max(1));
        // The chunks are the parameter-gradient grid's y (at most 65,535 blocks).
        if rows.max(1).div_ceil(rows_per_chunk) > 65_535 {
            bail!("layer norm kernel: {rows} rows is over the grid's 65,535 chunks of {rows_per_chunk}");
        }
        Ok(Self {
            rows: to_u32("rows", rows)?,
            d: to_u32("width", d)?,
            rows_per_chunk: to_u32("rows per chunk", rows_per_chunk)?,
            chunks: to_u32("chunks", rows.max(1).div_ceil(rows_per_chunk))?,
            tile_rows: t.ln_tile_rows,
            threads: t.threads,
        })
    }

    /// Grid of the warp-per-row kernels (`ln_fwd`, `ln_bwd_dx`), with blocks of `threads`.
    pub(crate) fn rows_grid(&self) -> [u32; 3] {
        [self.rows.div_ceil(self.threads / 32).max(1), 1, 1]
    }

    /// Grid and block of `ln_bwd_params_part`.
    pub(crate) fn part_grid(&self) -> ([u32; 3], [u32; 3]) {
        (
            [self.d.div_ceil(32), self.chunks, 1],
            [32, self.tile_rows, 1],
        )
    }

    /// Grid of `ln_bwd_params_finish`, with blocks of `threads`.
    pub(crate) fn finish_grid(&self) -> [u32; 3] {
        [self.d.div_ceil(self.threads), 1, 1]
    }

    /// Floats of the parameter-gradient partials: `[chunks, 2, d]`.
    pub(crate) fn partials(&self) -> usize {
        2 * self.chunks as usize * self.d as usize
    }
}

/// GEGLU grid for `n` outputs.
pub(crate) fn geglu_grid(n: usize, t: Tuning) -> [u32; 3] {
    let blocks = n
        .div_ceil(t.threads as usize)
        .clamp(1, t.geglu_max_blocks as usize);
    [blocks as u32, 1, 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SD's largest UNet group (320 channels in 32 groups at 64×64, so 40 960 elements per
    /// group at batch 2) makes 10 chunks of 4096; the VAE's 1024×1024 decoder stage (128
    /// channels, 4 per group, 2^20 each) hits the chunk cap and lengthens the chunks instead.
    #[test]
    fn group_chunks_cover_the_group_within_the_cap() {
        let g = GnGeometry::new(&[2, 320, 64, 64], 32, Tuning::CUDA).unwrap();
        assert_eq!((g.chunk, g.chunks), (4096, 10));
        assert_eq!(g.grid(), [10, 64, 1]);
        let g = GnGeometry::new(&[1, 128, 1024, 1024], 32, Tuning::CUDA).unwrap();
        assert_eq!(g.chunks, 1024);
        assert!(g.chunk as u64 * g.chunks as u64 >= 4 << 20);
        let g = GnGeometry::new(&[2, 6, 5, 7], 3, Tuning::CUDA).unwrap();
        assert_eq!((g.chunk, g.chunks), (70, 1));
    }

    #[test]
    fn layer_norm_tiles_cover_every_row() {
        let g = LnGeometry::new(2 * 4096, 320, Tuning::CUDA).unwrap();
        assert_eq!(g.rows_grid(), [1024, 1, 1]);
        assert_eq!(g.part_grid(), ([10, 128, 1], [32, 8, 1]));
        let g = LnGeometry::new(77, 1280, Tuning::CUDA).unwrap();
        assert_eq!((g.rows_per_chunk, g.chunks), (64, 2));
        // 65,535 chunks of 64 rows fill the parameter-gradient grid's y; one more row is over.
        assert!(LnGeometry::new(65_535 * 64, 8, Tuning::CUDA).is_ok());
        let e = LnGeometry::new(65_535 * 64 + 1, 8, Tuning::CUDA).unwrap_err();
        assert!(e.to_string().contains("65,535 chunks"), "{e}");
    }
}
