//! Masked loss from `sdtrain --config train.json` on tiny-sd15: a copy of the demo images with a
//! `-masklabel.png` beside each (zero except the top-left quarter). The masks change the first
//! step's loss (an ignored key fails here); all-ones masks, and `unmasked_weight` 1, give the
//! unmasked loss exactly; a cached-latents run equals the uncached one, flips included; an
//! unreadable mask file stops the run naming it; the mask files are not trained on.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, sdtrain, step_losses, text, write_config};

/// The demo images copied into `dir/data`, each with a 48 × 48 mask (resized to its image) that
/// is `inside` over its top-left quarter and `outside` elsewhere.
fn masked_data(dir: &Path, inside: u8, outside: u8) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for entry in std::fs::read_dir(demo_data()).unwrap() {
        let path = entry.unwrap().path();
        let to = data.join(path.file_name().unwrap());
        std::fs::copy(&path, &to).unwrap();
        if path.extension().is_some_and(|e| e == "png") {
            let stem = path.file_stem().unwrap().to_string_lossy();
            let mask = image::GrayImage::from_fn(48, 48, |x, y| {
                image::Luma([if x < 24 && y < 24 { inside } else { outside }])
            });
            mask.save(data.join(format!("{stem}-masklabel.png")))
                .unwrap();
        }
    }
    data
}

/// The logged losses of a run on `data` with `extra` (2 steps, flips on), and its log.
fn run(dir: &Path, data: &Path, extra: serde_json::Value) -> (Vec<f64>, String) {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = serde_json::json!({
        "zero_frequency_noise_ratio": 0.0, "cond_dropout": 0.0, "flip_p": 0.5, "max_steps": 2,
        "batch_size": 2,
    });
    cfg.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let c = write_config(dir, "tiny-sd15", data, cfg);
    let out = sdtrain(&["--config", c.to_str().unwrap(), "--cpu"], dir);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.join("out"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.ends_with("latent_cache"))
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    (step_losses(&runs[0]), log)
}

#[test]
fn masks_weigh_the_loss_and_ones_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let quarter = masked_data(&tmp.path().join("quarter"), 255, 0);
    let ones = masked_data(&tmp.path().join("ones"), 255, 255);
    let at = |name: &str| tmp.path().join(name);
    let (plain, log) = run(&at("plain"), &quarter, serde_json::json!({}));
    // 8 images: the mask files are not training images
    assert!(log.contains("8 images"), "{log}");
    let on = serde_json::json!({"masked_loss": true});
    let (masked, _) = run(&at("masked"), &quarter, on.clone());
    for (m, p) in masked.iter().zip(&plain) {
        // a quarter of the latent kept: the loss drops to about a quarter
        assert!(*m < 0.6 * p && *m > 0.05 * p, "{masked:?} vs {plain:?}");
    }
    // normalising by the mask's mean brings it back near the plain loss, and it differs
    let norm = serde_json::json!({"masked_training": true, "normalize_masked_area_loss": true});
    let (normalised, _) = run(&at("norm"), &quarter, norm);
    assert!(
        normalised[0] > 2.0 * masked[0] && normalised[0] != plain[0],
        "{normalised:?}"
    );
    // all-ones masks, and a floor of 1, are the unmasked loss exactly
    assert_eq!(run(&at("ones"), &ones, on.clone()).0, plain);
    let floor = serde_json::json!({"masked_loss": true, "unmasked_weight": 1.0});
    assert_eq!(run(&at("floor"), &quarter, floor).0, plain);
    let always = serde_json::json!({"masked_loss": true, "unmasked_probability": 1.0});
    assert_eq!(run(&at("always"), &quarter, always).0, plain);
}

#[test]
fn cached_latents_train_with_their_masks() {
    let tmp = tempfile::tempdir().unwrap();
    let data = masked_data(tmp.path(), 255, 30);
    let on = serde_json::json!({"masked_loss": true});
    let (uncached, _) = run(&tmp.path().join("uncached"), &data, on);
    for (name, cache) in [
        ("memory", "cache_latents"),
        ("disk", "cache_latents_to_disk"),
    ] {
        let extra = serde_json::json!({"masked_loss": true, cache: true});
        let (cached, log) = run(&tmp.path().join(name), &data, extra);
        assert!(log.contains("8 encoded"), "{log}");
        for (a, b) in cached.iter().zip(&uncached) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{name}: {cached:?} vs {uncached:?}"
            );
        }
    }
}

#[test]
fn an_unreadable_mask_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let data = masked_data(tmp.path(), 255, 0);
    let bad = data.join("red_circle-masklabel.png");
    std::fs::write(&bad, b"not an image").unwrap();
    let c = write_config(
        tmp.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({"masked_loss": true, "max_steps": 8}),
    );
    let out = sdtrain(&["--config", c.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(
        text(&out).contains("red_circle-masklabel.png"),
        "{}",
        text(&out)
    );
}

/// OneTrainer's masked prior preservation on a LoRA: the first step's adapters add nothing
/// (their `up` starts at zero), so its prior term is 0 and its loss the plain masked loss; after
/// one update the prior (the model without its adapters) differs from the prediction, and the
/// second step's loss grows. Catches the prior predicted with the adapters on (its term stays
/// 0), the term left out, or one added inside the mask. A full fine-tune is refused.
#[test]
fn masked_prior_preservation_pulls_toward_the_model_without_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let data = masked_data(&tmp.path().join("data"), 255, 0);
    let lora = |extra: serde_json::Value| {
        let mut cfg = serde_json::json!({"mode": "lora", "lr": 0.05, "masked_loss": true,
                                         "adapter": {"rank": 4, "alpha": 4}});
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        cfg
    };
    let (plain, _) = run(
        &tmp.path().join("plain"),
        &data,
        lora(serde_json::json!({})),
    );
    let (prior, _) = run(
        &tmp.path().join("prior"),
        &data,
        lora(serde_json::json!({"masked_prior_preservation_weight": 1.0})),
    );
    assert!(
        (prior[0] - plain[0]).abs() <= 1e-6 * plain[0],
        "{prior:?} vs {plain:?}"
    );
    assert!(prior[1] > plain[1] * (1.0 + 1e-6), "{prior:?} vs {plain:?}");

    let cfg = write_config(
        &tmp.path().join("plain"),
        "tiny-sd15",
        &data,
        serde_json::json!({"masked_loss": true, "masked_prior_preservation_weight": 1.0}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("masked_prior_preservation_weight"));
}
