//! `sdtrain inspect` on an adapter file: what it adapts and how (kohya's layout, or diffusers'
//! read into it: LoRA, LoCon, LoHa, LoKr, DoRA), the modules per model part, ranks and alphas,
//! the stored dtypes, and what its header records of the training (kohya's `ss_*` keys, as
//! A1111's LoRA card and kohya's `show_metadata.py` show them: base model, steps, resolution,
//! optimizer, the most frequent training tags, the dataset folders, the comment), with A1111's
//! hash of its tensors.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::Device;
use safetensors::SafeTensors;

use crate::adapter::addnet_hash::addnet_hashes;
use crate::adapter::factors::{Algo, DORA_SCALE};
use crate::adapter::kohya_file::{load_kohya, KohyaError, KohyaModule};

/// The model parts, in the order the report lists them.
const PARTS: [&str; 3] = ["unet", "text_encoder", "text_encoder_2"];

/// How many training tags the report lists.
const TOP_TAGS: usize = 12;

/// Whether the safetensors file at `path` holds adapter tensors (kohya's `lora_*`, LyCORIS's
/// `lycoris_*`, or diffusers'/PEFT's `.lora_A`/`.lora_B`/`.lora.down`), by its header only.
pub fn is_adapter_file(path: &Path) -> bool {
    header_tensors(path).is_some_and(|tensors| {
        tensors.keys().any(|k| {
            k.starts_with("lora_")
                || k.starts_with("lycoris_")
                || k.contains(".lora_")
                || k.contains(".lora.")
        })
    })
}

/// The tensors a safetensors file's header lists (name → shape), or `None` when `path` is not
/// one. Only the header is read; for a torch file, only its pickle.
fn header_tensors(path: &Path) -> Option<HashMap<String, Vec<usize>>> {
    if crate::torch_pickle::is_torch_file(path) {
        let file = crate::torch_pickle::TorchTensors::open(path).ok()?;
        return Some(
            file.records()
                .values()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect(),
        );
    }
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: mapped read-only and dropped before returning; only the header pages are touched
    // (a multi-GB checkpoint is not read).
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let (_, meta) = SafeTensors::read_metadata(&map).ok()?;
    Some(
        meta.tensors()
            .into_iter()
            .map(|(k, t)| (k, t.shape.clone()))
            .collect(),
    )
}

/// One part of the model (UNet, a text encoder) and its modules.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PartReport {
    pub modules: usize,
    /// Ranks of the Linear (and 1×1 conv) modules, and of the 3×3 convs: (min, max).
    pub linear_ranks: Option<(usize, usize)>,
    pub conv_ranks: Option<(usize, usize)>,
}

/// What `sdtrain inspect` prints for an adapter file.
#[derive(Debug, Clone)]
pub struct AdapterReport {
    pub path: PathBuf,
    pub bytes: u64,
    /// Elements per stored dtype.
    pub dtypes: BTreeMap<String, u64>,
    pub kind: &'static str,
    /// By part, in this order: `unet`, `text_encoder`, `text_encoder_2` (those it adapts).
    pub parts: Vec<(&'static str, PartReport)>,
    /// (min, max) of the modules' alphas.
    pub alphas: (f32, f32),
    pub metadata: HashMap<String, String>,
    /// A1111's hash of the tensors (the SHA-256 after the header).
    pub model_hash: String,
    /// The textual-inversion embeddings the file bundles, by token.
    pub bundled: Vec<String>,
}

/// Reads the adapter file at `path`.
pub fn inspect_adapter(path: &Path) -> Result<AdapterReport, KohyaError> {
    let file = load_kohya(path, &Device::Cpu)?;
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    // A torch file (a LoRA saved as `.pt`) is described by its safetensors image.
    let bytes = crate::adapter::kohya_file::adapter_bytes(path)?;
    let mut dtypes = BTreeMap::new();
    if let Ok((_, meta)) = SafeTensors::read_metadata(&bytes) {
        for info in meta.tensors().values() {
            let n: u64 = info.shape.iter().map(|&d| d as u64).product();
            *dtypes.entry(format!("{:?}", info.dtype)).or_default() += n;
        }
    }
    let mut parts: BTreeMap<&'static str, PartReport> = BTreeMap::new();
    for m in &file.modules {
        let part = parts.entry(part_of(&m.name)).or_default();
        part.modules += 1;
        let range = match m.is_conv3x3() {
            true => &mut part.conv_ranks,
            false => &mut part.linear_ranks,
        };
        let r = m.rank();
        *range = Some(range.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))));
    }
    let alphas = file
        .modules
        .iter()
        .fold((f32::INFINITY, 0f32), |(lo, hi), m| {
            (lo.min(m.alpha), hi.max(m.alpha))
        });
    let parts = PARTS
        .iter()
        .filter_map(|p| parts.remove(p).map(|r| (*p, r)))
        .collect();
    Ok(AdapterReport {
        path: path.to_path_buf(),
        bytes: size,
        dtypes,
        kind: kind_of(&file.modules),
        parts,
        alphas,
        metadata: file.metadata,
        model_hash: addnet_hashes(&bytes).0,
        bundled: file.bundled_embeddings,
    })
}

