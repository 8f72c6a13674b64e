//! Where a model comes from: a local diffusers folder, a local single-file `.safetensors`
//! checkpoint ([`super::single_file`]), a single file `torch.save` wrote (`.ckpt`, `.pt`: read
//! through its converted copy, [`crate::torch_pickle`]), or a Hugging Face hub repo id
//! (`org/name[@revision]`) resolved to a snapshot folder in the standard hub cache.
//!
//! Cache layout (shared with Python's `huggingface_hub`):
//! `<cache>/models--org--name/refs/<revision>` holds a commit hash, and
//! `<cache>/models--org--name/snapshots/<commit>/…` holds the files. The cache is `HF_HUB_CACHE`,
//! else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`. With `HF_HUB_OFFLINE` set only the cache
//! is read. Online, a snapshot that already holds every file sdtrain needs is used without touching
//! the network; otherwise the repo's file list is fetched and only the files the selection rules
//! pick ([`files::hub_plan`]) are downloaded, with `HF_TOKEN` for gated or private repos.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use super::family::FamilyError;
use super::files::{self, FilesError, MODEL_INDEX};
use super::layout::ModelLayout;
use crate::error_chain::External;

const DEFAULT_REVISION: &str = "main";

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(
        "`{spec}` is neither an existing folder nor a hub repo id (`org/name` or `org/name@revision`)"
    )]
    InvalidSpec { spec: String },
    #[error("cannot convert this torch checkpoint to safetensors")]
    Convert {
        path: PathBuf,
        source: Box<crate::torch_pickle::ConvertError>,
    },
    #[error(
        "{} is a file, neither a diffusers pipeline folder nor a .safetensors checkpoint",
        path.display()
    )]
    NotAFolder { path: PathBuf },
    #[error("cannot locate the hub cache: set HF_HUB_CACHE or HF_HOME (HOME is not set either)")]
    NoCacheDir,
    #[error(
        "{repo}@{revision} is not in the hub cache {} and offline mode is on (HF_HUB_OFFLINE); \
         download it first or unset HF_HUB_OFFLINE",
        cache_dir.display()
    )]
    NotCached {
        repo: String,
        revision: String,
        cache_dir: PathBuf,
    },
    #[error(
        "{repo}@{revision}: the cached snapshot {} is incomplete and offline mode is on \
         (HF_HUB_OFFLINE)",
        snapshot.display()
    )]
    IncompleteOffline {
        repo: String,
        revision: String,
        snapshot: PathBuf,
        source: Box<FamilyError>,
    },
    #[error("{repo}@{revision}: cannot reach the hub")]
    Hub {
        repo: String,
        revision: String,
        source: Box<External<hf_hub::api::sync::ApiError>>,
    },
    #[error("{repo}@{revision}: cannot download {file}")]
    Download {
        repo: String,
        revision: String,
        file: String,
        source: Box<External<hf_hub::api::sync::ApiError>>,
    },
    #[error("cannot write {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Layout(#[from] FamilyError),
    #[error(transparent)]
    Files(#[from] FilesError),
}

impl SourceError {
    /// True when the `--model` argument or the model it names is at fault (exit code 2), false
    /// when the environment is (cache, network, disk).
    pub fn is_usage(&self) -> bool {
        match self {
            SourceError::InvalidSpec { .. } | SourceError::NotAFolder { .. } => true,
            // The file is at fault when it cannot be read; the cache, when it cannot be written.
            SourceError::Convert { source, .. } => {
                matches!(**source, crate::torch_pickle::ConvertError::Read(_))
            }
            SourceError::Layout(e) => e.is_usage(),
            SourceError::Files(e) => e.is_usage(),
            SourceError::NoCacheDir
            | SourceError::NotCached { .. }
            | SourceError::IncompleteOffline { .. }
            | SourceError::Hub { .. }
            | SourceError::Download { .. }
            | SourceError::Io { .. } => false,
        }
    }
}

