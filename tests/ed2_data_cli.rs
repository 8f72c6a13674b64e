//! EveryDream2's data keys end to end on tiny-sd15 (`sdtrain --config train.json --cpu`):
//! `rated_dataset` with `write_schedule` (the schedules show each epoch's image count shrink),
//! per-image YAML settings, `keep_tags`, and `validation_config` with a split, a stabilised
//! subset, an extra named set, fractional `every_n_epochs` and the relative loss.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::cli::{
    demo_data, run_folder, sdtrain, sdtrain_ok, sdtrain_refused, text, write_config,
};

/// The demo images in `dir/data`, with a rating file for two of them.
fn rated_data(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("data");
    common::copy_dir(&demo_data(), &data);
    std::fs::write(data.join("red_circle.yaml"), "rating: 5\n").unwrap();
    std::fs::write(
        data.join("blue_square.yaml"),
        "rating: 0.5\ntags:\n  - tag: plain\n    weight: 2\n",
    )
    .unwrap();
    std::fs::write(data.join("global.yaml"), "tags:\n  - tiny\n").unwrap();
    data
}

/// Rated epochs train on ceil(8 · fraction) distinct images: 8, 8, then (4 − 0.75)/4 and
/// (4 − 1.5)/4 of them (EveryDream2's schedule with 25%), which the written schedules show. With
/// `rated_dataset` ignored every epoch would hold all 8; with `write_schedule` ignored there
/// would be no files.
#[test]
fn rated_dataset_shrinks_epochs_and_schedules_are_written() {
    let tmp = tempfile::tempdir().unwrap();
    let data = rated_data(tmp.path());
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({
            "max_steps": null, "max_epochs": 4, "batch_size": 2,
            "rated_dataset": true, "rated_dataset_target_dropout_percent": 25,
            "write_schedule": true, "shuffle_tags": true, "keep_tags": 1,
        }),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let mut distinct = Vec::new();
    for epoch in 0..4 {
        let path = run.join(format!("ep{epoch}_batch_schedule.txt"));
        let schedule = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let lines: Vec<&str> = schedule.lines().collect();
        assert!(
            lines[0].starts_with("step:00000, wh:[64, 64], r:"),
            "{schedule}"
        );
        assert_eq!(lines.len() % 2, 0, "{schedule}");
        let paths: BTreeSet<&str> = lines
            .iter()
            .map(|l| l.split("path:").nth(1).unwrap())
            .collect();
        distinct.push(paths.len());
    }
    assert_eq!(distinct, [8, 8, 7, 5]);
    // 4 + 4 + 4 + 3 steps, the total counted from the shrunk epochs.
    assert!(text(&out).contains("steps           15"), "{}", text(&out));
}

#[test]
fn a_bad_image_yaml_exits_2_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = rated_data(tmp.path());
    std::fs::write(data.join("green_square.yaml"), "cond_droput: 0.05\n").unwrap();
    let cfg = write_config(tmp.path(), "tiny-sd15", &data, serde_json::json!({}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("green_square.yaml") && msg.contains("cond_droput"),
        "{msg}"
    );
}

/// EveryDream2's validation file: `val` (25% held out), `stabilize-train` and a named extra set
/// are all scored before training and twice per epoch (`every_n_epochs: 0.5`), relative to their
/// first value, and logged under their names.
#[test]
fn validation_config_scores_every_set_under_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    common::copy_dir(&demo_data(), &data);
    let extra = tmp.path().join("santa");
    std::fs::create_dir(&extra).unwrap();
    for name in ["red_circle.png", "blue_square.png"] {
        std::fs::copy(data.join(name), extra.join(name)).unwrap();
    }
    std::fs::write(
        tmp.path().join("val.json"),
        serde_json::json!({
            "documentation": {"seed": "ignored"},
            "validate_training": true, "val_split_mode": "automatic",
            "auto_split_proportion": 0.25, "manual_data_root": null,
            "extra_manual_datasets": {"santa suit": "santa"},
            "stabilize_training_loss": true, "stabilize_split_proportion": 0.2,
            "every_n_epochs": 0.5, "seed": 555, "use_relative_loss": true
        })
        .to_string(),
    )
    .unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({"max_steps": null, "max_epochs": 1, "validation_config": "val.json"}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let msg = text(&out);
    assert!(out.status.success(), "{msg}");
    // ceil(0.25 · 8) = 2 held out: 6 steps.
    assert!(msg.contains("val (2 images), stabilize-train (2 images), santa suit (2 images)"));
    assert!(
        msg.contains(
            "step 0: validation loss val 0.0000, stabilize-train 0.0000, santa suit 0.0000"
        ),
        "{msg}"
    );
    let validations: Vec<&str> = msg
        .lines()
        .filter(|l| l.contains("validation loss"))
        .collect();
    assert_eq!(validations.len(), 3, "{msg}");
    assert!(msg.contains("step 3: validation loss") && msg.contains("step 6: validation loss"));
    let run = run_folder(tmp.path());
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let with_sets: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l.get("val_sets").is_some())
        .collect();
    assert_eq!(with_sets.len(), 2, "{log}");
    let sets = with_sets[0]["val_sets"].as_object().unwrap();
    let names: Vec<&str> = sets.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        ["_all_val_combined", "santa suit", "stabilize-train"]
    );
}