/// The model part a module belongs to, by its kohya name.
fn part_of(name: &str) -> &'static str {
    if name.starts_with("lora_te2_") || name.contains("text_encoder_2") {
        "text_encoder_2"
    } else if name.starts_with("lora_te") || name.contains("text_encoder") {
        "text_encoder"
    } else {
        "unet"
    }
}

/// The adapter type its modules' tensors make.
fn kind_of(modules: &[KohyaModule]) -> &'static str {
    let any = |f: &dyn Fn(&KohyaModule) -> bool| modules.iter().any(f);
    if any(&|m| m.get(DORA_SCALE).is_some()) {
        "DoRA"
    } else if any(&|m| m.algo == Algo::Hadamard) {
        "LoHa"
    } else if any(&|m| m.algo == Algo::Kron) {
        "LoKr"
    } else if any(&|m| m.is_conv3x3()) {
        "LoCon"
    } else {
        "LoRA"
    }
}

impl AdapterReport {
    fn meta(&self, key: &str) -> Option<&str> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty() && *v != "None")
    }

    /// The training tags summed over every folder (A1111's `build_tags`), most frequent first
    /// (ties in name order), with counts.
    pub fn top_tags(&self) -> Vec<(String, u64)> {
        let Some(v) = self.meta("ss_tag_frequency") else {
            return Vec::new();
        };
        let Ok(serde_json::Value::Object(dirs)) = serde_json::from_str(v) else {
            return Vec::new();
        };
        let mut tags: Vec<(String, u64)> = Vec::new();
        for counts in dirs.values().filter_map(|d| d.as_object()) {
            for (tag, n) in counts {
                let n = n.as_u64().unwrap_or(0);
                match tags.iter_mut().find(|(t, _)| t == tag.trim()) {
                    Some((_, c)) => *c += n,
                    None => tags.push((tag.trim().to_string(), n)),
                }
            }
        }
        tags.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        tags
    }

    fn fmt_training(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = |k: &str| self.meta(k);
        if let Some(model) = m("ss_sd_model_name") {
            row(f, "trained on", &model)?;
        }
        let mut run = Vec::new();
        if let Some(s) = m("ss_steps") {
            run.push(format!("{s} steps"));
        }
        if let Some(e) = m("ss_epoch") {
            run.push(format!("epoch {e}"));
        }
        if let Some(n) = m("ss_num_train_images") {
            run.push(format!("{n} images per epoch"));
        }
        if let Some(r) = m("ss_resolution") {
            run.push(format!("at {r}"));
        }
        if let Some(b) = m("ss_total_batch_size") {
            run.push(format!("batch {b}"));
        }
        if !run.is_empty() {
            row(f, "training", &run.join(", "))?;
        }
        if let Some(lr) = m("ss_unet_lr").or(m("ss_learning_rate")) {
            let te =
                m("ss_text_encoder_lr").map_or(String::new(), |t| format!(", text encoder {t}"));
            let sched = m("ss_lr_scheduler").map_or(String::new(), |s| format!(", {s}"));
            row(f, "lr", &format!("UNet {lr}{te}{sched}"))?;
        }
        if let Some(o) = m("ss_optimizer") {
            row(f, "optimizer", &o)?;
        }
        if let Some(c) = m("ss_clip_skip") {
            row(f, "clip skip", &c)?;
        }
        if let Some(t) = m("ss_training_started_at").and_then(|t| t.parse::<f64>().ok()) {
            let date = chrono::DateTime::from_timestamp(t.floor() as i64, 0)
                .map(|d| d.format("%Y-%m-%d %H:%M UTC").to_string())
                .unwrap_or_default();
            let took = m("ss_training_finished_at")
                .and_then(|e| e.parse::<f64>().ok())
                .map_or(String::new(), |e| format!(" ({:.0} s)", (e - t).max(0.0)));
            row(f, "started", &format!("{date}{took}"))?;
        }
        let tags = self.top_tags();
        if !tags.is_empty() {
            let shown: Vec<String> = tags
                .iter()
                .take(TOP_TAGS)
                .map(|(t, n)| format!("{t} ({n})"))
                .collect();
            let more = match tags.len() > TOP_TAGS {
                true => format!(", … {} tags in all", tags.len()),
                false => String::new(),
            };
            row(f, "tags", &format!("{}{more}", shown.join(", ")))?;
        }
        if let Some(dirs) = m("ss_dataset_dirs").and_then(|d| serde_json::from_str(d).ok()) {
            let serde_json::Value::Object(dirs) = dirs else {
                return Ok(());
            };
            let list: Vec<String> = dirs
                .iter()
                .map(|(name, d)| format!("{name}: {} images ×{}", d["img_count"], d["n_repeats"]))
                .collect();
            if !list.is_empty() {
                row(f, "folders", &list.join(", "))?;
            }
        }
        if let Some(c) = m("ss_training_comment") {
            row(f, "comment", &c)?;
        }
        Ok(())
    }
}

