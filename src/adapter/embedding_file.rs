//! Textual-inversion embedding files, in the layouts A1111, ComfyUI, kohya
//! sd-scripts and diffusers write and load:
//! - SD1/SD2: `emb_params` `[n, dim]` (kohya's `train_textual_inversion.py`, A1111's safetensors
//!   embeddings), or A1111's `string_to_param.*` key;
//! - SDXL: `clip_l` `[n, 768]` for the first text encoder and `clip_g` `[n, 1280]` for the second
//!   (kohya's `sdxl_train_textual_inversion.py`; A1111 and ComfyUI read these two keys);
//! - diffusers' `learned_embeds.safetensors`: one tensor under the placeholder token's name,
//!   `[n, dim]` or `[dim]` (`textual_inversion.py`'s `save_progress`); OneTrainer's `emp_params`;
//! - bundled in a LoRA file (OneTrainer's "bundle embeddings", which A1111 loads with the LoRA):
//!   `bundle_emb.<placeholder>.clip_l` (SD1, SD2, and SDXL's first text encoder) and
//!   `.clip_g` (SDXL's second), or `bundle_emb.<placeholder>.string_to_param.*`.
//!
//! A file holds SDXL vectors exactly when it has `clip_g`: a `clip_l` alone is one text encoder's
//! (OneTrainer's SD1 bundles are named so).
//!
//! - in PyTorch's format (a `torch.save` zip): A1111's `.pt` embeddings (`string_to_param`, the
//!   vectors under `*`) and diffusers' `learned_embeds.bin` (one tensor named for its token).
//!
//! Vectors are read as f32; a 1-D tensor is one vector. Any other layout is an error that names
//! the file and its keys.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::SafeTensors;

use super::kohya_file::{decode, encode_tensor, KohyaError};
use crate::error_chain::External;
use crate::fsutil;

/// kohya's key for an SD1/SD2 embedding.
pub const EMB_PARAMS: &str = "emb_params";
/// kohya's (and A1111's, ComfyUI's) keys for SDXL's two text encoders.
pub const CLIP_L: &str = "clip_l";
pub const CLIP_G: &str = "clip_g";

#[derive(Debug, thiserror::Error)]
pub enum EmbeddingFileError {
    #[error(transparent)]
    Kohya(#[from] KohyaError),
    #[error(
        "{}: not a textual-inversion embedding (keys {keys}); expected `emb_params`, \
         `clip_l`/`clip_g`, or one tensor named for its token",
        path.display()
    )]
    Layout { path: PathBuf, keys: String },
    #[error("{}: tensor `{key}` has shape {shape:?}; an embedding is [vectors, width] or [width]", path.display())]
    Shape {
        path: PathBuf,
        key: String,
        shape: Vec<usize>,
    },
    #[error("{}: {message}", path.display())]
    Model { path: PathBuf, message: String },
    #[error("{}: cannot read it as a PyTorch (pickle) file", path.display())]
    Torch {
        path: PathBuf,
        #[source]
        source: crate::torch_pickle::TorchFileError,
    },
}

/// The vectors a file holds.
#[derive(Debug, Clone)]
pub enum EmbeddingVectors {
    /// One text encoder's (SD1/SD2).
    Single(Tensor),
    /// SDXL's, for each encoder the file has.
    Sdxl {
        clip_l: Option<Tensor>,
        clip_g: Option<Tensor>,
    },
}

/// A loaded embedding file.
#[derive(Debug, Clone)]
pub struct EmbeddingFile {
    pub path: PathBuf,
    pub vectors: EmbeddingVectors,
    /// The token a diffusers file names its one tensor after (`<cat-toy>`), else `None`.
    pub key_token: Option<String>,
    /// The header's `token_string` (sdtrain writes it), else `None`.
    pub header_token: Option<String>,
}

