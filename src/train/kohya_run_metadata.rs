//! The training metadata kohya sd-scripts writes into a network file (`train_network.py`'s
//! `metadata`, in its single-dataset form), built once per run from the plan and the dataset so
//! that every adapter file sdtrain saves carries it. A1111's LoRA cards read it (the trained
//! tags from `ss_tag_frequency`, the dataset size from `ss_dataset_dirs`, the resolutions from
//! `ss_bucket_info`, the base model and clip skip), as do Civitai's upload form and kohya's own
//! tools.
//!
//! Values are written as kohya writes them, `str()` of the Python value: `True`/`False`, `None`
//! for a setting that is off where kohya's default is `None`, floats as Python prints them, and
//! JSON (`json.dumps`) for the dataset's dictionaries. Each key maps sdtrain's nearest setting
//! (EveryDream2's `zero_frequency_noise_ratio` is kohya's `noise_offset`; `cond_dropout`
//! is `caption_dropout_rate`; `clip_skip` means what kohya's does, `None` when 0).
//!
//! The separate VAE's keys (`ss_vae_name`, and for a file its hashes) are written when `vae`
//! replaces the model's, as kohya writes them for `--vae`.
//!
//! The validation split is `ss_validation_split` (the held-out fraction, `0.0` without one) and
//! `ss_validation_seed` (`None` when the run's seed draws it).
//!
//! Left out, each with its reason ([`OMITTED`]): sd-scripts' own commit, its `lowram`
//! switch, kohya's validation schedule and resize filter, which it names its own
//! way, `random_crop` (EveryDream2's crop jitter is another rule), and `ss_datasets`, which
//! kohya writes instead of the single-dataset keys for a `dataset_config`, as sdtrain does then
//! ([`super::kohya_datasets_metadata`]).
//!
//! `adapter.no_metadata` (kohya's `--no_metadata`) keeps only what loaders need.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::{CacheLatents, OptimizerKind, ParamGroupPlan, TrainPlan};
use crate::data::bucket::Bucket;
use crate::data::dataset::ImageMeta;
use crate::data::regularization::RegularizationSummary;
use crate::diffusion::loss::{HuberSchedule, HuberScheduleKind, LossType};
use crate::precision::Amp;
use crate::py_json::{py_bool, py_float, PyValue};

/// kohya's keys (`tests/fixtures/reference/kohya_metadata.json`) that sdtrain does not write.
pub const OMITTED: &[(&str, &str)] = &[
    ("ss_sd_scripts_commit_hash", "sd-scripts' own git commit"),
    ("ss_lowram", "a loading switch of sd-scripts"),
    (
        "ss_datasets",
        "written instead of the single-dataset keys, for a dataset_config",
    ),
    (
        "ss_max_validation_steps",
        "kohya's validation schedule, not EveryDream2's",
    ),
    ("ss_validate_every_n_epochs", "the same"),
    ("ss_validate_every_n_steps", "the same"),
    ("ss_resize_interpolation", "kohya's resize filter choice"),
    (
        "ss_random_crop",
        "EveryDream2's crop jitter is another rule",
    ),
];

/// What a run's adapter files record besides the network: `ss_optimizer`, and the other keys
/// (empty under `no_metadata`).
#[derive(Debug, Clone, PartialEq)]
pub struct KohyaRunMetadata {
    pub optimizer: String,
    pub keys: BTreeMap<String, String>,
    /// ModelSpec's keys beyond the model's own, written even under `no_metadata` (as kohya
    /// adds `get_sai_model_spec` to its minimum keys): the `metadata_*` fields,
    /// `encoder_layer`, `timestep_range`, and this build as `implementation_version`.
    pub modelspec: BTreeMap<String, String>,
}

/// The run's facts beyond the plan.
pub struct RunFacts<'a> {
    pub plan: &'a TrainPlan,
    /// The training images and each one's bucket.
    pub items: &'a [ImageMeta],
    pub buckets: &'a [Bucket],
    pub amp: Amp,
    /// Whether any block is checkpointed (`gradient_checkpointing` as decided).
    pub checkpointing: bool,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
    /// Data-parallel ranks (1 on one device).
    pub world: usize,
    pub validation_images: usize,
    /// The regularization images, when `reg_data_root` is set (already among `items`).
    pub regularization: Option<&'a RegularizationSummary>,
    /// A random id per run (kohya's `ss_session_id`).
    pub session_id: u32,
}

