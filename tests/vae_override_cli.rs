//! `vae` (kohya's `--vae`): a VAE in place of the model's, from a VAE folder, a pipeline
//! folder, a `.safetensors` file in diffusers' or A1111's names (or a whole checkpoint's
//! `first_stage_model.`), or a hub repo id. tiny-sd21's VAE has tiny-sd15's architecture and
//! other weights; its single-file checkpoint was written by diffusers' own conversion script
//! (tests/fixtures/make_single_files.py), so its `first_stage_model.` names are other tools'.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use common::fixture;
use sdtrain::model::files::Component;
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::vae_source::open_vae;

/// The moments tiny-sd15's pipeline encodes a fixed image to, with `vae` in place of its own.
fn moments(vae: Option<&str>) -> Vec<f32> {
    let mut layout = ModelLayout::read(&fixture("tiny-sd15"), None).unwrap();
    if let Some(spec) = vae {
        let base = layout.component(Component::Vae).unwrap();
        let over = open_vae(spec, base, None).unwrap_or_else(|e| panic!("{spec}: {e:#}"));
        layout = layout.with_vae(over.files);
    }
    let sd = common::load_f32(layout);
    let values: Vec<f32> = (0..3 * 32 * 32)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let x = Tensor::from_vec(values, (1, 3, 32, 32), &Device::Cpu).unwrap();
    let m = sd.vae().unwrap().encode_moments(&x).unwrap();
    m.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// An A1111-style VAE file: the checkpoint's `first_stage_model.` tensors under their LDM names
/// without the prefix (as `vae-ft-mse-840000-ema-pruned.safetensors` stores them), plus a
/// non-weight the LDM code keeps.
fn a1111_vae_file(dir: &Path) -> PathBuf {
    let bytes = std::fs::read(fixture("single-file/tiny-sd21.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| Some((n.strip_prefix("first_stage_model.")?.to_string(), v)))
        .collect();
    let decay = 0.999f32.to_le_bytes();
    out.push((
        "model_ema.decay".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![], &decay).unwrap(),
    ));
    let path = dir.join("tiny-vae-a1111.safetensors");
    safetensors::serialize_to_file(out, None, &path).unwrap();
    path
}

/// Every form of tiny-sd21's VAE encodes as tiny-sd21's VAE does (its single file in f16, so to
/// f16's rounding), and not as tiny-sd15's own. Catches the override not applied, LDM names
/// mapped to the wrong layers, or a full checkpoint's other tensors taken for the VAE's.
#[test]
fn every_form_of_a_vae_encodes_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let own = moments(None);
    let folder = fixture("tiny-sd21/vae");
    let reference = moments(Some(folder.to_str().unwrap()));
    assert!(max_diff(&own, &reference) > 0.05, "the two VAEs differ");
    let exact = [
        fixture("tiny-sd21"),
        fixture("tiny-sd21/vae/diffusion_pytorch_model.safetensors"),
    ];
    for spec in exact {
        let got = moments(Some(spec.to_str().unwrap()));
        assert_eq!(got, reference, "{}", spec.display());
    }
    let half = [
        fixture("single-file/tiny-sd21.safetensors"),
        a1111_vae_file(tmp.path()),
    ];
    for spec in half {
        let got = moments(Some(spec.to_str().unwrap()));
        let d = max_diff(&got, &reference);
        assert!(d < 0.01, "{}: {d}", spec.display());
    }
}

/// A LoRA run with a VAE file: the console names it, and the file records kohya's
/// `ss_vae_name`, `ss_vae_hash` and `ss_new_vae_hash` (A1111's hashes of the file).
#[test]
fn a_run_records_the_vae_as_kohya_does() {
    let tmp = tempfile::tempdir().unwrap();
    let vae = a1111_vae_file(tmp.path());
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "vae": vae});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("vae: ") && log.contains("in place of the model's"),
        "{log}"
    );
    let bytes = std::fs::read(run_folder(tmp.path()).join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    let (legacy, full) = sdtrain::adapter::addnet_hash::file_hashes(&vae).unwrap();
    assert_eq!(meta["ss_vae_name"], "tiny-vae-a1111.safetensors");
    assert_eq!(meta["ss_vae_hash"], legacy);
    assert_eq!(meta["ss_new_vae_hash"], full);
}

