//! kohya's dataset config (`dataset_config`, kohya's `--dataset_config` TOML) from the CLI: a
//! LoRA run on two datasets (a DreamBooth one with a regularization subset, a fine-tuning one
//! read from kohya's metadata JSON), each subset with its own repeats and captions, and the
//! mistakes a user makes in the file, each refused naming its place in it. The per-step caption
//! rules are checked against kohya's `process_caption` in tests/step_seams.rs, the bucket sizes
//! against kohya's `make_bucket_resolutions` in tests/kohya_dataset_config_parity.rs.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{
    demo_data, file_metadata, run_folder, sdtrain, sdtrain_ok, step_losses, text, write_config,
};

/// `imgs/subject` (one image with a `.txt` caption, one without), `imgs/reg` (three images, no
/// captions), `imgs/ft` (one image) with `meta.json` beside the TOML.
fn images(dir: &Path) {
    let copy = |name: &str, to: &str| {
        let to = dir.join(to);
        std::fs::create_dir_all(&to).unwrap();
        std::fs::copy(
            demo_data().join(format!("{name}.png")),
            to.join(format!("{name}.png")),
        )
        .unwrap();
    };
    copy("red_circle", "imgs/subject");
    std::fs::write(dir.join("imgs/subject/red_circle.txt"), "ted man, smiling").unwrap();
    copy("blue_square", "imgs/subject");
    for name in ["green_square", "black_triangle", "blue_stripes"] {
        copy(name, "imgs/reg");
    }
    copy("green_square", "imgs/ft");
    std::fs::write(
        dir.join("meta.json"),
        r#"{"green_square.png": {"caption": "a green square", "tags": "green, square"}}"#,
    )
    .unwrap();
}

const CONFIG: &str = r#"
[general]
caption_extension = ".txt"
resolution = 64
batch_size = 1
enable_bucket = false

[[datasets]]
  [[datasets.subsets]]
  image_dir = "imgs/subject"
  class_tokens = "ted man"
  num_repeats = 2
  caption_prefix = "photo of"

  [[datasets.subsets]]
  image_dir = "imgs/reg"
  class_tokens = "man"
  is_reg = true

[[datasets]]
  [[datasets.subsets]]
  metadata_file = "meta.json"
  image_dir = "imgs/ft"
"#;

/// Writes `toml` and a LoRA train.json naming it (and a `data_root` the config replaces).
fn config(dir: &Path, toml: &str, extra: serde_json::Value) -> PathBuf {
    std::fs::write(dir.join("dataset.toml"), toml).unwrap();
    let mut keys = serde_json::json!({
        "mode": "lora",
        "dataset_config": "dataset.toml",
        "resolution": 512,
        "batch_size": 4,
    });
    if let (Some(k), Some(e)) = (keys.as_object_mut(), extra.as_object()) {
        k.extend(e.clone());
    }
    write_config(dir, "tiny-sd15", &demo_data(), keys)
}

