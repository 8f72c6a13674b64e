//! A safetensors file seen under other names: each name of the view is a tensor of the file,
//! possibly reshaped, sliced along its first dimension or transposed. A single-file checkpoint is
//! read this way, its LDM names (`model.diffusion_model.input_blocks.1.1.proj_in.weight`) seen as
//! the diffusers names each component's loader asks for (`down_blocks.0.attentions.0.proj_in.
//! weight`), so the loaders, their shape checks and the unused-tensor check run unchanged.
//! Nothing is copied until a tensor is loaded; the file stays memory-mapped and is shared by the
//! views of all its components.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

/// How a view's tensor is made from the stored one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewOp {
    /// As stored.
    Same,
    /// The stored values in another shape of the same size (a 1×1 conv seen as a linear layer).
    Reshape(Vec<usize>),
    /// Rows `start..start + len` of the first dimension (one of a fused q/k/v projection).
    Rows { start: usize, len: usize },
    /// The transpose of a 2-D tensor (a projection stored as `x @ P` seen as a linear weight).
    Transpose,
}

/// One tensor of a view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewEntry {
    /// The name the file stores it under.
    pub stored: String,
    pub op: ViewOp,
    /// The shape the view gives it.
    pub shape: Vec<usize>,
    /// The stored dtype.
    pub dtype: DType,
}

#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("{}: `{stored}` is not in the file", file.display())]
    Missing { file: PathBuf, stored: String },
    #[error("{}: `{stored}` has shape {shape:?}, which cannot be seen as `{name}` by {op:?}", file.display())]
    Op {
        file: PathBuf,
        stored: String,
        name: String,
        shape: Vec<usize>,
        op: ViewOp,
    },
    #[error("{}: `{stored}`", file.display())]
    Dtype {
        file: PathBuf,
        stored: String,
        source: Box<candle_core::Error>,
    },
}

/// The name a file would store a tensor the view lacks under (`None`: no such name).
pub type StoredNameFn = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Names → stored tensors of one memory-mapped safetensors file.
pub struct TensorView {
    file: PathBuf,
    st: Arc<MmapedSafetensors>,
    entries: BTreeMap<String, ViewEntry>,
    stored_names: Option<StoredNameFn>,
}

impl std::fmt::Debug for TensorView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("file", &self.file)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

impl PartialEq for TensorView {
    fn eq(&self, other: &Self) -> bool {
        self.file == other.file && self.entries == other.entries
    }
}

impl Eq for TensorView {}

impl TensorView {
    /// The view of `file` (mapped as `st`) where each name of `map` is `(stored name, op)`.
    /// Checks that every stored tensor exists and that its op fits its shape.
    pub fn new(
        file: &Path,
        st: Arc<MmapedSafetensors>,
        map: BTreeMap<String, (String, ViewOp)>,
    ) -> Result<Self, ViewError> {
        let mut entries = BTreeMap::new();
        for (name, (stored, op)) in map {
            let view = st.get(&stored).map_err(|_| ViewError::Missing {
                file: file.to_path_buf(),
                stored: stored.clone(),
            })?;
            let dtype = DType::try_from(view.dtype()).map_err(|source| ViewError::Dtype {
                file: file.to_path_buf(),
                stored: stored.clone(),
                source: Box::new(source),
            })?;
            let found = view.shape().to_vec();
            let shape = view_shape(&found, &op).ok_or_else(|| ViewError::Op {
                file: file.to_path_buf(),
                stored: stored.clone(),
                name: name.clone(),
                shape: found.clone(),
                op: op.clone(),
            })?;
            entries.insert(
                name,
                ViewEntry {
                    stored,
                    op,
                    shape,
                    dtype,
                },
            );
        }
        Ok(Self {
            file: file.to_path_buf(),
            st,
            entries,
            stored_names: None,
        })
    }

    /// The view, able to say under which name its file would store a tensor it lacks
    /// ([`Self::stored_name_of`]), for errors about a missing tensor.
    pub fn with_stored_names(mut self, f: StoredNameFn) -> Self {
        self.stored_names = Some(f);
        self
    }

    /// The name the file stores `name` under: the entry's, else what the view's naming rule
    /// says the file would use.
    pub fn stored_name_of(&self, name: &str) -> Option<String> {
        match self.entries.get(name) {
            Some(e) => Some(e.stored.clone()),
            None => self.stored_names.as_ref().and_then(|f| f(name)),
        }
    }

