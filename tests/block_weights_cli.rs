//! kohya's block-wise LoRA (`adapter.block_dims`, `block_alphas`, `conv_block_dims`,
//! `down/mid/up_lr_weight`, `block_lr_zero_threshold`) from the CLI. The settings and block
//! indices are checked against kohya's functions in tests/kohya_block_weights_parity.rs; here,
//! that a run attaches, weights, prices and records them.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sdtrain::adapter::block_weights::block_index;

/// A saved module: its rank, kernel height (1 for Linear) and alpha.
#[derive(Debug, Clone, PartialEq)]
struct Module {
    rank: usize,
    kernel: usize,
    alpha: f32,
}

struct Saved {
    tensors: HashMap<String, Vec<f32>>,
    modules: HashMap<String, Module>,
    args: String,
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// One step of a LoCon (UNet only, fp32 file, AdamW without weight decay) on tiny-sd15.
fn one_step(dir: &Path, fixture: &str, adapter_extra: serde_json::Value) -> Saved {
    let mut adapter = serde_json::json!({"rank": 4, "alpha": 4, "conv_rank": 2, "conv_alpha": 2,
                                         "train_text_encoder": false, "save_dtype": "fp32"});
    for (k, v) in adapter_extra.as_object().unwrap() {
        adapter[k] = v.clone();
    }
    let opt = dir.join("optimizer.json");
    std::fs::write(
        &opt,
        r#"{"base": {"optimizer": "adamw", "weight_decay": 0.0}}"#,
    )
    .unwrap();
    let extra = serde_json::json!({"mode": "locon", "max_steps": 1, "adapter": adapter,
                                   "optimizer_config": opt});
    let cfg = write_config(dir, fixture, &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let bytes = std::fs::read(run_folder(dir).join("sdtrain.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = HashMap::new();
    let mut modules = HashMap::new();
    for (name, view) in st.tensors() {
        let values = f32s(view.data());
        if let Some(module) = name.strip_suffix(".lora_down.weight") {
            let shape = view.shape();
            let kernel = if shape.len() == 4 { shape[2] } else { 1 };
            let alpha = f32s(st.tensor(&format!("{module}.alpha")).unwrap().data())[0];
            modules.insert(
                module.to_string(),
                Module {
                    rank: shape[0],
                    kernel,
                    alpha,
                },
            );
        }
        tensors.insert(name, values);
    }
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let args = header.metadata().as_ref().unwrap()["ss_network_args"].clone();
    Saved {
        tensors,
        modules,
        args,
    }
}

fn list<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

/// Ranks 1, 2, 3 in turn, 0 in blocks 5 and OUT03 (16); 3×3 convs 2, but 0 in OUT00 (13);
/// alphas half the block's index.
fn block_keys() -> (Vec<usize>, Vec<f64>, Vec<usize>) {
    let dims: Vec<usize> = (0..25)
        .map(|i| if i == 5 || i == 16 { 0 } else { 1 + i % 3 })
        .collect();
    let alphas: Vec<f64> = (0..25).map(|i| i as f64 / 2.0).collect();
    let conv: Vec<usize> = (0..25).map(|i| if i == 13 { 0 } else { 2 }).collect();
    (dims, alphas, conv)
}

/// Each module a block-wise LoCon keeps is at its block's rank and alpha (alpha 0 is the rank,
/// as kohya's), its 3×3 convs at the block's conv rank; a block of rank 0 has none. The file
/// records kohya's strings, and `--dry-run` prices exactly the saved parameters. Catches a
/// block index off by one, the conv ranks read from block_dims, a skipped block kept, or the
/// plan pricing the uniform rank.
#[test]
fn each_block_gets_its_own_rank_and_alpha() {
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = one_step(plain_dir.path(), "tiny-sd15", serde_json::json!({}));
    let (dims, alphas, conv) = block_keys();
    let keys = serde_json::json!({"block_dims": list(&dims), "block_alphas": alphas,
                                  "conv_block_dims": conv});
    let dir = tempfile::tempdir().unwrap();
    let blocks = one_step(dir.path(), "tiny-sd15", keys.clone());
    let mut kept = 0;
    for (name, m) in &plain.modules {
        let i = block_index(name, false).unwrap_or_else(|| panic!("{name} in no block"));
        let rank = if m.kernel > 1 { conv[i] } else { dims[i] };
        let alpha = if m.kernel > 1 { 2.0 } else { alphas[i] as f32 };
        let want = (rank > 0).then_some(Module {
            rank,
            kernel: m.kernel,
            alpha: if alpha == 0.0 { rank as f32 } else { alpha },
        });
        assert_eq!(
            blocks.modules.get(name),
            want.as_ref(),
            "{name} (block {i})"
        );
        kept += usize::from(want.is_some());
    }
    assert_eq!(
        blocks.modules.len(),
        kept,
        "modules outside the plain run's"
    );
    assert!(kept > 10 && kept < plain.modules.len(), "{kept} kept");
    for want in [
        format!(r#""block_dims": "{}""#, list(&dims)),
        r#""conv_block_dims": "2,2,2"#.to_string(),
        r#""block_alphas": "0.0,0.5,1.0"#.to_string(),
    ] {
        assert!(blocks.args.contains(&want), "{want} not in {}", blocks.args);
    }

    // The dry run prices the block-wise ranks: its count is the saved parameters (no alphas).
    let saved: usize = blocks
        .tensors
        .iter()
        .filter(|(n, _)| !n.ends_with(".alpha"))
        .map(|(_, v)| v.len())
        .sum();
    let cfg = dir.path().join("train.json");
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        dir.path(),
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains(&format!("unet: adamw, {saved} trained parameters")),
        "{saved} parameters saved; {log}"
    );
    assert!(log.contains("block-wise (kohya): block_dims="), "{log}");
}

/// With the same blocks, learning-rate weights scale each block's first update (`lora_up`,
/// zero before it) by exactly the weight (powers of two), leave `lora_down` (whose gradient is
/// zero while `lora_up` is) alone, and a weight of 0 (or at the threshold) drops the block's
/// modules as kohya does. Catches the weight of the wrong block, of the wrong part (down for
/// up), or not applied.
#[test]
fn learning_rate_weights_scale_each_blocks_update() {
    let (dims, _, _) = block_keys();
    // Zero OUT03 (16) by rank in the unweighted run and by weight in the weighted one, so both
    // have the same modules (drawn from one stream in the same order).
    let conv: Vec<usize> = (0..25).map(|i| if i == 16 { 0 } else { 2 }).collect();
    let same = serde_json::json!({"block_dims": dims.clone(), "conv_block_dims": conv});
    let a_dir = tempfile::tempdir().unwrap();
    let unweighted = one_step(a_dir.path(), "tiny-sd15", same);
    let mut rank_only = dims.clone();
    rank_only[16] = 4;
    let up = [2.0, 0.5, 0.25, 0.1, 4.0, 1.0, 2.0, 0.5, 2.0, 1.0, 1.0, 1.0];
    let weighted_keys = serde_json::json!({"block_dims": rank_only, "up_lr_weight": up,
                                           "down_lr_weight": "zeros+0.5",
                                           "mid_lr_weight": 4, "block_lr_zero_threshold": 0.1});
    let b_dir = tempfile::tempdir().unwrap();
    let weighted = one_step(b_dir.path(), "tiny-sd15", weighted_keys);
    let names = |s: &Saved| {
        s.modules
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
    };
    let (a, b) = (names(&unweighted), names(&weighted));
    assert!(
        a == b,
        "the weight 0.1 (at the threshold) drops OUT03's modules, as rank 0 does; only \
         unweighted: {:?}; only weighted: {:?}",
        a.difference(&b).collect::<Vec<_>>(),
        b.difference(&a).collect::<Vec<_>>()
    );
    let mut scaled = 0;
    for (name, want) in &unweighted.tensors {
        let got = &weighted.tensors[name];
        let module = name.split('.').next().unwrap();
        let i = block_index(module, false).unwrap();
        let weight = match i {
            12 => 4.0,
            13.. => up[i - 13],
            _ => 0.5,
        };
        let ratio = if name.contains("lora_up") {
            weight
        } else {
            1.0
        };
        let expected: Vec<f32> = want.iter().map(|v| v * ratio as f32).collect();
        assert_eq!(got, &expected, "{name} (block {i}, weight {weight})");
        scaled += usize::from(ratio != 1.0 && want.iter().any(|&v| v != 0.0));
    }
    assert!(scaled > 10, "{scaled} tensors scaled");
    assert!(
        weighted.args.contains(r#""down_lr_weight": "zeros+0.5""#)
            && weighted
                .args
                .contains(r#""block_lr_zero_threshold": "0.1""#),
        "{}",
        weighted.args
    );
}

/// Mistakes are refused with their key: before anything loads when the config alone shows
/// them (exit 2), or when the model's family is known (SDXL has 23 blocks).
#[test]
fn block_settings_that_cannot_apply_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let opt = tmp.path().join("prodigy.json");
    std::fs::write(&opt, r#"{"base": {"optimizer": "prodigy", "lr": 1.0}}"#).unwrap();
    let dry = |extra: serde_json::Value| {
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            tmp.path(),
        );
        (out.status.code(), text(&out))
    };
    let cases = [
        (
            serde_json::json!({"mode": "lora", "optimizer_config": opt,
                               "adapter": {"up_lr_weight": "sine"}}),
            "adapter.up_lr_weight",
            "prodigy",
        ),
        (
            serde_json::json!({"mode": "loha", "adapter": {"block_dims": vec![4; 25]}}),
            "adapter.block_dims",
            "\"locon\"",
        ),
        (
            serde_json::json!({"mode": "lora", "adapter": {"block_dims": vec![4; 24]}}),
            "adapter.block_dims",
            "25 for SD1/SD2, 23 for SDXL",
        ),
        (
            serde_json::json!({"mode": "lora", "adapter": {"down_lr_weight": "steep"}}),
            "adapter.down_lr_weight",
            "reverse_linear",
        ),
        (
            serde_json::json!({"mode": "lora",
                               "adapter": {"conv_block_dims": vec![4; 25], "block_dims": vec![4; 25]}}),
            "adapter.conv_block_dims",
            "locon",
        ),
    ];
    for (extra, key, says) in cases {
        let (code, log) = dry(extra.clone());
        assert_eq!(code, Some(2), "{extra}: {log}");
        assert!(log.contains(key) && log.contains(says), "{extra}: {log}");
    }
    // Switching blocks off needs no per-parameter rate: Prodigy takes 0/1 weights.
    let (code, log) = dry(serde_json::json!({"mode": "lora", "optimizer_config": opt,
                                             "adapter": {"up_lr_weight": [1, 0, 1]}}));
    assert_eq!(code, Some(0), "{log}");

    // SD1's 25 entries on SDXL: refused when the model is read, naming the key.
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1,
                                   "adapter": {"block_dims": vec![4; 25]}});
    let cfg = write_config(tmp.path(), "tiny-sdxl", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("adapter.block_dims has 25 entries; SDXL has 23 blocks"),
        "{log}"
    );
}

/// SDXL's 23 blocks are read by kohya's own module names: a weight of 0 on OUT00's blocks
/// (`output_blocks.0`–`2`, kohya's 13–15) drops exactly the modules there.
#[test]
fn sdxl_blocks_follow_kohyas_sdxl_names() {
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = one_step(plain_dir.path(), "tiny-sdxl", serde_json::json!({}));
    let dir = tempfile::tempdir().unwrap();
    let up = serde_json::json!({"up_lr_weight": "0,0,0,1,1,1,1,1,1"});
    let blocks = one_step(dir.path(), "tiny-sdxl", up);
    let mut dropped = 0;
    for name in plain.modules.keys() {
        let i = block_index(name, true).unwrap_or_else(|| panic!("{name} in no block"));
        let zero = (13..=15).contains(&i);
        assert_eq!(
            blocks.modules.contains_key(name),
            !zero,
            "{name} (block {i})"
        );
        dropped += usize::from(zero);
    }
    assert!(dropped > 0 && blocks.modules.len() + dropped == plain.modules.len());
}

/// With `dim_from_weights` the file's modules are kept whatever their block (kohya builds them
/// from the file), and a block of weight 0 leaves its modules untrained. The fixture's UNet
/// modules all sit in IN01: weight 0 there leaves the UNet nothing to train, which is refused;
/// weight 0.5 trains them.
#[test]
fn dim_from_weights_keeps_the_files_modules_and_freezes_weight_0() {
    let tmp = tempfile::tempdir().unwrap();
    let file = common::fixture("kohya_tiny_sd15.safetensors");
    let run = |down: &str| {
        let adapter = serde_json::json!({"init_from": file, "dim_from_weights": true,
                                         "down_lr_weight": down});
        let extra = serde_json::json!({"mode": "locon", "max_steps": 1, "adapter": adapter});
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path())
    };
    let out = run("1,0");
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("learning-rate weight 0"),
        "{}",
        text(&out)
    );
    let out = run("1,0.5");
    assert!(out.status.success(), "{}", text(&out));
}
