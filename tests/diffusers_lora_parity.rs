//! LoRA files in diffusers' own layouts (tests/fixtures/diffusers_lora_reference.py, diffusers
//! 0.42.1 + PEFT 0.21.2): what its training scripts save (`lora.down`/`lora_linear_layer` keys,
//! no alpha), PEFT's keys with the `LoraConfig` in the header (lora_alpha, an alpha_pattern,
//! rsLoRA) and diffusers 0.14's attention-processor keys. Merged the way `sdtrain sample --lora`
//! merges, every adapted layer's weight is the one diffusers fuses from the same file; and the
//! files start a run as `adapter.init_from`, giving the merged model's UNet output.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use sdtrain::adapter::kohya_file::load_kohya;
use sdtrain::adapter::merge::merge_kohya;
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::train::adapters::attach_with;

const CASES: [(&str, &str); 5] = [
    ("sd15", "scripts"),
    ("sd15", "peft"),
    ("sd15", "processor"),
    ("sdxl", "scripts"),
    ("sdxl", "peft"),
];

fn dir() -> PathBuf {
    common::repo_root().join("tests/fixtures/diffusers_lora")
}

fn fixture(model: &str) -> &'static str {
    if model == "sd15" {
        "tiny-sd15"
    } else {
        "tiny-sdxl"
    }
}

/// Catches each reading of diffusers' layouts a one-line bug would break: lora_A read as up, the
/// metadata's lora_alpha (or its alpha_pattern, or rsLoRA's √r) not applied, a scale of
/// `alpha/r` assumed for a file without alpha, a processor key mapped to the wrong projection,
/// a text encoder alias missing (the module would be unknown).
#[test]
fn diffusers_lora_files_merge_as_diffusers_merges_them() {
    for (model, kind) in CASES {
        let what = format!("{model}_{kind}");
        let file = load_kohya(&dir().join(format!("{what}.safetensors")), &Device::Cpu).unwrap();
        let reference: HashMap<String, Tensor> = candle_core::safetensors::load(
            dir().join(format!("merged_{what}.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let mut sd = common::load_frozen_f32(fixture(model));
        let naming = sdtrain::adapter::kohya_naming(&sd);
        let n = merge_kohya(&mut sd, &naming, &file, 1.0).unwrap();
        assert_eq!(n, reference.len(), "{what}: merged modules");
        let all = common::layer_weights(&mut sd);
        let mut worst = 0f32;
        for (key, want) in &reference {
            let got =
                common::layer_weight(&all, key).unwrap_or_else(|| panic!("{what}: no layer {key}"));
            let err = common::rel_err(got, want);
            worst = worst.max(err);
            assert!(err <= 1e-6, "{what}: {key}: rel err {err}");
        }
        eprintln!("{what}: {n} layers, worst rel err {worst:.1e}");
    }
}

fn plan(init_from: PathBuf) -> AdapterPlan {
    AdapterPlan {
        rank: 4,
        alpha: 4.0,
        conv_rank: 4,
        conv_alpha: 4.0,
        train_text_encoder: true,
        train_unet: true,
        unet_lr: None,
        text_encoder_lr: None,
        dropout: 0.0,
        factor: -1,
        init_from: Some(init_from),
        save_dtype: SaveDtype::Fp32,
        training_metadata: true,
        training_comment: None,
        dim_from_weights: false,
        loraplus: Default::default(),
        rank_dropout: 0.0,
        module_dropout: 0.0,
        blocks: None,
        layer_filter: None,
        scale_weight_norms: None,
    }
}

fn unet_out(sd: &StableDiffusion) -> Tensor {
    common::sd15_unet_out(sd)
}

/// A diffusers file as `init_from` of a LoRA run: the adapters start from its factors and its
/// scale, so the UNet gives the merged model's output.
#[test]
fn diffusers_lora_files_start_a_lora_run() {
    for kind in ["scripts", "peft"] {
        let path = dir().join(format!("sd15_{kind}.safetensors"));
        let mut sd = common::load_frozen_f32("tiny-sd15");
        let a = attach_with(&mut sd, TrainMode::Lora, plan(path.clone()), 1).unwrap();
        sdtrain::adapter::set_training(&a.modules, false);
        let mut merged = common::load_frozen_f32("tiny-sd15");
        let naming = sdtrain::adapter::kohya_naming(&merged);
        merge_kohya(
            &mut merged,
            &naming,
            &load_kohya(&path, &Device::Cpu).unwrap(),
            1.0,
        )
        .unwrap();
        let err = common::rel_err(&unet_out(&sd), &unet_out(&merged));
        eprintln!("sd15_{kind} as init_from: UNet rel err {err:.1e} against the merge");
        assert!(err <= 1e-5, "sd15_{kind}: rel err {err}");
    }
}
