//! Token / position embedding table `[vocab, dim]`, looked up with `index_select` (whose backward
//! scatters into the table).

use candle_core::{Result, Tensor};

use crate::weights::{Init, Weights, WeightsError};

#[derive(Debug, Clone)]
pub struct Embedding {
    pub path: String,
    pub weight: Tensor,
}

impl Embedding {
    pub fn new(w: &Weights, vocab: usize, dim: usize) -> std::result::Result<Self, WeightsError> {
        let weight = w.get_init((vocab, dim), "weight", Init::Normal(0.02))?;
        Ok(Self {
            path: w.prefix(),
            weight,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.weight.dims()[0]
    }

    /// `ids` of any shape (u32 or i64) → `[..ids, dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        let flat = ids.flatten_all()?;
        let out = self.weight.index_select(&flat, 0)?;
        dims.push(self.weight.dims()[1]);
        out.reshape(dims)
    }
}