/// Regressions: images under the training size were upscaled with no word, and kohya's
/// `10_sks dog/IMG_0001.png` trained as "IMG" once with no word. Now one warning line each
/// (EveryDream2's for the first, with its `undersized_images.txt` in the run folder).
#[test]
fn undersized_images_and_kohya_folders_are_warned_about() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    common::copy_dir(&demo_data(), &data);
    let kohya = data.join("10_sks dog");
    std::fs::create_dir(&kohya).unwrap();
    std::fs::copy(data.join("red_circle.png"), kohya.join("IMG_0001.png")).unwrap();
    // The demo images are 64×64: at 128 every one of the 9 is undersized.
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({"resolution": 128, "max_steps": 1}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let msg = text(&out);
    assert!(out.status.success(), "{msg}");
    let run = run_folder(tmp.path());
    let listed = run.join("undersized_images.txt");
    let undersized: Vec<&str> = msg.lines().filter(|l| l.contains("smaller than")).collect();
    assert_eq!(undersized.len(), 1, "{msg}");
    assert!(
        undersized[0].starts_with("warning: 9 images are smaller than the target size")
            && undersized[0].contains("10_sks dog/IMG_0001.png 64x64 for 128x128")
            && undersized[0].contains("and 6 more")
            && undersized[0].contains(&listed.display().to_string()),
        "{msg}"
    );
    let list = std::fs::read_to_string(&listed).unwrap();
    assert_eq!(list.lines().count(), 10, "{list}");
    assert!(list
        .contains("green_square.png with size: (64, 64) is smaller than target size: [128, 128]"));
    let kohya_lines: Vec<&str> = msg.lines().filter(|l| l.contains("kohya")).collect();
    assert_eq!(kohya_lines.len(), 1, "{msg}");
    assert!(
        kohya_lines[0].contains("10_sks dog") && kohya_lines[0].contains("\"IMG\""),
        "{msg}"
    );
}

/// EveryDream2's JSON dataset from the CLI: `data_root` names a `.json` list whose entries give
/// each image (relative to the JSON file) and its caption and settings; the run trains them
/// (three distinct captions and the empty one of `cond_dropout` encoded once). The list and
/// `resolver` forms of `data_root` are refused, naming them.
#[test]
fn a_json_dataset_trains_its_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let imgs = tmp.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    for name in ["red_circle", "blue_square", "green_square"] {
        std::fs::copy(
            demo_data().join(format!("{name}.png")),
            imgs.join(format!("{name}.png")),
        )
        .unwrap();
    }
    let entries = serde_json::json!([
        {"image": "imgs/red_circle.png", "main_prompt": "a red circle", "multiply": 2},
        {"image": "imgs/blue_square.png", "main_prompt": "a blue square", "tags": ["flat"]},
        {"image": "imgs/green_square.png", "main_prompt": "a green square"},
    ]);
    std::fs::write(tmp.path().join("set.json"), entries.to_string()).unwrap();
    let keys = serde_json::json!({"mode": "lora", "disable_textenc_training": true});
    let cfg = write_config(tmp.path(), "tiny-sd15", Path::new("set.json"), keys);
    let log = sdtrain_ok(&cfg, tmp.path(), &[]);
    assert!(log.contains("data: 3 images loaded"), "{log}");
    assert!(log.contains("4 samples/epoch"), "{log}");
    assert!(
        log.contains("text-encoder cache: 4 captions encoded"),
        "{log}"
    );
    let set = r#"data_root=[{"resolver": "json", "path": "set.json"}]"#;
    let log = sdtrain_refused(&cfg, tmp.path(), &["--set", set]);
    assert!(log.contains("`resolver` forms of data_root"), "{log}");
}
