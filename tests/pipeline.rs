//! Whole-pipeline loading through the real path (model spec → folder → layout → models), and
//! prompt conditioning against transformers' outputs (`tests/fixtures/make_fixtures.py`).

mod common;

use candle_core::{DType, Device, Tensor};
use sdtrain::model::family::ModelFamily;
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::model::source::ModelSource;

const PROMPTS: [&str; 3] = [
    "a photo of a cat",
    "An astronaut riding a horse, highly detailed, 4k",
    "",
];

fn load(name: &str, dtype: DType, train: bool) -> StableDiffusion {
    let spec = common::fixture(name).display().to_string();
    let dir = ModelSource::parse(&spec).unwrap().resolve().unwrap();
    let layout = ModelLayout::read(&dir.path, None).unwrap();
    let opts = LoadOptions {
        dtype,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: train,
        train_text_encoders: train,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    StableDiffusion::load(layout, &opts).unwrap()
}

#[test]
fn sd15_and_sd21_condition_on_last_hidden_state() {
    for name in ["tiny-sd15", "tiny-sd21"] {
        let sd = load(name, DType::F32, false);
        let refs = common::reference(name);
        let cond = sd.encode_prompts(&PROMPTS, 0).unwrap();
        let err = common::rel_err(&cond.context, &common::get(&refs, "te.last_hidden_state"));
        assert!(err <= 1e-4, "{name}: context rel err {err}");
        assert!(cond.pooled.is_none());
    }
}

#[test]
fn sdxl_conditions_on_both_penultimate_layers_and_pooled_projection() {
    let sd = load("tiny-sdxl", DType::F32, false);
    assert_eq!(sd.family(), ModelFamily::Sdxl);
    let refs = common::reference("tiny-sdxl");
    let cond = sd.encode_prompts(&PROMPTS, 0).unwrap();
    let want = Tensor::cat(
        &[
            common::get(&refs, "te.penultimate"),
            common::get(&refs, "te2.penultimate"),
        ],
        2,
    )
    .unwrap();
    let err = common::rel_err(&cond.context, &want);
    assert!(err <= 1e-4, "context rel err {err}");
    let err = common::rel_err(
        &cond.pooled.unwrap(),
        &common::get(&refs, "te2.text_embeds"),
    );
    assert!(err <= 1e-4, "pooled rel err {err}");
}

#[test]
fn clip_skip_uses_an_earlier_layer_with_the_final_norm() {
    let sd = load("tiny-sd15", DType::F32, false);
    let skipped = sd.encode_prompts(&PROMPTS, 1).unwrap().context;
    let te = &sd.text_encoders[0].model;
    let want = te
        .final_layer_norm
        .forward(&common::get(
            &common::reference("tiny-sd15"),
            "te.penultimate",
        ))
        .unwrap();
    let err = common::rel_err(&skipped, &want);
    assert!(err <= 1e-4, "clip skip rel err {err}");
}

#[test]
fn bf16_load_keeps_trainable_params_as_f32_masters() {
    let sd = load("tiny-sdxl", DType::BF16, true);
    assert!(!sd.unet_weights.params().is_empty());
    assert!(sd
        .text_encoders
        .iter()
        .all(|te| !te.weights.params().is_empty()));
    assert!(sd
        .unet_weights
        .params()
        .iter()
        .all(|(_, v)| v.dtype() == DType::F32));
    assert_eq!(
        sd.vae().unwrap().dtype(),
        DType::BF16,
        "frozen weights in the compute dtype"
    );
    let cond = sd.encode_prompts(&["a cat"], 0).unwrap();
    assert_eq!(cond.context.dims(), &[1, 77, 64]);
    assert_eq!(
        cond.context.dtype(),
        DType::BF16,
        "activations in the compute dtype"
    );
}
