//! `sdtrain resize-lora`: a LoRA/LoCon file at a lower rank ([`super::resize`]), with kohya
//! sd-scripts' `networks/resize_lora.py` flags, defaults and file handling:
//! - the modules are found as kohya finds them: a key whose last or second-to-last part is
//!   `lora_down` (kohya), `lora_A` (PEFT, diffusers) or `down` (ControlLoRA, diffusers' old
//!   attention processors), its other half beside it and its alpha at `<module>.alpha`;
//! - every other tensor (LoHa, LoKr, DoRA magnitudes, bundled embeddings) is kept as it is, and
//!   every float tensor is written in `--save-dtype` (kohya's `--save_precision`, float32 unless
//!   given);
//! - the header is kept, with kohya's `ss_training_comment`, `ss_network_dim` and
//!   `ss_network_alpha` updates and fresh `sshs_*` hashes.
//!
//! Alphas: a kohya-format module (`lora_down`) is written with its new alpha, as kohya writes it.
//! A module of another format keeps no alpha of its own (loaders take its rank, a scale of 1), so
//! a scale it had from diffusers' `lora_adapter_metadata` is folded into its `up`, and that
//! entry, which also gives the old ranks, is dropped.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::bail;
use candle_core::{DType, Device};
use clap::Args;
use rayon::prelude::*;
use safetensors::{Dtype as StDtype, SafeTensors};

use super::kohya_file::{decode, encode_values, write_hashed, Encoded};
use super::resize::{resize_module, Factors, RankRule, Resized};
use crate::precision::parse_save_dtype;
use crate::py_json::py_float;

#[derive(Debug, Clone, Args)]
pub struct ResizeArgs {
    /// The LoRA/LoCon file to resize (kohya's `--model`): kohya's format, or diffusers'/PEFT's.
    #[arg(long, value_name = "FILE", alias = "model")]
    pub lora: PathBuf,
    /// The `.safetensors` file to write (kohya's `--save_to`).
    #[arg(long, value_name = "FILE", alias = "save-to")]
    pub out: PathBuf,
    /// The new rank of the Linear and 1×1 conv modules; with `--dynamic-method`, the largest
    /// (kohya's `--new_rank`). A module is never raised above its own rank.
    #[arg(long, alias = "new-rank", default_value_t = 4)]
    pub rank: usize,
    /// The new rank of the 3×3 convs (kohya's `--new_conv_rank`; default: `--rank`).
    #[arg(long, alias = "new-conv-rank")]
    pub conv_rank: Option<usize>,
    /// Pick each module's rank from its singular values (kohya's `--dynamic_method`): `sv_ratio`
    /// keeps those above the largest / PARAM, `sv_fro` a PARAM fraction of the Frobenius norm,
    /// `sv_cumulative` a PARAM fraction of their sum.
    #[arg(long, value_parser = ["sv_ratio", "sv_fro", "sv_cumulative"])]
    pub dynamic_method: Option<String>,
    /// The dynamic method's target (kohya's `--dynamic_param`).
    #[arg(long)]
    pub dynamic_param: Option<f64>,
    /// `fp32` (kohya's default `float`), `fp16` or `bf16`: the dtype of every float tensor
    /// written (kohya's `--save_precision`).
    #[arg(long, alias = "save-precision", default_value = "fp32", value_parser = parse_save_dtype)]
    pub save_dtype: DType,
    /// Print each module's new rank and how much of it is kept (kohya's `--verbose`).
    #[arg(long)]
    pub verbose: bool,
}

/// The formats kohya's script knows, as (down, up) key parts.
const FORMATS: [(&str, &str); 3] = [
    ("lora_down", "lora_up"),
    ("lora_A", "lora_B"),
    ("down", "up"),
];

