//! Adapter training glue: attaches LoRA/LoCon/LoHa/LoKr/DoRA modules to the loaded (frozen) model as the plan
//! says, optionally starts them from an existing kohya file (`adapter.init_from`), names their
//! parameters for the optimizer, and saves them in kohya's format.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use candle_core::{DType, Var};

use crate::adapter::attach::{attach_selected, unet_target_in};
use crate::adapter::block_weights::BlockTable;
use crate::adapter::factors;
use crate::adapter::kohya_file::{
    load_kohya, match_to_model, save_kohya_with, ExpectedModule, KohyaBase, KohyaMetadata,
    KohyaTensorSet,
};
use crate::adapter::kohya_names::{KohyaComponent, KohyaNaming};
use crate::adapter::{
    attach_text_encoder, kohya_naming, AdapterComponent, AdapterMode, AdapterSpec, LayerGeometry,
    LoraModule,
};
use crate::config::{AdapterPlan, SaveDtype, TrainMode, TrainPlan};
use crate::model::family::{ModelFamily, PredictionType};
use crate::model::pipeline::StableDiffusion;

/// The adapters of one run.
pub struct TrainedAdapters {
    pub modules: Vec<Arc<LoraModule>>,
    pub plan: AdapterPlan,
    naming: KohyaNaming,
    names: Vec<String>,
    base: KohyaBase,
    mode: AdapterMode,
    /// kohya's block-wise ranks and learning-rate weights, resolved for the model.
    blocks: Option<BlockTable>,
}

fn kohya_component(c: AdapterComponent) -> KohyaComponent {
    match c {
        AdapterComponent::Unet => KohyaComponent::Unet,
        AdapterComponent::TextEncoder => KohyaComponent::TextEncoder,
        AdapterComponent::TextEncoder2 => KohyaComponent::TextEncoder2,
    }
}

/// Attaches the adapters `plan.adapter` describes to `sd` (whose weights are frozen), their
/// initial weights and dropout masks drawn from `seed` (the run's: a resumed run's is the save
/// point's, so its masks repeat).
pub fn attach(
    sd: &mut StableDiffusion,
    plan: &TrainPlan,
    seed: u64,
) -> anyhow::Result<TrainedAdapters> {
    let a = plan
        .adapter
        .clone()
        .context("adapter mode without an adapter plan")?;
    attach_with(sd, plan.mode, a, seed)
}

/// The attach spec for an adapter mode (`None` for a full fine-tune).
pub fn adapter_spec(mode: TrainMode, a: &AdapterPlan, seed: u64) -> Option<AdapterSpec> {
    let mode = match mode {
        TrainMode::Lora => AdapterMode::Lora,
        TrainMode::Locon => AdapterMode::Locon,
        TrainMode::Loha => AdapterMode::Loha,
        TrainMode::Lokr => AdapterMode::Lokr,
        TrainMode::Dora => AdapterMode::Dora,
        TrainMode::Full | TrainMode::TextualInversion => return None,
    };
    Some(AdapterSpec {
        mode,
        rank: a.rank,
        alpha: a.alpha,
        conv_rank: a.conv_rank,
        conv_alpha: a.conv_alpha,
        dropout: a.dropout,
        factor: a.factor,
        seed,
    })
}

