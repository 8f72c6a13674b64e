//! UNet forward parity with diffusers 0.42.1 on the tiny fixtures (f32 ≤ 1e-4, bf16 ≤ 3e-2,
//! relative L2). Expected tensors: `tests/fixtures/make_fixtures.py` (keys `unet.*`).

mod common;

use candle_core::{DType, Device, Tensor};
use sdtrain::model::unet::{AddedConditions, UNet2DConditionModel, UnetConfig};
use sdtrain::model::weights::Weights;

fn load_unet(name: &str, dtype: DType) -> UNet2DConditionModel {
    let dir = common::fixture(name).join("unet");
    let cfg = UnetConfig::from_file(&dir.join("config.json")).unwrap();
    let files = [dir.join("diffusion_pytorch_model.safetensors")];
    let w = Weights::from_files(&files, "unet", dtype, &Device::Cpu, false).unwrap();
    let unet = UNet2DConditionModel::new(&w, &cfg).unwrap();
    assert!(w.unused().is_empty(), "unused tensors: {:?}", w.unused());
    unet
}

fn unet_output(name: &str, dtype: DType) -> (Tensor, Tensor) {
    let refs = common::reference(name);
    let unet = load_unet(name, dtype);
    let cast = |k: &str| common::get(&refs, k).to_dtype(dtype).unwrap();
    let added = refs.contains_key("unet.time_ids").then(|| AddedConditions {
        text_embeds: cast("unet.text_embeds"),
        time_ids: common::get(&refs, "unet.time_ids"),
    });
    let out = unet
        .forward(
            &cast("unet.sample"),
            &common::get(&refs, "unet.timesteps"),
            &cast("unet.encoder_hidden_states"),
            added.as_ref(),
        )
        .unwrap();
    (out, common::get(&refs, "unet.out"))
}

fn check(name: &str) {
    let (out, want) = unet_output(name, DType::F32);
    let err = common::rel_err(&out, &want);
    println!("{name} unet f32 rel err {err:.3e}");
    assert!(err <= 1e-4, "{name}: f32 UNet rel err {err}");
    let (out, want) = unet_output(name, DType::BF16);
    assert_eq!(out.dtype(), DType::BF16);
    let err = common::rel_err(&out, &want);
    println!("{name} unet bf16 rel err {err:.3e}");
    assert!(err <= 3e-2, "{name}: bf16 UNet rel err {err}");
}

#[test]
fn unet_matches_diffusers_sd15() {
    check("tiny-sd15");
}

#[test]
fn unet_matches_diffusers_sd21() {
    check("tiny-sd21");
}

#[test]
fn unet_matches_diffusers_sdxl() {
    check("tiny-sdxl");
}

#[test]
fn unet_rejects_latents_not_divisible_by_downsampling() {
    let unet = load_unet("tiny-sd15", DType::F32);
    let x = Tensor::zeros((1, 4, 10, 10), DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    let ctx = Tensor::zeros((1, 77, 32), DType::F32, &Device::Cpu).unwrap();
    let e = unet.forward(&x, &t, &ctx, None).unwrap_err().to_string();
    assert!(e.contains("multiple of 4"), "{e}");
}
