//! The training metadata of adapter files, from the CLI: kohya sd-scripts' `ss_*` keys
//! (`train_network.py`'s list, tests/fixtures/reference/kohya_metadata.json) with this run's
//! values, the dataset's folders, tags and buckets as A1111's LoRA cards read them, the base
//! model's name and hashes, the precalculated A1111 hash, and `adapter.no_metadata`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sha2::Digest;

/// Two folders of the demo images with comma-separated captions: `ted` (repeated 3 times by
/// its multiply.txt) and `style/water` (nested).
fn tagged_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let ted = data.join("ted");
    let water = data.join("style/water");
    std::fs::create_dir_all(&ted).unwrap();
    std::fs::create_dir_all(&water).unwrap();
    std::fs::write(ted.join("multiply.txt"), "3").unwrap();
    let demo = demo_data();
    let images = ["red_circle", "blue_square", "green_square"];
    for (i, name) in images.iter().enumerate() {
        let (folder, caption) = match i {
            0 => (&ted, "Ted Bennet, a man, smiling"),
            1 => (&ted, "ted bennet,  a man , outdoors,,"),
            _ => (&water, "watercolor, Ted Bennet"),
        };
        std::fs::copy(
            demo.join(format!("{name}.png")),
            folder.join(format!("{name}.png")),
        )
        .unwrap();
        std::fs::write(folder.join(format!("{name}.txt")), caption).unwrap();
    }
    data
}

