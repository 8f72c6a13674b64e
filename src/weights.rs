//! Named-tensor loading for model construction, in the spirit of candle-nn's `VarBuilder` but
//! built for training:
//! - tensors come from one or more safetensors files (memory-mapped, shards merged) or from a
//!   seeded random initialiser (benchmarks on real configs without real weights);
//! - each tensor is cast to the requested dtype and shape-checked with an error naming the tensor,
//!   the file and both shapes;
//! - when `trainable`, each tensor becomes a `Var`, recorded with its full name, so the trainer
//!   gets the parameter list in construction order;
//! - every name read is recorded, so the loader can report tensors the model never used;
//! - or from a [`TensorView`] of a single-file checkpoint, which shows the file's LDM-named
//!   tensors under the diffusers names the models ask for; shape errors then name both;
//! - a module's tensors may be stored with or without its own name as a prefix
//!   ([`Weights::pp_or_flat`]: transformers 5 saves `CLIPTextModel` without `text_model.`). Names
//!   given out (parameters, layer paths) are the module paths either way; lookups, the unused
//!   check and [`Weights::checkpoint_params`] use the names the files store.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::error_chain::External;
use crate::tensor_view::TensorView;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// ` (`…` in the file's names)` for a tensor the file names otherwise.
fn stored_as(stored: &Option<String>) -> String {
    stored
        .as_ref()
        .map_or(String::new(), |s| format!(" (`{s}` in the file's names)"))
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{component}: tensor `{name}`{} not found in {files}", stored_as(.stored))]
    Missing {
        component: String,
        name: String,
        /// The name the file would store it under, where that differs (a single file's).
        stored: Option<String>,
        files: String,
    },
    #[error("{component}: shape mismatch for `{name}` in {file}: file has {found:?}, model wants {want:?}")]
    Shape {
        component: String,
        name: String,
        file: String,
        found: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{component}: cannot read safetensors {files}{note}")]
    Open {
        component: String,
        files: String,
        /// What a file is instead of safetensors, when its first bytes tell
        /// ([`crate::file_sniff`]).
        note: String,
        source: Box<External<candle_core::Error>>,
    },
    #[error("{component}: cannot load tensor `{name}`")]
    Load {
        component: String,
        name: String,
        source: Box<candle_core::Error>,
    },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error(
        "{component}: neither `{nested}` nor `{flat}` is in {files}: not a checkpoint of this model"
    )]
    NoLayout {
        component: String,
        files: String,
        nested: String,
        flat: String,
    },
    #[error(
        "{component}: {files} holds both `{nested}` and `{flat}`: tensors saved with and without \
         the `{prefix}.` prefix cannot be told apart"
    )]
    MixedLayout {
        component: String,
        files: String,
        prefix: String,
        nested: String,
        flat: String,
    },
}

impl WeightsError {
    /// True when the model's files are at fault (a tensor missing or of the wrong shape, a file
    /// that is not safetensors), not the machine reading them.
    pub fn is_usage(&self) -> bool {
        match self {
            WeightsError::Missing { .. }
            | WeightsError::Shape { .. }
            | WeightsError::Open { .. }
            | WeightsError::Config(_)
            | WeightsError::NoLayout { .. }
            | WeightsError::MixedLayout { .. } => true,
            WeightsError::Load { .. } => false,
        }
    }
}

/// A candle error without its `WithPath` layers: the message already names the file, and
/// candle's `path: "…"` would say it twice.
fn without_path(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithPath { inner, .. } => without_path(*inner),
        other => other,
    }
}

/// How a tensor is filled when weights are generated rather than read.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    Zeros,
    Ones,
    Normal(f64),
    Uniform(f64),
}

enum Source {
    Files {
        files: Vec<PathBuf>,
        st: Box<MmapedSafetensors>,
    },
    View(Arc<TensorView>),
    Random(Box<Mutex<StdRng>>),
}

impl Source {
    /// The files, for messages.
    fn describe(&self) -> String {
        match self {
            Source::Files { files, .. } => display_files(files),
            Source::View(v) => format!("{} (single-file checkpoint)", v.file().display()),
            Source::Random(_) => "random weights".to_string(),
        }
    }
}

struct Inner {
    component: String,
    source: Source,
    dtype: DType,
    device: Device,
    trainable: bool,
    params: Mutex<Vec<Param>>,
    /// Stored names read so far.
    used: Mutex<HashSet<String>>,
    /// Elements handed out so far (each name counted once).
    elements: AtomicUsize,
    /// Layers built from this source store their weights in fp8 (`nn::fp8::layer_weight`).
    fp8_base: AtomicBool,
}

