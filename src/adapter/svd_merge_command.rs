//! `sdtrain merge-lora` without `--model`: kohya LoRA/LoCon files merged into one
//! ([`super::svd_merge`]), written as kohya's `svd_merge_lora.py` writes it: every module of any
//! file, `alpha` its rank, the minimum `ss_*` header (`ss_network_dim` and `ss_network_alpha` the
//! rank asked for, `ss_network_args` the conv rank, the base model of the first file that names
//! one) with ModelSpec's keys and the `sshs_*` hashes.
//!
//! Only LoRA/LoCon modules under kohya's names are merged; a LoHa, LoKr or DoRA module, or a file
//! in diffusers' layout, is refused with its name (kohya's script skips what it cannot read, and
//! the merged file would silently lack it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::factors::Algo;
use super::kohya_file::{load_kohya, save_kohya, KohyaFile, KohyaTensorSet};
use super::kohya_meta::{KohyaBase, KohyaMetadata};
use super::resize::Factors;
use super::svd_merge::{svd_merge, Part};

/// Merges `loras` (each at its ratio) into `out` at `rank` (`conv_rank` for 3×3 convs).
pub fn run(
    loras: &[PathBuf],
    ratios: &[f64],
    rank: usize,
    conv_rank: Option<usize>,
    out: &Path,
    dtype: DType,
) -> anyhow::Result<()> {
    if rank == 0 || conv_rank == Some(0) {
        bail!("--rank and --conv-rank must be at least 1");
    }
    let conv_rank = conv_rank.unwrap_or(rank);
    let files: Vec<KohyaFile> = loras
        .iter()
        .map(|p| load_kohya(p, &Device::Cpu).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<_>>()?;
    // Each module's factors, scale and file index, from every file that has it, in file order.
    let mut modules: BTreeMap<String, Vec<(Factors, f64, usize)>> = BTreeMap::new();
    let names: Vec<String> = files.iter().map(|f| f.path.display().to_string()).collect();
    for (index, (file, ratio)) in files.iter().zip(ratios).enumerate() {
        for m in &file.modules {
            let what =
                |problem: &str| format!("{}: module `{}` {problem}", file.path.display(), m.name);
            if m.algo != Algo::LowRank || m.get(super::factors::DORA_SCALE).is_some() {
                bail!(
                    "{}",
                    what(
                        "is not a LoRA/LoCon module (LoHa, LoKr and DoRA are not merged into a \
                         LoRA; fold them into a model with --model)"
                    )
                );
            }
            if m.name.contains('.') {
                bail!(
                    "{}",
                    what(
                        "is in diffusers' layout; merge files with kohya's names (lora_unet_…, \
                         lora_te_…), or fold it into a model with --model"
                    )
                );
            }
            let (down, up) = (
                m.down().context("no lora_down")?,
                m.up().context("no lora_up")?,
            );
            let factors = Factors {
                down: flat(down)?,
                down_shape: down.dims().to_vec(),
                up: flat(up)?,
                up_shape: up.dims().to_vec(),
            };
            let scale = ratio * f64::from(m.alpha) / m.rank() as f64;
            modules
                .entry(m.name.clone())
                .or_default()
                .push((factors, scale, index));
        }
    }
    if modules.is_empty() {
        bail!("the files hold no LoRA module to merge");
    }
    let merged: Vec<anyhow::Result<KohyaTensorSet>> = modules
        .par_iter()
        .map(|(name, parts)| {
            let list: Vec<Part<'_>> = parts
                .iter()
                .map(|(f, s, i)| Part {
                    factors: f,
                    scale: *s,
                    source: &names[*i],
                })
                .collect();
            let max = match parts[0].0.is_spatial_conv() {
                true => conv_rank,
                false => rank,
            };
            let merged =
                svd_merge(&list, max).map_err(|p| anyhow::anyhow!("module `{name}`: {p}"))?;
            let f = merged.factors;
            let down = Tensor::from_vec(f.down, f.down_shape, &Device::Cpu)?;
            let up = Tensor::from_vec(f.up, f.up_shape, &Device::Cpu)?;
            Ok(KohyaTensorSet::lora(name, down, up, merged.alpha))
        })
        .collect();
    let sets: Vec<KohyaTensorSet> = merged.into_iter().collect::<anyhow::Result<_>>()?;
    let metadata = metadata(&files, rank, conv_rank, out);
    save_kohya(out, &sets, &metadata, dtype)?;
    eprintln!(
        "merge: {} files into {} ({} modules, rank {rank}, 3×3 conv rank {conv_rank})",
        files.len(),
        out.display(),
        sets.len()
    );
    Ok(())
}

fn flat(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// kohya's `build_minimum_network_metadata` for the merge, with ModelSpec's keys titled by the
/// file's name. The base model is the first file's `ss_base_model_version`, else SDXL when the
/// names are SDXL's (`lora_te2_`, `input_blocks`), else SD1.
fn metadata(files: &[KohyaFile], rank: usize, conv_rank: usize, out: &Path) -> KohyaMetadata {
    let named = files
        .iter()
        .find_map(|f| f.metadata.get("ss_base_model_version"))
        .and_then(|v| KohyaBase::from_ss_name(v));
    let sdxl_names = files
        .iter()
        .flat_map(|f| &f.modules)
        .any(|m| m.name.starts_with("lora_te2_") || m.name.contains("_input_blocks_"));
    let base = named.unwrap_or(match sdxl_names {
        true => KohyaBase::SdxlBase,
        false => KohyaBase::SdV1,
    });
    let title = out
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let mut extra = BTreeMap::new();
    // kohya writes them as `f"{new_rank}"` and `json.dumps` of ints.
    extra.insert("ss_network_alpha".to_string(), rank.to_string());
    extra.insert(
        "ss_network_args".to_string(),
        format!("{{\"conv_dim\": {conv_rank}, \"conv_alpha\": {conv_rank}}}"),
    );
    // ModelSpec's resolution, as kohya's `sai_model_spec` defaults it without one.
    let side = match base {
        KohyaBase::SdV1 | KohyaBase::SdV2 => 512,
        KohyaBase::SdV2V => 768,
        KohyaBase::SdxlBase => 1024,
    };
    let mut meta = KohyaMetadata::tool_written(base, rank, rank as f64, title, (side, side));
    meta.extra = extra;
    meta
}
