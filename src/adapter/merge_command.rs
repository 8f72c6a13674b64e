//! `sdtrain merge-lora`: a model with LoRA/LyCORIS files folded into its weights, saved as a
//! model of its own, as kohya sd-scripts' `networks/merge_lora.py --sd_model` (and
//! `sdxl_merge_lora.py`) saves one: each file's modules are added, `W += ratio · ΔW`, in f32
//! ([`super::merge`], the same fold `sdtrain sample --lora` and A1111 apply), in the order given.
//! Without `--model`, the files are merged into one LoRA at `--rank`, as kohya's
//! `svd_merge_lora.py` merges them ([`super::svd_merge`]).
//!
//! The output is a single file in the A1111/ComfyUI layout when `--out` ends in `.safetensors`,
//! else a diffusers folder; only the layers a file changes are rewritten, the rest of the base is
//! copied as stored. Embeddings a file bundles are not merged (a checkpoint has no place for a new
//! token); the command says so.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use clap::Args;

use super::kohya_file::load_kohya;
use super::kohya_names::KohyaComponent;
use super::merge::{layer_weights, merge_kohya_layers};
use crate::model::export::Updates;
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::model::pipeline::{LoadOptions, StableDiffusion};
use crate::model::single_file::SingleFileOptions;
use crate::model::source::ModelSource;
use crate::precision::parse_save_dtype;

#[derive(Debug, Clone, Args)]
pub struct MergeArgs {
    /// The model to merge into: a hub id `org/name[@revision]`, a diffusers folder or a
    /// single-file checkpoint (kohya's `--sd_model`). Without it, the files are merged into one
    /// LoRA at `--rank` (kohya's `svd_merge_lora.py`).
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER|FILE")]
    pub model: Option<String>,
    /// Without `--model`: the merged LoRA's rank (kohya's `--new_rank`), capped per module at
    /// the layer's channels.
    #[arg(long, alias = "new-rank")]
    pub rank: Option<usize>,
    /// Without `--model`: the rank of the 3×3 convs (kohya's `--new_conv_rank`; default `--rank`).
    #[arg(long, alias = "new-conv-rank")]
    pub conv_rank: Option<usize>,
    /// A kohya LoRA/LoCon/LoHa/LoKr/DoRA file, or diffusers' LoRA file, to merge; repeatable,
    /// merged in the order given (kohya's `--models`).
    #[arg(long = "lora", value_name = "FILE", required = true)]
    pub loras: Vec<PathBuf>,
    /// The multiplier of each `--lora`, in the same order (kohya's `--ratios`; default 1 each).
    #[arg(long = "ratio", value_name = "RATIO", allow_negative_numbers = true)]
    pub ratios: Vec<f64>,
    /// Where to write: a `.safetensors` file (the A1111/ComfyUI single-file layout) or a
    /// diffusers folder (kohya's `--save_to`).
    #[arg(long, value_name = "FILE|FOLDER")]
    pub out: PathBuf,
    /// `fp32` (kohya's default `float`), `fp16` or `bf16`: the dtype of the merged components'
    /// weights (kohya's `--save_precision`). A half single file is half throughout.
    #[arg(long, alias = "save-precision", default_value = "fp32", value_parser = parse_save_dtype)]
    pub save_dtype: DType,
    /// Replace an existing diffusers folder at `--out`, whole.
    #[arg(long)]
    pub overwrite: bool,
}

/// Runs the command; returns what it wrote.
pub fn run(args: &MergeArgs) -> anyhow::Result<PathBuf> {
    let ratios = ratios(args)?;
    match (&args.model, args.rank) {
        (Some(model), None) if args.conv_rank.is_none() => into_model(args, model, &ratios),
        (Some(_), _) => bail!(
            "--rank and --conv-rank set the rank of a merged LoRA, which is written without \
             --model; with --model the files are folded into the model's weights"
        ),
        (None, Some(rank)) => {
            let out = &args.out;
            if out.extension().and_then(|e| e.to_str()) != Some("safetensors") {
                bail!(
                    "--out {}: the merged LoRA is a .safetensors file; name it so",
                    out.display()
                );
            }
            super::svd_merge_command::run(
                &args.loras,
                &ratios,
                rank,
                args.conv_rank,
                out,
                args.save_dtype,
            )?;
            Ok(out.clone())
        }
        (None, None) => bail!(
            "give --model to fold the files into a model, or --rank to merge them into one LoRA"
        ),
    }
}