/// The key prefix of embeddings bundled in a LoRA file (OneTrainer's `StableDiffusionLoRASaver`
/// and `StableDiffusionXLLoRASaver`: `bundle_emb.<placeholder>.clip_l`, and `.clip_g` for SDXL;
/// A1111's Lora extension also reads `bundle_emb.<placeholder>.string_to_param.*`).
pub const BUNDLE_EMB: &str = "bundle_emb.";

/// The most values a tensor of a PyTorch embedding file may hold (75 vectors of SDXL's 1280 is
/// 96,000; a million leaves room and bounds what a file's pickle can make sdtrain allocate).
const MAX_TORCH_ELEMENTS: usize = 1_000_000;

/// OneTrainer's standalone SD1/SD2 key (`StableDiffusionEmbeddingSaver`).
const EMP_PARAMS: &str = "emp_params";

/// Where a file's tensors come from.
enum Source<'a> {
    Safetensors(SafeTensors<'a>),
    /// A PyTorch pickle (A1111's `.pt`, diffusers' `.bin`), its state dict's tensors.
    Torch(crate::torch_pickle::TorchTensors),
}

/// A file's tensors, read on demand.
struct Reader<'a> {
    path: &'a Path,
    source: Source<'a>,
    device: &'a Device,
}

impl Reader<'_> {
    /// The tensor names, sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.source {
            Source::Safetensors(st) => st.names().into_iter().map(str::to_string).collect(),
            Source::Torch(pth) => pth.records().keys().cloned().collect(),
        };
        names.sort();
        names
    }

    /// The tensor at `key` as stored, as f32 on the device.
    fn raw(&self, key: &str) -> Result<Tensor, EmbeddingFileError> {
        let path = self.path;
        match &self.source {
            Source::Safetensors(st) => {
                let view = st.tensor(key).map_err(|source| KohyaError::Format {
                    path: path.to_path_buf(),
                    source: External(source),
                })?;
                Ok(decode(path, key, &view, self.device)?)
            }
            Source::Torch(pth) => {
                let torch = |source| EmbeddingFileError::Torch {
                    path: path.to_path_buf(),
                    source,
                };
                // The shape comes from the pickle: a hostile one must not size an allocation.
                let dims = pth.records().get(key).map(|t| t.shape.clone());
                if let Some(dims) =
                    dims.filter(|d| d.iter().product::<usize>() > MAX_TORCH_ELEMENTS)
                {
                    return Err(EmbeddingFileError::Shape {
                        path: path.to_path_buf(),
                        key: key.to_string(),
                        shape: dims,
                    });
                }
                let t = pth
                    .get(key)
                    .map_err(torch)?
                    .ok_or_else(|| EmbeddingFileError::Layout {
                        path: path.to_path_buf(),
                        keys: format!("`{key}` could not be read"),
                    })?;
                t.to_dtype(DType::F32)
                    .and_then(|t| t.to_device(self.device))
                    .map_err(|e| {
                        torch(crate::torch_pickle::TorchFileError::Tensor {
                            path: path.to_path_buf(),
                            name: key.to_string(),
                            message: e.to_string(),
                        })
                    })
            }
        }
    }

    /// The tensor at `key` as `[vectors, width]` f32.
    fn read(&self, key: &str) -> Result<Tensor, EmbeddingFileError> {
        let path = self.path;
        let t = self.raw(key)?;
        match *t.dims() {
            [_] => Ok(t.unsqueeze(0).map_err(|source| KohyaError::Tensor {
                name: key.to_string(),
                source,
            })?),
            [n, _] if n > 0 => Ok(t),
            _ => Err(EmbeddingFileError::Shape {
                path: path.to_path_buf(),
                key: key.to_string(),
                shape: t.dims().to_vec(),
            }),
        }
    }

    /// One embedding's vectors from its keys, each given as (the part after the embedding's
    /// prefix, the whole key): SDXL's `clip_l`/`clip_g`, or one tensor (`emb_params`,
    /// OneTrainer's `emp_params` or an SD1 `clip_l`, A1111's `string_to_param.*`, or a lone tensor
    /// under any name, whose name is returned as its token).
    fn vectors(
        &self,
        keys: &[(String, String)],
    ) -> Result<(EmbeddingVectors, Option<String>), EmbeddingFileError> {
        let find = |k: &str| {
            keys.iter()
                .find(|(part, _)| part == k)
                .map(|(_, full)| full)
        };
        if let Some((_, out)) = keys.iter().find(|(part, _)| part.ends_with("_out")) {
            return Err(EmbeddingFileError::Layout {
                path: self.path.to_path_buf(),
                keys: format!(
                    "`{out}`: OneTrainer's output embeddings (`*_out`) are not supported"
                ),
            });
        }
        if let Some(g) = find(CLIP_G) {
            let clip_l = find(CLIP_L).map(|k| self.read(k)).transpose()?;
            let clip_g = Some(self.read(g)?);
            return Ok((EmbeddingVectors::Sdxl { clip_l, clip_g }, None));
        }
        let single = [CLIP_L, EMB_PARAMS, EMP_PARAMS]
            .into_iter()
            .find_map(find)
            .or(match keys {
                [(_, only)] => Some(only),
                _ => None,
            });
        match single {
            Some(key) => {
                let part = keys.iter().find(|(_, k)| k == key).map(|(p, _)| p.as_str());
                let named = part.filter(|p| {
                    ![CLIP_L, EMB_PARAMS, EMP_PARAMS].contains(p)
                        && !p.starts_with("string_to_param")
                        && *p != "*"
                });
                Ok((
                    EmbeddingVectors::Single(self.read(key)?),
                    named.map(str::to_string),
                ))
            }
            None => {
                let names: Vec<String> = keys.iter().map(|(_, k)| k.clone()).collect();
                Err(EmbeddingFileError::Layout {
                    path: self.path.to_path_buf(),
                    keys: super::kohya_file::listed(&names, ", "),
                })
            }
        }
    }
}

