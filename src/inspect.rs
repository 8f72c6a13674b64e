//! `sdtrain inspect`: what a model is (family, prediction type, native resolution), how big each
//! component is, and every file sdtrain would load from it.
//!
//! Parameter counts and dtypes come from the safetensors headers only: the files are
//! memory-mapped and only the header pages are touched, so inspecting SDXL reads kilobytes, not
//! gigabytes.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use crate::error_chain::External;
use crate::model::family::FamilyError;
use crate::model::files::{ComponentFiles, ComponentSource};
use crate::model::layout::ModelLayout;
use crate::model::single_file::SingleFile;
use crate::model::single_file::SingleFileOptions;
use crate::model::source::{ModelDir, ModelSource, Origin, SourceError};

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Layout(#[from] FamilyError),
    #[error("cannot open {}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a valid safetensors file{}", path.display(), crate::file_sniff::safetensors_note(path))]
    Header {
        path: PathBuf,
        source: External<safetensors::SafeTensorError>,
    },
}

impl InspectError {
    /// True for errors in what the user asked for (exit code 2); false when reading failed.
    pub fn is_usage(&self) -> bool {
        match self {
            InspectError::Source(e) => e.is_usage(),
            InspectError::Layout(e) => e.is_usage(),
            InspectError::Open { .. } | InspectError::Header { .. } => false,
        }
    }
}

/// What the headers of one or more safetensors files hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorStats {
    pub tensors: usize,
    /// Total element count.
    pub params: u64,
    /// Element count per stored dtype (`F32`, `F16`, `BF16`, …).
    pub dtypes: BTreeMap<String, u64>,
}

impl TensorStats {
    fn add(&mut self, other: &TensorStats) {
        self.tensors += other.tensors;
        self.params += other.params;
        for (d, n) in &other.dtypes {
            *self.dtypes.entry(d.clone()).or_default() += n;
        }
    }

    /// The stored dtypes, e.g. `F32` or `F16+F32`.
    pub fn dtype_summary(&self) -> String {
        if self.dtypes.is_empty() {
            "-".to_string()
        } else {
            self.dtypes.keys().cloned().collect::<Vec<_>>().join("+")
        }
    }
}

/// Reads the header of a safetensors file without reading tensor data.
pub fn read_header(path: &Path) -> Result<TensorStats, InspectError> {
    let open_err = |source| InspectError::Open {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(open_err)?;
    // SAFETY: mapped read-only and dropped before returning; only the header pages are touched
    // (read_metadata checks the data length against the header without reading the data).
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(open_err)?;
    let (_, metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|source| InspectError::Header {
            path: path.to_path_buf(),
            source: External(source),
        })?;
    let mut stats = TensorStats::default();
    for (_, info) in metadata.tensors() {
        let count: u64 = info.shape.iter().map(|&d| d as u64).product();
        stats.tensors += 1;
        stats.params += count;
        *stats.dtypes.entry(info.dtype.to_string()).or_default() += count;
    }
    Ok(stats)
}

/// One component's files and header statistics.
#[derive(Debug, Clone)]
pub struct ComponentReport {
    pub files: ComponentFiles,
    pub stats: TensorStats,
}

/// Everything `sdtrain inspect` prints.
#[derive(Debug, Clone)]
pub struct InspectReport {
    pub source: ModelSource,
    pub dir: ModelDir,
    pub layout: ModelLayout,
    pub components: Vec<ComponentReport>,
}

impl InspectReport {
    pub fn total_params(&self) -> u64 {
        self.components.iter().map(|c| c.stats.params).sum()
    }
}

/// Resolves `source` (reading the hub settings from the environment when it is a repo id) and
/// inspects it.
pub fn inspect(source: &ModelSource, variant: Option<&str>) -> Result<InspectReport, InspectError> {
    inspect_with(source, variant, &SingleFileOptions::default())
}

/// As [`inspect`], opening a single file with `single`.
pub fn inspect_with(
    source: &ModelSource,
    variant: Option<&str>,
    single: &SingleFileOptions,
) -> Result<InspectReport, InspectError> {
    let dir = source.resolve_for(variant)?;
    inspect_dir_with(source.clone(), dir, variant, single)
}

/// Inspects an already resolved model folder.
pub fn inspect_dir(
    source: ModelSource,
    dir: ModelDir,
    variant: Option<&str>,
) -> Result<InspectReport, InspectError> {
    inspect_dir_with(source, dir, variant, &SingleFileOptions::default())
}

/// As [`inspect_dir`], opening a single file with `single`.
pub fn inspect_dir_with(
    source: ModelSource,
    dir: ModelDir,
    variant: Option<&str>,
    single: &SingleFileOptions,
) -> Result<InspectReport, InspectError> {
    let layout = ModelLayout::read_with(&dir.path, variant, single)?;
    let mut components = Vec::new();
    for files in &layout.components {
        let mut stats = TensorStats::default();
        match &files.source {
            ComponentSource::Folder { weights, .. } => {
                for w in weights {
                    stats.add(&read_header(w)?);
                }
            }
            ComponentSource::Packed { .. } => {
                for (shape, dtype) in files.tensor_shapes().map_err(FamilyError::from)?.values() {
                    let count: u64 = shape.iter().map(|&d| d as u64).product();
                    stats.tensors += 1;
                    stats.params += count;
                    *stats.dtypes.entry(dtype.clone()).or_default() += count;
                }
            }
        }
        components.push(ComponentReport {
            files: files.clone(),
            stats,
        });
    }
    Ok(InspectReport {
        source,
        dir,
        layout,
        components,
    })
}

/// `1234567` → `1.23M`.
fn human(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}K", n / 1e3)
    } else {
        format!("{n}")
    }
}