/// Trains `extra` for one step on `model`; the final adapter file's header and its bytes.
fn train(dir: &Path, model: &str, extra: serde_json::Value) -> (HashMap<String, String>, Vec<u8>) {
    let data = tagged_data(dir);
    let mut extra = extra;
    extra["max_steps"] = 1.into();
    let cfg = write_config(dir, model, &data, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let bytes = std::fs::read(run_folder(dir).join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    (header.metadata().clone().unwrap(), bytes)
}

fn json(v: &str) -> serde_json::Value {
    serde_json::from_str(v).unwrap_or_else(|e| panic!("{v}: {e}"))
}

fn kohya_keys() -> Vec<String> {
    let path = common::fixture("reference/kohya_metadata.json");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    r["ss_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect()
}

/// Every kohya key but the few named as left out, with this run's values: the ones A1111's
/// LoRA card shows (tags, folders, buckets, model, clip skip) and the run's settings. Catches a
/// key dropped, a setting written from the wrong field, or `ss_optimizer` naming an optimizer
/// the run did not use.
#[test]
fn a_lora_file_carries_kohyas_training_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "mode": "lora",
        "clip_skip": 2,
        "zero_frequency_noise_ratio": 0.05,
        "min_snr_gamma": 5.0,
        "cond_dropout": 0.1,
        "flip_p": 0.0,
        "grad_accum": 2,
        "adapter": {"rank": 2, "dropout": 0.1, "training_comment": "for ted"},
    });
    let (meta, bytes) = train(tmp.path(), "tiny-sd15", extra);
    let omitted: Vec<&str> = sdtrain::train::kohya_run_metadata::OMITTED
        .iter()
        .map(|(k, _)| *k)
        .collect();
    // A base model folder has no file to hash (the single file's test below has them), and
    // the run keeps the model's VAE (tests/vae_override_cli.rs has a `vae`).
    let file_only = ["ss_sd_model_hash", "ss_new_sd_model_hash"];
    let vae_only = sdtrain::train::kohya_run_metadata::VAE_KEYS;
    for key in kohya_keys() {
        let expected = !omitted.contains(&key.as_str())
            && !file_only.contains(&key.as_str())
            && !vae_only.contains(&key.as_str());
        assert_eq!(meta.contains_key(&key), expected, "{key}");
    }
    // The dataset, as A1111's LoRA card reads it.
    assert_eq!(
        json(&meta["ss_tag_frequency"]),
        serde_json::json!({
            "ted": {"ted bennet": 2, "a man": 2, "smiling": 1, "outdoors": 1},
            "style/water": {"watercolor": 1, "ted bennet": 1},
        })
    );
    assert_eq!(
        json(&meta["ss_dataset_dirs"]),
        serde_json::json!({
            "ted": {"n_repeats": 3, "img_count": 2},
            "style/water": {"n_repeats": 1, "img_count": 1},
        })
    );
    let buckets = json(&meta["ss_bucket_info"]);
    let counted: i64 = buckets["buckets"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| b["count"].as_i64().unwrap())
        .sum();
    assert_eq!(counted, 7, "{buckets}");
    assert_eq!(meta["ss_num_train_images"], "7");
    assert_eq!(meta["ss_sd_model_name"], "tiny-sd15");
    assert!(
        !meta.contains_key("ss_new_sd_model_hash"),
        "a folder has no file hash"
    );
    // The run's settings.
    for (key, want) in [
        ("ss_clip_skip", "2"),
        ("ss_noise_offset", "0.05"),
        ("ss_min_snr_gamma", "5.0"),
        ("ss_caption_dropout_rate", "0.1"),
        ("ss_flip_aug", "False"),
        ("ss_keep_tokens", "0"),
        ("ss_gradient_accumulation_steps", "2"),
        ("ss_total_batch_size", "2"),
        ("ss_network_dropout", "0.1"),
        ("ss_training_comment", "for ted"),
        ("ss_mixed_precision", "no"),
        ("ss_max_train_steps", "1"),
        ("ss_max_token_length", "None"),
        ("ss_zero_terminal_snr", "False"),
        ("ss_loss_type", "l2"),
        ("ss_network_dim", "2"),
    ] {
        assert_eq!(meta[key], want, "{key}");
    }
    assert!(
        meta["ss_optimizer"].starts_with("bitsandbytes.optim.adamw.AdamW8bit("),
        "{}",
        meta["ss_optimizer"]
    );
    let started: f64 = meta["ss_training_started_at"].parse().unwrap();
    let finished: f64 = meta["ss_training_finished_at"].parse().unwrap();
    assert!(finished >= started, "{started} {finished}");
    // `sdtrain inspect` on the file reads it back as A1111's card would.
    let file = run_folder(tmp.path()).join("sdtrain.safetensors");
    let out = sdtrain(&["inspect", "--model", file.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    for line in [
        "type           LoRA (network module networks.lora)\n",
        "base model     sd_v1\n",
        "trained on     tiny-sd15\n",
        "tags           ted bennet (3), a man (2), outdoors (1), smiling (1), watercolor (1)\n",
        "folders        style/water: 1 images ×1, ted: 2 images ×3\n",
        "comment        for ted\n",
    ] {
        assert!(report.contains(line), "{line:?} not in\n{report}");
    }
    assert!(report.contains("unet           "), "{report}");
    assert!(report.contains("modules, rank 2\n"), "{report}");
    // A1111's hash of the tensors, precalculated as kohya does.
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let digest = sha2::Sha256::digest(&bytes[8 + header_len..]);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(meta["sshs_model_hash"], hex);
    assert!(
        report.contains(&format!("A1111 hash     {hex}\n")),
        "{report}"
    );
}

/// `adapter.no_metadata` (kohya's `--no_metadata`) keeps what loaders need and nothing of the
/// run or its data; a single-file base records its name and A1111's hashes of it.
#[test]
fn no_metadata_keeps_only_what_loaders_need_and_a_single_file_is_hashed() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "adapter": {"no_metadata": true}});
    let (meta, _) = train(tmp.path(), "tiny-sd15", extra);
    let mut ss: Vec<&str> = meta
        .keys()
        .map(String::as_str)
        .filter(|k| k.starts_with("ss_"))
        .collect();
    ss.sort();
    let mut minimum = sdtrain::adapter::kohya_meta::MINIMUM_KEYS.to_vec();
    minimum.sort();
    assert_eq!(ss, minimum);
    assert!(meta.contains_key("sshs_model_hash"));
    assert!(meta.contains_key("modelspec.architecture"));

    let tmp = tempfile::tempdir().unwrap();
    let (meta, _) = train(
        tmp.path(),
        "single-file/tiny-sd15.safetensors",
        serde_json::json!({"mode": "lora"}),
    );
    let file = std::fs::read(common::fixture("single-file/tiny-sd15.safetensors")).unwrap();
    let digest = sha2::Sha256::digest(&file);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(meta["ss_sd_model_name"], "tiny-sd15.safetensors");
    assert_eq!(meta["ss_new_sd_model_hash"], hex);
    assert_eq!(meta["ss_sd_model_hash"].len(), 8);
}

/// kohya's `keep_tokens` counts the caption's first piece, which sdtrain's `keep_tags` (the tags
/// after it) keeps whenever the tags are shuffled: `keep_tags` 1 is kohya's `keep_tokens` 2.
/// Catches sdtrain's count written as kohya's.
#[test]
fn keep_tags_are_written_as_kohyas_keep_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "shuffle_tags": true, "keep_tags": 1});
    let (meta, _) = train(tmp.path(), "tiny-sd15", extra);
    assert_eq!(meta["ss_shuffle_caption"], "True");
    assert_eq!(meta["ss_keep_tokens"], "2");
}