/// The placeholder and the rest of a bundled embedding's key (`bundle_emb.<placeholder>.<rest>`).
fn bundled_key(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix(BUNDLE_EMB)?.split_once('.')
}

/// Reads the embedding at `path` (vectors as f32 on `device`): a file of one embedding, or a LoRA
/// file that bundles exactly one.
pub fn load_embedding(path: &Path, device: &Device) -> Result<EmbeddingFile, EmbeddingFileError> {
    let bytes = read_bytes(path)?;
    if torch_kind(&bytes).is_some() {
        return load_torch(path, device);
    }
    let reader = reader(path, &bytes, device)?;
    let header_token = SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, h)| h.metadata().as_ref()?.get("token_string").cloned())
        .filter(|t| !t.trim().is_empty());
    let names = reader.names();
    if names.iter().any(|n| bundled_key(n).is_some()) {
        let mut bundled = bundles(&reader, &names)?;
        if bundled.len() != 1 {
            let tokens: Vec<String> = bundled.iter().map(|b| b.default_token()).collect();
            return Err(EmbeddingFileError::Model {
                path: path.to_path_buf(),
                message: format!(
                    "bundles {} embeddings ({}); one is needed here",
                    tokens.len(),
                    tokens.join(", ")
                ),
            });
        }
        return Ok(bundled.remove(0));
    }
    let keys: Vec<(String, String)> = names.iter().map(|n| (n.clone(), n.clone())).collect();
    let (vectors, key_token) = reader.vectors(&keys)?;
    Ok(EmbeddingFile {
        path: path.to_path_buf(),
        vectors,
        key_token,
        header_token,
    })
}

/// The embeddings a LoRA file bundles (`bundle_emb.<placeholder>.…`), by placeholder (each one's
/// token); empty when it bundles none.
pub fn load_bundled(
    path: &Path,
    device: &Device,
) -> Result<Vec<EmbeddingFile>, EmbeddingFileError> {
    // A LoRA saved by `torch.save`: its safetensors image, as `load_kohya` reads it.
    let bytes = super::kohya_file::adapter_bytes(path)?;
    let reader = reader(path, &bytes, device)?;
    bundles(&reader, &reader.names())
}