/// An epoch is the subject's 2 images × 2 repeats, the regularization images balanced to those
/// 4 samples (kohya: 3 images × 1, then one more repeat for the first), and the fine-tuning
/// image: 9 steps at batch 1, 4 of them regularization samples, which log a zero loss at
/// `prior_loss_weight: 0`. The config's resolution and batch size replace train.json's. Catches
/// a subset's repeats ignored, regularization balanced against both datasets (it would take 5),
/// captions from the wrong file or without the subset's prefix, and the metadata's tags lost.
#[test]
fn a_dataset_config_trains_each_subset_with_its_own_settings() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let extra = serde_json::json!({
        "max_steps": null,
        "max_epochs": 1,
        "prior_loss_weight": 0.0,
    });
    let cfg = config(tmp.path(), CONFIG, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("train.json's data_root not read"), "{log}");
    assert!(
        log.contains("datasets[0].subsets[0]: 2 images × 2 repeats"),
        "{log}"
    );
    assert!(log.contains("9 samples/epoch"), "{log}");
    let run = run_folder(tmp.path());
    let losses = step_losses(&run);
    assert_eq!(losses.len(), 9, "{losses:?}");
    assert_eq!(
        losses.iter().filter(|&&l| l == 0.0).count(),
        4,
        "{losses:?}"
    );

    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["batch_size"], 1);
    assert_eq!(plan["data"]["resolution"], 64);

    let meta = file_metadata(&run.join("sdtrain.safetensors"));
    // kohya's dataset-config branch: subsets named by their folder (or metadata file), the
    // regularization subsets' captions counted too, and no single-dataset keys.
    let json = |k: &str| -> serde_json::Value { serde_json::from_str(&meta[k]).unwrap() };
    let tags = json("ss_tag_frequency");
    assert_eq!(
        tags["subject"],
        serde_json::json!({"photo of ted man": 2, "smiling": 1})
    );
    assert_eq!(
        tags["meta.json"],
        serde_json::json!({"a green square": 1, "green": 1, "square": 1})
    );
    assert_eq!(tags["reg"], serde_json::json!({"man": 3}));
    assert_eq!(
        json("ss_dataset_dirs"),
        serde_json::json!({
            "subject": {"n_repeats": 2, "img_count": 2},
            "meta.json": {"n_repeats": 1, "img_count": 1},
        })
    );
    assert!(!meta.contains_key("ss_batch_size_per_device"));
    assert!(!meta.contains_key("ss_reg_dataset_dirs"));
    let datasets = json("ss_datasets");
    let (d0, d1) = (&datasets[0], &datasets[1]);
    assert_eq!(datasets.as_array().unwrap().len(), 2);
    assert_eq!(
        (
            &d0["is_dreambooth"],
            &d0["num_train_images"],
            &d0["num_reg_images"]
        ),
        (
            &serde_json::json!(true),
            &serde_json::json!(4),
            &serde_json::json!(3)
        )
    );
    assert_eq!(d0["resolution"], serde_json::json!([64, 64]));
    let s0 = &d0["subsets"][0];
    assert_eq!(
        (
            &s0["img_count"],
            &s0["num_repeats"],
            &s0["image_dir"],
            &s0["class_tokens"]
        ),
        (
            &serde_json::json!(2),
            &serde_json::json!(2),
            &serde_json::json!("subject"),
            &serde_json::json!("ted man")
        )
    );
    assert_eq!(s0["caption_prefix"], "photo of");
    assert_eq!(d0["subsets"][1]["is_reg"], true);
    assert_eq!(d0["subsets"][1]["img_count"], 3);
    assert_eq!(d1["is_dreambooth"], false);
    assert_eq!(d1["subsets"][0]["metadata_file"], "meta.json");
    assert_eq!(d1["num_train_images"], 1);
}

/// Two datasets at their own resolution and batch size train in one run, as kohya's
/// `DatasetGroup` trains them: the subject's 2 images × 2 repeats at 64 px in batches of 2, and
/// three images at 128 px one at a time, make 2 + 3 = 5 steps an epoch (kohya's
/// `len(train_dataset_group)`), each micro-batch of one dataset. Catches a dataset trained at the
/// first one's size or batch (4 or 7 steps; its buckets would read 64x64), and the files' per-dataset
/// `ss_datasets` entries taking the run's.
#[test]
fn datasets_at_their_own_resolution_and_batch_size_train_in_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let toml = "[general]\ncaption_extension = \".txt\"\nenable_bucket = false\n\
                [[datasets]]\nresolution = 64\nbatch_size = 2\n\
                [[datasets.subsets]]\nimage_dir = \"imgs/subject\"\nclass_tokens = \"ted man\"\n\
                num_repeats = 2\n\
                [[datasets]]\nresolution = 128\nbatch_size = 1\n\
                [[datasets.subsets]]\nimage_dir = \"imgs/reg\"\nclass_tokens = \"man\"\n";
    let extra = serde_json::json!({"max_steps": null, "max_epochs": 1});
    let cfg = config(tmp.path(), toml, extra);
    let log = sdtrain_ok(&cfg, tmp.path(), &["--dry-run"]);
    assert!(
        log.contains("datasets[0]: 64 px, batch 2, buckets off")
            && log.contains("datasets[1]: 128 px, batch 1, buckets off"),
        "{log}"
    );
    assert!(log.contains("datasets[0]'s; each dataset's above"), "{log}");
    // The memory plan prices the micro-batch of the most pixels: 1 × 128² over 2 × 64².
    assert!(log.contains("batch 1 at 128 px (datasets[1])"), "{log}");

    let log = sdtrain_ok(&cfg, tmp.path(), &[]);
    assert!(
        log.contains("datasets[0]: 64 px, batch 2, buckets: 64x64 ×2")
            && log.contains("datasets[1]: 128 px, batch 1, buckets: 128x128 ×3"),
        "{log}"
    );
    assert!(
        log.contains("7 samples/epoch, 5 steps/epoch of 2/1×1"),
        "{log}"
    );
    let run = run_folder(tmp.path());
    assert_eq!(step_losses(&run).len(), 5);

    let meta = file_metadata(&run.join("sdtrain.safetensors"));
    let datasets: serde_json::Value = serde_json::from_str(&meta["ss_datasets"]).unwrap();
    let shape =
        |d: &serde_json::Value| (d["resolution"].clone(), d["batch_size_per_device"].clone());
    assert_eq!(
        (shape(&datasets[0]), shape(&datasets[1])),
        (
            (serde_json::json!([64, 64]), serde_json::json!(2)),
            (serde_json::json!([128, 128]), serde_json::json!(1))
        )
    );
}