/// [`attach`] from its parts: the mode, the adapter settings and the init seed.
pub fn attach_with(
    sd: &mut StableDiffusion,
    mode: TrainMode,
    a: AdapterPlan,
    seed: u64,
) -> anyhow::Result<TrainedAdapters> {
    let Some(spec) = adapter_spec(mode, &a, seed) else {
        anyhow::bail!("full fine-tuning has no adapters");
    };
    let naming = kohya_naming(sd);
    let sdxl = sd.family() == ModelFamily::Sdxl;
    let blocks = super::adapter_blocks::resolve_table(&a, spec.mode, sdxl)?;
    let filter = a.layer_filter.clone();
    if let (Some(f), true) = (&filter, a.train_unet) {
        crate::adapter::attach::check_layer_filter(&mut sd.unet, &spec, f)?;
    }
    let (modules, a) = match (&a.init_from, a.dim_from_weights) {
        (Some(path), true) => {
            let ranks = file_ranks(path, &candle_core::Device::Cpu)
                .with_context(|| format!("adapter.init_from {}", path.display()))?;
            let parts = (a.train_unet, a.train_text_encoder);
            let modules = attach_file_ranks(sd, &spec, &naming, &ranks, parts, filter.as_ref())?;
            let a = plan_of_file(a, &ranks);
            (modules, a)
        }
        _ => {
            // kohya's network_train_text_encoder_only: no UNet adapters at all.
            let mut modules = match (&blocks, a.train_unet) {
                (_, false) => Vec::new(),
                (Some(table), true) => super::adapter_blocks::attach_unet_blocks(
                    &mut sd.unet,
                    (&spec, filter.as_ref()),
                    &naming,
                    table,
                )?,
                (None, true) => {
                    let select = |path: &str, g: &LayerGeometry| {
                        unet_target_in(path, g, &spec, filter.as_ref())
                    };
                    attach_selected(&mut sd.unet, AdapterComponent::Unet, &spec, &select)?
                }
            };
            if a.train_text_encoder {
                let comps = [
                    AdapterComponent::TextEncoder,
                    AdapterComponent::TextEncoder2,
                ];
                for (te, comp) in sd.text_encoders.iter_mut().zip(comps) {
                    modules.extend(attach_text_encoder(&mut te.model, comp, &spec)?);
                }
            }
            (modules, a)
        }
    };
    let extra = crate::adapter::lora::ExtraDropout {
        rank: a.rank_dropout,
        module: a.module_dropout,
    };
    if extra != Default::default() {
        for m in &modules {
            m.set_extra_dropout(extra)?;
        }
    }
    let family = sd.family();
    let names = modules
        .iter()
        .map(|m| naming.module_name(kohya_component(m.component), &m.module_path))
        .collect::<Result<Vec<_>, _>>()?;
    let base = match (family, sd.layout.prediction_type) {
        (ModelFamily::Sd1, _) => KohyaBase::SdV1,
        (ModelFamily::Sd2, PredictionType::Epsilon) => KohyaBase::SdV2,
        (ModelFamily::Sd2, PredictionType::VPrediction) => KohyaBase::SdV2V,
        (ModelFamily::Sdxl, _) => KohyaBase::SdxlBase,
    };
    let adapters = TrainedAdapters {
        modules,
        plan: a,
        naming,
        names,
        base,
        mode: spec.mode,
        blocks,
    };
    if let Some(path) = &adapters.plan.init_from {
        adapters
            .init_from(path)
            .with_context(|| format!("adapter.init_from {}", path.display()))?;
    }
    crate::adapter::set_training(&adapters.modules, true);
    Ok(adapters)
}

/// A kohya file's `(rank, alpha)` per module name, and whether the module is a 3×3 conv.
type FileRanks = std::collections::HashMap<String, (usize, f64, bool)>;

fn file_ranks(path: &Path, device: &candle_core::Device) -> anyhow::Result<FileRanks> {
    let file = load_kohya(path, device)?;
    Ok(file
        .modules
        .iter()
        .map(|m| {
            let entry = (m.rank(), f64::from(m.alpha), m.is_conv3x3());
            (m.name.clone(), entry)
        })
        .collect())
}