/// A parsed `--model` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A diffusers pipeline folder, or a single-file `.safetensors` checkpoint, on disk.
    Local(PathBuf),
    /// A single-file checkpoint saved by `torch.save` (`.ckpt`, `.pt`, `.pth`, `.bin`): read as
    /// data, never run ([`crate::torch_pickle`]), through a converted `.safetensors` copy.
    Torch(PathBuf),
    /// A hub repo; `revision` is a branch, tag or commit hash (`main` when absent).
    Hub {
        repo_id: String,
        revision: Option<String>,
    },
}

impl ModelSource {
    /// Parses `spec`: an existing folder, `.safetensors` file or torch checkpoint wins;
    /// otherwise it must be `org/name[@revision]`.
    pub fn parse(spec: &str) -> Result<Self, SourceError> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        let lower = spec.to_ascii_lowercase();
        if lower.ends_with(".safetensors") && path.is_file() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        let torch = crate::torch_pickle::has_torch_extension(path);
        if torch && path.is_file() {
            return Ok(ModelSource::Torch(path.to_path_buf()));
        }
        if torch || lower.ends_with(".safetensors") {
            return Err(SourceError::InvalidSpec {
                spec: spec.to_string(),
            });
        }
        if path.exists() {
            return Err(SourceError::NotAFolder {
                path: path.to_path_buf(),
            });
        }
        let (repo_id, revision) = match spec.split_once('@') {
            Some((repo, rev)) => (repo, Some(rev)),
            None => (spec, None),
        };
        if !is_repo_id(repo_id) || revision.is_some_and(|r| !is_revision(r)) {
            return Err(SourceError::InvalidSpec {
                spec: spec.to_string(),
            });
        }
        Ok(ModelSource::Hub {
            repo_id: repo_id.to_string(),
            revision: revision.map(str::to_string),
        })
    }

    /// Resolves to a local folder using the process environment (see [`HubEnv::from_env`]).
    pub fn resolve(&self) -> Result<ModelDir, SourceError> {
        self.resolve_for(None)
    }

    /// As [`ModelSource::resolve`], making sure the files a read with `variant` needs are there.
    /// The environment is read only for a hub repo.
    pub fn resolve_for(&self, variant: Option<&str>) -> Result<ModelDir, SourceError> {
        match self {
            ModelSource::Local(path) => Ok(ModelDir {
                path: path.clone(),
                origin: Origin::Local,
            }),
            ModelSource::Torch(path) => torch_copy(path),
            ModelSource::Hub { .. } => self.resolve_with(&HubEnv::from_env()?, variant),
        }
    }

    /// Resolves to a local folder, downloading (unless `env.offline`) what a read with `variant`
    /// needs.
    pub fn resolve_with(
        &self,
        env: &HubEnv,
        variant: Option<&str>,
    ) -> Result<ModelDir, SourceError> {
        files::check_variant(variant)?;
        match self {
            ModelSource::Local(path) => Ok(ModelDir {
                path: path.clone(),
                origin: Origin::Local,
            }),
            ModelSource::Torch(path) => torch_copy(path),
            ModelSource::Hub { repo_id, revision } => {
                let revision = revision.as_deref().unwrap_or(DEFAULT_REVISION);
                resolve_hub(repo_id, revision, env, variant)
            }
        }
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Local(p) | ModelSource::Torch(p) => write!(f, "{}", p.display()),
            ModelSource::Hub {
                repo_id,
                revision: Some(r),
            } => write!(f, "{repo_id}@{r}"),
            ModelSource::Hub {
                repo_id,
                revision: None,
            } => f.write_str(repo_id),
        }
    }
}

