//! sdtrain's adapters against LyCORIS (lycoris-lora 4.1.3) on tiny-sdxl: the UNet and both text
//! encoders (`lora_unet`, `lora_te1`, `lora_te2`), from the numbers
//! tests/fixtures/lycoris_sdxl_reference.py wrote under tests/fixtures/lycoris/sdxl/ (rerun
//! command there). tests/lycoris_parity.rs does the same on tiny-sd15 and checks each module type
//! on its own.
//!
//! - Files sdtrain writes for SDXL (all five modes) use kohya's original-SGM UNet names
//!   (`lora_unet_input_blocks_4_1_…`). The script maps them to diffusers names with diffusers' own
//!   converter and loads them into `create_lycoris_from_weights` on the diffusers UNet and the two
//!   CLIP text encoders: every module is placed, no key is missing or unexpected, and LyCORIS's
//!   UNet output and both text encoders' outputs equal sdtrain's.
//! - Files LyCORIS writes (`create_lycoris` + `save_weights` on the diffusers UNet, so diffusers
//!   names, `lora_unet_down_blocks_1_attentions_0_…`; LoHa, LoKr, DoRA, LoCon) load as
//!   `adapter.init_from` and merge (`sdtrain sample --lora`), giving LyCORIS's outputs.
//! - A file written as SimpleTuner writes its LyCORIS networks (UNet only, LyCORIS's default
//!   `lycoris_` prefix, SimpleTuner's example `lycoris_config.json`: LoKr, factor 16/8, full `w2`)
//!   merges and gives LyCORIS's UNet output.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use sdtrain::adapter::kohya_file::load_kohya;
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::model::unet::AddedConditions;
use sdtrain::train::adapters::attach_with;

const MODES: [(&str, TrainMode); 5] = [
    ("lora", TrainMode::Lora),
    ("locon", TrainMode::Locon),
    ("loha", TrainMode::Loha),
    ("lokr", TrainMode::Lokr),
    ("dora", TrainMode::Dora),
];

/// The reference inputs' fixture.
const FIXTURE: &str = "tiny-sdxl";

fn dir() -> PathBuf {
    common::fixture("lycoris/sdxl")
}

fn tensors_of(path: &Path) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

fn load_sdxl() -> StableDiffusion {
    common::load_frozen_f32(FIXTURE)
}

/// The settings lycoris_sdxl_reference.py uses.
fn plan(init_from: Option<PathBuf>) -> AdapterPlan {
    common::lycoris_plan(init_from, SaveDtype::Fp16)
}

/// Writes sdtrain's SDXL file for `mode` (seed 7, every factor randomised) to `path`.
fn write_sdtrain_file(mode: TrainMode, path: &Path) {
    common::write_random_adapter(load_sdxl(), mode, plan(None), path);
}

/// Regenerates the committed `sdtrain_<mode>.safetensors` that lycoris_sdxl_reference.py reads.
#[test]
#[ignore = "writes tests/fixtures/lycoris/sdxl/sdtrain_*.safetensors for lycoris_sdxl_reference.py"]
fn write_sdtrain_sdxl_files() {
    std::fs::create_dir_all(dir()).unwrap();
    for (name, mode) in MODES {
        write_sdtrain_file(mode, &dir().join(format!("sdtrain_{name}.safetensors")));
    }
}

/// The outputs the reference script records, sdtrain's side: the UNet's on the reference inputs
/// (`unet`), each text encoder's last hidden state on the reference prompts (`te1`, `te2`) and
/// text_encoder_2's projected pooled output (`te2_embeds`).
fn outputs(sd: &StableDiffusion) -> BTreeMap<&'static str, Tensor> {
    let refs = common::reference(FIXTURE);
    let get = |k: &str| common::get(&refs, k);
    let added = AddedConditions {
        text_embeds: get("unet.text_embeds"),
        time_ids: get("unet.time_ids"),
    };
    let unet = sd
        .unet
        .forward(
            &get("unet.sample"),
            &get("unet.timesteps"),
            &get("unet.encoder_hidden_states"),
            Some(&added),
        )
        .unwrap();
    let te1 = sd.text_encoders[0]
        .model
        .forward(&get("te.input_ids"), 0)
        .unwrap();
    let te2 = sd.text_encoders[1]
        .model
        .forward(&get("te2.input_ids"), 0)
        .unwrap();
    BTreeMap::from([
        ("unet", unet),
        ("te1", te1.last_hidden_state),
        ("te2", te2.last_hidden_state),
        (
            "te2_embeds",
            te2.text_embeds.expect("text_encoder_2 projects"),
        ),
    ])
}