/// One LoRA module's keys in the file.
#[derive(Debug, Clone, PartialEq)]
struct ModuleKeys {
    /// The key without its `lora_down(.weight)` part.
    block: String,
    /// The module as loaders name it: `block`, except in diffusers' `lora.down` and
    /// `lora_linear_layer.down` layouts (`unet.….to_q.lora.down.weight` adapts `unet.….to_q`),
    /// whose alpha is `<module>.alpha` ([`super::diffusers_keys::diffusers_key`]).
    module: String,
    down: String,
    up: String,
    /// Whether it is kohya's `lora_down`/`lora_up` format.
    kohya: bool,
    /// The stored rank (set once the pair is checked).
    rank: usize,
}

/// kohya's search (`resize_lora_model`): a key whose last part, or the one before a last
/// `weight`-like part, is a format's down name.
fn module_keys(key: &str) -> Option<ModuleKeys> {
    let parts: Vec<&str> = key.split('.').collect();
    let n = parts.len();
    for (i, (down, up)) in FORMATS.iter().enumerate() {
        let (block, tail) = if n >= 2 && parts[n - 2] == *down {
            (parts[..n - 2].join("."), format!(".{}", parts[n - 1]))
        } else if n >= 1 && parts[n - 1] == *down {
            (parts[..n - 1].join("."), String::new())
        } else {
            continue;
        };
        let module = super::diffusers_keys::diffusers_key(key)
            .map_or_else(|| block.clone(), |(module, _)| module);
        return Some(ModuleKeys {
            up: format!("{block}.{up}{tail}"),
            down: key.to_string(),
            module,
            block,
            kohya: i == 0,
            rank: 0,
        });
    }
    None
}

/// Runs the command; returns the file written.
pub fn run(args: &ResizeArgs) -> anyhow::Result<PathBuf> {
    let rule = check(args)?;
    let conv_rank = args.conv_rank.unwrap_or(args.rank);
    let path = &args.lora;
    // A LoRA saved by `torch.save` (kohya's `save_model_as = "pt"`): its safetensors image.
    let bytes = super::kohya_file::adapter_bytes(path)?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is not a safetensors file: {e}", path.display()))?;
    let mut metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is not a safetensors file: {e}", path.display()))?;
    let views: BTreeMap<String, safetensors::tensor::TensorView<'_>> =
        st.tensors().into_iter().collect();
    let modules = find_modules(path, &views)?;
    let alphas = module_alphas(path, &views, &metadata, &modules)?;
    let started = std::time::Instant::now();
    let resized: Vec<anyhow::Result<Resized>> = modules
        .par_iter()
        .map(|m| {
            let factors = read_factors(path, &views, m)?;
            let (alpha, fold) = alphas[&m.block];
            let max = match factors.is_spatial_conv() {
                true => conv_rank,
                false => args.rank,
            };
            Ok(resize_module(&factors, alpha, rule, max, fold))
        })
        .collect();
    let resized: Vec<Resized> = resized.into_iter().collect::<anyhow::Result<_>>()?;
    report(args, &modules, &resized, rule);
    let mut tensors: Vec<(String, Encoded)> = Vec::with_capacity(views.len());
    let mut replaced: std::collections::HashSet<&str> = Default::default();
    for (m, r) in modules.iter().zip(&resized) {
        let f = &r.factors;
        tensors.push((
            m.down.clone(),
            encode_values(&f.down, f.down_shape.clone(), args.save_dtype)?,
        ));
        tensors.push((
            m.up.clone(),
            encode_values(&f.up, f.up_shape.clone(), args.save_dtype)?,
        ));
        let alpha_key = format!("{}.alpha", m.module);
        if m.kohya || views.contains_key(&alpha_key) {
            tensors.push((
                alpha_key.clone(),
                encode_values(&[r.alpha], Vec::new(), args.save_dtype)?,
            ));
        }
        replaced.extend([m.down.as_str(), m.up.as_str()]);
        replaced.insert(
            views
                .get_key_value(&alpha_key)
                .map_or("", |(k, _)| k.as_str()),
        );
    }
    for (key, view) in &views {
        if !replaced.contains(key.as_str()) {
            tensors.push((key.clone(), keep(path, key, view, args.save_dtype)?));
        }
    }
    update_metadata(&mut metadata, args, rule, &modules, &resized);
    write_hashed(&args.out, &tensors, metadata)?;
    eprintln!(
        "wrote {} ({} modules resized in {:.1} s)",
        args.out.display(),
        modules.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(args.out.clone())
}

fn check(args: &ResizeArgs) -> anyhow::Result<RankRule> {
    if args.rank == 0 || args.conv_rank == Some(0) {
        bail!("--rank and --conv-rank must be at least 1");
    }
    if args.out.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        bail!(
            "--out {}: the file written is a .safetensors file; name it so",
            args.out.display()
        );
    }
    let param = |ok: fn(f64) -> bool, range: &str| -> anyhow::Result<f64> {
        match args.dynamic_param {
            None => bail!("--dynamic-method needs --dynamic-param (its target, {range})"),
            Some(p) if !ok(p) => bail!("--dynamic-param {p}: must be {range}"),
            Some(p) => Ok(p),
        }
    };
    Ok(match args.dynamic_method.as_deref() {
        None if args.dynamic_param.is_some() => {
            bail!("--dynamic-param needs --dynamic-method (sv_ratio, sv_fro or sv_cumulative)")
        }
        None => RankRule::Fixed,
        Some("sv_ratio") => RankRule::SvRatio(param(|p| p.is_finite() && p >= 1.0, "1 or more")?),
        Some("sv_fro") => RankRule::SvFro(param(|p| p > 0.0 && p <= 1.0, "in (0, 1]")?),
        Some("sv_cumulative") => {
            RankRule::SvCumulative(param(|p| p > 0.0 && p <= 1.0, "in (0, 1]")?)
        }
        Some(other) => bail!("--dynamic-method {other}: sv_ratio, sv_fro or sv_cumulative"),
    })
}

