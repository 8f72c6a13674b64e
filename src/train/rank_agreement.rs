//! What the ranks of a multi-process run must agree on before they train. Each process reads
//! its own train.json and its own copy of the data, and nothing in the gradient sum would notice
//! if they differed: a rank with another learning rate, another dataset or its own random seed
//! (`seed: -1`) trains something else and its gradients are summed all the same. So before
//! training:
//!
//! - **The seed:** a plan that draws its seed (`-1`) takes rank 0's draw on every rank, so the
//!   data order and the noise are one run's.
//! - **The plan:** every setting is compared with rank 0's, except those that name files or
//!   devices (a path, a hub id, `gpuid`, `devices`, `vram_limit_gb`, the `--set` list), which are
//!   each machine's own, and those only rank 0 reads (the run's name, how often it logs). A
//!   difference ends the run on every rank, naming the settings.
//! - **The data:** every image's path under `data_root`, caption, size, repeat count and own
//!   settings are compared with rank 0's (a hash each); a difference ends the run naming the
//!   first image that differs.
//! - **The files it starts from:** each model component's weight files, the adapter file
//!   `init_from` and a resumed run's save point, sampled ([`file_sample`]); another model,
//!   another revision of it, another init_from or another save point ends the run naming it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::TrainPlan;
use crate::data::ImageMeta;
use crate::dist::Collective;
use crate::model::files::ComponentSource;
use crate::model::layout::ModelLayout;

/// Settings that are each machine's own, or that only rank 0 reads (how it names and logs the
/// run), by their dotted name in plan.json.
const LOCAL_KEYS: [&str; 9] = [
    "train_config",
    "overrides",
    "gpuid",
    "devices",
    "vram_limit_gb",
    "project_name",
    "run_name",
    "log_step",
    "tensorboard",
];

/// The most differences an error lists.
const SHOWN: usize = 4;

/// `plan` as every rank will train it: rank 0's seed when the plan draws its own, and an error
/// when another rank's settings differ from rank 0's. Every rank calls it at the same point.
pub fn agree_plan(plan: &TrainPlan, coll: &mut dyn Collective) -> anyhow::Result<TrainPlan> {
    let mine = serde_json::to_vec(plan).context("the plan as JSON")?;
    let all = coll.all_gather("plan", &mine)?;
    let values = all
        .iter()
        .enumerate()
        .map(|(r, bytes)| {
            serde_json::from_slice::<Value>(bytes).with_context(|| format!("rank {r}'s plan"))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let Some((lead, others)) = values.split_first() else {
        return Ok(plan.clone());
    };
    let draws = |v: &Value| v.get("random_seed") == Some(&Value::Bool(true));
    let lead_seed = lead.get("seed").and_then(Value::as_u64);
    let mut plan = plan.clone();
    if let (true, true, Some(seed)) = (draws(lead), plan.random_seed, lead_seed) {
        plan.seed = seed;
    }
    let rank = coll.rank();
    for (r, other) in others.iter().enumerate().map(|(k, v)| (k + 1, v)) {
        let mut other = other.clone();
        if draws(lead) && draws(&other) {
            if let (Some(o), Some(seed)) = (other.as_object_mut(), lead_seed) {
                o.insert("seed".into(), seed.into());
            }
        }
        let diffs = differences(lead, &other);
        if diffs.is_empty() {
            continue;
        }
        let shown: Vec<&str> = diffs.iter().take(SHOWN).map(String::as_str).collect();
        let more = match diffs.len().saturating_sub(SHOWN) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        let who = whose(r, rank);
        bail!(
            "{who} train.json differs from rank 0's: {}{more}. Every rank must train the same \
             settings (paths and devices may differ)",
            shown.join("; ")
        );
    }
    Ok(plan)
}

/// How this rank's errors name rank `r`'s copy: "this rank's" or "rank r's".
fn whose(r: usize, rank: usize) -> String {
    if r == rank {
        "this rank's".to_string()
    } else {
        format!("rank {r}'s")
    }
}

/// The settings that differ between `lead` (rank 0's) and `other`, as `key: value on rank 0,
/// value here` in dotted names, leaving out the machine's own settings.
fn differences(lead: &Value, other: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk("", lead, other, &mut out);
    out
}

fn walk(key: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    if LOCAL_KEYS.contains(&key) || names_a_file(a) || names_a_file(b) {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let name = if key.is_empty() {
                    k.clone()
                } else {
                    format!("{key}.{k}")
                };
                let get = |m: &serde_json::Map<String, Value>| m.get(k).cloned();
                let (a, b) = (get(x).unwrap_or(Value::Null), get(y).unwrap_or(Value::Null));
                walk(&name, &a, &b, out);
            }
        }
        _ if a != b => out.push(format!("{key} is {b} here, {a} on rank 0")),
        _ => {}
    }
}