/// Checks every output against the reference's `<tag>.<output>` (relative error ≤ `tol`), and,
/// with `base`, that the file moved each of them (so that each component's modules are checked).
fn assert_outputs(
    what: &str,
    ours: &BTreeMap<&str, Tensor>,
    reference: &BTreeMap<String, Tensor>,
    tag: &str,
    tol: f32,
) {
    for (out, t) in ours {
        let want = &reference[&format!("{tag}.{out}")];
        let change = common::rel_err(&reference[&format!("base.{out}")], want);
        assert!(
            change > 1e-3,
            "{what}: the file changes LyCORIS's {out} by {change}"
        );
        let err = common::rel_err(t, want);
        eprintln!("{what}: {out} rel err against LyCORIS {err:.2e} (change {change:.2e})");
        assert!(err <= tol, "{what}: {out} rel err against LyCORIS {err}");
    }
}

fn attach(mode: TrainMode, file: &Path) -> (StableDiffusion, usize) {
    let mut sd = load_sdxl();
    let a = attach_with(&mut sd, mode, plan(Some(file.to_path_buf())), 1).unwrap();
    sdtrain::adapter::set_training(&a.modules, false);
    let n = a.modules.len();
    (sd, n)
}

#[test]
fn sdtrain_sdxl_files_load_into_lycoris_and_give_its_outputs() {
    let report = common::reference_json("lycoris/sdxl/from_sdtrain.json");
    let outs = tensors_of(&dir().join("from_sdtrain.safetensors"));
    let base = outputs(&load_sdxl());
    for (out, t) in &base {
        // The reference inputs give sdtrain's base model LyCORIS's base outputs.
        let err = common::rel_err(t, &outs[&format!("base.{out}")]);
        assert!(err <= 1e-5, "base {out}: rel err {err}");
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, mode) in MODES {
        // The committed file is what sdtrain writes today.
        let committed = dir().join(format!("sdtrain_{name}.safetensors"));
        let fresh = tmp.path().join(format!("{name}.safetensors"));
        write_sdtrain_file(mode, &fresh);
        let (a, b) = (tensors_of(&committed), tensors_of(&fresh));
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, t) in &a {
            assert_eq!(common::max_abs_diff(t, &b[k]), 0.0, "{name}: {k}");
        }
        // LyCORIS placed every module of each component and found every key.
        for prefix in ["lora_unet", "lora_te1", "lora_te2"] {
            let r = &report[name][prefix];
            let n = r["file_modules"].as_u64().unwrap();
            assert!(n > 0, "{name} {prefix}");
            assert_eq!(n, r["lycoris_modules"].as_u64().unwrap(), "{name} {prefix}");
            let in_file = a
                .keys()
                .filter(|k| k.starts_with(&format!("{prefix}_")) && k.ends_with(".alpha"))
                .count();
            assert_eq!(in_file as u64, n, "{name} {prefix}: modules in the file");
            for list in [
                "file_modules_without_layer",
                "missing_keys",
                "unexpected_keys",
            ] {
                let l = r[list].as_array().unwrap();
                assert!(l.is_empty(), "{name} {prefix} {list}: {l:?}");
            }
        }
        // LyCORIS's outputs with the file are sdtrain's.
        let (sd, _) = attach(mode, &committed);
        assert_outputs(name, &outputs(&sd), &outs, name, 1e-5);
    }
}

/// sdtrain's SGM names are the ones diffusers' SDXL kohya converter turns into the same modules'
/// diffusers paths: every UNet module of a LoCon run, named forwards by sdtrain, appears in the
/// script's map with its own path.
#[test]
fn sdtrain_sgm_names_are_diffusers_converter_names() {
    let map = common::reference_json("lycoris/sdxl/sgm_to_diffusers.json");
    let map = map.as_object().unwrap();
    let mut sd = load_sdxl();
    let a = attach_with(&mut sd, TrainMode::Locon, plan(None), 7).unwrap();
    let naming = sdtrain::adapter::kohya_naming(&sd);
    let mut seen = 0;
    for m in &a.modules {
        if m.component != sdtrain::adapter::AdapterComponent::Unet {
            continue;
        }
        let sgm = naming
            .module_name(
                sdtrain::adapter::kohya_names::KohyaComponent::Unet,
                &m.module_path,
            )
            .unwrap();
        let want = format!("lora_unet_{}", m.module_path.replace('.', "_"));
        assert_eq!(map[&sgm].as_str(), Some(want.as_str()), "{sgm}");
        seen += 1;
    }
    assert_eq!(seen, map.len(), "modules sdtrain names against the map");
}