/// kohya's `--dim_from_weights`: an adapter on each of the mode's target layers that the file
/// holds, at the file's rank and alpha; a model part the file has no module of gets none.
fn attach_file_ranks(
    sd: &mut StableDiffusion,
    spec: &crate::adapter::attach::AdapterSpec,
    naming: &KohyaNaming,
    ranks: &FileRanks,
    (unet, text_encoders): (bool, bool),
    filter: Option<&crate::adapter::layer_filter::LayerFilter>,
) -> anyhow::Result<Vec<std::sync::Arc<crate::adapter::lora::LoraModule>>> {
    use crate::adapter::attach::text_encoder_target;
    let of = |component: AdapterComponent, path: &str| {
        let name = naming.module_name(kohya_component(component), path).ok()?;
        ranks.get(&name).map(|&(r, alpha, _)| (r, alpha))
    };
    let unet_select = |path: &str, g: &_| {
        unet_target_in(path, g, spec, filter).and_then(|_| of(AdapterComponent::Unet, path))
    };
    let holds = |comp: AdapterComponent| {
        let prefix = format!("{}_", naming.prefix(kohya_component(comp)));
        let held = ranks.keys().any(|k| k.starts_with(&prefix));
        if !held {
            crate::console::say(format_args!(
                "adapter: init_from has no {comp:?} modules; dim_from_weights trains none there"
            ));
        }
        held
    };
    let mut modules = Vec::new();
    if unet && holds(AdapterComponent::Unet) {
        modules = attach_selected(&mut sd.unet, AdapterComponent::Unet, spec, &unet_select)?;
    }
    if text_encoders {
        let comps = [
            AdapterComponent::TextEncoder,
            AdapterComponent::TextEncoder2,
        ];
        for (te, comp) in sd.text_encoders.iter_mut().zip(comps) {
            // A file that adapts the UNet alone leaves this encoder without adapters.
            if !holds(comp) {
                continue;
            }
            let select =
                |path: &str, _: &_| text_encoder_target(path, spec).and_then(|_| of(comp, path));
            modules.extend(attach_selected(&mut te.model, comp, spec, &select)?);
        }
    }
    Ok(modules)
}

/// The plan with the file's largest ranks and their alphas, as the saved file's header
/// records them.
fn plan_of_file(mut a: AdapterPlan, ranks: &FileRanks) -> AdapterPlan {
    let largest = |conv: bool| {
        ranks
            .values()
            .filter(|v| v.2 == conv)
            .max_by_key(|v| v.0)
            .map(|&(r, alpha, _)| (r, alpha))
    };
    if let Some((r, alpha)) = largest(false) {
        (a.rank, a.alpha) = (r, alpha);
    }
    if let Some((r, alpha)) = largest(true) {
        (a.conv_rank, a.conv_alpha) = (r, alpha);
    }
    a
}

impl TrainedAdapters {
    /// Loads a kohya-named file into the modules. A file scale that differs from the module's
    /// (another alpha) is folded into the factor `ΔW` is linear in ([`factors::scale_carrier`]),
    /// so the module computes exactly what the file describes.
    fn init_from(&self, path: &Path) -> anyhow::Result<()> {
        let device = self
            .modules
            .first()
            .map_or(candle_core::Device::Cpu, |m| m.device());
        let file = load_kohya(path, &device)?;
        if let Some(warning) = file.bundled_embeddings_warning() {
            crate::console::say(format_args!("{warning}"));
        }
        let expected: Vec<ExpectedModule> = self
            .modules
            .iter()
            .map(|m| ExpectedModule {
                component: kohya_component(m.component),
                module_path: m.module_path.clone(),
                shapes: m
                    .params
                    .iter()
                    .map(|(s, v)| (s.to_string(), v.dims().to_vec()))
                    .collect(),
            })
            .collect();
        let report = match_to_model(&file, &self.naming, &expected)?;
        for hit in &report.matched {
            let m = &self.modules[hit.expected_index];
            let f = &hit.module;
            let get = |s: &str| f.get(s).cloned();
            let file_scale = factors::scale(f.algo, &get, f64::from(f.alpha))?;
            let carrier = factors::scale_carrier(m.algo, &get);
            for (suffix, var) in &m.params {
                let Some(t) = f.get(suffix) else {
                    anyhow::bail!("{}: module `{}` has no `{suffix}`", path.display(), f.name);
                };
                let mut t = t.to_dtype(DType::F32)?;
                if *suffix == carrier {
                    t = (t * (file_scale / m.scale()))?;
                }
                var.set(&t)?;
            }
        }
        crate::console::say(format_args!(
            "adapter: started from {} ({} modules loaded, {} new)",
            path.display(),
            report.matched.len(),
            report.missing.len()
        ));
        Ok(())
    }