/// The file's LoRA modules, in key order; a down half without its up half, or a pair that is not
/// a LoRA pair, is an error naming the keys.
fn find_modules(
    path: &Path,
    views: &BTreeMap<String, safetensors::tensor::TensorView<'_>>,
) -> anyhow::Result<Vec<ModuleKeys>> {
    let mut modules = Vec::new();
    for key in views.keys() {
        let Some(mut m) = module_keys(key) else {
            continue;
        };
        let Some(up) = views.get(&m.up) else {
            bail!(
                "{}: `{}` has no `{}` beside it",
                path.display(),
                m.down,
                m.up
            );
        };
        let (d, u) = (views[key].shape(), up.shape());
        let pair = match (d, u) {
            ([r, _], [_, r2]) => r == r2,
            ([r, _, _, _], [_, r2, 1, 1]) => r == r2,
            _ => false,
        };
        if d.contains(&0) || u.contains(&0) {
            bail!(
                "{}: `{}` {d:?} / `{}` {u:?}: a LoRA pair has no empty dimension",
                path.display(),
                m.down,
                m.up
            );
        }
        let mid = format!("{}.lora_mid.weight", m.block);
        if views.contains_key(&mid) {
            bail!(
                "{}: module `{}` is a LyCORIS Tucker LoCon (`{mid}`), whose product is not \
                 up·down; it is not resized",
                path.display(),
                m.block
            );
        }
        if !pair {
            bail!(
                "{}: `{}` {d:?} and `{}` {u:?} are not a LoRA pair (want down [r, in] / up \
                 [out, r], or down [r, in, kh, kw] / up [out, r, 1, 1])",
                path.display(),
                m.down,
                m.up
            );
        }
        m.rank = d[0];
        modules.push(m);
    }
    if modules.is_empty() {
        bail!(
            "{}: no LoRA/LoCon module to resize (no `lora_down`/`lora_up`, `lora_A`/`lora_B` or \
             `down`/`up` pair; LoHa and LoKr files are not resized)",
            path.display()
        );
    }
    Ok(modules)
}