/// Merges `file` into a fresh tiny-sdxl (what `sdtrain sample --lora` does); returns the model
/// and the number of modules merged.
fn merged(file: &Path) -> (StableDiffusion, usize) {
    let kohya = load_kohya(file, &Device::Cpu).unwrap();
    let mut sd = load_sdxl();
    let naming = sdtrain::adapter::kohya_naming(&sd);
    let n = sdtrain::adapter::merge::merge_kohya(&mut sd, &naming, &kohya, 1.0).unwrap();
    (sd, n)
}

#[test]
fn lycoris_sdxl_files_load_as_init_from_and_merge() {
    let outs = tensors_of(&dir().join("from_lycoris.safetensors"));
    for (name, mode) in [
        ("loha", TrainMode::Loha),
        ("lokr", TrainMode::Lokr),
        ("dora", TrainMode::Dora),
        ("locon", TrainMode::Locon),
    ] {
        let file = dir().join(format!("lycoris_{name}.safetensors"));
        // LyCORIS on a diffusers UNet: diffusers names under kohya's prefix.
        let keys = tensors_of(&file);
        assert!(keys
            .keys()
            .any(|k| k.starts_with("lora_unet_down_blocks_1_attentions_0_")));
        let (sd, modules) = attach(mode, &file);
        let what = format!("{name} as init_from");
        assert_outputs(&what, &outputs(&sd), &outs, name, 1e-5);

        // Merging rounds `W + ΔW` to f32 once per layer where LyCORIS adds the two outputs; with
        // these files' large random factors (they change the UNet output by 110–150%) the UNet
        // is sensitive to that rounding: LyCORIS's own LoCon output moves by 5.2e-6 between f32
        // and f64. Measured merged errors are ≤ 9.2e-6.
        let (sd, n) = merged(&file);
        assert_eq!(n, modules, "{name}: every module merged");
        assert_outputs(&format!("{name} merged"), &outputs(&sd), &outs, name, 3e-5);
    }
}

#[test]
fn simpletuner_lycoris_file_merges() {
    let outs = tensors_of(&dir().join("from_lycoris.safetensors"));
    let file = dir().join("simpletuner_lokr.safetensors");
    let keys = tensors_of(&file);
    assert!(keys.keys().all(|k| k.starts_with("lycoris_")));
    assert!(keys.values().all(|t| t.dtype() == DType::BF16));
    let modules = keys.keys().filter(|k| k.ends_with(".alpha")).count();
    let (sd, n) = merged(&file);
    assert_eq!(n, modules, "every module merged");
    let unet = &outputs(&sd)["unet"];
    let change = common::rel_err(&outs["base.unet"], &outs["simpletuner.unet"]);
    assert!(change > 1e-3, "the file changes LyCORIS's UNet by {change}");
    let err = common::rel_err(unet, &outs["simpletuner.unet"]);
    eprintln!("SimpleTuner LoKr merged: UNet rel err {err:.2e} (change {change:.2e})");
    assert!(err <= 1e-5, "SimpleTuner LoKr merged: UNet rel err {err}");
}

/// A module name that matches no layer of the model (here diffusers-style names of layers tiny-sdxl
/// lacks, and a text-encoder module under the UNet-only `lycoris_` prefix) is an error that names
/// it, for `init_from` and for merging; nothing is silently skipped.
#[test]
fn unknown_sdxl_module_names_are_errors_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in [
        "lora_unet_down_blocks_0_attentions_0_proj_in", // level 0 of SDXL has no attention
        "lycoris_down_blocks_1_attentions_0_transformer_blocks_5_attn1_to_q",
        "lycoris_text_model_encoder_layers_0_mlp_fc1",
    ] {
        let mut all: std::collections::HashMap<String, Tensor> =
            tensors_of(&dir().join("lycoris_locon.safetensors"))
                .into_iter()
                .collect();
        let down = Tensor::zeros((2, 16), DType::F32, &Device::Cpu).unwrap();
        let up = Tensor::zeros((16, 2), DType::F32, &Device::Cpu).unwrap();
        all.insert(format!("{bad}.lora_down.weight"), down);
        all.insert(format!("{bad}.lora_up.weight"), up);
        let file = tmp.path().join("bad.safetensors");
        candle_core::safetensors::save(&all, &file).unwrap();

        let mut sd = load_sdxl();
        let err = attach_with(&mut sd, TrainMode::Locon, plan(Some(file.clone())), 1)
            .err()
            .expect("init_from accepted an unknown module");
        let msg = format!("{err:#}");
        assert!(msg.contains(bad) && msg.contains("1 module(s)"), "{msg}");

        let kohya = load_kohya(&file, &Device::Cpu).unwrap();
        let mut sd = load_sdxl();
        let naming = sdtrain::adapter::kohya_naming(&sd);
        let err = sdtrain::adapter::merge::merge_kohya(&mut sd, &naming, &kohya, 1.0).unwrap_err();
        assert!(err.to_string().contains(bad), "{err}");
    }
}