/// One trainable parameter: its module path name, the name its file stores it under.
struct Param {
    name: String,
    stored: String,
    var: Var,
}

/// A cursor into a tensor source at a module path prefix. Cheap to clone.
#[derive(Clone)]
pub struct Weights {
    inner: Arc<Inner>,
    /// The module path (`text_model.encoder.layers.0`): parameter and layer names.
    prefix: String,
    /// The prefix the files store this module's tensors under: `prefix`, less the levels a
    /// [`Weights::pp_or_flat`] found stored flat.
    stored: String,
}

impl Weights {
    /// Reads from safetensors `files` (shards are merged). `component` names the model in errors.
    pub fn from_files(
        files: &[PathBuf],
        component: &str,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Result<Self, WeightsError> {
        // SAFETY: the files are memory-mapped read-only; sdtrain never writes to a loaded model
        // file while it is mapped (saves go to a temp file and are renamed).
        let st =
            unsafe { MmapedSafetensors::multi(files) }.map_err(|source| WeightsError::Open {
                component: component.to_string(),
                files: display_files(files),
                note: files
                    .iter()
                    .map(|f| crate::file_sniff::safetensors_note(f))
                    .find(|n| !n.is_empty())
                    .unwrap_or_default(),
                source: Box::new(External(without_path(source))),
            })?;
        Ok(Self::with_source(
            Source::Files {
                files: files.to_vec(),
                st: Box::new(st),
            },
            component,
            dtype,
            device,
            trainable,
        ))
    }

    /// Reads through `view` (a component of a single-file checkpoint): names are the view's.
    pub fn from_view(
        view: Arc<TensorView>,
        component: &str,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Self {
        Self::with_source(Source::View(view), component, dtype, device, trainable)
    }

    /// Generates every tensor from a seeded RNG, using each layer's own init.
    pub fn random(
        seed: u64,
        component: &str,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Self {
        let rng = Box::new(Mutex::new(StdRng::seed_from_u64(seed)));
        Self::with_source(Source::Random(rng), component, dtype, device, trainable)
    }

    fn with_source(
        source: Source,
        component: &str,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                component: component.to_string(),
                source,
                dtype,
                device: device.clone(),
                trainable,
                params: Mutex::new(Vec::new()),
                used: Mutex::new(HashSet::new()),
                elements: AtomicUsize::new(0),
                fp8_base: AtomicBool::new(false),
            }),
            prefix: String::new(),
            stored: String::new(),
        }
    }