impl KohyaRunMetadata {
    /// The metadata of `f`'s run.
    pub fn of(f: &RunFacts<'_>) -> std::io::Result<Self> {
        let group = &f.plan.optimizer.unet;
        let optimizer = optimizer_name(group);
        let mut keys = BTreeMap::new();
        let metadata = f.plan.adapter.as_ref().is_none_or(|a| a.training_metadata);
        if metadata {
            settings(f, &mut keys);
            dataset(f, &mut keys);
            named_file(&f.plan.model, MODEL_KEYS, &mut keys)?;
            if let Some(vae) = &f.plan.model_file.vae {
                named_file(vae, VAE_KEYS, &mut keys)?;
            }
        }
        let mut modelspec = f.plan.modelspec.fields.clone();
        modelspec.insert(
            "modelspec.implementation_version".into(),
            format!("sdtrain/{}", env!("CARGO_PKG_VERSION")),
        );
        Ok(Self {
            optimizer,
            keys,
            modelspec,
        })
    }
}

/// kohya's `optimizer_name(optimizer_args)`: the class its optimizer would be, and the
/// arguments that differ by run.
pub fn optimizer_name(g: &ParamGroupPlan) -> String {
    use OptimizerKind as K;
    let class = match g.optimizer {
        K::AdamW => "torch.optim.adamw.AdamW",
        K::AdamW8bit => "bitsandbytes.optim.adamw.AdamW8bit",
        K::Lion => "lion_pytorch.lion_pytorch.Lion",
        K::Lion8bit => "bitsandbytes.optim.lion.Lion8bit",
        K::Adafactor => "transformers.optimization.Adafactor",
        K::Prodigy => "prodigyopt.prodigy.Prodigy",
        K::DadaptAdam => "dadaptation.dadapt_adam.DAdaptAdam",
        K::DadaptAdan => "dadaptation.dadapt_adan.DAdaptAdan",
        K::DadaptLion => "dadaptation.dadapt_lion.DAdaptLion",
        K::DadaptSgd => "dadaptation.dadapt_sgd.DAdaptSGD",
        K::CoordinateDowg => "dowg.CoordinateDoWG",
        K::ScalarDowg => "dowg.ScalarDoWG",
        K::Adacoor => "optimizer.adacoor.AdaCoor",
        K::AdamWScheduleFree => "schedulefree.adamw_schedulefree.AdamWScheduleFree",
        K::Came => "came_pytorch.CAME.CAME",
        K::Came8bit => "sdtrain.optim.CAME8bit",
    };
    let args = match g.optimizer {
        K::CoordinateDowg | K::ScalarDowg | K::Adacoor => Vec::new(),
        K::Adafactor => vec![
            format!("scale_parameter={}", py_bool(g.adafactor.scale_parameter)),
            "relative_step=False".to_string(),
            "warmup_init=False".to_string(),
        ],
        _ => vec![
            format!("weight_decay={}", py_float(g.weight_decay)),
            format!("betas=({}, {})", py_float(g.betas.0), py_float(g.betas.1)),
        ],
    };
    match args.is_empty() {
        true => class.to_string(),
        false => format!("{class}({})", args.join(",")),
    }
}

