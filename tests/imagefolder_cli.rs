//! Hugging Face's imagefolder layout (`data_layout: "imagefolder"`, what diffusers' training
//! scripts read from `--train_data_dir`): the images and captions sdtrain reads equal what
//! `datasets.load_dataset("imagefolder")` gives diffusers (tests/fixtures/imagefolder_reference.py
//! on tests/fixtures/imagefolder/), and a run on such a folder trains its rows' captions.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

/// Every train-split row, as `datasets` 5.2 reads it: nested metadata files with paths relative
/// to their folder, a row naming an image twice trained twice, the test split's metadata and an
/// image without a row left out, and CSV captions with commas, quotes and line breaks. Catches a
/// path resolved from the root, a duplicate row merged, another split's rows trained, and a CSV
/// field split at its comma.
#[test]
fn imagefolder_rows_match_datasets() {
    let reference = common::reference_json("reference/imagefolder.json");
    let root = common::fixture("imagefolder");
    for name in ["jsonl", "csv"] {
        let folder = root.join(name);
        let records =
            sdtrain::data::imagefolder::scan_imagefolder("data_root", &folder, "text").unwrap();
        let mut got: Vec<(String, String)> = records
            .iter()
            .map(|r| {
                let rel = r.path.strip_prefix(&folder).unwrap();
                (rel.to_string_lossy().replace('\\', "/"), r.caption.clone())
            })
            .collect();
        got.sort();
        let want: Vec<(String, String)> = reference[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p[0].as_str().unwrap().to_string(),
                    p[1].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(got, want, "{name}");
    }
}

/// A diffusers-style folder (images and a metadata.jsonl, no caption files) trains its rows'
/// captions with no data_layout given: three distinct captions (and the empty one caption dropout
/// needs) are encoded once; read as EveryDream2's folders the images would be captioned by their
/// file names instead. The unlisted image is named in a note and not trained.
#[test]
fn a_diffusers_train_data_dir_trains_its_metadata_captions() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("hf");
    std::fs::create_dir_all(&data).unwrap();
    for name in [
        "red_circle",
        "blue_square",
        "green_square",
        "black_triangle",
    ] {
        std::fs::copy(
            demo_data().join(format!("{name}.png")),
            data.join(format!("{name}.png")),
        )
        .unwrap();
    }
    std::fs::write(
        data.join("metadata.jsonl"),
        "{\"file_name\": \"red_circle.png\", \"text\": \"a red circle\"}\n\
         {\"file_name\": \"blue_square.png\", \"text\": \"a blue square\"}\n\
         {\"file_name\": \"green_square.png\", \"text\": \"a green square\"}\n",
    )
    .unwrap();
    let keys = serde_json::json!({
        "mode": "lora", "max_steps": 2, "batch_size": 1, "resolution": 64,
        "disable_textenc_training": true,
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", Path::new("hf"), keys);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("read as Hugging Face's imagefolder"), "{log}");
    assert!(log.contains("data: 3 images loaded"), "{log}");
    assert!(
        log.contains("1 image beside the metadata no row names") && log.contains("black_triangle"),
        "{log}"
    );
    assert!(
        log.contains("text-encoder cache: 4 captions encoded"),
        "{log}"
    );
    assert_eq!(step_losses(&run_folder(tmp.path())).len(), 2);
}