/// Each module's alpha and the factor folded into its new `up`: the `.alpha` tensor's value, or
/// the one diffusers' `lora_adapter_metadata` gives (folded, as a module without `.alpha` is
/// read at a scale of 1), else the rank (kohya's scale 1).
fn module_alphas(
    path: &Path,
    views: &BTreeMap<String, safetensors::tensor::TensorView<'_>>,
    metadata: &HashMap<String, String>,
    modules: &[ModuleKeys],
) -> anyhow::Result<HashMap<String, (f32, f64)>> {
    let ranks: Vec<(&str, usize)> = modules
        .iter()
        .filter(|m| !views.contains_key(&format!("{}.alpha", m.module)))
        .map(|m| (m.module.as_str(), views[&m.down].shape()[0]))
        .collect();
    let from_metadata = super::diffusers_keys::metadata_alphas(metadata, &ranks)
        .map_err(|problem| anyhow::anyhow!("{}: {problem}", path.display()))?;
    let mut out = HashMap::new();
    for m in modules {
        let rank = views[&m.down].shape()[0] as f32;
        let key = format!("{}.alpha", m.module);
        let entry = match views.get(&key) {
            Some(view) => {
                let t = decode(path, &key, view, &Device::Cpu)?;
                let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
                match v[..] {
                    [a] if a.is_finite() => (a, 1.0),
                    _ => bail!(
                        "{}: `{key}` must be one finite number, got {v:?}",
                        path.display()
                    ),
                }
            }
            None => match from_metadata.get(&m.module) {
                Some(&a) => (rank, f64::from(a) / f64::from(rank)),
                None => (rank, 1.0),
            },
        };
        out.insert(m.block.clone(), entry);
    }
    Ok(out)
}

fn read_factors(
    path: &Path,
    views: &BTreeMap<String, safetensors::tensor::TensorView<'_>>,
    m: &ModuleKeys,
) -> anyhow::Result<Factors> {
    let read = |key: &str| -> anyhow::Result<(Vec<f32>, Vec<usize>)> {
        let view = &views[key];
        let t = decode(path, key, view, &Device::Cpu)?;
        let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
        if v.iter().any(|x| !x.is_finite()) {
            bail!("{}: `{key}` holds NaN or infinite values", path.display());
        }
        Ok((v, view.shape().to_vec()))
    };
    let (down, down_shape) = read(&m.down)?;
    let (up, up_shape) = read(&m.up)?;
    Ok(Factors {
        down,
        down_shape,
        up,
        up_shape,
    })
}

/// A tensor the resize does not change: a float one in `dtype` (as kohya casts every float
/// tensor), any other as it is.
fn keep(
    path: &Path,
    key: &str,
    view: &safetensors::tensor::TensorView<'_>,
    dtype: DType,
) -> anyhow::Result<Encoded> {
    match view.dtype() {
        StDtype::F16 | StDtype::BF16 | StDtype::F32 | StDtype::F64 => {
            let t = decode(path, key, view, &Device::Cpu)?;
            Ok(encode_values(
                &t.flatten_all()?.to_vec1()?,
                view.shape().to_vec(),
                dtype,
            )?)
        }
        other => Ok(Encoded::raw(
            other,
            view.shape().to_vec(),
            view.data().to_vec(),
        )),
    }
}

/// kohya's header updates, plus dropping diffusers' `lora_adapter_metadata` (its ranks are the
/// old ones) where a module of another format was resized.
fn update_metadata(
    metadata: &mut HashMap<String, String>,
    args: &ResizeArgs,
    rule: RankRule,
    modules: &[ModuleKeys],
    resized: &[Resized],
) {
    let comment = metadata
        .get("ss_training_comment")
        .cloned()
        .unwrap_or_default();
    let old_rank = modules.iter().map(|m| m.rank).max().unwrap_or(0);
    match rule.method() {
        None => {
            let conv_rank = args.conv_rank.unwrap_or(args.rank);
            let conv = match conv_rank == args.rank {
                true => String::new(),
                false => format!(" (conv: {conv_rank})"),
            };
            let (dim, alpha) = file_dim_and_alpha(resized);
            metadata.insert(
                "ss_training_comment".into(),
                format!(
                    "dimension is resized from {old_rank} to {}{conv}; {comment}",
                    args.rank
                ),
            );
            metadata.insert("ss_network_dim".into(), dim.to_string());
            metadata.insert("ss_network_alpha".into(), py_float(f64::from(alpha)));
        }
        Some((method, param)) => {
            metadata.insert(
                "ss_training_comment".into(),
                format!(
                    "Dynamic resize with {method}: {} from {old_rank}; {comment}",
                    py_float(param)
                ),
            );
            metadata.insert("ss_network_dim".into(), "Dynamic".into());
            metadata.insert("ss_network_alpha".into(), "Dynamic".into());
        }
    }
    if modules.iter().any(|m| !m.kohya) && metadata.remove("lora_adapter_metadata").is_some() {
        eprintln!(
            "resize: dropped the header's `lora_adapter_metadata` (it gives the old ranks); \
             loaders read the new ranks from the tensors, at a scale of 1 where a module has no \
             alpha"
        );
    }
}