fn row(f: &mut fmt::Formatter<'_>, label: &str, value: &dyn fmt::Display) -> fmt::Result {
    writeln!(f, "{label:<14} {value}")
}

fn ranks(r: Option<(usize, usize)>) -> Option<String> {
    r.map(|(lo, hi)| match lo == hi {
        true => lo.to_string(),
        false => format!("{lo}–{hi}"),
    })
}

impl fmt::Display for AdapterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        row(f, "adapter file", &self.path.display())?;
        let dtypes: Vec<&str> = self.dtypes.keys().map(String::as_str).collect();
        row(
            f,
            "size",
            &format!(
                "{:.2} MiB, {}",
                self.bytes as f64 / 1048576.0,
                dtypes.join(", ")
            ),
        )?;
        let module = self.meta("ss_network_module").unwrap_or("(not recorded)");
        row(
            f,
            "type",
            &format!("{} (network module {module})", self.kind),
        )?;
        if let Some(base) = self
            .meta("ss_base_model_version")
            .or(self.meta("modelspec.architecture"))
        {
            row(f, "base model", &base)?;
        }
        for (part, p) in &self.parts {
            let mut text = format!("{} modules", p.modules);
            if let Some(r) = ranks(p.linear_ranks) {
                text.push_str(&format!(", rank {r}"));
            }
            if let Some(r) = ranks(p.conv_ranks) {
                text.push_str(&format!(", 3×3 conv rank {r}"));
            }
            row(f, part, &text)?;
        }
        let (lo, hi) = self.alphas;
        if lo.is_finite() {
            let alpha = match lo == hi {
                true => format!("{lo}"),
                false => format!("{lo}–{hi}"),
            };
            row(f, "alpha", &alpha)?;
        }
        if !self.bundled.is_empty() {
            let tokens: Vec<String> = self.bundled.iter().map(|t| format!("`{t}`")).collect();
            row(
                f,
                "embeddings",
                &format!("{} (bundled: `sample --lora` adds them)", tokens.join(", ")),
            )?;
        }
        if !self.metadata.keys().any(|k| k.starts_with("ss_")) {
            row(f, "training", &"not recorded (no kohya `ss_*` metadata)")?;
        }
        self.fmt_training(f)?;
        row(f, "A1111 hash", &self.model_hash)
    }
}