/// PyTorch's two file formats.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TorchKind {
    /// A zip archive (torch ≥ 1.6).
    Zip,
    /// A bare pickle (torch's legacy format).
    Legacy,
}

/// Whether `bytes` are a PyTorch file, from its first bytes: a zip archive, or torch's legacy
/// pickle, which opens with protocol 2 and torch's magic number as a 10-byte long. A safetensors
/// file opens with its header's length, which neither matches (as lengths they would be 67 MB
/// and 168 MB headers).
fn torch_kind(bytes: &[u8]) -> Option<TorchKind> {
    match bytes {
        [b'P', b'K', 3, 4, ..] => Some(TorchKind::Zip),
        [0x80, 0x02, 0x8a, 0x0a, ..] => Some(TorchKind::Legacy),
        _ => None,
    }
}

/// Whether the file at `path` is in PyTorch's format (by its first bytes).
pub fn is_torch_file(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| torch_kind(&head).is_some())
}

/// The tensors of a PyTorch embedding file as `(name, shape, dtype)`, nested dicts' keys joined
/// with `.` (A1111's `string_to_param.*`); `None` for a file that is not one.
pub fn torch_tensors(path: &Path) -> Option<Vec<(String, Vec<usize>, String)>> {
    let file = crate::torch_pickle::TorchTensors::open(path).ok()?;
    Some(
        file.records()
            .values()
            .map(|t| (t.name.clone(), t.shape.clone(), format!("{:?}", t.dtype)))
            .collect(),
    )
}

/// An embedding in PyTorch's format: A1111's `.pt` (the vectors in `string_to_param`, under
/// `*`) or diffusers' `learned_embeds.bin` (one tensor named for its token). Read by
/// [`crate::torch_pickle`], which builds data only (no code in the file runs).
fn load_torch(path: &Path, device: &Device) -> Result<EmbeddingFile, EmbeddingFileError> {
    // Every tensor of the state dict, nested dicts' keys joined with `.`: A1111's vectors are
    // `string_to_param.*` (a plain dict, or the original code's `ParameterDict` module),
    // diffusers' one tensor is named for its token.
    let pth = crate::torch_pickle::TorchTensors::open(path).map_err(|source| match source {
        crate::torch_pickle::TorchFileError::NoStateDict { .. } => EmbeddingFileError::Layout {
            path: path.to_path_buf(),
            keys: "none: the PyTorch file holds no tensors at its top level or in \
                   `string_to_param`"
                .into(),
        },
        source => EmbeddingFileError::Torch {
            path: path.to_path_buf(),
            source,
        },
    })?;
    let reader = Reader {
        path,
        source: Source::Torch(pth),
        device,
    };
    let keys: Vec<(String, String)> = reader.names().into_iter().map(|n| (n.clone(), n)).collect();
    let (vectors, key_token) = reader.vectors(&keys)?;
    Ok(EmbeddingFile {
        path: path.to_path_buf(),
        vectors,
        key_token,
        header_token: None,
    })
}

fn bundles(
    reader: &Reader<'_>,
    names: &[String],
) -> Result<Vec<EmbeddingFile>, EmbeddingFileError> {
    let mut by_placeholder: std::collections::BTreeMap<&str, Vec<(String, String)>> =
        Default::default();
    for n in names {
        if let Some((placeholder, rest)) = bundled_key(n) {
            by_placeholder
                .entry(placeholder)
                .or_default()
                .push((rest.to_string(), n.clone()));
        }
    }
    by_placeholder
        .into_iter()
        .map(|(placeholder, keys)| {
            let (vectors, _) = reader.vectors(&keys)?;
            Ok(EmbeddingFile {
                path: reader.path.to_path_buf(),
                vectors,
                key_token: Some(placeholder.to_string()),
                header_token: None,
            })
        })
        .collect()
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, EmbeddingFileError> {
    Ok(std::fs::read(path).map_err(|source| KohyaError::Read {
        path: path.to_path_buf(),
        source,
    })?)
}

fn reader<'a>(
    path: &'a Path,
    bytes: &'a [u8],
    device: &'a Device,
) -> Result<Reader<'a>, EmbeddingFileError> {
    let st = SafeTensors::deserialize(bytes).map_err(|source| KohyaError::Format {
        path: path.to_path_buf(),
        source: External(source),
    })?;
    Ok(Reader {
        path,
        source: Source::Safetensors(st),
        device,
    })
}