    /// A cursor one level down: `pp("down_blocks").pp(0)` reads `down_blocks.0.*`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        let name = name.to_string();
        Self {
            inner: self.inner.clone(),
            prefix: self.path(&name),
            stored: self.stored_path(&name),
        }
    }

    /// A cursor at module path `name` whose tensors the files hold either under `name.` (as
    /// [`Weights::pp`] reads them) or directly at this cursor, without the `name.` level.
    /// `probe`, a tensor every checkpoint of the module has, picks the layout once for the whole
    /// module. Either way the cursor's names are `name.*`. Random sources use the `name.` layout.
    pub fn pp_or_flat(&self, name: &str, probe: &str) -> Result<Self, WeightsError> {
        let nested = self.pp(name);
        if matches!(self.inner.source, Source::Random(_)) {
            return Ok(nested);
        }
        match (nested.contains(probe), self.contains(probe)) {
            (true, false) => Ok(nested),
            (false, true) => Ok(Self {
                stored: self.stored.clone(),
                ..nested
            }),
            (both, _) => {
                let component = self.inner.component.clone();
                let files = self.inner.source.describe();
                let (nested, flat) = (nested.stored_path(probe), self.stored_path(probe));
                Err(if both {
                    WeightsError::MixedLayout {
                        component,
                        files,
                        prefix: self.path(name),
                        nested,
                        flat,
                    }
                } else {
                    WeightsError::NoLayout {
                        component,
                        files,
                        nested,
                        flat,
                    }
                })
            }
        }
    }

    /// The module path of this cursor, e.g. `down_blocks.0.resnets.1`.
    pub fn prefix(&self) -> String {
        self.prefix.clone()
    }

    /// The full tensor name of `name` under this cursor.
    pub fn path(&self, name: &str) -> String {
        join(&self.prefix, name)
    }

    /// The name the files store `name` under (the same as [`Weights::path`] unless a
    /// [`Weights::pp_or_flat`] above this cursor found a flat layout).
    pub fn stored_path(&self, name: &str) -> String {
        join(&self.stored, name)
    }

    pub fn component(&self) -> &str {
        &self.inner.component
    }

    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Whether the source holds `name` under this cursor (always true for random weights).
    pub fn contains(&self, name: &str) -> bool {
        match &self.inner.source {
            Source::Files { st, .. } => st.get(&self.stored_path(name)).is_ok(),
            Source::View(v) => v.entry(&self.stored_path(name)).is_some(),
            Source::Random(_) => true,
        }
    }

    /// Reads `name` with the given shape; random sources fill it with `Normal(0.02)`.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor, WeightsError> {
        self.get_init(shape, name, Init::Normal(0.02))
    }

    /// Reads `name` with the given shape; random sources fill it with `init`.
    pub fn get_init(
        &self,
        shape: impl Into<Shape>,
        name: &str,
        init: Init,
    ) -> Result<Tensor, WeightsError> {
        let shape: Shape = shape.into();
        let full = self.path(name);
        // Errors name the tensor as the files store it: that is the name a user can look up.
        let stored = self.stored_path(name);
        let inner = &self.inner;
        let load_err = |e| WeightsError::Load {
            component: inner.component.clone(),
            name: stored.clone(),
            source: Box::new(e),
        };
        let tensor = match &inner.source {
            Source::Files { files, st } => {
                let view = st.get(&stored).map_err(|_| WeightsError::Missing {
                    component: inner.component.clone(),
                    name: stored.clone(),
                    stored: None,
                    files: display_files(files),
                })?;
                if view.shape() != shape.dims() {
                    return Err(WeightsError::Shape {
                        component: inner.component.clone(),
                        name: stored.clone(),
                        file: display_files(files),
                        found: view.shape().to_vec(),
                        want: shape.dims().to_vec(),
                    });
                }
                st.load(&stored, &inner.device)
                    .and_then(|t| t.to_dtype(inner.dtype))
                    .map_err(load_err)?
            }
            Source::View(view) => {
                let entry = view.entry(&stored).ok_or_else(|| WeightsError::Missing {
                    component: inner.component.clone(),
                    name: stored.clone(),
                    stored: view.stored_name_of(&stored).filter(|own| *own != stored),
                    files: inner.source.describe(),
                })?;
                if entry.shape != shape.dims() {
                    return Err(WeightsError::Shape {
                        component: inner.component.clone(),
                        // Rendered inside the message's backticks: `x` (stored as `y`).
                        name: format!("{stored}` (stored as `{}", entry.stored),
                        file: inner.source.describe(),
                        found: entry.shape.clone(),
                        want: shape.dims().to_vec(),
                    });
                }
                view.load(&stored, &inner.device)
                    .and_then(|t| t.to_dtype(inner.dtype))
                    .map_err(load_err)?
            }
            Source::Random(rng) => {
                random_tensor(rng, &shape, init, inner.dtype, &inner.device).map_err(load_err)?
            }
        };
        if lock(&inner.used).insert(stored.clone()) {
            inner
                .elements
                .fetch_add(tensor.elem_count(), Ordering::Relaxed);
        }
        if inner.trainable {
            let var = Var::from_tensor(&tensor).map_err(load_err)?;
            let t = var.as_tensor().clone();
            lock(&inner.params).push(Param {
                name: full,
                stored,
                var,
            });
            Ok(t)
        } else {
            Ok(tensor)
        }
    }

    /// Asks the layers built from this source from now on to store their weights as e4m3 codes
    /// with a scale per output channel (`base_weight_dtype: "fp8"`, `nn::fp8::layer_weight`),
    /// when the source is frozen; a trainable source ignores it.
    pub fn set_fp8_base(&self, on: bool) {
        self.inner.fp8_base.store(on, Ordering::Relaxed);
    }

    /// Whether layers built from this source store their weights in fp8.
    pub fn fp8_base(&self) -> bool {
        self.inner.fp8_base.load(Ordering::Relaxed) && !self.inner.trainable
    }

    /// Elements of every tensor read so far, trainable or frozen (a parameter count).
    pub fn element_count(&self) -> usize {
        self.inner.elements.load(Ordering::Relaxed)
    }

    /// The trainable parameters created so far, by module path name, in construction order.
    pub fn params(&self) -> Vec<(String, Var)> {
        let params = lock(&self.inner.params);
        params
            .iter()
            .map(|p| (p.name.clone(), p.var.clone()))
            .collect()
    }

    /// [`Weights::params`] under the names the files store them: what an export writes back
    /// into a copy of the loaded checkpoint, in the checkpoint's own layout.
    pub fn checkpoint_params(&self) -> Vec<(String, Var)> {
        let params = lock(&self.inner.params);
        params
            .iter()
            .map(|p| (p.stored.clone(), p.var.clone()))
            .collect()
    }

    /// Tensors present in the files that no layer read (sorted). Empty for random sources.
    pub fn unused(&self) -> Vec<String> {
        let used = lock(&self.inner.used);
        let mut out: Vec<String> = match &self.inner.source {
            Source::Files { st, .. } => st
                .tensors()
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| !used.contains(n))
                .collect(),
            Source::View(v) => v
                .entries()
                .map(|(n, _)| n.clone())
                .filter(|n| !used.contains(n))
                .collect(),
            Source::Random(_) => Vec::new(),
        };
        out.sort();
        out
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked mid-push; the data is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn display_files(files: &[PathBuf]) -> String {
    let names: Vec<String> = files
        .iter()
        .map(|p: &PathBuf| Path::new(p).display().to_string())
        .collect();
    names.join(", ")
}

