//! `sdtrain convert`: a diffusers folder to a single file and back draws the same image, a
//! `--save-dtype` casts every float tensor, `--vae` bakes another VAE in, and bad input is refused
//! with the reason.

mod common;

use std::path::Path;

use candle_core::DType;
use common::cli::{sample_bytes, sdtrain, text};

fn convert(dir: &Path, model: &str, out: &str, more: &[&str]) {
    let mut args = vec!["convert", "--model", model, "--out", out];
    args.extend_from_slice(more);
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
}

/// SD1.5 and SDXL folders become single files and folders again, and each draws the original's
/// image byte for byte. Catches a component left out, a tensor renamed where the loader does not
/// look, or a config (prediction type, scheduler) lost on the way.
#[test]
fn a_converted_model_draws_the_same_image() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-sd15", "tiny-sdxl"] {
        let base = common::fixture(name).display().to_string();
        let file = format!("{name}.safetensors");
        let folder = format!("{name}-again");
        convert(tmp.path(), &base, &file, &[]);
        convert(tmp.path(), &file, &folder, &[]);
        let want = sample_bytes(tmp.path(), &base, "base.png", &[]);
        assert!(
            sample_bytes(tmp.path(), &file, "file.png", &[]) == want,
            "{name}: single file"
        );
        assert!(
            sample_bytes(tmp.path(), &folder, "folder.png", &[]) == want,
            "{name}: folder"
        );
    }
}

/// `--save-dtype fp16` writes every float tensor of a single file and of a folder in f16 (the
/// integer ones keep theirs). Catches the dtype applied to one component only.
#[test]
fn save_dtype_casts_every_float_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::fixture("tiny-sd15").display().to_string();
    convert(
        tmp.path(),
        &base,
        "half.safetensors",
        &["--save-dtype", "fp16"],
    );
    convert(tmp.path(), &base, "half", &["--save-dtype", "fp16"]);
    let mut files = vec![tmp.path().join("half.safetensors")];
    for c in [
        "unet/diffusion_pytorch_model",
        "vae/diffusion_pytorch_model",
        "text_encoder/model",
    ] {
        files.push(tmp.path().join(format!("half/{c}.safetensors")));
    }
    for f in files {
        let tensors = candle_core::safetensors::load(&f, &candle_core::Device::Cpu).unwrap();
        let floats: Vec<_> = tensors.values().filter(|t| t.dtype().is_float()).collect();
        assert!(!floats.is_empty(), "{}", f.display());
        assert!(
            floats.iter().all(|t| t.dtype() == DType::F16),
            "{}",
            f.display()
        );
    }
}

/// `--vae` bakes another VAE in: the single file draws what the model draws with `sample --vae`.
#[test]
fn a_baked_vae_draws_as_sample_vae_does() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::fixture("tiny-sd15").display().to_string();
    let vae = common::fixture("tiny-sd21/vae").display().to_string();
    convert(tmp.path(), &base, "baked.safetensors", &["--vae", &vae]);
    let want = sample_bytes(tmp.path(), &base, "vae.png", &["--vae", &vae]);
    let plain = sample_bytes(tmp.path(), &base, "plain.png", &[]);
    assert!(want != plain, "the two VAEs draw the same image");
    assert!(sample_bytes(tmp.path(), "baked.safetensors", "baked.png", &[]) == want);
}

/// Bad input ends with an error naming the flag or the path; a folder of other files is kept.
#[test]
fn bad_conversions_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::fixture("tiny-sd15").display().to_string();
    std::fs::create_dir(tmp.path().join("notes")).unwrap();
    std::fs::write(tmp.path().join("notes/keep.txt"), "mine").unwrap();
    let missing = tmp.path().join("nothing-here").display().to_string();
    for (args, needle) in [
        (
            vec!["--model", &base, "--out", "notes"],
            "is not a diffusers folder",
        ),
        (
            vec!["--model", &base, "--out", &base, "--overwrite"],
            "would replace the base model",
        ),
        (
            vec!["--model", &missing, "--out", "x.safetensors"],
            "nothing-here",
        ),
        (
            vec![
                "--model",
                &base,
                "--out",
                "x.safetensors",
                "--save-dtype",
                "fp8",
            ],
            "must be fp32, fp16 or bf16",
        ),
    ] {
        let mut all = vec!["convert"];
        all.extend(args);
        let o = sdtrain(&all, tmp.path());
        assert!(!o.status.success(), "{all:?}");
        assert!(text(&o).contains(needle), "{all:?}: {}", text(&o));
    }
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("notes/keep.txt")).unwrap(),
        "mine"
    );
}