    /// Restarts every module's dropout stream for optimizer step `step` (see
    /// [`LoraModule::begin_step`]).
    pub fn begin_step(&self, step: usize) {
        for m in &self.modules {
            m.begin_step(step);
        }
    }

    /// Optimizer parameters of the UNet (`text_encoder == false`) or text-encoder modules, named
    /// by kohya key. A UNet module in a block of learning-rate weight 0 (kept by
    /// `dim_from_weights`, which takes every module of its file) is left out and so not trained,
    /// as kohya's `assemble_params` leaves out a group of rate 0.
    pub fn params(&self, text_encoder: bool) -> Vec<(String, Var)> {
        let frozen = |name: &str| {
            !text_encoder
                && self
                    .blocks
                    .as_ref()
                    .is_some_and(|t| t.lr_weight(name) == 0.0)
        };
        self.modules
            .iter()
            .zip(&self.names)
            .filter(|(m, _)| (m.component != AdapterComponent::Unet) == text_encoder)
            .filter(|(_, name)| !frozen(name))
            .flat_map(|(m, name)| {
                m.params
                    .iter()
                    .map(move |(suffix, v)| (format!("{name}.{suffix}"), v.clone()))
            })
            .collect()
    }

    /// Each parameter's learning-rate multiple in the UNet's or the text encoders' group
    /// (block weight × LoRA+ ratio), or `None` when all are 1.
    pub(super) fn lr_scale(
        &self,
        text_encoder: bool,
    ) -> Option<super::adapter_blocks::LrScale<'_>> {
        match text_encoder {
            false => super::adapter_blocks::lr_scale(self.blocks.as_ref(), self.plan.loraplus.unet),
            true => super::adapter_blocks::lr_scale(None, self.plan.loraplus.text_encoder),
        }
    }

    /// Writes the kohya file atomically.
    pub fn save(&self, path: &Path, meta: SaveInfo<'_>) -> anyhow::Result<()> {
        let sets: Vec<KohyaTensorSet> = self
            .modules
            .iter()
            .zip(&self.names)
            .map(|(m, name)| KohyaTensorSet {
                name: name.clone(),
                tensors: m
                    .params
                    .iter()
                    .map(|(s, v)| (s.to_string(), v.as_detached_tensor()))
                    .collect(),
                alpha: m.saved_alpha() as f32,
            })
            .collect();
        let a = &self.plan;
        let (network_module, args) = network_args(self.mode, a);
        let mut metadata = KohyaMetadata {
            base: self.base,
            network_module: network_module.to_string(),
            network_dim: a.rank,
            network_alpha: a.alpha,
            network_args: args,
            learning_rate: meta.unet_lr,
            unet_lr: Some(meta.unet_lr),
            text_encoder_lr: meta.text_encoder_lr,
            steps: meta.steps as u64,
            epoch: meta.epoch as u64,
            num_train_images: meta.num_train_images as u64,
            resolution: (meta.resolution as u32, meta.resolution as u32),
            seed: meta.seed,
            optimizer: meta.run.map_or_else(String::new, |r| r.optimizer.clone()),
            output_name: meta.output_name.to_string(),
            training_started_at: meta.started_at,
            minimal: !a.training_metadata,
            extra: meta.run.map(|r| r.keys.clone()).unwrap_or_default(),
        };
        if let Some(run) = meta.run {
            metadata.extra.extend(run.modelspec.clone());
        }
        if !metadata.minimal {
            metadata.extra.insert(
                "ss_training_finished_at".to_string(),
                crate::py_json::py_float(crate::adapter::kohya_meta::unix_now()),
            );
        }
        let dtype = match a.save_dtype {
            SaveDtype::Fp16 => DType::F16,
            SaveDtype::Bf16 => DType::BF16,
            SaveDtype::Fp32 => DType::F32,
        };
        save_kohya_with(path, &sets, meta.bundle, &metadata, dtype)?;
        Ok(())
    }
}

