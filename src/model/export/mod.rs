//! Saving a fine-tuned model: as a diffusers pipeline folder ([`save_diffusers_folder`]) or as a
//! single-file checkpoint in the LDM layout ([`save_single_file`]). Both write the base model
//! ([`ModelLayout`](super::layout::ModelLayout): a folder or a single file) with the trained
//! components' tensors replacing the base ones, through one streaming safetensors writer.
//!
//! - `folder.rs`: the diffusers folder, for sdtrain and diffusers
//!   (`StableDiffusionPipeline.from_pretrained`, `StableDiffusionXLPipeline…`);
//! - `single_file.rs`: the one `.safetensors` A1111 and ComfyUI load, its tensors named by
//!   [`model::single_file::names`](super::single_file::names) (reading single files and their
//!   key names is [`model::single_file`](super::single_file), which export uses);
//! - `tensors.rs`: the base tensors, the merge with the trained ones, and the writer.

mod folder;
mod single_file;
mod tensors;

use std::path::PathBuf;

use candle_core::{DType, Tensor, Var};

use super::files::{Component, FilesError};
use crate::error_chain::External;
use crate::fsutil::FsError;

pub use folder::{save_diffusers_folder, weights_file_name};

/// The tensors an export writes in place of the base's, by component, under the names the base
/// files store them. A component listed with no tensors is rewritten whole in the export's dtype.
pub type Updates<T> = Vec<(Component, Vec<(String, T)>)>;
pub use single_file::{save_single_file, save_single_file_with};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export dtype {0:?} is not supported: use f32, f16 or bf16")]
    Dtype(DType),
    #[error("the base pipeline {} has no `{component}` component to update", root.display())]
    MissingComponent { root: PathBuf, component: Component },
    #[error("`{0}` is listed twice among the updated components")]
    Duplicate(Component),
    #[error(
        "refusing to export into {}: it would replace the base model {}",
        out.display(),
        base.display()
    )]
    IntoBase { out: PathBuf, base: PathBuf },
    #[error("{component}: updated tensor `{name}` is not in the base checkpoint {files}")]
    UnknownTensor {
        component: Component,
        name: String,
        files: String,
    },
    #[error("{component}: tensor `{name}` is given twice")]
    DuplicateTensor { component: Component, name: String },
    #[error("{component}: tensor `{name}` has shape {got:?}, the base checkpoint has {want:?}")]
    Shape {
        component: Component,
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{component}: cannot read the base weights {files}")]
    Base {
        component: Component,
        files: String,
        source: Box<External<candle_core::Error>>,
    },
    #[error("{component}: tensor `{name}`")]
    Tensor {
        component: Component,
        name: String,
        source: Box<candle_core::Error>,
    },
    #[error("{component}: tensor `{name}` has dtype {dtype:?}, which the export cannot write")]
    TensorDtype {
        component: Component,
        name: String,
        dtype: DType,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{folder}: {message}")]
    Tokenizer { folder: String, message: String },
    #[error(transparent)]
    Fs(#[from] FsError),
    #[error(transparent)]
    Files(#[from] FilesError),
}

/// Anything that holds a tensor to export: a plain [`Tensor`] or a trained [`Var`], so
/// `Weights::params()` can be passed as is.
pub trait ExportTensor {
    fn export_tensor(&self) -> &Tensor;
}

impl ExportTensor for Tensor {
    fn export_tensor(&self) -> &Tensor {
        self
    }
}

impl ExportTensor for Var {
    fn export_tensor(&self) -> &Tensor {
        self.as_tensor()
    }
}
