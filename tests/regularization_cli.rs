//! Regularization images and kohya's DreamBooth folders from the CLI: a LoRA run on
//! `data_layout: "kohya"` folders with a `reg_data_root`, whose regularization samples train
//! beside the subject's, sized as kohya sizes them and weighed by `prior_loss_weight`, and
//! recorded in the LoRA file's kohya metadata. The reading and sizing rules themselves are
//! checked against kohya's code in tests/kohya_dreambooth_parity.rs.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{
    demo_data, run_folder, sdtrain, sdtrain_ok, sdtrain_refused, step_losses, text, write_config,
};

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

/// diffusers' DreamBooth class images: `reg_data_root` does not exist, so the base model draws
/// `num_class_images` of `class_prompt` into it (EveryDream2's layout: PNGs with the prompt in
/// caption files), they train as regularization images, and a second run finds them and draws
/// none. In kohya's layout they go to `1_<class_prompt>`. Catches images drawn but not read,
/// drawn again on every run, captioned with anything but the prompt, or of another size.
#[test]
fn missing_class_images_are_drawn_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, _) = folders(tmp.path());
    let reg = tmp.path().join("class");
    let extra = serde_json::json!({
        "mode": "lora",
        "max_steps": 1,
        "data_layout": "kohya",
        "caption_extension": ".txt",
        "reg_data_root": reg,
        "class_prompt": "a photo of a shape",
        "num_class_images": 2,
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &train, extra);
    let run = || sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let out = run();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("drawing 2 of \"a photo of a shape\""), "{log}");
    assert!(log.contains("(pndm, 50 steps, cfg 7.5"), "{log}");
    assert!(log.contains("regularization: 2 images"), "{log}");
    let folder = reg.join("1_a photo of a shape");
    let mut names: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["class-00000.png", "class-00001.png"]);
    let native = image::open(folder.join("class-00000.png")).unwrap();
    // The pipeline's default size: the UNet's sample size × the VAE's factor.
    let config = |part: &str| -> serde_json::Value {
        let path = common::fixture(&format!("tiny-sd15/{part}/config.json"));
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let vae_factor = 1
        << (config("vae")["block_out_channels"]
            .as_array()
            .unwrap()
            .len()
            - 1);
    let side = config("unet")["sample_size"].as_u64().unwrap() as u32 * vae_factor;
    assert_eq!((native.width(), native.height()), (side, side));
    let a = std::fs::read(folder.join("class-00000.png")).unwrap();
    let b = std::fs::read(folder.join("class-00001.png")).unwrap();
    assert_ne!(a, b, "each class image has its own seed");
    // A data-parallel run with images missing refuses to draw them, naming why.
    let more = tmp.path().join("more");
    let dp = write_config(
        tmp.path(),
        "tiny-sd15",
        &train,
        serde_json::json!({"mode": "lora", "max_steps": 1, "reg_data_root": more,
                           "class_prompt": "a photo of a shape", "num_class_images": 1}),
    );
    std::fs::remove_dir_all(tmp.path().join("out")).unwrap();
    let out = sdtrain(
        &["--config", dp.to_str().unwrap(), "--devices", "cpu,cpu"],
        tmp.path(),
    );
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("data-parallel run does not draw them"),
        "{log}"
    );
    assert!(!more.join("class-00000.png").exists());
    // train.json again as the first run's (the data-parallel config replaced it).
    write_config(
        tmp.path(),
        "tiny-sd15",
        &train,
        serde_json::json!({"mode": "lora", "max_steps": 1, "data_layout": "kohya",
                           "caption_extension": ".txt", "reg_data_root": reg,
                           "class_prompt": "a photo of a shape", "num_class_images": 2}),
    );
    // A second run finds them.
    let _ = std::fs::remove_dir_all(tmp.path().join("out"));
    let out = run();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("class images: 2 in reg_data_root (num_class_images 2), none to draw"),
        "{log}"
    );

    // EveryDream2's layout: into the folder itself, each with its caption file.
    let ed2 = tmp.path().join("class_ed2");
    let extra = serde_json::json!({
        "mode": "lora",
        "max_steps": 1,
        "reg_data_root": ed2,
        "class_prompt": "a photo of a shape",
        "num_class_images": 1,
    });
    let data = demo_data();
    let cfg = write_config(tmp.path(), "tiny-sd15", &data, extra);
    std::fs::remove_dir_all(tmp.path().join("out")).unwrap();
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(ed2.join("class-00000.png").is_file());
    assert_eq!(
        std::fs::read_to_string(ed2.join("class-00000.txt")).unwrap(),
        "a photo of a shape"
    );
    let _ = run_folder(tmp.path());
}

