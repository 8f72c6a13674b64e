//! kohya sd-scripts' DreamBooth folders and regularization images against kohya's own code
//! (tests/fixtures/reference/kohya_dreambooth.json, written by
//! tests/fixtures/kohya_dreambooth_reference.py, whose docstring has the rerun command):
//! - the folders of `data_layout: "kohya"`: which subfolders are read, each image's caption
//!   (caption file, class tokens) and repeats, for `.caption` and `.txt` caption files;
//! - the regularization set's size (kohya's balancing loop), on whole-number repeats;
//! - the loss with each sample's own weight (`prior_loss_weight`), alone and with min-SNR and
//!   debiased estimation, in kohya's `process_batch` order.

mod common;

use std::path::Path;

use candle_core::{Device, Tensor};
use sdtrain::data::kohya_layout::scan_kohya;
use sdtrain::data::regularization::balance;
use sdtrain::diffusion::loss::{LossConfig, LossInputs};
use sdtrain::diffusion::NoiseSchedule;
use serde_json::Value;

fn reference() -> Value {
    let path = common::fixture("reference/kohya_dreambooth.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Builds the reference's tree of empty images and caption files under `base`.
fn build_tree(r: &Value, base: &Path) {
    for entry in r["tree"].as_array().unwrap() {
        let path = base.join(entry["path"].as_str().unwrap());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, entry["text"].as_str().unwrap_or("")).unwrap();
    }
}

/// Catches a subfolder read that kohya ignores (no count, a count of 0, nested, loose images),
/// a caption from the wrong file or line, or repeats taken from the wrong place.
#[test]
fn kohya_folders_read_as_sd_scripts_reads_them() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    build_tree(&r, tmp.path());
    for (ext, want) in r["folders"].as_object().unwrap() {
        for (folder, is_reg) in [("train", false), ("reg", true)] {
            let records = scan_kohya("data_root", &tmp.path().join(folder), ext).unwrap();
            let ours: Vec<(String, String, f64)> = records
                .iter()
                .map(|rec| {
                    let rel = rec.path.strip_prefix(tmp.path()).unwrap();
                    let rel = rel.to_string_lossy().replace('\\', "/");
                    (rel, rec.caption.clone(), rec.multiplier)
                })
                .collect();
            let theirs: Vec<(String, String, f64)> = want
                .as_array()
                .unwrap()
                .iter()
                .filter(|w| w["is_reg"].as_bool() == Some(is_reg))
                .map(|w| {
                    (
                        w["path"].as_str().unwrap().to_string(),
                        w["caption"].as_str().unwrap().to_string(),
                        w["repeats"].as_f64().unwrap(),
                    )
                })
                .collect();
            assert_eq!(ours, theirs, "{folder} with {ext}");
        }
    }
}

/// Catches a balance that stops too early or late, deals the extra repeats in another order,
/// or keeps images kohya leaves out.
#[test]
fn regularization_sets_are_sized_as_sd_scripts_sizes_them() {
    let r = reference();
    let cases = r["balance"].as_array().unwrap();
    for case in cases {
        let f = |v: &Value| -> Vec<f64> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        let (reg, want) = (f(&case["reg"]), f(&case["repeats"]));
        let train = case["train"].as_f64().unwrap();
        assert_eq!(balance(&reg, train), want, "{case}");
    }
    assert!(cases.len() >= 10);
}

/// Catches a sample weight dropped, applied to the wrong sample, squared, or normalised by the
/// weights' sum.
#[test]
fn sample_weights_weigh_the_loss_as_sd_scripts_does() {
    let r = reference();
    let l = &r["loss"];
    let shape: Vec<usize> = common::dims(&l["shape"]);
    let tensor = |k: &str| {
        let v: Vec<f32> = l[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap()
    };
    let (pred, target) = (tensor("pred"), tensor("target"));
    let timesteps: Vec<u32> = l["timesteps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let schedule =
        NoiseSchedule::from_config(&l["scheduler_config"], Path::new("scheduler_config.json"))
            .unwrap();
    for case in l["cases"].as_array().unwrap() {
        let weights: Vec<f64> = case["sample_weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let cfg = LossConfig {
            min_snr_gamma: case["min_snr_gamma"].as_f64(),
            debiased_estimation: case["debiased"].as_bool().unwrap(),
            ..LossConfig::mse()
        };
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &timesteps,
            mask: None,
            sample_weights: Some(&weights),
        };
        let ours = cfg
            .loss(&schedule, schedule.prediction_type(), &inputs)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let want = case["loss"].as_f64().unwrap();
        let rel = (f64::from(ours) - want).abs() / want.abs();
        assert!(rel < 2e-6, "{case}: ours {ours}, rel {rel:.1e}");
    }
}