/// A string that names a file, a folder or a hub repo: it holds a path separator.
fn names_a_file(v: &Value) -> bool {
    matches!(v, Value::String(s) if s.contains('/') || s.contains('\\'))
}

/// One image as the ranks compare it: its path under its folder (the first of `roots`,
/// data_root then reg_data_root, that holds it), caption, size, repeat count and own settings.
fn item_hash(item: &ImageMeta, roots: &[&Path]) -> [u8; 8] {
    // Below its folder (data_root, or reg_data_root for a regularization image), so machines
    // that mount the data at other places agree.
    let rel = roots
        .iter()
        .find_map(|r| item.path.strip_prefix(r).ok())
        .unwrap_or(&item.path);
    let mut h = Sha256::new();
    for part in [
        rel.to_string_lossy().replace('\\', "/"),
        item.caption.clone(),
        format!("{:?} {} {:?}", item.size, item.multiplier, item.options),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let d = h.finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    out
}

/// Ends the run on every rank when a rank's training images differ from rank 0's, naming the
/// first that differs. Every rank calls it at the same point.
pub fn check_same_data(
    coll: &mut dyn Collective,
    items: &[ImageMeta],
    roots: &[&Path],
) -> anyhow::Result<()> {
    let mine: Vec<u8> = items.iter().flat_map(|i| item_hash(i, roots)).collect();
    let all = coll.all_gather("dataset", &mine)?;
    let Some(lead) = all.first() else {
        return Ok(());
    };
    let rank = coll.rank();
    for (r, other) in all.iter().enumerate().skip(1) {
        if other == lead {
            continue;
        }
        let (n_lead, n_other) = (lead.len() / 8, other.len() / 8);
        let first = (0..n_lead.min(n_other))
            .find(|&k| lead[8 * k..8 * k + 8] != other[8 * k..8 * k + 8])
            .unwrap_or(n_lead.min(n_other));
        let who = whose(r, rank);
        let place = match (r == rank).then(|| items.get(first)).flatten() {
            Some(item) => format!(
                "{} (its path, caption, size, repeats or settings)",
                item.path.display()
            ),
            None if r == 0 || rank == 0 => match items.get(first) {
                Some(item) => format!("rank 0's {}", item.path.display()),
                None => "past rank 0's last image".to_string(),
            },
            None => format!("image {first} in path order"),
        };
        bail!(
            "{who} training images differ from rank 0's: {n_other} images against {n_lead}, the \
             first difference at {place}. Every rank must see the same data under data_root"
        );
    }
    Ok(())
}

/// Blocks sampled from each file ([`file_sample`]).
const SAMPLES: u64 = 64;
/// Bytes per sampled block.
const BLOCK: u64 = 4096;

/// A sample of `path`'s content into `h`: its length and [`SAMPLES`] blocks of [`BLOCK`] bytes
/// spread evenly over it, the first at the start (a safetensors header: names, dtypes, shapes).
/// Two fine-tunes of one model differ in nearly every block, so a few hundred KiB tell them
/// apart without reading gigabytes.
fn file_sample(h: &mut Sha256, path: &Path) -> anyhow::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let read = || format!("cannot read {}", path.display());
    let mut f = std::fs::File::open(path).with_context(read)?;
    let len = f.metadata().with_context(read)?.len();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; BLOCK as usize];
    let last = len.saturating_sub(BLOCK);
    for k in 0..SAMPLES {
        let at = last * k / (SAMPLES - 1);
        f.seek(SeekFrom::Start(at)).with_context(read)?;
        let n = usize::try_from(BLOCK.min(len - at)).unwrap_or(0);
        f.read_exact(&mut buf[..n]).with_context(read)?;
        h.update(&buf[..n]);
    }
    Ok(())
}