/// Whether the file at `path` is a textual-inversion embedding
/// ([`crate::adapter::embedding_file`]'s layouts): for safetensors by its header only
/// (`emb_params`, `clip_l`/`clip_g`, or one tensor of rank 1 or 2, diffusers' `learned_embeds`);
/// a PyTorch file (A1111's `.pt`, diffusers' `.bin`) when it loads as one.
pub fn is_embedding_file(path: &Path) -> bool {
    use crate::adapter::embedding_file::{is_torch_file, load_embedding};
    if is_torch_file(path) {
        return load_embedding(path, &Device::Cpu).is_ok();
    }
    let Some(tensors) = header_tensors(path) else {
        return false;
    };
    let known = ["emb_params", "clip_l", "clip_g"];
    match tensors.len() {
        0 => false,
        1 => tensors.values().all(|shape| matches!(shape.len(), 1 | 2)),
        _ => tensors.keys().all(|k| known.contains(&k.as_str())),
    }
}

/// What `sdtrain inspect` prints for an embedding file.
#[derive(Debug, Clone)]
pub struct EmbeddingReport {
    pub path: PathBuf,
    pub bytes: u64,
    /// (key, shape, dtype) of each tensor, sorted by key.
    pub tensors: Vec<(String, Vec<usize>, String)>,
    /// The token `sdtrain sample --embedding` would use.
    pub token: String,
    pub vectors: usize,
    pub metadata: HashMap<String, String>,
}

/// Reads the embedding file at `path`.
pub fn inspect_embedding(
    path: &Path,
) -> Result<EmbeddingReport, crate::adapter::embedding_file::EmbeddingFileError> {
    use crate::adapter::embedding_file::{load_embedding, torch_tensors};
    let file = load_embedding(path, &Device::Cpu)?;
    if let Some(tensors) = torch_tensors(path) {
        return Ok(EmbeddingReport {
            path: path.to_path_buf(),
            bytes: std::fs::metadata(path).map_or(0, |m| m.len()),
            tensors,
            token: file.default_token(),
            vectors: file.vectors_per_token(),
            metadata: HashMap::new(),
        });
    }
    let bytes = std::fs::read(path).map_err(|source| KohyaError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|source| KohyaError::Format {
        path: path.to_path_buf(),
        source: crate::error_chain::External(source),
    })?;
    let mut tensors: Vec<(String, Vec<usize>, String)> = header
        .tensors()
        .iter()
        .map(|(k, t)| (k.clone(), t.shape.clone(), format!("{:?}", t.dtype)))
        .collect();
    tensors.sort();
    Ok(EmbeddingReport {
        path: path.to_path_buf(),
        bytes: bytes.len() as u64,
        tensors,
        token: file.default_token(),
        vectors: file.vectors_per_token(),
        metadata: header.metadata().clone().unwrap_or_default(),
    })
}

impl EmbeddingReport {
    /// The model family its widths fit: 768 is SD1's text encoder, 1024 SD2's, 768 + 1280 SDXL's.
    fn family(&self) -> &'static str {
        let width = |k: &str| {
            self.tensors
                .iter()
                .find(|(name, _, _)| name == k)
                .and_then(|(_, s, _)| s.last().copied())
        };
        match (width("clip_l"), width("clip_g")) {
            (Some(_), Some(_)) => "SDXL (clip_l for text_encoder, clip_g for text_encoder_2)",
            (Some(_), None) | (None, Some(_)) => "SDXL, one text encoder's only",
            (None, None) => match self.tensors.first().and_then(|(_, s, _)| s.last()) {
                Some(768) => "SD1 (width 768)",
                Some(1024) => "SD2 (width 1024)",
                _ => "SD1/SD2 layout (one text encoder)",
            },
        }
    }
}

impl fmt::Display for EmbeddingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        row(f, "embedding", &self.path.display())?;
        row(f, "size", &format!("{:.1} KiB", self.bytes as f64 / 1024.0))?;
        row(f, "type", &"textual-inversion embedding")?;
        row(f, "for", &self.family())?;
        row(
            f,
            "token",
            &format!("{} ({} vector(s))", self.token, self.vectors),
        )?;
        for (k, shape, dtype) in &self.tensors {
            row(f, "tensor", &format!("{k} {shape:?} {dtype}"))?;
        }
        let mut keys: Vec<&String> = self.metadata.keys().collect();
        keys.sort();
        for k in keys {
            row(f, "header", &format!("{k} = {}", self.metadata[k]))?;
        }
        Ok(())
    }
}
