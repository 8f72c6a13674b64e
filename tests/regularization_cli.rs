//! Regularization images and kohya's DreamBooth folders from the CLI: a LoRA run on
//! `data_layout: "kohya"` folders with a `reg_data_root`, whose regularization samples train
//! beside the subject's, sized as kohya sizes them and weighed by `prior_loss_weight`, and
//! recorded in the LoRA file's kohya metadata. The reading and sizing rules themselves are
//! checked against kohya's code in tests/kohya_dreambooth_parity.rs.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

/// `train/1_ted man/` (one image with a caption file, one without) and `reg/3_man/` (three
/// images, no caption files).
fn folders(dir: &Path) -> (PathBuf, PathBuf) {
    let (train, reg) = (dir.join("train/1_ted man"), dir.join("reg/3_man"));
    std::fs::create_dir_all(&train).unwrap();
    std::fs::create_dir_all(&reg).unwrap();
    let copy = |name: &str, to: &Path| {
        std::fs::copy(
            demo_data().join(format!("{name}.png")),
            to.join(format!("{name}.png")),
        )
        .unwrap();
    };
    copy("red_circle", &train);
    std::fs::write(train.join("red_circle.txt"), "ted man, smiling").unwrap();
    copy("blue_square", &train);
    for name in ["green_square", "black_triangle", "blue_stripes"] {
        copy(name, &reg);
    }
    (dir.join("train"), dir.join("reg"))
}

/// Two training samples per epoch (two images, 1 repeat) against regularization images of 3
/// repeats each: kohya takes the first (3 samples ≥ 2) and leaves the other two out, so an
/// epoch is 5 steps at batch 1, three of them regularization samples. With
/// `prior_loss_weight: 0` exactly those three log a zero loss. Catches the weight dropped or
/// given to the subject's samples, a balance that keeps all three images, captions from the
/// wrong files, and metadata that forgets the regularization set.
#[test]
fn regularization_samples_train_sized_and_weighed_as_kohya() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reg) = folders(tmp.path());
    let extra = serde_json::json!({
        "mode": "lora",
        "max_steps": null,
        "max_epochs": 1,
        "data_layout": "kohya",
        "caption_extension": ".txt",
        "reg_data_root": reg,
        "prior_loss_weight": 0.0,
        "cond_dropout": 0.0,
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &train, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("regularization: 3 images (2 not used: the epoch needs only the first 1), 3 samples per epoch"),
        "{log}"
    );
    assert!(log.contains("5 samples/epoch"), "{log}");
    let run = run_folder(tmp.path());
    let losses = step_losses(&run);
    assert_eq!(losses.len(), 5, "{losses:?}");
    let zeros = losses.iter().filter(|&&l| l == 0.0).count();
    assert_eq!(zeros, 3, "{losses:?}");

    let bytes = std::fs::read(run.join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    let get = |k: &str| meta.get(k).unwrap_or_else(|| panic!("{k} missing")).clone();
    assert_eq!(get("ss_num_reg_images"), "9");
    assert_eq!(get("ss_num_train_images"), "2");
    assert_eq!(get("ss_prior_loss_weight"), "0.0");
    assert_eq!(
        get("ss_dataset_dirs"),
        r#"{"1_ted man": {"n_repeats": 1, "img_count": 2}}"#
    );
    assert_eq!(
        get("ss_reg_dataset_dirs"),
        r#"{"3_man": {"n_repeats": 3, "img_count": 3}}"#
    );
    let tags: serde_json::Value = serde_json::from_str(&get("ss_tag_frequency")).unwrap();
    assert_eq!(
        tags,
        serde_json::json!({
            "1_ted man": {"ted man": 2, "smiling": 1},
            "3_man": {"man": 3},
        })
    );
}

/// The keys are checked before anything loads, with errors that name them (exit 2), and
/// `--dry-run` shows the layout and the regularization folder.
#[test]
fn regularization_keys_are_checked_and_shown() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reg) = folders(tmp.path());
    let run = |extra: serde_json::Value| {
        let cfg = write_config(tmp.path(), "tiny-sd15", &train, extra);
        sdtrain(
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            tmp.path(),
        )
    };
    let out = run(serde_json::json!({"data_layout": "kohya", "reg_data_root": reg}));
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("kohya's `<repeats>_<class tokens>` folders, captions in .caption"),
        "{log}"
    );
    assert!(
        log.contains("reg_data_root") && log.contains("loss × 1"),
        "{log}"
    );
    for (extra, key) in [
        (
            serde_json::json!({"prior_loss_weight": 0.5}),
            "prior_loss_weight",
        ),
        (
            serde_json::json!({"caption_extension": ".txt"}),
            "caption_extension",
        ),
        (
            serde_json::json!({"reg_data_root": train.join("1_ted man")}),
            "reg_data_root",
        ),
        (
            serde_json::json!({"data_layout": "kohya_ss"}),
            "data_layout",
        ),
    ] {
        let out = run(extra.clone());
        assert_eq!(out.status.code(), Some(2), "{extra}: {}", text(&out));
        assert!(text(&out).contains(key), "{extra}: {}", text(&out));
    }
    // A regularization folder without a kohya subfolder fails the run's start, naming it.
    let empty = tmp.path().join("empty_reg");
    std::fs::create_dir_all(empty.join("dogs")).unwrap();
    std::fs::copy(demo_data().join("red_circle.png"), empty.join("dogs/a.png")).unwrap();
    let extra = serde_json::json!({"mode": "lora", "data_layout": "kohya", "reg_data_root": empty});
    let cfg = write_config(tmp.path(), "tiny-sd15", &train, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(
        log.contains("reg_data_root") && log.contains("<repeats>_<class tokens>"),
        "{log}"
    );
}