/// The run's settings (the first part of kohya's dict).
fn settings(f: &RunFacts<'_>, m: &mut BTreeMap<String, String>) {
    let p = f.plan;
    let o = &p.objective;
    let group = &p.optimizer.unet;
    let schedule = group.schedule.resolve(f.total_steps as u64);
    let scheduler = match (schedule.kind.name(), schedule.warmup_steps) {
        ("constant", w) if w > 0 => "constant_with_warmup",
        (name, _) => name,
    };
    let micro_per_epoch = f.steps_per_epoch * p.grad_accum;
    let epochs = p
        .max_epochs
        .unwrap_or_else(|| f.total_steps.div_ceil(f.steps_per_epoch.max(1)) as u64);
    let none_if = |off: bool, v: String| if off { "None".to_string() } else { v };
    let (loss, huber) = loss_type(o.loss.loss_type);
    let adapter = p.adapter.as_ref();
    let fp8 = p.precision.base_weight_dtype;
    let mut put = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    put("ss_session_id", f.session_id.to_string());
    put("ss_num_validation_images", f.validation_images.to_string());
    let validation = p.data.validation.as_ref();
    let split = validation.and_then(|v| v.split).unwrap_or(0.0);
    put("ss_validation_split", py_float(split));
    let seed = validation.and_then(|v| v.seed);
    put(
        "ss_validation_seed",
        seed.map_or("None".into(), |s| s.to_string()),
    );
    let reg_samples = f.regularization.map_or(0.0, |r| r.samples_before);
    put("ss_num_reg_images", py_count(reg_samples));
    put("ss_num_batches_per_epoch", micro_per_epoch.to_string());
    put("ss_num_epochs", epochs.to_string());
    put("ss_gradient_checkpointing", py_bool(f.checkpointing));
    put("ss_gradient_accumulation_steps", p.grad_accum.to_string());
    put("ss_max_train_steps", f.total_steps.to_string());
    put("ss_lr_warmup_steps", schedule.warmup_steps.to_string());
    put("ss_lr_scheduler", scheduler.to_string());
    let dropout = adapter.map_or(0.0, |a| a.dropout);
    put(
        "ss_network_dropout",
        none_if(dropout == 0.0, py_float(dropout)),
    );
    let precision = match f.amp {
        Amp::Off => "no",
        Amp::Fp16 => "fp16",
        Amp::Bf16 => "bf16",
    };
    put("ss_mixed_precision", precision.into());
    put("ss_full_fp16", "False".into());
    put(
        "ss_clip_skip",
        none_if(o.clip_skip == 0, o.clip_skip.to_string()),
    );
    let chunks = p.data.caption_chunks;
    put(
        "ss_max_token_length",
        none_if(chunks <= 1, (75 * chunks).to_string()),
    );
    put(
        "ss_cache_latents",
        py_bool(p.data.cache_latents != CacheLatents::Off),
    );
    let offset = o.zero_frequency_noise_ratio;
    put("ss_noise_offset", none_if(offset == 0.0, py_float(offset)));
    put(
        "ss_noise_offset_random_strength",
        py_bool(o.offset_variant.random_strength),
    );
    let pyramid = o.pyramid_noise.as_ref();
    put(
        "ss_multires_noise_iterations",
        pyramid.map_or("None".into(), |n| n.iterations.to_string()),
    );
    put(
        "ss_multires_noise_discount",
        pyramid.map_or("0.3".into(), |n| py_float(n.discount)),
    );
    put(
        "ss_adaptive_noise_scale",
        o.offset_variant
            .adaptive_scale
            .map_or("None".into(), py_float),
    );
    put("ss_zero_terminal_snr", py_bool(o.zero_terminal_snr));
    put(
        "ss_training_comment",
        adapter
            .and_then(|a| a.training_comment.clone())
            .unwrap_or_else(|| "None".into()),
    );
    put("ss_optimizer", optimizer_name(group));
    put(
        "ss_max_grad_norm",
        py_float(p.clip_grad_norm.unwrap_or(0.0)),
    );
    put("ss_caption_dropout_rate", py_float(p.data.cond_dropout));
    put("ss_caption_dropout_every_n_epochs", "0".into());
    put("ss_caption_tag_dropout_rate", py_float(p.data.tag_dropout));
    put("ss_face_crop_aug_range", "None".into());
    let prior = p.data.regularization.as_ref();
    put(
        "ss_prior_loss_weight",
        py_float(prior.map_or(1.0, |r| r.prior_loss_weight)),
    );
    put(
        "ss_min_snr_gamma",
        o.min_snr_gamma.map_or("None".into(), py_float),
    );
    let cap = adapter.and_then(|a| a.scale_weight_norms);
    put("ss_scale_weight_norms", cap.map_or("None".into(), py_float));
    let ip = o.input_perturbation.as_ref();
    put(
        "ss_ip_noise_gamma",
        ip.map_or("None".into(), |i| py_float(i.gamma)),
    );
    put(
        "ss_ip_noise_gamma_random_strength",
        py_bool(ip.is_some_and(|i| i.random_strength)),
    );
    put(
        "ss_debiased_estimation",
        py_bool(o.loss.debiased_estimation),
    );
    put("ss_loss_type", loss.to_string());
    let (kind, c, scale) = match huber {
        Some(h) => (huber_kind(h.kind), py_float(h.c), py_float(h.scale)),
        None => ("snr", "0.1".into(), "1.0".into()),
    };
    put("ss_huber_schedule", kind.to_string());
    put("ss_huber_c", c);
    put("ss_huber_scale", scale);
    put(
        "ss_fp8_base",
        py_bool(fp8 == crate::config::BaseWeightDtype::Fp8),
    );
    put(
        "ss_fp8_base_unet",
        py_bool(fp8 == crate::config::BaseWeightDtype::Fp8Unet),
    );
}