/// The keys of `vectors` (one set per text encoder) bundled under `token` in a LoRA file, as
/// OneTrainer writes them: `bundle_emb.<token>.clip_l` for the first text encoder (SD1, SD2 and
/// SDXL alike) and `.clip_g` for SDXL's second.
pub fn bundle_keys(token: &str, vectors: &[Tensor]) -> Vec<(String, Tensor)> {
    [CLIP_L, CLIP_G]
        .iter()
        .zip(vectors)
        .map(|(k, t)| (format!("{BUNDLE_EMB}{token}.{k}"), t.clone()))
        .collect()
}

impl EmbeddingFile {
    /// The token prompts use for this file, when not given: the `token_string` its header
    /// records, else the token a diffusers file names its tensor after, else the file's name
    /// without its extension (A1111's and ComfyUI's rule).
    pub fn default_token(&self) -> String {
        self.header_token
            .clone()
            .or_else(|| self.key_token.clone())
            .unwrap_or_else(|| {
                self.path
                    .file_stem()
                    .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
            })
    }

    /// The vectors for a model with text encoders of these widths (one for SD1/SD2, two for
    /// SDXL), one `[n, width]` tensor each, the same `n` for both.
    pub fn for_encoders(&self, widths: &[usize]) -> Result<Vec<Tensor>, EmbeddingFileError> {
        let model = |message: String| EmbeddingFileError::Model {
            path: self.path.clone(),
            message,
        };
        let vectors =
            match (&self.vectors, widths.len()) {
                (EmbeddingVectors::Single(t), 1) => vec![t.clone()],
                (
                    EmbeddingVectors::Sdxl {
                        clip_l: Some(l),
                        clip_g: Some(g),
                    },
                    2,
                ) => {
                    vec![l.clone(), g.clone()]
                }
                (EmbeddingVectors::Sdxl { clip_l, .. }, 2) => {
                    let missing = if clip_l.is_none() { CLIP_L } else { CLIP_G };
                    return Err(model(format!(
                    "an SDXL embedding needs both `clip_l` and `clip_g`; `{missing}` is missing"
                )));
                }
                (EmbeddingVectors::Sdxl { .. }, _) => return Err(model(
                    "is an SDXL embedding (`clip_l`/`clip_g`), for a model with one text encoder"
                        .into(),
                )),
                (EmbeddingVectors::Single(_), _) => {
                    return Err(model(format!(
                        "is an SD1/SD2 embedding (one tensor), for a model with {} text encoders",
                        widths.len()
                    )))
                }
            };
        let counts: Vec<usize> = vectors.iter().map(|t| t.dims()[0]).collect();
        if counts.windows(2).any(|w| w[0] != w[1]) {
            return Err(model(format!(
                "`clip_l` has {} vectors and `clip_g` {}; they must match",
                counts[0], counts[1]
            )));
        }
        for (i, (t, &w)) in vectors.iter().zip(widths).enumerate() {
            if t.dims()[1] != w {
                return Err(model(format!(
                    "vectors of width {} for text encoder {} of width {w} (an embedding made \
                     for another model family)",
                    t.dims()[1],
                    i + 1
                )));
            }
        }
        Ok(vectors)
    }

