//! Adapter files (LoRA, LoCon, LoHa, LoKr, DoRA) round-trip: adapters with trained (non-zero) weights are saved in kohya's
//! format, loaded into a fresh model with `init_from`, and give the same UNet output. The same
//! file merged into a fresh model's weights (`sdtrain sample --lora`) gives that output too, and
//! the same text-encoder outputs.

mod common;

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::model::unet::AddedConditions;
use sdtrain::train::adapters::{attach_with, SaveInfo, TrainedAdapters};

fn load(name: &str) -> StableDiffusion {
    common::load_frozen_f32(name)
}

fn plan(init_from: Option<PathBuf>, save_dtype: SaveDtype) -> AdapterPlan {
    AdapterPlan {
        rank: 4,
        alpha: 2.0,
        conv_rank: 2,
        conv_alpha: 1.0,
        train_text_encoder: true,
        train_unet: true,
        unet_lr: None,
        text_encoder_lr: None,
        dropout: 0.0,
        factor: -1,
        init_from,
        save_dtype,
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

fn unet_out(sd: &StableDiffusion, name: &str) -> Tensor {
    let refs = common::reference(name);
    let added = refs.get("unet.time_ids").map(|ids| AddedConditions {
        text_embeds: common::get(&refs, "unet.text_embeds"),
        time_ids: ids.clone(),
    });
    sd.unet
        .forward(
            &common::get(&refs, "unet.sample"),
            &common::get(&refs, "unet.timesteps"),
            &common::get(&refs, "unet.encoder_hidden_states"),
            added.as_ref(),
        )
        .unwrap()
}

fn randomise(a: &TrainedAdapters) {
    common::randomise_adapters(&a.modules);
}

fn round_trip(name: &str, mode: TrainMode, dtype: SaveDtype, tol: f32) {
    let mut sd = load(name);
    let base = unet_out(&sd, name);
    let a = attach_with(&mut sd, mode, plan(None, dtype), 7).unwrap();
    sdtrain::adapter::set_training(&a.modules, false);
    randomise(&a);
    let before = unet_out(&sd, name);
    assert!(
        common::rel_err(&before, &base) > 1e-3,
        "{name}: the adapters change nothing"
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("lora.safetensors");
    let info = SaveInfo {
        steps: 1,
        epoch: 1,
        num_train_images: 8,
        resolution: 64,
        seed: 7,
        unet_lr: 1e-4,
        text_encoder_lr: Some(5e-5),
        output_name: "lora",
        started_at: 0.0,
        run: None,
        bundle: &[],
    };
    a.save(&file, info).unwrap();

    let mut fresh = load(name);
    let b = attach_with(&mut fresh, mode, plan(Some(file), dtype), 99).unwrap();
    sdtrain::adapter::set_training(&b.modules, false);
    let after = unet_out(&fresh, name);
    let err = common::rel_err(&after, &before);
    assert!(
        err <= tol,
        "{name} {mode:?} {dtype:?}: round-trip rel err {err}"
    );
    let te_adapters = fresh.encode_prompts(&["a cat on a mat"], 0).unwrap();

    let file = tmp.path().join("lora.safetensors");
    let kohya = sdtrain::adapter::kohya_file::load_kohya(&file, &Device::Cpu).unwrap();
    let mut merged = load(name);
    let naming = sdtrain::adapter::kohya_naming(&merged);
    let n = sdtrain::adapter::merge::merge_kohya(&mut merged, &naming, &kohya, 1.0).unwrap();
    assert_eq!(n, b.modules.len(), "{name}: every module merged");
    let err = common::rel_err(&unet_out(&merged, name), &after);
    assert!(err <= 1e-5, "{name} {mode:?}: merged UNet rel err {err}");
    let te_merged = merged.encode_prompts(&["a cat on a mat"], 0).unwrap();
    let err = common::rel_err(&te_merged.context, &te_adapters.context);
    assert!(
        err <= 1e-5,
        "{name} {mode:?}: merged text encoder rel err {err}"
    );
    // Multiplier 0 leaves the base model.
    let mut zero = load(name);
    sdtrain::adapter::merge::merge_kohya(&mut zero, &naming, &kohya, 0.0).unwrap();
    assert!(common::rel_err(&unet_out(&zero, name), &base) <= 1e-6);
}

#[test]
fn loha_round_trips_exactly_in_fp32_sd15() {
    round_trip("tiny-sd15", TrainMode::Loha, SaveDtype::Fp32, 1e-6);
}

#[test]
fn lokr_round_trips_in_default_fp16_sd21() {
    round_trip("tiny-sd21", TrainMode::Lokr, SaveDtype::Fp16, 2e-3);
}

#[test]
fn dora_round_trips_exactly_in_fp32_sdxl() {
    round_trip("tiny-sdxl", TrainMode::Dora, SaveDtype::Fp32, 1e-6);
}

#[test]
fn lora_round_trips_exactly_in_fp32_sd15() {
    round_trip("tiny-sd15", TrainMode::Lora, SaveDtype::Fp32, 1e-6);
}

#[test]
fn locon_round_trips_in_default_fp16_sd21() {
    round_trip("tiny-sd21", TrainMode::Locon, SaveDtype::Fp16, 2e-3);
}

#[test]
fn sdxl_lora_round_trips_through_ldm_names() {
    round_trip("tiny-sdxl", TrainMode::Lora, SaveDtype::Fp32, 1e-6);
}
