//! Token / position embedding table `[vocab, dim]`, looked up with `index_select` (whose backward
//! scatters into the table).
//!
//! A table may carry rows added after it (textual inversion's new tokens, [`Embedding::add_rows`]):
//! ids from `base_vocab()` on are looked up there. The added rows are their own tensor, so they
//! can train (a `Var`, in f32) while the table stays frozen in half precision, and a gradient
//! reaches only them.

use candle_core::{bail, DType, Result, Tensor};

use crate::weights::{Init, Weights, WeightsError};

#[derive(Debug, Clone)]
pub struct Embedding {
    pub path: String,
    pub weight: Tensor,
    /// Rows for ids `base_vocab()..vocab_size()`, `[n, dim]`.
    pub added: Option<Tensor>,
}

impl Embedding {
    pub fn new(w: &Weights, vocab: usize, dim: usize) -> std::result::Result<Self, WeightsError> {
        let weight = w.get_init((vocab, dim), "weight", Init::Normal(0.02))?;
        Ok(Self {
            path: w.prefix(),
            weight,
            added: None,
        })
    }

    /// Every id the embedding has a row for: the table's and the added ones.
    pub fn vocab_size(&self) -> usize {
        self.base_vocab() + self.added.as_ref().map_or(0, |a| a.dims()[0])
    }

    /// The table's own rows (ids below this are looked up there).
    pub fn base_vocab(&self) -> usize {
        self.weight.dims()[0]
    }

    pub fn dim(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Appends `rows` `[n, dim]` after the rows the embedding has (the table's, then any added
    /// before), giving ids `vocab_size()..vocab_size() + n`. Rows added to rows that train must
    /// themselves be the trained tensor: this concatenation is a new tensor.
    pub fn add_rows(&mut self, rows: Tensor) -> Result<()> {
        let (_, dim) = rows.dims2()?;
        if dim != self.dim() {
            bail!(
                "`{}`: added rows of width {dim} for a {}-wide embedding",
                self.path,
                self.dim()
            );
        }
        let rows = rows.to_device(self.weight.device())?;
        self.added = Some(match self.added.take() {
            None => rows,
            Some(old) => Tensor::cat(&[&old, &rows.to_dtype(old.dtype())?], 0)?,
        });
        Ok(())
    }

    /// `ids` of any shape (u32 or i64) → `[..ids, dim]`, in the table's dtype, or the added rows'
    /// when the embedding has them.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward_known(ids, None)
    }

    /// [`Embedding::forward`] given the ids already read to the host (`host`, flattened), so
    /// that ids on a device are not read back again to find the added ones.
    pub fn forward_known(&self, ids: &Tensor, host: Option<&[i64]>) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        let flat = ids.flatten_all()?;
        dims.push(self.dim());
        let out = match &self.added {
            None => self.weight.index_select(&flat, 0)?,
            Some(added) => {
                let read;
                let host = match host {
                    Some(h) if h.len() == flat.elem_count() => h,
                    _ => {
                        read = flat.to_dtype(DType::I64)?.to_vec1::<i64>()?;
                        &read
                    }
                };
                self.lookup_with_added(host, added)?
            }
        };
        out.reshape(dims)
    }

    /// Each id from the table or the added rows: both looked up (an id of the other kind reads
    /// row 0) and blended by a 0/1 mask, so only the added rows' own ids send them a gradient.
    fn lookup_with_added(&self, host: &[i64], added: &Tensor) -> Result<Tensor> {
        let base = self.base_vocab() as i64;
        let n = host.len();
        let (mut from_table, mut from_added, mut mask) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for &id in host {
            let is_added = id >= base;
            from_table.push(if is_added { 0 } else { id as u32 });
            from_added.push(if is_added { (id - base) as u32 } else { 0 });
            mask.push(if is_added { 1f32 } else { 0.0 });
        }
        let device = self.weight.device();
        let dtype = added.dtype();
        let table = self
            .weight
            .index_select(&Tensor::from_vec(from_table, n, device)?, 0)?
            .to_dtype(dtype)?;
        let rows = added.index_select(&Tensor::from_vec(from_added, n, device)?, 0)?;
        let mask = Tensor::from_vec(mask, (n, 1), device)?.to_dtype(dtype)?;
        let keep = mask.affine(-1.0, 1.0)?;
        table.broadcast_mul(&keep)? + rows.broadcast_mul(&mask)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn table() -> Embedding {
        let weight = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        Embedding {
            path: "emb".into(),
            weight,
            added: None,
        }
    }

    #[test]
    fn added_rows_take_the_ids_after_the_table_and_alone_get_gradients() {
        let mut e = table();
        let rows = Var::from_tensor(
            &Tensor::new(&[[100f32, 101., 102.], [200., 201., 202.]], &Device::Cpu).unwrap(),
        )
        .unwrap();
        e.add_rows(rows.as_tensor().clone()).unwrap();
        assert_eq!((e.base_vocab(), e.vocab_size()), (4, 6));
        let ids = Tensor::new(&[[1u32, 5, 4], [4, 0, 3]], &Device::Cpu).unwrap();
        let out = e.forward(&ids).unwrap();
        assert_eq!(out.dims(), &[2, 3, 3]);
        let got: Vec<Vec<f32>> = out.reshape((6, 3)).unwrap().to_vec2().unwrap();
        assert_eq!(got[0], vec![3., 4., 5.]);
        assert_eq!(got[1], vec![200., 201., 202.]);
        assert_eq!(got[2], vec![100., 101., 102.]);
        assert_eq!(got[3], vec![100., 101., 102.]);
        assert_eq!(got[4], vec![0., 1., 2.]);
        assert_eq!(got[5], vec![9., 10., 11.]);
        // Row i of the output weighted by i + 1: row 0 of the added rows is used at outputs 2
        // and 3 (3 + 4), row 1 at output 1 (2); table ids send the added rows nothing.
        let w = Tensor::new(&[1f32, 2., 3., 4., 5., 6.], &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 1))
            .unwrap();
        let loss = out.broadcast_mul(&w).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let g: Vec<Vec<f32>> = g.get(rows.as_tensor()).unwrap().to_vec2().unwrap();
        assert_eq!(g, vec![vec![7.; 3], vec![2.; 3]]);
    }

    #[test]
    fn rows_added_twice_append_and_a_wrong_width_is_refused() {
        let mut e = table();
        e.add_rows(Tensor::ones((1, 3), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        e.add_rows(Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        assert_eq!(e.vocab_size(), 7);
        let out: Vec<Vec<f32>> = e
            .forward(&Tensor::new(&[4u32, 5], &Device::Cpu).unwrap())
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(out, vec![vec![1.; 3], vec![0.; 3]]);
        let err = e
            .add_rows(Tensor::zeros((1, 2), DType::F32, &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("width 2"), "{err}");
    }
}
