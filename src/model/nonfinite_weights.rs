//! Finds the first stored tensor of a model that holds NaN or Inf. A model saved from a run that
//! diverged (or damaged on disk) loads without complaint and makes every step's loss non-finite;
//! a run that stops on non-finite losses reads the model's files again with this, so its error
//! names the broken tensor and file instead of only suggesting a lower learning rate.
//!
//! Reading every tensor costs a pass over the weights, so this runs on that error path only,
//! never at load time.

use std::collections::BTreeSet;
use std::path::PathBuf;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};

use super::layout::ModelLayout;

/// A tensor holding a non-finite value.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFiniteTensor {
    pub file: PathBuf,
    pub tensor: String,
    /// The first non-finite value met: NaN, inf or -inf.
    pub value: f32,
}

/// The first tensor, in file then name order, of the model's weight files that holds NaN or
/// Inf; `None` when all are finite or none could be read (the load already succeeded once, so
/// a file unreadable now is not this check's to report).
pub fn first_nonfinite(layout: &ModelLayout) -> Option<NonFiniteTensor> {
    let files: BTreeSet<&PathBuf> = layout.components.iter().flat_map(|c| c.weights()).collect();
    files.into_iter().find_map(first_in_file)
}

fn first_in_file(file: &PathBuf) -> Option<NonFiniteTensor> {
    // SAFETY: the mapping is read only, as candle's loaders map model files.
    let st = unsafe { MmapedSafetensors::new(file) }.ok()?;
    let mut names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let t = st.load(&name, &Device::Cpu).ok()?;
        if !t.dtype().is_float() {
            return None;
        }
        let values = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .ok()?;
        let value = values.into_iter().find(|v| !v.is_finite())?;
        Some(NonFiniteTensor {
            file: file.clone(),
            tensor: name,
            value,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;
    use std::collections::HashMap;

    /// A tensor with one Inf among finite ones is found and named with its file; finite files
    /// and integer tensors are passed over. Catches a check that reads only the first value,
    /// or that reports nothing for Inf (`max` ignores NaN, `is_nan` ignores Inf).
    #[test]
    fn names_the_tensor_and_file_with_a_non_finite_value() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("a.safetensors");
        let bad = dir.path().join("b.safetensors");
        let ones = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let ints = Tensor::new(&[1i64, 2], &Device::Cpu).unwrap();
        let inf = Tensor::new(&[1f32, 2.0, f32::INFINITY], &Device::Cpu).unwrap();
        candle_core::safetensors::save(
            &HashMap::from([("w".to_string(), ones.clone()), ("i".to_string(), ints)]),
            &good,
        )
        .unwrap();
        candle_core::safetensors::save(
            &HashMap::from([("a".to_string(), ones), ("z.bias".to_string(), inf)]),
            &bad,
        )
        .unwrap();
        assert_eq!(first_in_file(&good), None);
        let found = first_in_file(&bad).unwrap();
        assert_eq!(
            (found.tensor.as_str(), found.value),
            ("z.bias", f32::INFINITY)
        );
        assert_eq!(found.file, bad);
    }
}