/// Each dataset's own `validation_split` and `validation_seed`, drawn per subset as kohya's
/// `split_train_val`: the subject's dataset holds nothing out, and the other's three images at
/// 0.5 train on ceil(1.5) = 2 and validate round(1.5) = 2, one image in both, as in kohya. So an
/// epoch is 2 × 2 + 2 = 6 samples and validation 2 images. Catches the split taken from the whole
/// run (it would hold out subject images), kohya's overlap lost (5 samples), and the second
/// dataset's split refused or ignored.
#[test]
fn each_dataset_holds_out_its_own_validation_split_as_kohya() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let toml = "[general]\nresolution = 64\nbatch_size = 1\ncaption_extension = \".txt\"\n\
                [[datasets]]\n[[datasets.subsets]]\nimage_dir = \"imgs/subject\"\n\
                class_tokens = \"ted man\"\nnum_repeats = 2\n\
                [[datasets]]\nvalidation_split = 0.5\nvalidation_seed = 11\n\
                [[datasets.subsets]]\nimage_dir = \"imgs/reg\"\nclass_tokens = \"man\"\n";
    let extra = serde_json::json!({"max_steps": null, "max_epochs": 1});
    let cfg = config(tmp.path(), toml, extra);
    let log = sdtrain_ok(&cfg, tmp.path(), &["--dry-run"]);
    assert!(
        log.contains("each dataset's validation_split of its subsets (kohya's split_train_val)"),
        "{log}"
    );
    let log = sdtrain_ok(&cfg, tmp.path(), &[]);
    assert!(log.contains("validation: 2 images"), "{log}");
    assert!(log.contains("6 samples/epoch"), "{log}");
}

/// `--dry-run` lists the subsets; each mistake is refused before anything loads (exit 2),
/// naming the file and the key's place in it.
#[test]
fn dataset_config_mistakes_name_their_place() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let dry = |toml: &str| {
        let cfg = config(tmp.path(), toml, serde_json::json!({}));
        sdtrain(
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            tmp.path(),
        )
    };
    let out = dry(CONFIG);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("dataset_config") && log.contains("3 subsets"),
        "{log}"
    );
    assert!(
        log.contains("datasets[0].subsets[1]") && log.contains("regularization, loss × 1"),
        "{log}"
    );

    let subset = "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"imgs/subject\"\n";
    let cases = [
        (
            format!("{subset}num_repeat = 2\n"),
            "datasets[0].subsets[0].num_repeat",
            "num_repeats",
        ),
        (
            format!("{subset}color_aug = true\n"),
            "datasets[0].subsets[0].color_aug",
            "colour augmentation",
        ),
        (
            format!("{subset}keep_tokens = 1.5\n"),
            "datasets[0].subsets[0].keep_tokens",
            "whole number",
        ),
        (
            format!("[general]\nbatch_size = 0\n{subset}"),
            "general.batch_size",
            "at least 1",
        ),
        (
            format!("{subset}resolution = 512\n"),
            "datasets[0].subsets[0].resolution",
            "dataset key",
        ),
        (
            "[[datasets]]\nvalidation_split = 1.5\n[[datasets.subsets]]\nimage_dir = \"imgs/subject\"\n".to_string(),
            "datasets[0].validation_split",
            "below 1",
        ),
        (
            format!("{subset}[[datasets]]\nenable_bucket = true\nmin_bucket_reso = 2048\nmax_bucket_reso = 1024\n[[datasets.subsets]]\nimage_dir = \"imgs/reg\"\n"),
            "datasets[1].min_bucket_reso",
            "shortest ≤ longest",
        ),
        (
            "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"nowhere\"\n".to_string(),
            "datasets[0].subsets[0].image_dir",
            "does not exist",
        ),
        (
            format!("{subset}is_reg = true\n"),
            "datasets",
            "no training subset",
        ),
        (
            format!("{subset}[[datasets.subsets]]\nmetadata_file = \"meta.json\"\n"),
            "datasets[0].subsets",
            "mixes DreamBooth subsets",
        ),
        ("[[datasets]\n".to_string(), "dataset.toml", "not valid TOML"),
    ];
    for (toml, place, why) in cases {
        let out = dry(&toml);
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{toml}\n{log}");
        assert!(log.contains(place) && log.contains(why), "{toml}\n{log}");
        assert!(log.contains("dataset.toml"), "{log}");
    }
}

