//! Named-tensor loading for model construction, in the spirit of candle-nn's `VarBuilder` but
//! built for training:
//! - tensors come from one or more safetensors files (memory-mapped, shards merged) or from a
//!   seeded random initialiser (benchmarks on real configs without real weights);
//! - each tensor is cast to the requested dtype and shape-checked with an error naming the tensor,
//!   the file and both shapes;
//! - when `trainable`, each tensor becomes a `Var`, recorded with its full name, so the trainer
//!   gets the parameter list in construction order;
//! - every name read is recorded, so the loader can report tensors the model never used.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{component}: tensor `{name}` not found in {files}")]
    Missing {
        component: String,
        name: String,
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
    #[error("{component}: cannot read safetensors {files}: {source}")]
    Open {
        component: String,
        files: String,
        source: Box<candle_core::Error>,
    },
    #[error("{component}: cannot load tensor `{name}`: {source}")]
    Load {
        component: String,
        name: String,
        source: Box<candle_core::Error>,
    },
    #[error("invalid model config: {0}")]
    Config(String),
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
    Random(Box<Mutex<StdRng>>),
}

struct Inner {
    component: String,
    source: Source,
    dtype: DType,
    device: Device,
    trainable: bool,
    params: Mutex<Vec<(String, Var)>>,
    used: Mutex<HashSet<String>>,
    /// Elements handed out so far (each name counted once).
    elements: AtomicUsize,
}

/// A cursor into a tensor source at a module path prefix. Cheap to clone.
#[derive(Clone)]
pub struct Weights {
    inner: Arc<Inner>,
    prefix: String,
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
                source: Box::new(without_path(source)),
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
            }),
            prefix: String::new(),
        }
    }

    /// A cursor one level down: `pp("down_blocks").pp(0)` reads `down_blocks.0.*`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        Self {
            inner: self.inner.clone(),
            prefix: self.path(&name.to_string()),
        }
    }

    /// The module path of this cursor, e.g. `down_blocks.0.resnets.1`.
    pub fn prefix(&self) -> String {
        self.prefix.clone()
    }

    /// The full tensor name of `name` under this cursor.
    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
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
            Source::Files { st, .. } => st.get(&self.path(name)).is_ok(),
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
        let inner = &self.inner;
        let load_err = |e| WeightsError::Load {
            component: inner.component.clone(),
            name: full.clone(),
            source: Box::new(e),
        };
        let tensor = match &inner.source {
            Source::Files { files, st } => {
                let view = st.get(&full).map_err(|_| WeightsError::Missing {
                    component: inner.component.clone(),
                    name: full.clone(),
                    files: display_files(files),
                })?;
                if view.shape() != shape.dims() {
                    return Err(WeightsError::Shape {
                        component: inner.component.clone(),
                        name: full.clone(),
                        file: display_files(files),
                        found: view.shape().to_vec(),
                        want: shape.dims().to_vec(),
                    });
                }
                st.load(&full, &inner.device)
                    .and_then(|t| t.to_dtype(inner.dtype))
                    .map_err(load_err)?
            }
            Source::Random(rng) => {
                random_tensor(rng, &shape, init, inner.dtype, &inner.device).map_err(load_err)?
            }
        };
        if lock(&inner.used).insert(full.clone()) {
            inner
                .elements
                .fetch_add(tensor.elem_count(), Ordering::Relaxed);
        }
        if inner.trainable {
            let var = Var::from_tensor(&tensor).map_err(load_err)?;
            let t = var.as_tensor().clone();
            lock(&inner.params).push((full, var));
            Ok(t)
        } else {
            Ok(tensor)
        }
    }

    /// Elements of every tensor read so far, trainable or frozen (a parameter count).
    pub fn element_count(&self) -> usize {
        self.inner.elements.load(Ordering::Relaxed)
    }

    /// The trainable parameters created so far, by full name, in construction order.
    pub fn params(&self) -> Vec<(String, Var)> {
        lock(&self.inner.params).clone()
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
            Source::Random(_) => Vec::new(),
        };
        out.sort();
        out
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