    /// The file the view reads.
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn entry(&self, name: &str) -> Option<&ViewEntry> {
        self.entries.get(name)
    }

    /// Every name of the view with its entry, sorted by name.
    pub fn entries(&self) -> impl Iterator<Item = (&String, &ViewEntry)> {
        self.entries.iter()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Loads `name` onto `device` in its stored dtype.
    pub fn load(&self, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("`{name}` is not in the view")))?;
        // Ops run on the host, where the mapped data already is; only the result is uploaded.
        let t = self.st.load(&e.stored, &Device::Cpu)?;
        let t = match &e.op {
            ViewOp::Same => t,
            ViewOp::Reshape(shape) => t.reshape(shape.as_slice())?,
            ViewOp::Rows { start, len } => t.narrow(0, *start, *len)?.contiguous()?,
            ViewOp::Transpose => t.t()?.contiguous()?,
        };
        t.to_device(device)
    }

    /// The stored bytes of `name`'s source tensor (before its op), for hashing.
    pub fn stored_bytes(&self, name: &str) -> Option<&[u8]> {
        let e = self.entries.get(name)?;
        self.st.get(&e.stored).ok().map(|v| v.data())
    }
}

/// The shape `op` gives a stored tensor of shape `found`, if it applies.
fn view_shape(found: &[usize], op: &ViewOp) -> Option<Vec<usize>> {
    match op {
        ViewOp::Same => Some(found.to_vec()),
        ViewOp::Reshape(shape) => (shape.iter().product::<usize>()
            == found.iter().product::<usize>())
        .then(|| shape.clone()),
        ViewOp::Rows { start, len } => {
            let (&rows, rest) = found.split_first()?;
            (start + len <= rows && *len > 0).then(|| {
                let mut s = vec![*len];
                s.extend_from_slice(rest);
                s
            })
        }
        ViewOp::Transpose => match found {
            [a, b] => Some(vec![*b, *a]),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_reshape_slice_and_transpose() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let qkv = Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((6, 2))
            .unwrap();
        let conv = Tensor::arange(0f32, 4., &Device::Cpu)
            .unwrap()
            .reshape((2, 2, 1, 1))
            .unwrap();
        candle_core::safetensors::save(
            &[("qkv".to_string(), qkv), ("conv".to_string(), conv)]
                .into_iter()
                .collect(),
            &path,
        )
        .unwrap();
        let st = Arc::new(unsafe { MmapedSafetensors::new(&path) }.unwrap());
        let map: BTreeMap<String, (String, ViewOp)> = [
            (
                "k".into(),
                ("qkv".into(), ViewOp::Rows { start: 2, len: 2 }),
            ),
            ("lin".into(), ("conv".into(), ViewOp::Reshape(vec![2, 2]))),
            ("proj".into(), ("conv".into(), ViewOp::Reshape(vec![2, 2]))),
            ("t".into(), ("qkv".into(), ViewOp::Transpose)),
        ]
        .into_iter()
        .collect();
        let mut map2 = map.clone();
        map2.insert("proj".into(), ("conv".into(), ViewOp::Transpose));
        let v = TensorView::new(&path, st.clone(), map).unwrap();
        let k = v.load("k", &Device::Cpu).unwrap();
        assert_eq!(k.to_vec2::<f32>().unwrap(), [[4., 5.], [6., 7.]]);
        assert_eq!(v.entry("lin").unwrap().shape, [2, 2]);
        let t = v.load("t", &Device::Cpu).unwrap();
        assert_eq!(t.dims(), [2, 6]);
        assert_eq!(t.to_vec2::<f32>().unwrap()[1][0], 1.);
        // A transpose of a 4-D tensor does not apply, and the error names the tensors.
        let err = TensorView::new(&path, st.clone(), map2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`conv`") && err.contains("`proj`"), "{err}");
        let missing: BTreeMap<String, (String, ViewOp)> =
            [("x".into(), ("absent".into(), ViewOp::Same))]
                .into_iter()
                .collect();
        let err = TensorView::new(&path, st, missing).unwrap_err().to_string();
        assert!(err.contains("`absent` is not in the file"), "{err}");
    }
}