/// kohya's `loss_type` name (`l2`, `l1`, `huber` for its pseudo-Huber, `smooth_l1`), or
/// EveryDream2's for its own losses (`onetrainer_mix` for OneTrainer's weighted sum); and the Huber schedule when one applies.
fn loss_type(t: LossType) -> (&'static str, Option<HuberSchedule>) {
    match t {
        LossType::Mse => ("l2", None),
        LossType::L1 => ("l1", None),
        LossType::PseudoHuber(s) => ("huber", Some(s)),
        LossType::SmoothL1(s) => ("smooth_l1", Some(s)),
        LossType::Huber => ("huber_everydream2", None),
        LossType::MseHuber => ("mse_huber", None),
        LossType::HuberMse => ("huber_mse", None),
        LossType::Mix(_) => ("onetrainer_mix", None),
    }
}

fn huber_kind(k: HuberScheduleKind) -> &'static str {
    match k {
        HuberScheduleKind::Constant => "constant",
        HuberScheduleKind::Exponential => "exponential",
        HuberScheduleKind::Snr => "snr",
    }
}

/// The dataset's keys (kohya's single-dataset branch).
fn dataset(f: &RunFacts<'_>, m: &mut BTreeMap<String, String>) {
    let p = f.plan;
    let d = &p.data;
    if let Some(config) = &d.dataset_config {
        super::kohya_datasets_metadata::write(f, config, m);
        return;
    }
    let mut put = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    put("ss_batch_size_per_device", p.batch_size.to_string());
    put(
        "ss_total_batch_size",
        (p.batch_size * p.grad_accum * f.world).to_string(),
    );
    put("ss_color_aug", "False".into());
    put("ss_flip_aug", py_bool(d.flip_p > 0.0));
    put("ss_shuffle_caption", py_bool(d.shuffle_tags));
    // kohya's `keep_tokens` counts the first piece, which sdtrain's `keep_tags` keeps anyway
    // whenever captions are shuffled, tag-dropped or warmed up.
    let reordered =
        d.shuffle_tags || d.tag_dropout > 0.0 || d.kohya_captions.token_warmup.is_some();
    let keep_tokens = d.keep_tags + usize::from(reordered);
    put("ss_keep_tokens", keep_tokens.to_string());
    put("ss_enable_bucket", py_bool(d.buckets.is_some()));
    let no_upscale = d
        .buckets
        .as_ref()
        .and_then(|b| b.kohya)
        .is_some_and(|k| k.no_upscale);
    put("ss_bucket_no_upscale", py_bool(no_upscale));
    let sides = f.buckets.iter().flat_map(|b| [b.width, b.height]);
    put(
        "ss_min_bucket_reso",
        sides.clone().min().unwrap_or(0).to_string(),
    );
    put("ss_max_bucket_reso", sides.max().unwrap_or(0).to_string());
    let train = f
        .items
        .iter()
        .filter(|i| i.options.prior_loss_weight.is_none());
    let dirs = folders(train, &d.data_root);
    put("ss_dataset_dirs", dataset_dirs(&dirs).dumps());
    let reg_dirs = match (f.regularization, &d.regularization) {
        (Some(summary), Some(plan)) => folders(&summary.own, &plan.data_root),
        // A dataset config's `is_reg` subsets.
        (Some(summary), None) => folders(&summary.own, &d.data_root),
        _ => Vec::new(),
    };
    put("ss_reg_dataset_dirs", dataset_dirs(&reg_dirs).dumps());
    // kohya counts every subset's captions, the regularization ones too, by folder name.
    let mut captions: Vec<(String, Vec<&str>)> = Vec::new();
    for (name, items) in dirs.iter().chain(&reg_dirs) {
        let caps = items.iter().map(|i| i.caption.as_str());
        match captions.iter_mut().find(|(n, _)| n == name) {
            Some((_, list)) => list.extend(caps),
            None => captions.push((name.clone(), caps.collect())),
        }
    }
    put("ss_tag_frequency", tag_frequency(&captions).dumps());
    let info = match d.buckets {
        Some(_) => bucket_info(f.items, f.buckets).dumps(),
        None => "null".to_string(),
    };
    put("ss_bucket_info", info);
}