/// With the text encoders frozen, the captions are encoded once: a subset whose captions are
/// dropped every epoch (`caption_dropout_every_n_epochs = 1`) needs the empty caption in the
/// cache, and one with a shuffle turns the cache off. Catches the empty caption left out (the
/// step would find no encoding) and a per-step subset cached.
#[test]
fn the_text_cache_follows_the_subsets() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let subset = "[general]\nresolution = 64\nbatch_size = 1\ncaption_extension = \".txt\"\n\
                  [[datasets]]\n[[datasets.subsets]]\nimage_dir = \"imgs/subject\"\n\
                  class_tokens = \"ted man\"\n";
    let extra = serde_json::json!({"disable_textenc_training": true});
    let cfg = config(
        tmp.path(),
        &format!("{subset}caption_dropout_every_n_epochs = 1\n"),
        extra.clone(),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("text-encoder cache: 3 captions encoded"),
        "{log}"
    );

    let cfg = config(
        tmp.path(),
        &format!("{subset}shuffle_caption = true\n"),
        extra,
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("text cache     off: shuffle_tags"), "{log}");
}

/// kohya's `bucket_no_upscale` from a dataset config: an 80×48 image under the resolution's
/// area trains at its own size, the 64×64 ones at theirs. Catches the flag dropped (the 80×48
/// image would go to a generated bucket) and a small image scaled up.
#[test]
fn bucket_no_upscale_gives_each_image_its_own_bucket() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    image::RgbImage::from_pixel(80, 48, image::Rgb([200, 40, 40]))
        .save(tmp.path().join("imgs/subject/wide.png"))
        .unwrap();
    let toml = "[general]\nresolution = 64\nbatch_size = 1\nenable_bucket = true\n\
                bucket_no_upscale = true\nbucket_reso_steps = 8\nmin_bucket_reso = 32\n\
                max_bucket_reso = 128\n\
                [[datasets]]\n[[datasets.subsets]]\nimage_dir = \"imgs/subject\"\n";
    let cfg = config(tmp.path(), toml, serde_json::json!({}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("80x48 ×1") && log.contains("64x64 ×2"),
        "{log}"
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    let log = text(&out);
    assert!(
        log.contains("never scaled up (kohya's bucket_no_upscale)"),
        "{log}"
    );
}

/// A validation image split out of a subset keeps the caption its subset gave it: train.json's
/// `caption_prefix` (the subset's fallback) is on it once. With every image captioned "ted man"
/// the text cache then holds one caption; a prefix added again to the held-out image would make
/// it two.
#[test]
fn a_validation_image_keeps_its_subsets_caption() {
    let tmp = tempfile::tempdir().unwrap();
    images(tmp.path());
    let toml = "[general]\nresolution = 64\nbatch_size = 1\nvalidation_split = 0.34\n\
                [[datasets]]\n[[datasets.subsets]]\nimage_dir = \"imgs/reg\"\n\
                class_tokens = \"ted man\"\n";
    let extra = serde_json::json!({
        "disable_textenc_training": true,
        "caption_prefix": "photo of",
    });
    let cfg = config(tmp.path(), toml, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("validation: 1 images"), "{log}");
    assert!(
        log.contains("text-encoder cache: 1 captions encoded"),
        "{log}"
    );
}