/// Every file under `dir`, in path order.
fn files_under(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries =
            std::fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))?;
        for e in entries {
            let path = e
                .with_context(|| format!("cannot list {}", d.display()))?
                .path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What the ranks compare of the files they start from, as `(what, file, hash)`:
/// - each model component's weight files (sampled, [`file_sample`]; configs are left out, their
///   shapes are in the weights' headers);
/// - the adapter file `init_from`;
/// - the save point a resumed run starts from: every file in it, by its path inside the save
///   point (a machine whose copy is older, or whose run folder ends at another save point, has
///   other files).
pub fn start_files(
    layout: &ModelLayout,
    init_from: Option<&Path>,
    save_point: Option<&Path>,
) -> anyhow::Result<Vec<(String, PathBuf, [u8; 8])>> {
    let mut out = Vec::new();
    let mut add = |what: String, files: &[PathBuf]| -> anyhow::Result<()> {
        let mut h = Sha256::new();
        for f in files {
            if let Some(dir) = save_point.filter(|d| f.starts_with(d)) {
                let rel = f.strip_prefix(dir).unwrap_or(f).to_string_lossy();
                h.update(rel.as_bytes());
            }
            file_sample(&mut h, f)?;
        }
        let mut hash = [0u8; 8];
        hash.copy_from_slice(&h.finalize()[..8]);
        let first = files.first().cloned().unwrap_or_default();
        out.push((what, first, hash));
        Ok(())
    };
    for c in &layout.components {
        let files = match &c.source {
            ComponentSource::Folder { weights, .. } => weights.clone(),
            ComponentSource::Packed { file, .. } => vec![file.clone()],
        };
        add(format!("{} weights", c.component), &files)?;
    }
    if let Some(p) = init_from {
        add("adapter.init_from file".into(), &[p.to_path_buf()])?;
    }
    if let Some(dir) = save_point {
        let name = dir
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        add(format!("save point {name}"), &files_under(dir)?)?;
    }
    Ok(out)
}

/// Ends the run on every rank when a rank starts from other files than rank 0 (another model,
/// another revision, another init_from), naming the first that differs. Every rank calls it at
/// the same point.
pub fn check_same_files(
    coll: &mut dyn Collective,
    files: &[(String, PathBuf, [u8; 8])],
) -> anyhow::Result<()> {
    let mine: Vec<u8> = files
        .iter()
        .flat_map(|(what, _, hash)| {
            let mut b = (what.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(what.as_bytes());
            b.extend_from_slice(hash);
            b
        })
        .collect();
    let all = coll.all_gather("start files", &mine)?;
    let Some(lead) = all.first() else {
        return Ok(());
    };
    let rank = coll.rank();
    let Some(r) = all.iter().position(|other| other != lead) else {
        return Ok(());
    };
    if rank == 0 {
        bail!(
            "rank {r} starts from other model or adapter files than rank 0 (see its error). \
             Every rank must load the same files"
        );
    }
    if r != rank && all[rank] == *lead {
        bail!("rank {r} starts from other model or adapter files than rank 0 (see its error)");
    }
    // This rank differs: name the first entry that is not rank 0's.
    let lead_entries = entries(lead);
    let differs = files
        .iter()
        .find(|(what, _, hash)| !lead_entries.contains(&(what.clone(), *hash)));
    let what = match differs {
        Some((what, path, _)) => format!("its {what} ({})", path.display()),
        None => format!(
            "{} files against rank 0's {}",
            files.len(),
            lead_entries.len()
        ),
    };
    bail!(
        "this rank starts from other files than rank 0: {what} differ from rank 0's. Every rank \
         must load the same model, adapter and save point files (compare `model`, \
         `adapter.init_from` and `resume_ckpt` on each machine)"
    )
}

/// The `(what, hash)` entries of a rank's [`check_same_files`] message.
fn entries(mut b: &[u8]) -> Vec<(String, [u8; 8])> {
    let mut out = Vec::new();
    while b.len() >= 8 {
        let n = u64::from_le_bytes(b[..8].try_into().unwrap_or_default()) as usize;
        let Some(rest) = b.get(8..8 + n + 8) else {
            break;
        };
        let what = String::from_utf8_lossy(&rest[..n]).into_owned();
        let mut hash = [0u8; 8];
        hash.copy_from_slice(&rest[n..]);
        out.push((what, hash));
        b = &b[8 + n + 8..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn differences_name_the_settings_and_leave_out_files_and_devices() {
        let lead = json!({
            "lr": 1e-6, "gpuid": 0, "model": "/a/model", "devices": ["cuda:0"],
            "optimizer": {"unet": {"lr": 1e-6, "betas": [0.9, 0.999]}},
            "data": {"data_root": "/mnt/a", "flip_p": 0.0},
            "hub": "org/name", "overrides": ["lr=1"],
        });
        let other = json!({
            "lr": 2e-6, "gpuid": 3, "model": "/b/model", "devices": ["cuda:1"],
            "optimizer": {"unet": {"lr": 1e-6, "betas": [0.9, 0.99]}},
            "data": {"data_root": "/data/b", "flip_p": 0.5},
            "hub": "org/other", "overrides": [],
        });
        assert_eq!(
            differences(&lead, &other),
            vec![
                "data.flip_p is 0.5 here, 0.0 on rank 0",
                "lr is 2e-6 here, 1e-6 on rank 0",
                "optimizer.unet.betas is [0.9,0.99] here, [0.9,0.999] on rank 0",
            ]
        );
        assert!(differences(&lead, &lead).is_empty());
    }
}
