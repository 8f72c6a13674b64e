//! kohya's `block_lr` (sdxl_train.py's per-block learning rates of an SDXL full fine-tune),
//! from the CLI on the tiny SDXL fixture: after one AdamW step each UNet tensor has moved by at
//! most its block's rate (Adam's first update is ±lr where the gradient is not tiny), and a
//! block at 0 not at all.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sdtrain::model::single_file::names::unet_to_ldm;
use sdtrain::model::single_file::unet_blocks;
use sdtrain::model::unet::UnetConfig;

fn load(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// kohya's block of an LDM name (sdxl_train.py), written out again here.
fn block(ldm: &str) -> usize {
    let n = |rest: &str| rest.split('.').next().unwrap().parse::<usize>().unwrap();
    if ldm.starts_with("time_embed.") || ldm.starts_with("label_emb.") {
        0
    } else if let Some(r) = ldm.strip_prefix("input_blocks.") {
        1 + n(r)
    } else if let Some(r) = ldm.strip_prefix("middle_block.") {
        10 + n(r)
    } else if let Some(r) = ldm.strip_prefix("output_blocks.") {
        13 + n(r)
    } else {
        assert!(ldm.starts_with("out."), "{ldm}");
        22
    }
}

/// Every block at its own rate (23 different ones), three at 0. Catches a block numbered one
/// off (its tensors move by a neighbour's rate), a block at 0 that trains, and the group's `lr`
/// used instead of the blocks'.
#[test]
fn each_block_trains_at_its_own_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("optimizer.json"),
        serde_json::json!({"base": {"optimizer": "adamw", "weight_decay": 0.0,
                                     "epsilon": 1e-12}})
        .to_string(),
    )
    .unwrap();
    let rates: Vec<f64> = (0..23)
        .map(|i| match i {
            0 | 11 | 22 => 0.0,
            i => 1e-3 * (1.0 + 0.1 * i as f64),
        })
        .collect();
    let cfg = write_config(
        dir,
        "tiny-sdxl",
        &demo_data(),
        serde_json::json!({
            "mode": "full", "max_steps": 1, "lr": 5e-2, "block_lr": rates,
            "optimizer_config": "optimizer.json", "save_full_precision": true,
            "clip_grad_norm": null, "save_every_n_epochs": 0
        }),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let fixture = common::fixture("tiny-sdxl").join("unet");
    let before = load(&fixture.join("diffusion_pytorch_model.safetensors"));
    let run = run_folder(dir);
    let after = load(&run.join("final/unet/diffusion_pytorch_model.safetensors"));
    let config: UnetConfig = UnetConfig::from_file(&fixture.join("config.json")).unwrap();
    let blocks = unet_blocks(&config).unwrap();
    let mut moved = [0.0f64; 23];
    for (name, b) in &before {
        let ldm = unet_to_ldm(name, &blocks).unwrap_or_else(|| panic!("{name}"));
        let a = after[name].to_dtype(DType::F32).unwrap();
        let diff = common::max_abs_diff(&a, &b.to_dtype(DType::F32).unwrap()) as f64;
        let k = block(&ldm);
        moved[k] = moved[k].max(diff);
    }
    eprintln!("moved per block: {moved:?}");
    for (k, (m, r)) in moved.iter().zip(&rates).enumerate() {
        match *r {
            0.0 => assert_eq!(*m, 0.0, "block {k} is at 0 but moved {m}"),
            r => assert!(
                *m <= r * 1.0001 && *m >= r * 0.999,
                "block {k}: moved {m}, its rate {r}: {moved:?}"
            ),
        }
    }
}

/// Refused before anything loads (or, for a model that is not SDXL, when it loads), naming
/// `block_lr`.
#[test]
fn a_block_lr_that_cannot_apply_is_refused() {
    let rates = |n: usize| serde_json::json!(vec![1e-4; n]);
    for (fixture, extra, says) in [
        (
            "tiny-sdxl",
            serde_json::json!({"mode": "lora", "block_lr": rates(23)}),
            "full fine-tune",
        ),
        (
            "tiny-sdxl",
            serde_json::json!({"mode": "full", "block_lr": rates(22)}),
            "22 rates",
        ),
        (
            "tiny-sdxl",
            serde_json::json!({"mode": "full", "block_lr": "1e-4,x"}),
            "comma-separated",
        ),
        (
            "tiny-sdxl",
            serde_json::json!({"mode": "full", "block_lr": rates(23).as_array().unwrap().iter().enumerate().map(|(i, _)| if i == 3 { -1.0 } else { 1e-4 }).collect::<Vec<f64>>()}),
            "rate 3",
        ),
        (
            "tiny-sd15",
            serde_json::json!({"mode": "full", "block_lr": rates(23)}),
            "for SDXL",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = write_config(tmp.path(), fixture, &demo_data(), extra.clone());
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        let log = text(&out);
        assert!(!out.status.success(), "{extra}: {log}");
        assert!(
            log.contains("block_lr") && log.contains(says),
            "{extra}: {log}"
        );
    }
}

/// A learning-rate-free optimizer sizes its step for the whole group: rates of their own are
/// refused, rates that only switch blocks off (0 or the UNet's lr) are taken.
#[test]
fn block_rates_beside_a_learning_rate_free_optimizer_only_switch_blocks() {
    for (rates, ok) in [(vec![1.0, 0.5, 0.0], false), (vec![1.0, 1.0, 0.0], true)] {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("optimizer.json"),
            serde_json::json!({"base": {"optimizer": "prodigy"}}).to_string(),
        )
        .unwrap();
        let block_lr: Vec<f64> = (0..23).map(|i| rates[i % 3]).collect();
        let cfg = write_config(
            tmp.path(),
            "tiny-sdxl",
            &demo_data(),
            serde_json::json!({"mode": "full", "lr": 1.0, "block_lr": block_lr,
                               "optimizer_config": "optimizer.json"}),
        );
        // The accepted one trains (no per-parameter rate to refuse).
        let args = match ok {
            true => vec!["--config", cfg.to_str().unwrap(), "--cpu"],
            false => vec!["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        };
        let out = sdtrain(&args, tmp.path());
        let log = text(&out);
        assert_eq!(out.status.success(), ok, "{rates:?}: {log}");
        if !ok {
            assert!(log.contains("block_lr") && log.contains("prodigy"), "{log}");
        }
    }
}