fn random_tensor(
    rng: &Mutex<StdRng>,
    shape: &Shape,
    init: Init,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let n = shape.elem_count();
    let data: Vec<f32> = match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Uniform(bound) => random_fill(rng, n, |r| r.random_range(-bound..bound) as f32),
        // Box–Muller: no extra crate for a benchmark-only initialiser.
        Init::Normal(std) => random_fill(rng, n, |r| {
            let u1: f64 = r.random_range(f64::EPSILON..1.0);
            let u2: f64 = r.random::<f64>();
            (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        }),
    };
    Tensor::from_vec(data, shape.clone(), device)?.to_dtype(dtype)
}

/// `n` values of `sample`, filled in parallel: each 64 Ki-element chunk has its own generator,
/// seeded from one draw of the source's RNG and the chunk index, so the values depend on the
/// seed and the order tensors are read, never on the thread count. (A full SDXL UNet is 2.6 G
/// values: one thread took minutes.)
fn random_fill(
    rng: &Mutex<StdRng>,
    n: usize,
    sample: impl Fn(&mut StdRng) -> f32 + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let base: u64 = lock(rng).random();
    let mut data = vec![0f32; n];
    data.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut r =
                StdRng::seed_from_u64(base ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for v in chunk {
                *v = sample(&mut r);
            }
        });
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `names` (each a `[2]` f32 tensor of ones) into `dir/model.safetensors`.
    fn file(dir: &Path, names: &[&str]) -> PathBuf {
        let path = dir.join("model.safetensors");
        let tensors: Vec<(String, Tensor)> = names
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(),
                )
            })
            .collect();
        candle_core::safetensors::save(&tensors.into_iter().collect(), &path).unwrap();
        path
    }

    fn open(path: &Path) -> Weights {
        Weights::from_files(&[path.to_path_buf()], "te", DType::F32, &Device::Cpu, true).unwrap()
    }

    #[test]
    fn pp_or_flat_reads_either_layout_under_module_names() {
        let dir = tempfile::tempdir().unwrap();
        for (names, stored) in [
            (["m.a.w", "m.b.w", "m.extra", "top.w"], "m."),
            (["a.w", "b.w", "extra", "top.w"], ""),
        ] {
            let w = open(&file(dir.path(), &names));
            let m = w.pp_or_flat("m", "a.w").unwrap();
            m.pp("a").get(2, "w").unwrap();
            m.pp("b").get(2, "w").unwrap();
            w.pp("top").get(2, "w").unwrap();
            let params: Vec<String> = w.params().into_iter().map(|(n, _)| n).collect();
            assert_eq!(params, ["m.a.w", "m.b.w", "top.w"]);
            let in_file: Vec<String> = w.checkpoint_params().into_iter().map(|(n, _)| n).collect();
            assert_eq!(
                in_file,
                [
                    format!("{stored}a.w"),
                    format!("{stored}b.w"),
                    "top.w".into()
                ]
            );
            // The unused check compares stored names, so it works in both layouts.
            assert_eq!(w.unused(), [format!("{stored}extra")]);
            // Errors name the tensor as stored.
            let err = m.get(2, "absent").unwrap_err().to_string();
            assert!(err.contains(&format!("`{stored}absent`")), "{err}");
        }
    }

    #[test]
    fn pp_or_flat_refuses_unknown_and_mixed_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let path = file(dir.path(), &["x.w"]);
        let err = open(&path)
            .pp_or_flat("m", "a.w")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("neither `m.a.w` nor `a.w`") && err.contains(&path.display().to_string()),
            "{err}"
        );
        let path = file(dir.path(), &["m.a.w", "a.w"]);
        let err = open(&path)
            .pp_or_flat("m", "a.w")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("both `m.a.w` and `a.w`"), "{err}");
        // Random weights have no layout to detect.
        let w = Weights::random(0, "te", DType::F32, &Device::Cpu, false);
        assert_eq!(w.pp_or_flat("m", "a.w").unwrap().stored_path("w"), "m.w");
    }
}