/// A count as Python prints it: an `int` when whole, else a `float`.
fn py_count(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        py_float(v)
    }
}

/// The training images by folder, named as kohya names a subset (its folder's name; here the
/// path below `data_root`, so that nested folders stay apart), in the order first seen.
fn folders<'a>(
    items: impl IntoIterator<Item = &'a ImageMeta>,
    root: &Path,
) -> Vec<(String, Vec<&'a ImageMeta>)> {
    let mut out: Vec<(String, Vec<&ImageMeta>)> = Vec::new();
    for item in items {
        let dir = item.path.parent().unwrap_or(root);
        let name = match dir.strip_prefix(root) {
            Ok(rel) if !rel.as_os_str().is_empty() => rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/"),
            _ => dir
                .file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into()),
        };
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some((_, list)) => list.push(item),
            None => out.push((name, vec![item])),
        }
    }
    out
}

/// `ss_dataset_dirs`: `{folder: {"n_repeats": r, "img_count": n}}`; `r` is the folder's
/// `multiply.txt` repeat (the mean when its images differ).
fn dataset_dirs(dirs: &[(String, Vec<&ImageMeta>)]) -> PyValue {
    PyValue::Dict(
        dirs.iter()
            .map(|(name, items)| {
                let mean = items.iter().map(|i| i.multiplier).sum::<f64>() / items.len() as f64;
                let repeats = if mean.fract() == 0.0 && mean.abs() < 1e15 {
                    PyValue::Int(mean as i64)
                } else {
                    PyValue::Float(mean)
                };
                let entry = vec![
                    ("n_repeats".to_string(), repeats),
                    ("img_count".to_string(), PyValue::Int(items.len() as i64)),
                ];
                (name.clone(), PyValue::Dict(entry))
            })
            .collect(),
    )
}

/// kohya's `set_tag_frequency`: per folder, each caption split at commas, each tag trimmed and
/// lower-cased, counted; empty tags are skipped.
pub(super) fn tag_frequency(captions: &[(String, Vec<&str>)]) -> PyValue {
    let mut out: Vec<(String, PyValue)> = Vec::new();
    for (dir, caps) in captions {
        let mut counts: Vec<(String, i64)> = Vec::new();
        for caption in caps {
            for tag in caption.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                let tag = tag.to_lowercase();
                match counts.iter_mut().find(|(t, _)| *t == tag) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((tag, 1)),
                }
            }
        }
        let dict = counts
            .into_iter()
            .map(|(t, n)| (t, PyValue::Int(n)))
            .collect();
        out.push((dir.clone(), PyValue::Dict(dict)));
    }
    PyValue::Dict(out)
}

