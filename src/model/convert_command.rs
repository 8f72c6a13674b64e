//! `sdtrain convert`: a model saved in the other layout, as kohya sd-scripts'
//! `tools/convert_diffusers20_original_sd.py` and diffusers' conversion scripts save it: a
//! diffusers folder (or hub id) as the one `.safetensors` A1111 and ComfyUI load, or a single file
//! as a diffusers folder; optionally in another dtype (`--save-dtype`) and with another VAE baked
//! in (`--vae`, as A1111 users bake one). The family, prediction type and configs are detected as
//! every command detects them; the tensors stream through the exporters ([`super::export`]),
//! never the whole model in memory. A torch file (`.ckpt`, `.pt`) given with a `.safetensors`
//! `--out` and nothing else to change is written as stored, every tensor of it kept (the "ckpt to
//! safetensors" A1111 users run), read as data without running it ([`crate::torch_pickle`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use candle_core::{DType, Tensor};
use clap::Args;

use super::export::Updates;
use super::files::Component;
use super::layout::ModelLayout;
use super::single_file::SingleFileOptions;
use super::source::ModelSource;
use crate::precision::parse_save_dtype;

#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {
    /// The model to convert: a hub id `org/name[@revision]`, a diffusers folder or a single-file
    /// checkpoint.
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER|FILE")]
    pub model: String,
    /// Where to write: a `.safetensors` file (the A1111/ComfyUI single-file layout) or a
    /// diffusers folder.
    #[arg(long, value_name = "FILE|FOLDER")]
    pub out: PathBuf,
    /// `fp32`, `fp16` or `bf16` for every float tensor (kohya's `--float`/`--fp16`/`--bf16`);
    /// default: as stored.
    #[arg(long, alias = "save-precision", value_parser = parse_save_dtype)]
    pub save_dtype: Option<DType>,
    /// A VAE to write in place of the model's: a VAE or pipeline folder, a `.safetensors` VAE
    /// file (A1111's or diffusers' names) or a hub id.
    #[arg(long, value_name = "VAE")]
    pub vae: Option<String>,
    /// For a single file whose configs cannot be told from its tensors: a diffusers folder (or
    /// hub id) with the matching configs.
    #[arg(long, value_name = "FOLDER")]
    pub model_config: Option<PathBuf>,
    /// Prefer weight files of this variant (e.g. `fp16`) where the model has them.
    #[arg(long, value_name = "NAME")]
    pub variant: Option<String>,
    /// Replace an existing diffusers folder at `--out`, whole.
    #[arg(long)]
    pub overwrite: bool,
}

/// Runs the command; returns what it wrote.
pub fn run(args: &ConvertArgs) -> anyhow::Result<PathBuf> {
    let single = args.out.extension().and_then(|e| e.to_str()) == Some("safetensors");
    if !single {
        check_folder_out(&args.out, args.overwrite)?;
    }
    let src = Path::new(&args.model);
    let as_stored = args.vae.is_none() && args.save_dtype.is_none() && args.model_config.is_none();
    if single && as_stored && crate::torch_pickle::has_torch_extension(src) && src.is_file() {
        return torch_as_stored(src, &args.out);
    }
    let dir = ModelSource::parse(&args.model)
        .and_then(|s| s.resolve())
        .with_context(|| format!("--model `{}`", args.model))?;
    let options = SingleFileOptions {
        model_config: args.model_config.clone(),
        prediction_type: None,
    };
    let mut layout = dir
        .noting_copy(ModelLayout::read_with(
            &dir.path,
            args.variant.as_deref(),
            &options,
        ))
        .with_context(|| format!("--model `{}`", args.model))?;
    if let Some(spec) = &args.vae {
        let base = layout
            .component(Component::Vae)
            .context("the model has no VAE to replace")?;
        let vae = super::vae_source::open_vae(spec, base, args.variant.as_deref())
            .with_context(|| format!("--vae `{spec}`"))?;
        eprintln!("convert: vae {}, in place of the model's", vae.described);
        layout = layout.with_vae(vae.files);
    }
    // A component listed with no tensors is rewritten whole in `dtype`; one not listed is
    // copied as stored.
    let (updated, dtype): (Updates<Tensor>, DType) = match args.save_dtype {
        Some(d) => (
            layout
                .components
                .iter()
                .map(|c| (c.component, Vec::new()))
                .collect(),
            d,
        ),
        None => (Vec::new(), DType::F32),
    };
    if single {
        super::export::save_single_file(&layout, &args.out, &updated, dtype)
    } else {
        super::export::save_diffusers_folder(&layout, &args.out, &updated, dtype)
    }
    .with_context(|| format!("saving {}", args.out.display()))?;
    eprintln!(
        "wrote {} ({:?} {}, {})",
        args.out.display(),
        layout.family,
        if single {
            "single file"
        } else {
            "diffusers folder"
        },
        args.save_dtype
            .map_or("dtypes as stored".to_string(), |d| format!("{d:?}"))
    );
    Ok(args.out.clone())
}

/// A torch file (`.ckpt`, `.pt`, …) as one `.safetensors` file: every tensor of its state dict
/// under its own name and dtype, bytes unchanged (EMA weights and all), as A1111's converters
/// write it; read as data, nothing in it runs ([`crate::torch_pickle`]).
fn torch_as_stored(src: &Path, out: &Path) -> anyhow::Result<PathBuf> {
    let mut metadata = serde_json::Map::new();
    if let Some(name) = src.file_name() {
        metadata.insert(
            "sdtrain.converted_from".into(),
            name.to_string_lossy().into_owned().into(),
        );
    }
    let done = crate::torch_pickle::convert(src, out, metadata)
        .with_context(|| format!("--model `{}`", src.display()))?;
    eprintln!(
        "wrote {} ({} tensors of the torch file as stored, {:.1} MB; nothing in it ran)",
        out.display(),
        done.tensors,
        done.bytes as f64 / 1e6
    );
    if !done.skipped.is_empty() {
        let names: Vec<&str> = done.skipped.iter().map(|(n, _)| n.as_str()).collect();
        eprintln!(
            "left out {} entries that are not tensors: {}",
            names.len(),
            names.join(", ")
        );
    }
    Ok(out.to_path_buf())
}

/// A folder `--out` replaces what is there, whole (the new folder is built beside it and renamed
/// into place). So an existing one must be empty, or a diffusers folder (one holding
/// `model_index.json`) that `--overwrite` allows to go, files sdtrain did not write included; a
/// mistyped path cannot take a folder of other files with it.
pub fn check_folder_out(out: &Path, overwrite: bool) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return Ok(());
    };
    let empty =
        meta.is_dir() && std::fs::read_dir(out).is_ok_and(|mut entries| entries.next().is_none());
    if empty {
        return Ok(());
    }
    if !(meta.is_dir() && out.join("model_index.json").is_file()) {
        bail!(
            "--out {}: it exists and is not a diffusers folder, which the new model would \
             replace; give a new folder, or a .safetensors file for a single file",
            out.display()
        );
    }
    if !overwrite {
        bail!(
            "--out {}: a diffusers folder is there; --overwrite replaces it whole (any file in it \
             sdtrain does not write goes too), or give a new folder",
            out.display()
        );
    }
    Ok(())
}
