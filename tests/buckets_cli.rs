//! Aspect buckets and the latent and text-encoder caches, end to end from the CLI on the three
//! tiny fixtures, with a set of photos of mixed shapes:
//! - a run buckets them (one bucket per micro-batch, runts filled) on SD1.5, SD2.1 and SDXL;
//! - a cached run trains on what an uncached one does: the same per-step training and
//!   validation losses, to the rounding of encoding images in other batches;
//! - a disk cache is reused by the next run, and an image whose content changed, or a run at
//!   another bucket size, is encoded again, never served stale.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{run_folder, sdtrain, text, write_config};
use image::{Rgb, RgbImage};

/// Seven images of five shapes (wide, tall, square, very wide, near square), with captions.
fn mixed_data(root: &Path) -> PathBuf {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let shapes = [
        (96, 64),
        (64, 96),
        (64, 64),
        (160, 40),
        (90, 80),
        (100, 66),
        (66, 100),
    ];
    for (i, &(w, h)) in shapes.iter().enumerate() {
        let img = RgbImage::from_fn(w, h, |x, y| {
            Rgb([(x * 7 + i as u32 * 30) as u8, (y * 5) as u8, (i * 40) as u8])
        });
        img.save(data.join(format!("img{i}.png"))).unwrap();
        std::fs::write(
            data.join(format!("img{i}.txt")),
            format!("shape {i}, colour"),
        )
        .unwrap();
    }
    data
}

/// Each step's training loss, then each step's validation loss.
fn losses(run: &Path) -> Vec<f64> {
    let records: Vec<serde_json::Value> = std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let train = records.iter().map(|v| v["loss"].as_f64().unwrap());
    let val = records.iter().map(|v| v["val_loss"].as_f64().unwrap());
    train.chain(val).collect()
}

/// Trains in `dir` and returns (output, run folder).
fn train(dir: &Path, fixture: &str, data: &Path, extra: serde_json::Value) -> (String, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = write_config(dir, fixture, data, extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap()], dir);
    let log = text(&out);
    assert!(out.status.success(), "{fixture}: {log}");
    (log, run_folder(dir))
}

fn base() -> serde_json::Value {
    serde_json::json!({
        "mode": "lora",
        "adapter": {"rank": 2, "alpha": 2},
        "batch_size": 2,
        "max_steps": 3,
        "crop_jitter": 0,
        "flip_p": 0.5,
        "disable_textenc_training": true,
        "cond_dropout": 0.0,
        "seed": 11,
        "validation_split": 0.3,
        "validation_every_n_steps": 1,
    })
}

fn with(mut v: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(a), Some(b)) = (v.as_object_mut(), extra.as_object()) {
        a.extend(b.clone());
    }
    v
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-4 * x.abs().max(1e-3),
            "{what}: {a:?} vs {b:?}"
        );
    }
}

#[test]
fn buckets_and_both_caches_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_data(dir.path());
    for fixture in ["tiny-sd15", "tiny-sd21", "tiny-sdxl"] {
        let plain = dir.path().join(format!("{fixture}-plain"));
        let (log, run) = train(
            &plain,
            fixture,
            &data,
            with(
                base(),
                serde_json::json!({"cache_text_encoder_outputs": false}),
            ),
        );
        // 7 images over several buckets: each micro-batch holds one shape.
        let buckets_line = log
            .lines()
            .find(|l| l.starts_with("aspect buckets:"))
            .unwrap_or_else(|| panic!("{fixture}: no bucket report\n{log}"));
        assert!(
            buckets_line.matches('×').count() >= 3,
            "{fixture}: {buckets_line}"
        );
        assert!(log.contains("latent cache: off"), "{fixture}: {log}");
        assert!(log.contains("text-encoder cache: off"), "{fixture}: {log}");
        let want = losses(&run);

        let cached = dir.path().join(format!("{fixture}-cached"));
        let (log, run) = train(
            &cached,
            fixture,
            &data,
            with(base(), serde_json::json!({"cache_latents": true})),
        );
        // 5 training images (2 held out for validation, cached on their own)
        assert!(log.contains("5 encoded, 0 reused"), "{fixture}: {log}");
        assert!(log.contains("VAE released"), "{fixture}: {log}");
        assert!(log.contains("text encoders released"), "{fixture}: {log}");
        assert_close(&losses(&run), &want, fixture);
    }
}

#[test]
fn the_disk_cache_is_reused_and_never_stale() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_data(dir.path());
    let out = dir.path().join("shared");
    let cfg = |extra: serde_json::Value| {
        with(
            with(
                base(),
                serde_json::json!({
                    "cache_latents_to_disk": true,
                    "output_dir": out,
                    "max_steps": 1,
                    "validation_split": null,
                    "validation_every_n_steps": null,
                }),
            ),
            extra,
        )
    };
    let run = |name: &str, extra: serde_json::Value| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        let c = write_config(&d, "tiny-sd15", &data, cfg(extra));
        let o = sdtrain(&["--config", c.to_str().unwrap()], &d);
        let log = text(&o);
        assert!(o.status.success(), "{name}: {log}");
        log
    };
    let first = run("a", serde_json::json!({}));
    assert!(first.contains("7 encoded, 0 reused"), "{first}");
    let files = std::fs::read_dir(out.join("latent_cache")).unwrap().count();
    assert_eq!(files, 7);

    let second = run("b", serde_json::json!({}));
    assert!(second.contains("0 encoded, 7 reused"), "{second}");

    // A changed image: only it is encoded again.
    RgbImage::from_fn(96, 64, |x, _| Rgb([x as u8, 1, 2]))
        .save(data.join("img0.png"))
        .unwrap();
    let third = run("c", serde_json::json!({}));
    assert!(third.contains("1 encoded, 6 reused"), "{third}");

    // Another resolution puts every image in another bucket: nothing is reused.
    let fourth = run("d", serde_json::json!({"resolution": 128}));
    assert!(fourth.contains("7 encoded, 0 reused"), "{fourth}");

    // No flips: other entries (the flipped latents are part of the key).
    let fifth = run("e", serde_json::json!({"flip_p": 0.0}));
    assert!(fifth.contains("7 encoded, 0 reused"), "{fifth}");
}

