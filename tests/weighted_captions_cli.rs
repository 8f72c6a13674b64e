//! kohya's `weighted_captions` from the CLI: a run encodes A1111's emphasis in its captions (the
//! encoding is checked against kohya's in tests/kohya_weighted_captions_parity.rs), through the
//! text cache and with a trained text encoder, and refuses a caption whose emphasis does not
//! read before it starts.

mod common;

use std::path::Path;

use common::cli::{run_folder, sdtrain, text, write_config};

/// Two images whose captions carry emphasis; `bad` gives the second a weight that is no number.
fn data(dir: &Path, bad: bool) -> std::path::PathBuf {
    let root = dir.join("data");
    std::fs::create_dir_all(&root).unwrap();
    let demo = common::cli::demo_data();
    for (name, caption) in [
        ("red_circle", "a (red:1.4) circle"),
        (
            "blue_square",
            if bad {
                "a (blue:1.2.3) square"
            } else {
                "a [blue] square"
            },
        ),
    ] {
        std::fs::copy(
            demo.join(format!("{name}.png")),
            root.join(format!("{name}.png")),
        )
        .unwrap();
        std::fs::write(root.join(format!("{name}.txt")), caption).unwrap();
    }
    root
}

/// The saved file's tensors (not its metadata, which holds the run's times), by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(run_folder(dir).join("sdtrain.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect();
    out.sort();
    out
}

/// The same run with and without `weighted_captions` trains differently (the emphasis weighs
/// the context), through the text cache (frozen encoder) and with the encoder trained.
#[test]
fn a_run_trains_on_weighted_captions() {
    for te in [false, true] {
        let run = |weighted: bool| {
            let tmp = tempfile::tempdir().unwrap();
            let root = data(tmp.path(), false);
            // Three steps in fp32: Adam's first step is the gradients' signs alone.
            let extra = serde_json::json!({"mode": "lora", "max_steps": 3, "weighted_captions": weighted,
                                           "adapter": {"train_text_encoder": te, "save_dtype": "fp32"}});
            let cfg = write_config(tmp.path(), "tiny-sd15", &root, extra);
            let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
            let log = text(&out);
            assert!(out.status.success(), "{log}");
            assert_eq!(log.contains("captions encoded in"), !te, "{log}");
            (tensors(tmp.path()), tmp)
        };
        let (plain, _a) = run(false);
        let (weighted, _b) = run(true);
        assert_ne!(plain, weighted, "text encoder trained: {te}");
    }
}

/// A caption whose weight is no number is refused before training, naming the image (kohya
/// stops mid-run there).
#[test]
fn a_caption_that_does_not_read_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = data(tmp.path(), true);
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "weighted_captions": true});
    let cfg = write_config(tmp.path(), "tiny-sd15", &root, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(
        log.contains("blue_square.png") && log.contains("weighted_captions"),
        "{log}"
    );
}