/// kohya's `caption_prefix` and `caption_suffix` reach the training and the regularization
/// images' captions (seen through the tags the LoRA file counts). Catches either folder left
/// without them.
#[test]
fn caption_affixes_reach_both_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reg) = folders(tmp.path());
    let extra = serde_json::json!({
        "mode": "lora",
        "max_steps": 1,
        "data_layout": "kohya",
        "caption_extension": ".txt",
        "reg_data_root": reg,
        "caption_prefix": "photo,",
        "caption_suffix": ", 8k",
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &train, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let bytes = std::fs::read(run_folder(tmp.path()).join("sdtrain.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tags: serde_json::Value =
        serde_json::from_str(&header.metadata().as_ref().unwrap()["ss_tag_frequency"]).unwrap();
    assert_eq!(tags["1_ted man"]["photo"], 2, "{tags}");
    assert_eq!(tags["1_ted man"]["8k"], 2, "{tags}");
    assert_eq!(tags["3_man"]["photo"], 3, "{tags}");
}

/// diffusers' DreamBooth folders: instance images without caption files train with
/// `instance_prompt` (an image with its own `.txt` keeps it), and a `class_data_dir` of images
/// named by a hash trains with `class_prompt`, as diffusers captions them. With the text encoders
/// frozen the distinct captions are encoded once: the two prompts, the one caption file and the
/// empty caption of `cond_dropout`, 4 in all. Catches captions from the file names (6), and
/// a prompt put over an image's own caption file (3). `instance_prompt` beside kohya's folders
/// (which name their captions) is refused.
#[test]
fn dreambooth_prompts_caption_the_images_without_captions() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reg) = (tmp.path().join("instance"), tmp.path().join("class"));
    std::fs::create_dir_all(&train).unwrap();
    std::fs::create_dir_all(&reg).unwrap();
    for (name, to, as_name) in [
        ("red_circle", &train, "red_circle"),
        ("blue_square", &train, "blue_square"),
        ("green_square", &train, "green_square"),
        ("black_triangle", &reg, "0-5f3a9c"),
        ("blue_stripes", &reg, "1-77e0b2"),
    ] {
        std::fs::copy(
            demo_data().join(format!("{name}.png")),
            to.join(format!("{as_name}.png")),
        )
        .unwrap();
    }
    std::fs::write(train.join("red_circle.txt"), "a red circle").unwrap();
    let keys = serde_json::json!({
        "mode": "lora",
        "instance_prompt": "a photo of sks shape",
        "reg_data_root": reg,
        "class_prompt": "a photo of a shape",
        "num_class_images": 2,
        "disable_textenc_training": true,
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &train, keys);
    let log = sdtrain_ok(&cfg, tmp.path(), &["--dry-run"]);
    assert!(
        log.contains("\"a photo of sks shape\" for every image without"),
        "{log}"
    );
    let log = sdtrain_ok(&cfg, tmp.path(), &[]);
    assert!(
        log.contains("text-encoder cache: 4 captions encoded"),
        "{log}"
    );

    let set = "data_layout=kohya";
    let log = sdtrain_refused(&cfg, tmp.path(), &["--set", set]);
    assert!(
        log.contains("instance_prompt") && log.contains("kohya's layout"),
        "{log}"
    );
}