/// The `.safetensors` copy of the torch checkpoint `path`, converted now unless an earlier
/// run did (`torch_pickle::converted_copy`); says which.
pub fn torch_copy(path: &Path) -> Result<ModelDir, SourceError> {
    let copy = crate::torch_pickle::converted_copy(path).map_err(|e| SourceError::Convert {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    match &copy.fresh {
        Some(done) => crate::console::say(format_args!(
            "{}: a torch pickle, read as data (nothing in it runs) and converted to {} ({} \
             tensors, {:.1} MB{}); later runs reuse the copy",
            path.display(),
            copy.path.display(),
            done.tensors,
            done.bytes as f64 / 1e6,
            match done.skipped.len() {
                0 => String::new(),
                n => format!(", {n} entries that are not tensors left out"),
            }
        )),
        None => crate::console::say(format_args!(
            "{}: read through its converted copy {}",
            path.display(),
            copy.path.display()
        )),
    }
    Ok(ModelDir {
        path: copy.path,
        origin: Origin::Converted {
            from: path.to_path_buf(),
        },
    })
}

/// A hub repo id: `org/name`, each part of letters, digits, `-`, `_`, `.`, not starting or ending
/// with `-`/`.` and without `--` or `..` (the hub's own rules).
fn is_repo_id(s: &str) -> bool {
    let Some((org, name)) = s.split_once('/') else {
        return false;
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
            && !p.contains("--")
            && !p.contains("..")
    };
    part_ok(org) && part_ok(name)
}

/// A branch, tag or commit: no empty path segment, no `..`, no backslash (it becomes a path
/// under `refs/`).
fn is_revision(s: &str) -> bool {
    !s.is_empty()
        && !s.contains('\\')
        && s.split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// Hub settings, read once from the environment (or built directly by tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubEnv {
    pub cache_dir: PathBuf,
    pub token: Option<String>,
    pub offline: bool,
    /// `HF_ENDPOINT`, for mirrors; the public hub when `None`.
    pub endpoint: Option<String>,
}

impl HubEnv {
    /// From `HF_HUB_CACHE`, `HF_HOME`, `HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE` and `HF_ENDPOINT`.
    pub fn from_env() -> Result<Self, SourceError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`HubEnv::from_env`], reading variables through `var` (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, SourceError> {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        let cache_dir = if let Some(c) = var("HF_HUB_CACHE") {
            PathBuf::from(c)
        } else if let Some(h) = var("HF_HOME") {
            PathBuf::from(h).join("hub")
        } else if let Some(home) = var("HOME").or_else(|| var("USERPROFILE")) {
            PathBuf::from(home).join(".cache/huggingface/hub")
        } else {
            return Err(SourceError::NoCacheDir);
        };
        Ok(Self {
            cache_dir,
            token: var("HF_TOKEN"),
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| is_truthy(&v)),
            endpoint: var("HF_ENDPOINT"),
        })
    }

    /// Reads only the cache at `cache_dir`.
    pub fn offline(cache_dir: PathBuf) -> Self {
        Self {
            cache_dir,
            token: None,
            offline: true,
            endpoint: None,
        }
    }
}

/// `1`, `true`, `yes`, `on` (any case), as `huggingface_hub` reads boolean variables.
pub fn is_truthy(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// A resolved model: the folder to read and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDir {
    pub path: PathBuf,
    pub origin: Origin,
}

impl ModelDir {
    /// `result`, its error noting which torch file a converted copy is of (an error reading the
    /// copy names the copy's path in the cache, which the user never gave).
    pub fn noting_copy<T, E>(&self, result: Result<T, E>) -> anyhow::Result<T>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        result.map_err(|e| match &self.origin {
            Origin::Converted { from } => anyhow::Error::new(e).context(format!(
                "{} (read through its safetensors copy {})",
                from.display(),
                self.path.display()
            )),
            Origin::Local | Origin::Hub { .. } => anyhow::Error::new(e),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Local,
    /// A torch checkpoint, read through its converted copy (`ModelDir::path`).
    Converted {
        from: PathBuf,
    },
    Hub {
        repo_id: String,
        revision: String,
        commit: String,
    },
}

/// The cache folder of a model repo: `models--org--name`.
pub fn repo_cache_dir(cache_dir: &Path, repo_id: &str) -> PathBuf {
    cache_dir.join(Repo::model(repo_id.to_string()).folder_name())
}

/// The commit a revision points at in the cache: `refs/<revision>`, or the revision itself when
/// it is a commit hash with a snapshot.
pub fn cached_commit(cache_dir: &Path, repo_id: &str, revision: &str) -> Option<String> {
    let repo_dir = repo_cache_dir(cache_dir, repo_id);
    if let Ok(commit) = std::fs::read_to_string(repo_dir.join("refs").join(revision)) {
        let commit = commit.trim();
        if !commit.is_empty() && !commit.contains(['/', '\\']) && commit != ".." {
            return Some(commit.to_string());
        }
    }
    if is_commit_hash(revision) && repo_dir.join("snapshots").join(revision).is_dir() {
        return Some(revision.to_string());
    }
    None
}

/// The cache's snapshot folder of `repo_id` at `commit`, reached by `revision`.
fn snapshot_dir(env: &HubEnv, repo_id: &str, revision: &str, commit: String) -> ModelDir {
    ModelDir {
        path: repo_cache_dir(&env.cache_dir, repo_id)
            .join("snapshots")
            .join(&commit),
        origin: Origin::Hub {
            repo_id: repo_id.to_string(),
            revision: revision.to_string(),
            commit,
        },
    }
}

fn resolve_hub(
    repo_id: &str,
    revision: &str,
    env: &HubEnv,
    variant: Option<&str>,
) -> Result<ModelDir, SourceError> {
    let hub_dir = |commit: String| snapshot_dir(env, repo_id, revision, commit);
    // A cached snapshot that reads, but from `.bin` weights: used if the hub cannot be reached.
    let mut readable = None;
    if let Some(commit) = cached_commit(&env.cache_dir, repo_id, revision) {
        let dir = hub_dir(commit);
        match ModelLayout::read(&dir.path, variant) {
            // Online, a snapshot holding `.bin` weights (Python's `huggingface_hub` fetched them)
            // may lack the safetensors the repo has: the plan below prefers those.
            Ok(layout)
                if !env.offline
                    && layout
                        .components
                        .iter()
                        .any(|c| !c.torch_files().is_empty()) =>
            {
                readable = Some(dir);
            }
            Ok(_) => return Ok(dir),
            Err(e) if e.is_pickle_only() && !env.offline => {}
            Err(e) if !e.is_incomplete() => return Err(e.into()),
            Err(source) if env.offline => {
                return Err(SourceError::IncompleteOffline {
                    repo: repo_id.to_string(),
                    revision: revision.to_string(),
                    snapshot: dir.path,
                    source: Box::new(source),
                })
            }
            Err(_) => {}
        }
    } else if env.offline {
        return Err(SourceError::NotCached {
            repo: repo_id.to_string(),
            revision: revision.to_string(),
            cache_dir: env.cache_dir.clone(),
        });
    }
    let pipeline = |fetch: &Fetch<'_>, repo_files: &[String]| -> Result<_, SourceError> {
        let model_index = files::read_json(&fetch(MODEL_INDEX)?)?;
        Ok(files::hub_plan(repo_id, &model_index, repo_files, variant)?)
    };
    let commit = match (download(repo_id, revision, env, &pipeline), readable) {
        (Ok(commit), _) => commit,
        (Err(e), Some(dir)) => {
            crate::console::say(format_args!(
                "{repo_id}: the hub could not be asked for safetensors weights ({e}); using the \
                 cached snapshot's `.bin` weights"
            ));
            return Ok(dir);
        }
        (Err(e), None) => return Err(e),
    };
    let dir = hub_dir(commit);
    ModelLayout::read(&dir.path, variant)?;
    Ok(dir)
}

/// A hub repo that holds one model component (a VAE: `madebyollin/sdxl-vae-fp16-fix`), not a
/// pipeline: its cached snapshot when `ready` accepts it, else (unless offline) the files `plan`
/// picks from the repo's file list, downloaded into the cache. `revision`: `main` when `None`.
pub fn resolve_component_repo(
    repo_id: &str,
    revision: Option<&str>,
    env: &HubEnv,
    ready: &dyn Fn(&Path) -> Result<(), FilesError>,
    plan: &dyn Fn(&[String]) -> Result<files::HubPlan, FilesError>,
) -> Result<ModelDir, SourceError> {
    let revision = revision.unwrap_or(DEFAULT_REVISION);
    let hub_dir = |commit: String| snapshot_dir(env, repo_id, revision, commit);
    match cached_commit(&env.cache_dir, repo_id, revision) {
        Some(commit) => {
            let dir = hub_dir(commit);
            match ready(&dir.path) {
                Ok(()) => return Ok(dir),
                Err(e) if !e.is_incomplete() => return Err(e.into()),
                Err(e) if env.offline => {
                    return Err(SourceError::IncompleteOffline {
                        repo: repo_id.to_string(),
                        revision: revision.to_string(),
                        snapshot: dir.path,
                        source: Box::new(FamilyError::from(e)),
                    })
                }
                Err(_) => {}
            }
        }
        None if env.offline => {
            return Err(SourceError::NotCached {
                repo: repo_id.to_string(),
                revision: revision.to_string(),
                cache_dir: env.cache_dir.clone(),
            })
        }
        None => {}
    }
    let pick =
        |_: &Fetch<'_>, repo_files: &[String]| -> Result<_, SourceError> { Ok(plan(repo_files)?) };
    let dir = hub_dir(download(repo_id, revision, env, &pick)?);
    ready(&dir.path)?;
    Ok(dir)
}

/// Downloads one repo file into the snapshot (or finds it there): its local path.
type Fetch<'a> = dyn Fn(&str) -> Result<PathBuf, SourceError> + 'a;

/// What to download: from the repo's file list, and files fetched on the way (a pipeline's
/// `model_index.json`).
type Planner<'a> = dyn Fn(&Fetch<'_>, &[String]) -> Result<files::HubPlan, SourceError> + 'a;

/// Fetches the repo's file list and downloads the files `plan` picks into the cache, returning
/// the commit they belong to.
fn download(
    repo_id: &str,
    revision: &str,
    env: &HubEnv,
    plan: &Planner<'_>,
) -> Result<String, SourceError> {
    let hub_err = |source| SourceError::Hub {
        repo: repo_id.to_string(),
        revision: revision.to_string(),
        source: Box::new(External(source)),
    };
    let cache = Cache::new(env.cache_dir.clone());
    // `from_cache` already reads the token file `huggingface-cli login` writes; HF_TOKEN wins.
    let mut builder = ApiBuilder::from_cache(cache.clone());
    if let Some(token) = &env.token {
        builder = builder.with_token(Some(token.clone()));
    }
    if let Some(endpoint) = &env.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder.build().map_err(hub_err)?;
    let info = api
        .repo(Repo::with_revision(
            repo_id.to_string(),
            RepoType::Model,
            revision.to_string(),
        ))
        .info()
        .map_err(hub_err)?;
    let commit = info.sha.clone();
    // Download from the commit, not the branch, so every file lands in the same snapshot even if
    // the branch moves meanwhile.
    let pinned = api.repo(Repo::with_revision(
        repo_id.to_string(),
        RepoType::Model,
        commit.clone(),
    ));
    let snapshot = repo_cache_dir(&env.cache_dir, repo_id)
        .join("snapshots")
        .join(&commit);
    let fetch = |file: &str| -> Result<PathBuf, SourceError> {
        let local = snapshot.join(file);
        if local.is_file() {
            return Ok(local);
        }
        pinned
            .download(file)
            .map_err(|source| SourceError::Download {
                repo: repo_id.to_string(),
                revision: revision.to_string(),
                file: file.to_string(),
                source: Box::new(External(source)),
            })
    };

    let repo_files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let plan = plan(&fetch, &repo_files)?;
    for file in &plan.files {
        fetch(file)?;
    }
    for index in &plan.indexes {
        let folder = index.rsplit_once('/').map_or("", |(f, _)| f);
        for shard in files::read_index(&snapshot.join(index))? {
            fetch(&format!("{folder}/{shard}"))?;
        }
    }
    cache
        .repo(Repo::with_revision(
            repo_id.to_string(),
            RepoType::Model,
            revision.to_string(),
        ))
        .create_ref(&commit)
        .map_err(|source| SourceError::Io {
            path: repo_cache_dir(&env.cache_dir, repo_id).join("refs"),
            source,
        })?;
    Ok(commit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_ids_and_revisions() {
        assert_eq!(
            ModelSource::parse("stabilityai/stable-diffusion-xl-base-1.0").unwrap(),
            ModelSource::Hub {
                repo_id: "stabilityai/stable-diffusion-xl-base-1.0".into(),
                revision: None
            }
        );
        assert_eq!(
            ModelSource::parse("org/name@refs/pr/1").unwrap(),
            ModelSource::Hub {
                repo_id: "org/name".into(),
                revision: Some("refs/pr/1".into())
            }
        );
    }

    #[test]
    fn rejects_specs_that_are_neither_folder_nor_repo_id() {
        for spec in [
            "",
            "nope",
            "./missing/folder",
            "a/b/c",
            "org/name@",
            "org/name@../x",
            "-org/name",
            "org/na--me",
        ] {
            let err = ModelSource::parse(spec).unwrap_err();
            assert!(
                matches!(err, SourceError::InvalidSpec { .. }),
                "{spec}: {err}"
            );
        }
    }

    /// A `.safetensors` file is a local model (opened as a single-file checkpoint), a torch
    /// file a checkpoint to convert; a missing file is an invalid spec.
    #[test]
    fn single_files_are_local_models_and_torch_files_are_converted() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(
            ModelSource::parse(file.to_str().unwrap()).unwrap(),
            ModelSource::Local(file.clone())
        );
        let ckpt = dir.path().join("model.ckpt");
        std::fs::write(&ckpt, b"x").unwrap();
        assert_eq!(
            ModelSource::parse(ckpt.to_str().unwrap()).unwrap(),
            ModelSource::Torch(ckpt.clone())
        );
        // Not a torch archive: refused when resolved, naming the file.
        let err = ModelSource::parse(ckpt.to_str().unwrap())
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.is_usage(), "{err}");
        assert!(format!("{:#}", anyhow::Error::new(err)).contains("model.ckpt"));
        let missing = dir.path().join("absent.safetensors");
        assert!(matches!(
            ModelSource::parse(missing.to_str().unwrap()),
            Err(SourceError::InvalidSpec { .. })
        ));
    }

    #[test]
    fn cache_dir_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            HubEnv::from_vars(move |k| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let e = env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")]).unwrap();
        assert_eq!(e.cache_dir, PathBuf::from("/c"));
        let e = env(&[("HF_HOME", "/h"), ("HOME", "/u")]).unwrap();
        assert_eq!(e.cache_dir, PathBuf::from("/h/hub"));
        let e = env(&[("HOME", "/u"), ("HF_TOKEN", "t"), ("HF_HUB_OFFLINE", "Yes")]).unwrap();
        assert_eq!(e.cache_dir, PathBuf::from("/u/.cache/huggingface/hub"));
        assert_eq!(e.token.as_deref(), Some("t"));
        assert!(e.offline);
        let e = env(&[("HOME", "/u"), ("HF_HUB_OFFLINE", "0")]).unwrap();
        assert!(!e.offline);
        assert!(matches!(env(&[]), Err(SourceError::NoCacheDir)));
    }

    #[test]
    fn truthy_values() {
        for v in ["1", "true", "TRUE", "yes", "on"] {
            assert!(is_truthy(v), "{v}");
        }
        for v in ["0", "false", "no", "off", ""] {
            assert!(!is_truthy(v), "{v}");
        }
    }

    #[test]
    fn offline_cache_miss_names_repo_revision_and_cache() {
        let dir = tempfile::tempdir().unwrap();
        let env = HubEnv::offline(dir.path().to_path_buf());
        let src = ModelSource::parse("tiny/absent@v2").unwrap();
        let err = src.resolve_with(&env, None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("tiny/absent@v2"), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        assert!(msg.contains("offline"), "{msg}");
    }

    #[test]
    fn commit_hash_revisions_resolve_without_a_ref() {
        let dir = tempfile::tempdir().unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snap = repo_cache_dir(dir.path(), "o/n")
            .join("snapshots")
            .join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        assert_eq!(
            cached_commit(dir.path(), "o/n", commit).as_deref(),
            Some(commit)
        );
        assert_eq!(cached_commit(dir.path(), "o/n", "main"), None);
    }
}