/// `ss_bucket_info`: each bucket in use, `{"resolution": [w, h], "count": n}` (counted with
/// repeats, as kohya counts), by index, and the mean aspect-ratio error of the images against
/// their buckets (`bucket w/h − image w/h`, absolute).
pub(super) fn bucket_info(items: &[ImageMeta], buckets: &[Bucket]) -> PyValue {
    let mut counts: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    let mut error = 0.0;
    for (item, b) in items.iter().zip(buckets) {
        *counts.entry((b.width, b.height)).or_default() += item.multiplier;
        let (w, h) = item.size;
        error += (b.width as f64 / b.height as f64 - w as f64 / h.max(1) as f64).abs();
    }
    let list = counts
        .into_iter()
        .enumerate()
        .map(|(i, ((w, h), n))| {
            let entry = vec![
                (
                    "resolution".to_string(),
                    PyValue::List(vec![PyValue::Int(w as i64), PyValue::Int(h as i64)]),
                ),
                ("count".to_string(), PyValue::Int(n.round() as i64)),
            ];
            (i.to_string(), PyValue::Dict(entry))
        })
        .collect();
    let mean = if items.is_empty() {
        0.0
    } else {
        error / items.len().min(buckets.len()).max(1) as f64
    };
    PyValue::Dict(vec![
        ("buckets".to_string(), PyValue::Dict(list)),
        ("mean_img_ar_error".to_string(), PyValue::Float(mean)),
    ])
}

/// The name, old hash and new hash keys of the base model, and of the `vae` in its place.
const MODEL_KEYS: [&str; 3] = [
    "ss_sd_model_name",
    "ss_sd_model_hash",
    "ss_new_sd_model_hash",
];
pub const VAE_KEYS: [&str; 3] = ["ss_vae_name", "ss_vae_hash", "ss_new_vae_hash"];

/// kohya's name key (a file's or folder's name, or the hub id) and, for a single file, its
/// hashes as A1111 computes them: the old 8-digit one (of 64 KiB at 1 MiB) and the SHA-256 of
/// the file.
fn named_file(
    spec: &str,
    [name_key, hash_key, new_hash_key]: [&str; 3],
    m: &mut BTreeMap<String, String>,
) -> std::io::Result<()> {
    let path = Path::new(spec);
    let name = match path.exists() {
        true => path
            .file_name()
            .map_or_else(|| spec.to_string(), |n| n.to_string_lossy().into()),
        false => spec.to_string(),
    };
    m.insert(name_key.into(), name);
    if path.is_file() {
        let (legacy, full) = crate::adapter::addnet_hash::file_hashes(path)?;
        m.insert(hash_key.into(), legacy);
        m.insert(new_hash_key.into(), full);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/reference/kohya_metadata.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// `ss_tag_frequency` is what kohya's `set_tag_frequency` counts on the same captions, and
    /// `json.dumps` writes it to the byte (tests/fixtures/kohya_metadata_reference.py). Catches
    /// tags kept in their case, untrimmed, empty tags counted, or the folders merged.
    #[test]
    fn tag_frequency_is_kohyas() {
        let r = reference();
        let captions: Vec<(String, Vec<&str>)> = r["tag_frequency_captions"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(dir, caps)| {
                let caps = caps.as_array().unwrap();
                (
                    dir.clone(),
                    caps.iter().map(|c| c.as_str().unwrap()).collect(),
                )
            })
            .collect();
        assert_eq!(
            tag_frequency(&captions).dumps(),
            r["tag_frequency_dumps"].as_str().unwrap()
        );
    }

    /// Every key is kohya's (`train_network.py`'s own list, read from its source), and the ones
    /// left out are few and named. Catches a key misspelt, or one of kohya's dropped silently.
    #[test]
    fn omitted_keys_are_kohyas() {
        let r = reference();
        let kohya: Vec<&str> = r["ss_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        for (k, _) in OMITTED {
            assert!(kohya.contains(k), "{k} is not one of kohya's keys");
        }
    }

    /// kohya's class path, and the arguments as its `f"{k}={v}"` writes them.
    #[test]
    fn optimizer_names_are_kohyas_class_paths() {
        let root = env!("CARGO_MANIFEST_DIR");
        let train = serde_json::json!({
            "model": format!("{root}/tests/fixtures/tiny-sd15"),
            "data_root": format!("{root}/data/demo"),
            "mode": "lora",
        });
        let plan =
            crate::config::TrainPlan::from_value(train, Path::new("train.json"), &[]).unwrap();
        let name = optimizer_name(&plan.optimizer.unet);
        assert!(
            name.starts_with("bitsandbytes.optim.adamw.AdamW8bit(weight_decay="),
            "{name}"
        );
        assert!(name.ends_with(",betas=(0.9, 0.999))"), "{name}");
    }
}