    /// How many vectors the token stands for.
    pub fn vectors_per_token(&self) -> usize {
        match &self.vectors {
            EmbeddingVectors::Single(t) => t.dims()[0],
            EmbeddingVectors::Sdxl { clip_l, clip_g } => clip_l
                .as_ref()
                .or(clip_g.as_ref())
                .map_or(0, |t| t.dims()[0]),
        }
    }
}

/// Writes one vector set per text encoder (`emb_params` for one, `clip_l`/`clip_g` for two) to
/// `path` atomically, in `dtype` (F16, BF16 or F32), with `metadata` in the header.
pub fn save_embedding(
    path: &Path,
    vectors: &[Tensor],
    dtype: DType,
    metadata: &HashMap<String, String>,
) -> Result<(), EmbeddingFileError> {
    let keys: &[&str] = match vectors.len() {
        1 => &[EMB_PARAMS],
        2 => &[CLIP_L, CLIP_G],
        n => {
            return Err(EmbeddingFileError::Model {
                path: path.to_path_buf(),
                message: format!("{n} vector sets; an embedding has one or two"),
            })
        }
    };
    let encoded = keys
        .iter()
        .zip(vectors)
        .map(|(k, t)| Ok((k.to_string(), encode_tensor(k, t, dtype)?)))
        .collect::<Result<Vec<_>, KohyaError>>()?;
    let bytes = safetensors::tensor::serialize(
        encoded.iter().map(|(n, e)| (n.as_str(), e)),
        Some(metadata.clone()),
    )
    .map_err(|source| KohyaError::Serialize {
        path: path.to_path_buf(),
        source: External(source),
    })?;
    fsutil::write_atomic(path, bytes).map_err(KohyaError::from)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vectors(n: usize, width: usize, offset: f32) -> Tensor {
        let v: Vec<f32> = (0..n * width).map(|i| i as f32 * 0.25 + offset).collect();
        Tensor::from_vec(v, (n, width), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().unwrap()
    }

    #[test]
    fn sd_and_sdxl_files_round_trip_under_kohyas_keys() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sd.safetensors");
        let v = vectors(3, 8, 0.5);
        save_embedding(&p, std::slice::from_ref(&v), DType::F32, &HashMap::new()).unwrap();
        let f = load_embedding(&p, &Device::Cpu).unwrap();
        assert!(matches!(f.vectors, EmbeddingVectors::Single(_)));
        assert_eq!(f.vectors_per_token(), 3);
        let got = f.for_encoders(&[8]).unwrap();
        assert_eq!(values(&got[0]), values(&v));
        assert!(f.for_encoders(&[8, 16]).is_err());
        assert!(f
            .for_encoders(&[4])
            .unwrap_err()
            .to_string()
            .contains("width 8"));

        let p = dir.path().join("xl.safetensors");
        let (l, g) = (vectors(2, 8, 0.0), vectors(2, 16, 1.0));
        save_embedding(&p, &[l.clone(), g.clone()], DType::F16, &HashMap::new()).unwrap();
        let st_bytes = std::fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        let mut keys: Vec<&str> = st.names();
        keys.sort();
        assert_eq!(keys, vec!["clip_g", "clip_l"]);
        let f = load_embedding(&p, &Device::Cpu).unwrap();
        let got = f.for_encoders(&[8, 16]).unwrap();
        assert_eq!(values(&got[0]), values(&l));
        assert_eq!(values(&got[1]), values(&g));
        let err = f.for_encoders(&[8]).unwrap_err().to_string();
        assert!(err.contains("SDXL embedding"), "{err}");
    }

    /// Catches a safetensors file whose header length starts like a pickle (640 bytes is
    /// `80 02 00 …`) taken for a PyTorch file.
    #[test]
    fn torch_files_are_told_from_safetensors_by_their_first_bytes() {
        assert_eq!(torch_kind(b"PK\x03\x04rest"), Some(TorchKind::Zip));
        let legacy = [0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46];
        assert_eq!(torch_kind(&legacy), Some(TorchKind::Legacy));
        let header_640 = 640u64.to_le_bytes();
        assert_eq!(torch_kind(&header_640), None);
        assert_eq!(torch_kind(b"{"), None);
    }

    #[test]
    fn diffusers_single_token_files_and_bad_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("learned_embeds.safetensors");
        let one = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
        let write = |p: &Path, keys: &[&str]| write_keys(p, keys, &one);
        write(&p, &["<cat-toy>"]);
        let f = load_embedding(&p, &Device::Cpu).unwrap();
        assert_eq!(f.key_token.as_deref(), Some("<cat-toy>"));
        let got = f.for_encoders(&[4]).unwrap();
        assert_eq!(values(&got[0]), vec![vec![1., 2., 3., 4.]]);

        let p = dir.path().join("two.safetensors");
        write(&p, &["a", "b"]);
        let err = load_embedding(&p, &Device::Cpu).unwrap_err().to_string();
        assert!(
            err.contains("not a textual-inversion embedding") && err.contains("a, b"),
            "{err}"
        );
    }

    /// A LoRA file's bundles (OneTrainer's keys, A1111's `string_to_param.*`) come apart by
    /// placeholder; one alone is what `load_embedding` reads; OneTrainer's output vectors and its
    /// `emp_params` are handled.
    #[test]
    fn bundled_embeddings_by_placeholder() {
        let dir = tempfile::tempdir().unwrap();
        let one = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let write = |name: &str, keys: &[&str]| {
            let p = dir.path().join(name);
            write_keys(&p, keys, &one);
            p
        };
        let p = write(
            "pivotal.safetensors",
            &[
                "lora_unet_x.lora_down.weight",
                "bundle_emb.a.clip_l",
                "bundle_emb.b.clip_l",
                "bundle_emb.b.clip_g",
                "bundle_emb.c.string_to_param.*",
            ],
        );
        let all = load_bundled(&p, &Device::Cpu).unwrap();
        let tokens: Vec<String> = all.iter().map(EmbeddingFile::default_token).collect();
        assert_eq!(tokens, ["a", "b", "c"]);
        assert!(matches!(all[0].vectors, EmbeddingVectors::Single(_)));
        assert!(matches!(all[1].vectors, EmbeddingVectors::Sdxl { .. }));
        assert!(matches!(all[2].vectors, EmbeddingVectors::Single(_)));
        let err = load_embedding(&p, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("bundles 3 embeddings (a, b, c)"), "{err}");
        let p = write(
            "one.safetensors",
            &["lora_unet_x.alpha", "bundle_emb.tok.clip_l"],
        );
        let f = load_embedding(&p, &Device::Cpu).unwrap();
        assert_eq!(
            (f.default_token().as_str(), f.vectors_per_token()),
            ("tok", 2)
        );
        let p = write("ot.safetensors", &["emp_params"]);
        let f = load_embedding(&p, &Device::Cpu).unwrap();
        assert_eq!(f.default_token(), "ot", "OneTrainer's key is not a token");
        let p = write("out.safetensors", &["emp_params", "emp_params_out"]);
        let err = load_embedding(&p, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("output embeddings"), "{err}");
    }

    /// A safetensors file at `p` holding `t` under each of `keys`.
    fn write_keys(p: &Path, keys: &[&str], t: &Tensor) {
        let views: Vec<(String, F32View)> =
            keys.iter().map(|k| (k.to_string(), st_view(t))).collect();
        let bytes =
            safetensors::tensor::serialize(views.iter().map(|(k, v)| (k.as_str(), v)), None)
                .unwrap();
        std::fs::write(p, bytes).unwrap();
    }

    struct F32View(Vec<u8>, Vec<usize>);
    impl safetensors::View for &F32View {
        fn dtype(&self) -> safetensors::Dtype {
            safetensors::Dtype::F32
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.0)
        }
        fn data_len(&self) -> usize {
            self.0.len()
        }
    }

    fn st_view(t: &Tensor) -> F32View {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        F32View(
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            t.dims().to_vec(),
        )
    }
}