/// `ss_network_dim` and `ss_network_alpha` after a fixed resize: the largest new rank of the
/// Linear and 1×1 modules (of the 3×3 convs in a file of convs alone), and the alpha most of the
/// modules at that rank share (the first in key order on a tie). kohya writes the rank asked for
/// and the last module's alpha; for a file of one alpha and rank they agree.
fn file_dim_and_alpha(resized: &[Resized]) -> (usize, f32) {
    let linear: Vec<&Resized> = resized
        .iter()
        .filter(|r| !r.factors.is_spatial_conv())
        .collect();
    let pool: Vec<&Resized> = match linear.is_empty() {
        true => resized.iter().collect(),
        false => linear,
    };
    let dim = pool.iter().map(|r| r.factors.rank()).max().unwrap_or(0);
    let at_dim: Vec<f32> = pool
        .iter()
        .filter(|r| r.factors.rank() == dim)
        .map(|r| r.alpha)
        .collect();
    let mut best = (0, 0.0);
    for a in &at_dim {
        let count = at_dim.iter().filter(|b| *b == a).count();
        if count > best.0 {
            best = (count, *a);
        }
    }
    (dim, best.1)
}

/// What the resize kept: each module with `--verbose` (kohya's lines), and a summary.
fn report(args: &ResizeArgs, modules: &[ModuleKeys], resized: &[Resized], rule: RankRule) {
    let pct = |x: f64| match x.is_finite() {
        true => format!("{:.1}%", 100.0 * x),
        false => "-".to_string(),
    };
    if args.verbose {
        for (m, r) in modules.iter().zip(resized) {
            let mut line = format!(
                "{:75} | sum(S) retained: {}, fro retained: {}, max(S) ratio: {:.1}",
                m.block,
                pct(r.sum_retained),
                pct(r.fro_retained),
                r.max_ratio
            );
            if rule.method().is_some() {
                line += &format!(
                    ", dynamic | dim: {}, alpha: {}",
                    r.factors.rank(),
                    py_float(f64::from(r.alpha))
                );
            }
            eprintln!("{line}");
        }
    }
    let fro: Vec<f64> = resized
        .iter()
        .map(|r| r.fro_retained)
        .filter(|x| x.is_finite())
        .collect();
    let mean = match fro.is_empty() {
        true => f64::NAN,
        false => fro.iter().sum::<f64>() / fro.len() as f64,
    };
    let std =
        (fro.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / fro.len().max(1) as f64).sqrt();
    let (old_lo, old_hi) = span(modules.iter().map(|m| m.rank));
    let (new_lo, new_hi) = span(resized.iter().map(|r| r.factors.rank()));
    eprintln!(
        "resize: {} modules, rank {} → {}; average Frobenius norm retention {} (std {})",
        modules.len(),
        range_text(old_lo, old_hi),
        range_text(new_lo, new_hi),
        pct(mean),
        match std.is_finite() {
            true => format!("{std:.3}"),
            false => "-".to_string(),
        }
    );
}

fn span(ranks: impl Iterator<Item = usize>) -> (usize, usize) {
    ranks.fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r), hi.max(r)))
}

fn range_text(lo: usize, hi: usize) -> String {
    match lo == hi {
        true => lo.to_string(),
        false => format!("{lo}–{hi}"),
    }
}