/// `ss_network_module` and `ss_network_args`: kohya's for LoRA/LoCon, LyCORIS's kohya network
/// (`lycoris.kohya`, with its `algo`) for LoHa, LoKr and DoRA (LyCORIS's `lora` with `dora_wd`,
/// input-axis: `wd_on_output` False).
fn network_args(mode: AdapterMode, a: &AdapterPlan) -> (&'static str, Vec<(String, String)>) {
    let f = crate::adapter::kohya_file::py_float;
    let mut args = Vec::new();
    let (module, algo) = match mode {
        AdapterMode::Lora => ("networks.lora", None),
        AdapterMode::Locon => ("networks.lora", None),
        AdapterMode::Loha => ("lycoris.kohya", Some("loha")),
        AdapterMode::Lokr => ("lycoris.kohya", Some("lokr")),
        AdapterMode::Dora => ("lycoris.kohya", Some("lora")),
    };
    if let Some(algo) = algo {
        args.push(("algo".to_string(), algo.to_string()));
    }
    if mode != AdapterMode::Lora {
        args.push(("conv_dim".to_string(), a.conv_rank.to_string()));
        args.push(("conv_alpha".to_string(), f(a.conv_alpha)));
    }
    if mode == AdapterMode::Lokr {
        args.push(("factor".to_string(), a.factor.to_string()));
    }
    if mode == AdapterMode::Dora {
        args.push(("dora_wd".to_string(), "True".to_string()));
        args.push(("wd_on_output".to_string(), "False".to_string()));
    }
    if a.dropout > 0.0 {
        args.push(("dropout".to_string(), f(a.dropout)));
    }
    // kohya's own `network_args` strings.
    for (key, p) in [
        ("rank_dropout", a.rank_dropout),
        ("module_dropout", a.module_dropout),
    ] {
        if p > 0.0 {
            args.push((key.to_string(), f(p)));
        }
    }
    // Block-wise ranks and weights as kohya's strings.
    args.extend(a.blocks.iter().flat_map(|b| b.network_args()));
    // LoRA+ as kohya's network_args would hold it: one ratio, or each group's.
    match (a.loraplus.unet, a.loraplus.text_encoder) {
        (Some(u), Some(t)) if u == t => args.push(("loraplus_lr_ratio".to_string(), f(u))),
        (u, t) => {
            let each = [
                ("loraplus_unet_lr_ratio", u),
                ("loraplus_text_encoder_lr_ratio", t),
            ];
            for (key, ratio) in each {
                if let Some(r) = ratio {
                    args.push((key.to_string(), f(r)));
                }
            }
        }
    }
    (module, args)
}

/// The run facts a saved adapter file records.
pub struct SaveInfo<'a> {
    pub steps: usize,
    pub epoch: usize,
    pub num_train_images: usize,
    pub resolution: usize,
    pub seed: u64,
    pub unet_lr: f64,
    pub text_encoder_lr: Option<f64>,
    pub output_name: &'a str,
    pub started_at: f64,
    /// The run's kohya metadata: `ss_optimizer` and the rest of kohya's keys (none without).
    pub run: Option<&'a super::kohya_run_metadata::KohyaRunMetadata>,
    /// Tensors saved beside the modules: a token's vectors bundled as `bundle_emb.<token>.…`.
    pub bundle: &'a [(String, candle_core::Tensor)],
}