/// A full fine-tune saves the VAE it trained with: its weights byte for byte and its own config
/// (scaling factor included), and the single file holds it too.
#[test]
fn a_full_fine_tune_saves_the_vae_in_its_place() {
    let tmp = tempfile::tempdir().unwrap();
    // tiny-sdxl's VAE has tiny-sd15's layers and SDXL's scaling factor, 0.13025.
    let extra = serde_json::json!({"mode": "full", "max_steps": 1, "save_ckpt_format": "both",
                                   "vae": fixture("tiny-sdxl/vae")});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let weights = "vae/diffusion_pytorch_model.safetensors";
    assert_eq!(
        std::fs::read(run.join("final").join(weights)).unwrap(),
        std::fs::read(fixture("tiny-sdxl").join(weights)).unwrap()
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("final/vae/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["scaling_factor"], 0.13025);
    // The single file (fp16, as saved by default) holds it too.
    let load = |path: PathBuf, name: &str| -> Vec<f32> {
        let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
        t[name]
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let saved = load(
        run.join("final.safetensors"),
        "first_stage_model.quant_conv.weight",
    );
    let sdxl = load(fixture("tiny-sdxl").join(weights), "quant_conv.weight");
    let own = load(fixture("tiny-sd15").join(weights), "quant_conv.weight");
    assert!(max_diff(&saved, &sdxl) < 1e-3, "{saved:?} {sdxl:?}");
    assert!(max_diff(&saved, &own) > 1e-2);
}

/// A hub repo id is read from the hub cache (offline), at the repo's root.
#[test]
fn a_hub_repo_vae_comes_from_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.join("models--test--tiny-vae");
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for f in ["config.json", "diffusion_pytorch_model.safetensors"] {
        std::fs::copy(fixture("tiny-sd21/vae").join(f), snapshot.join(f)).unwrap();
    }
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "vae": "test/tiny-vae"});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(["--config", cfg.to_str().unwrap(), "--cpu"])
        .current_dir(tmp.path())
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("vae: test/tiny-vae (hub repo"), "{log}");
    let bytes = std::fs::read(run_folder(tmp.path()).join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["ss_vae_name"], "test/tiny-vae");
    assert!(!meta.contains_key("ss_vae_hash"));
}

/// What cannot be a VAE is refused with exit 2, naming `vae` and the file.
#[test]
fn what_is_not_a_vae_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let wide = tmp.path().join("wide-vae");
    std::fs::create_dir_all(&wide).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-sd21/vae/config.json")).unwrap(),
    )
    .unwrap();
    config["latent_channels"] = 16.into();
    std::fs::write(wide.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        fixture("tiny-sd21/vae/diffusion_pytorch_model.safetensors"),
        wide.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let cases = [
        (
            serde_json::json!(fixture("kohya_tiny_sd15.safetensors")),
            "holds no VAE tensors",
        ),
        (serde_json::json!(wide), "latents of 16 channels"),
        (
            serde_json::json!("not a repo id"),
            "neither an existing file or folder",
        ),
        (serde_json::json!(tmp.path()), "neither a VAE"),
    ];
    for (vae, says) in cases {
        let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "vae": vae});
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sdtrain"))
            .args(["--config", cfg.to_str().unwrap(), "--cpu"])
            .current_dir(tmp.path())
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_HUB_CACHE", tmp.path().join("empty-cache"))
            .output()
            .unwrap();
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{vae}: {log}");
        assert!(log.contains("vae") && log.contains(says), "{vae}: {log}");
    }
}

/// `sdtrain sample --vae` decodes with that VAE: the same seed draws another image than with
/// the model's own VAE, and the VAE is named on the console.
#[test]
fn sample_decodes_with_the_vae_given() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("tiny-sd15");
    let vae = fixture("tiny-sd21/vae");
    let draw = |name: &str, vae: Option<&Path>| {
        let out_path = tmp.path().join(name);
        let mut args = vec![
            "sample".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--prompt".into(),
            "a cat".into(),
            "--steps".into(),
            "1".into(),
            "--width".into(),
            "32".into(),
            "--height".into(),
            "32".into(),
            "--cpu".into(),
            "--out".into(),
            out_path.display().to_string(),
        ];
        if let Some(v) = vae {
            args.extend(["--vae".into(), v.display().to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = sdtrain(&args, tmp.path());
        assert!(out.status.success(), "{}", text(&out));
        (text(&out), std::fs::read(out_path).unwrap())
    };
    let (_, own) = draw("own.png", None);
    let (log, with_vae) = draw("vae.png", Some(&vae));
    assert!(log.contains("in place of the model's"), "{log}");
    assert_ne!(own, with_vae);
}