#[test]
fn crop_jitter_with_a_latent_cache_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_data(dir.path());
    let cfg = write_config(
        dir.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({"cache_latents": true, "crop_jitter": 0.05}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap()], dir.path());
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("crop_jitter") && log.contains("cache_latents"),
        "{log}"
    );
}

/// A file whose header reads fine but whose pixels do not decode is left out of its step with a
/// warning naming it, and the run goes on; the summary counts it.
#[test]
fn an_image_that_fails_to_decode_mid_run_is_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_data(dir.path());
    let mut png = Vec::new();
    RgbImage::from_fn(64, 64, |x, y| Rgb([x as u8 * 3, y as u8 * 3, 9]))
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    // Scramble the compressed pixel data inside IDAT; the chunk structure (and IEND) stay.
    let idat = png.windows(4).position(|w| w == b"IDAT").unwrap() + 4;
    for b in &mut png[idat + 2..idat + 40] {
        *b ^= 0x5a;
    }
    let bad = data.join("broken.png");
    std::fs::write(&bad, &png).unwrap();
    let cfg_for = |steps: u64| {
        let extra = with(
            base(),
            serde_json::json!({"max_steps": steps, "batch_size": 1, "validation_split": null,
                               "validation_every_n_steps": null}),
        );
        write_config(dir.path(), "tiny-sd15", &data, extra)
    };
    let dry = sdtrain(
        &["--config", cfg_for(1).to_str().unwrap(), "--dry-run"],
        dir.path(),
    );
    assert!(dry.status.success(), "{}", text(&dry));
    // 8 single-image steps: one epoch is every image once, so the broken one comes up.
    let out = sdtrain(&["--config", cfg_for(8).to_str().unwrap()], dir.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("8 images loaded, 0 skipped"), "{log}");
    assert!(
        log.contains("left out") && log.contains("broken.png"),
        "{log}"
    );
    // At batch 1 its step has nothing to train on: skipped, and counted.
    assert!(log.contains("none of its images could be decoded"), "{log}");
    assert!(log.contains("skipped steps   1"), "{log}");
    assert!(log.contains("left out        1 samples"), "{log}");
}

/// A runt batch's loss counts `(runt / batch)^1.5`, EveryDream2's discount. One image at batch 2
/// is a runt of 1, filled with a repeat of itself; its step's loss and gradient norm must be
/// those of a full batch of the same two samples (the image and a byte copy of it, which draw the
/// same seeds) times (1/2)^1.5. Catches the weight dropped where the micro-batch loss is scaled.
#[test]
fn a_runt_batch_loss_is_discounted() {
    let dir = tempfile::tempdir().unwrap();
    let image = RgbImage::from_fn(64, 64, |x, y| Rgb([(x * 4) as u8, (y * 3) as u8, 90]));
    let first_step = |name: &str, copies: usize| {
        let root = dir.path().join(name);
        let data = root.join("data");
        std::fs::create_dir_all(&data).unwrap();
        for i in 0..copies {
            image.save(data.join(format!("img{i}.png"))).unwrap();
            std::fs::write(data.join(format!("img{i}.txt")), "a gradient").unwrap();
        }
        let extra = serde_json::json!({"batch_size": 2, "max_steps": 1, "seed": 3});
        let cfg = write_config(&root, "tiny-sd15", &data, extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], &root);
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        let runt = log.contains("runt batches    1 samples repeated");
        assert_eq!(runt, copies == 1, "{name}: {log}");
        let line = std::fs::read_to_string(run_folder(&root).join("train_log.jsonl")).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        (
            v["loss"].as_f64().unwrap(),
            v["grad_norm"].as_f64().unwrap(),
        )
    };
    let (runt_loss, runt_norm) = first_step("runt", 1);
    let (full_loss, full_norm) = first_step("full", 2);
    let weight = 0.5f64.powf(1.5);
    for (what, runt, full) in [
        ("loss", runt_loss, full_loss),
        ("grad norm", runt_norm, full_norm),
    ] {
        assert!(
            (runt / full - weight).abs() <= 1e-5 * weight,
            "{what}: runt {runt} / full {full} = {}, want {weight}",
            runt / full
        );
    }
}

/// cond_dropout no longer turns the text-encoder cache off: the captions it drops become the
/// cached empty caption, and the run's losses equal an uncached run's (same dropout draws).
#[test]
fn the_text_cache_serves_cond_dropout_empty_captions() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_data(dir.path());
    let dropout = serde_json::json!({"cond_dropout": 0.5, "max_steps": 4});
    let (log, run) = train(
        &dir.path().join("plain"),
        "tiny-sd15",
        &data,
        with(
            with(base(), dropout.clone()),
            serde_json::json!({"cache_text_encoder_outputs": false}),
        ),
    );
    assert!(log.contains("text-encoder cache: off"), "{log}");
    let want = losses(&run);
    let (log, run) = train(
        &dir.path().join("cached"),
        "tiny-sd15",
        &data,
        with(base(), dropout),
    );
    assert!(log.contains("text encoders released"), "{log}");
    assert_close(&losses(&run), &want, "cond_dropout 0.5 cached");
}