impl fmt::Display for InspectReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layout = &self.layout;
        if let Some(sf) = layout.single_file() {
            return self.fmt_single_file(f, sf);
        }
        match &self.dir.origin {
            Origin::Local => writeln!(f, "model       {} (local folder)", self.source)?,
            Origin::Converted { .. } => writeln!(
                f,
                "model       {} (torch checkpoint, read through its safetensors copy)",
                self.source
            )?,
            Origin::Hub { commit, .. } => writeln!(
                f,
                "model       {} (hub cache, commit {commit})",
                self.source
            )?,
        }
        writeln!(f, "folder      {}", self.dir.path.display())?;
        self.fmt_model(f)?;
        writeln!(f)?;
        writeln!(f, "files it would load (under the folder above):")?;
        for path in layout.all_files() {
            let shown = path.strip_prefix(&self.dir.path).unwrap_or(&path);
            writeln!(f, "  {}", shown.display())?;
        }
        Ok(())
    }
}

impl InspectReport {
    /// Family, prediction, resolution and the component table.
    fn fmt_model(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layout = &self.layout;
        writeln!(f, "family      {}", layout.family)?;
        match layout.single_file() {
            Some(sf) => writeln!(
                f,
                "prediction  {} (from {})",
                layout.prediction_type, sf.prediction_from
            )?,
            None => writeln!(f, "prediction  {}", layout.prediction_type)?,
        }
        writeln!(f, "resolution  {0}x{0}", layout.native_resolution)?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<16}{:>14}  {:>8}  {:>7}  dtype",
            "component", "parameters", "approx", "tensors"
        )?;
        for c in &self.components {
            writeln!(
                f,
                "{:<16}{:>14}  {:>8}  {:>7}  {}",
                c.files.component.folder(),
                c.stats.params,
                human(c.stats.params),
                c.stats.tensors,
                c.stats.dtype_summary()
            )?;
        }
        let total = self.total_params();
        writeln!(f, "{:<16}{:>14}  {:>8}", "total", total, human(total))
    }

    /// A single-file checkpoint: the file, where its configs came from, the model, each
    /// component's config, the tokenizers and the tensors left out.
    fn fmt_single_file(&self, f: &mut fmt::Formatter<'_>, sf: &SingleFile) -> fmt::Result {
        writeln!(f, "model       {} (single-file checkpoint)", self.source)?;
        writeln!(f, "file        {}", sf.path.display())?;
        writeln!(f, "configs     {}", sf.origin)?;
        self.fmt_model(f)?;
        writeln!(f)?;
        writeln!(f, "configs (diffusers):")?;
        for (c, p) in &sf.components {
            writeln!(f, "  {:<15} {}", c.folder(), p.config)?;
        }
        writeln!(f, "  {:<15} {}", "scheduler", sf.scheduler)?;
        for t in &self.layout.tokenizers {
            match (&t.builtin, t.dir()) {
                (Some(b), _) => writeln!(
                    f,
                    "  {:<15} built-in CLIP BPE, {} tokens, pad {:?}, length {}",
                    t.folder, b.vocab_size, b.pad, b.max_length
                )?,
                (None, Some(dir)) => writeln!(f, "  {:<15} {}", t.folder, dir.display())?,
                (None, None) => {}
            }
        }
        if !sf.skipped.is_empty() {
            writeln!(f)?;
            writeln!(f, "left out ({} tensors):", sf.skipped.len())?;
            let mut reasons: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (name, why) in &sf.skipped {
                reasons.entry(why).or_default().push(name);
            }
            for (why, names) in reasons {
                let shown = names.iter().take(3).copied().collect::<Vec<_>>().join(", ");
                let more = names.len().saturating_sub(3);
                let more = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                writeln!(f, "  {why}: {shown}{more}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(999), "999");
        assert_eq!(human(1_234_567), "1.23M");
        assert_eq!(human(2_567_000_000), "2.57B");
    }

    #[test]
    fn truncated_file_is_a_header_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        std::fs::write(&path, [1u8, 2, 3]).unwrap();
        assert!(matches!(
            read_header(&path),
            Err(InspectError::Header { .. })
        ));
    }
}
