//! kohya's `max_token_length` from the CLI: captions longer than 75 tokens train on all their
//! tokens (in 75-token chunks, as kohya sd-scripts encodes them; the numbers are checked in
//! tests/kohya_weighting_parity.rs), through the text-encoder cache and with a text encoder
//! that trains; the dry run says so, and a value kohya does not offer is refused.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

/// The demo images with captions of about 150 tokens that differ only past the 75th.
fn long_caption_data(dir: &Path, tail: &str) -> std::path::PathBuf {
    let data = dir.join("data");
    common::copy_dir(&demo_data(), &data);
    let head = (0..30)
        .map(|i| format!("tag{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "txt") {
            std::fs::write(&path, format!("{head}, {tail}")).unwrap();
        }
    }
    data
}

fn losses(dir: &Path, tail: &str, extra: serde_json::Value) -> Vec<f64> {
    let data = long_caption_data(dir, tail);
    let cfg = write_config(dir, "tiny-sd15", &data, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    step_losses(&run_folder(dir))
}

#[test]
fn long_captions_train_on_every_token() {
    for extra in [
        // LoRA: the text encoders are frozen and their outputs cached.
        serde_json::json!({"mode": "lora", "seed": 3}),
        // Full fine-tune with the text encoder training: encoded every step.
        serde_json::json!({"mode": "full", "seed": 3}),
    ] {
        let run = |tail: &str, tokens: Option<u64>| {
            let tmp = tempfile::tempdir().unwrap();
            let mut extra = extra.clone();
            if let Some(t) = tokens {
                extra["max_token_length"] = t.into();
            }
            losses(tmp.path(), tail, extra)
        };
        // At 75 tokens the tails are cut off: the same losses. At 225 they are read.
        let (a, b) = (run("a red cat", None), run("a blue dog", None));
        assert_eq!(
            a, b,
            "{extra}: the tail past 75 tokens changed a 75-token run"
        );
        let (a, b) = (run("a red cat", Some(225)), run("a blue dog", Some(225)));
        assert_eq!(a.len(), b.len());
        assert_ne!(a, b, "{extra}: the tail past 75 tokens was not read at 225");
    }
}

#[test]
fn the_dry_run_says_so_and_other_lengths_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"max_token_length": 150}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("up to 150 tokens, in 2 chunks of 75"),
        "{}",
        text(&out)
    );
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"max_token_length": 100}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("`max_token_length` in ")
            && text(&out).contains("must be 75, 150 or 225"),
        "{}",
        text(&out)
    );
}