/// Folds the files into `model` and saves it (kohya's `merge_lora.py --sd_model`).
fn into_model(args: &MergeArgs, model: &str, ratios: &[f64]) -> anyhow::Result<PathBuf> {
    if args.out.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        crate::model::convert_command::check_folder_out(&args.out, args.overwrite)?;
    }
    let dir = ModelSource::parse(model)
        .and_then(|s| s.resolve())
        .with_context(|| format!("--model `{model}`"))?;
    let layout = dir
        .noting_copy(ModelLayout::read_with(
            &dir.path,
            None,
            &SingleFileOptions::default(),
        ))
        .with_context(|| format!("--model `{model}`"))?;
    // Trainable components are held as Vars, which records each weight's stored name.
    let opts = LoadOptions {
        dtype: DType::F32,
        trained_dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: true,
        train_text_encoders: true,
        fp8_unet: false,
        fp8_text_encoders: false,
    };
    let mut sd = StableDiffusion::load(layout.clone(), &opts)
        .with_context(|| format!("--model `{model}`"))?;
    let naming = super::kohya_naming(&sd);
    let mut changed: Vec<(KohyaComponent, String)> = Vec::new();
    for (path, ratio) in args.loras.iter().zip(ratios) {
        let file = load_kohya(path, &Device::Cpu)?;
        let layers = merge_kohya_layers(&mut sd, &naming, &file, *ratio)?;
        eprintln!(
            "merge: {} modules of {} (×{ratio})",
            layers.len(),
            path.display()
        );
        if !file.bundled_embeddings.is_empty() {
            eprintln!(
                "merge: {} bundles embeddings ({}), which are not merged: load them with the \
                 model as embeddings",
                path.display(),
                file.bundled_embeddings.join(", ")
            );
        }
        changed.extend(layers);
    }
    changed.sort();
    changed.dedup();
    let updated = stored_updates(&mut sd, &changed)?;
    let single = args.out.extension().and_then(|e| e.to_str()) == Some("safetensors");
    if single {
        crate::model::export::save_single_file(&layout, &args.out, &updated, args.save_dtype)
    } else {
        crate::model::export::save_diffusers_folder(&layout, &args.out, &updated, args.save_dtype)
    }
    .with_context(|| format!("saving {}", args.out.display()))?;
    eprintln!(
        "wrote {} ({} layers changed, {})",
        args.out.display(),
        changed.len(),
        if single {
            "single file"
        } else {
            "diffusers folder"
        }
    );
    Ok(args.out.clone())
}

/// One ratio per `--lora`: as given, or 1 each when none is.
fn ratios(args: &MergeArgs) -> anyhow::Result<Vec<f64>> {
    let ratios = match args.ratios.len() {
        0 => vec![1.0; args.loras.len()],
        n if n == args.loras.len() => args.ratios.clone(),
        n => bail!(
            "{n} --ratio for {} --lora: give one ratio per file, in the same order, or none",
            args.loras.len()
        ),
    };
    if let Some(r) = ratios.iter().find(|r| !r.is_finite()) {
        bail!("--ratio {r}: must be a finite number");
    }
    Ok(ratios)
}

/// The `changed` layers' merged weights under the names the base files store them, per
/// component, as the exporters take them.
fn stored_updates(
    sd: &mut StableDiffusion,
    changed: &[(KohyaComponent, String)],
) -> anyhow::Result<Updates<Tensor>> {
    let weights = layer_weights(sd, changed)?;
    let mut stored: HashMap<(KohyaComponent, String), String> = HashMap::new();
    let mut sources = vec![(KohyaComponent::Unet, &sd.unet_weights)];
    let comps = [KohyaComponent::TextEncoder, KohyaComponent::TextEncoder2];
    sources.extend(
        comps
            .into_iter()
            .zip(sd.text_encoders.iter().map(|te| &te.weights)),
    );
    for (component, w) in sources {
        for ((name, _), (stored_name, _)) in w.params().into_iter().zip(w.checkpoint_params()) {
            stored.insert((component, name), stored_name);
        }
    }
    let mut by_component: Updates<Tensor> = Vec::new();
    for key in changed {
        let name = format!("{}.weight", key.1);
        let stored_name = stored
            .get(&(key.0, name.clone()))
            .with_context(|| format!("no stored name for `{name}`"))?;
        let component = match key.0 {
            KohyaComponent::Unet => Component::Unet,
            KohyaComponent::TextEncoder => Component::TextEncoder,
            KohyaComponent::TextEncoder2 => Component::TextEncoder2,
        };
        let weight = weights[key].clone();
        match by_component.iter_mut().find(|(c, _)| *c == component) {
            Some((_, list)) => list.push((stored_name.clone(), weight)),
            None => by_component.push((component, vec![(stored_name.clone(), weight)])),
        }
    }
    Ok(by_component)
}
