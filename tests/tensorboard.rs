//! TensorBoard event files: the bytes PyTorch's `SummaryWriter` writes (a golden file made by
//! `tests/fixtures/tensorboard/make_pytorch_events.py`), and, from the CLI on each tiny fixture,
//! the event files of a 2-step run read back: every tag, the right steps, the losses of
//! `train_log.jsonl`, and no step twice after a resume.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sdtrain::tensorboard::event::{Event, ValueData, What, FILE_VERSION};
use sdtrain::tensorboard::reader::{event_files, read_dir, read_file, scalars, tags};
use sdtrain::tensorboard::record::{frame, parse_records};

fn golden() -> PathBuf {
    common::fixture("tensorboard/pytorch.tfevents")
}

/// Reads the golden file with our reader and checks what the generator wrote. Catches a wrong
/// field number or wire type in the reader, a wrong CRC or mask.
#[test]
fn pytorch_event_file_reads_back() {
    let events = read_file(&golden()).unwrap();
    assert_eq!(events[0].what, What::FileVersion(FILE_VERSION.into()));
    assert!(events.iter().all(|e| e.wall_time > 1.7e9), "{events:?}");
    assert_eq!(scalars(&events, "loss"), [(1, 0.25)]);
    assert_eq!(scalars(&events, "lr/unet"), [(1, 0.0)]);
    assert_eq!(scalars(&events, "grad_norm"), [(2, 3.5)]);
    assert_eq!(scalars(&events, "memory/in_use_mib"), [(300, 1234.5)]);
    let image = events
        .iter()
        .find_map(|e| match &e.what {
            What::Summary(v) if v[0].tag == "samples/0" => Some((e.step, v[0].data.clone())),
            _ => None,
        })
        .expect("the image event");
    let (2, ValueData::Image(img)) = image else {
        panic!("{image:?}")
    };
    assert_eq!((img.width, img.height, img.colorspace), (3, 2, 3));
    let rgb = image::load_from_memory(&img.encoded).unwrap().to_rgb8();
    assert_eq!(rgb.dimensions(), (3, 2));
    assert_eq!(rgb.get_pixel(0, 0).0, [255, 0, 0]);
    assert_eq!(rgb.get_pixel(2, 1).0, [128, 128, 128]);
}

/// Each event of the golden file, encoded and framed by sdtrain, gives PyTorch's bytes exactly:
/// field numbers, wire types, proto3's left-out defaults (step 0) and kept oneof zeros
/// (`lr/unet` 0.0), multi-byte varints (step 300), and the framing. A round trip through our
/// own reader cannot catch a field number that is wrong both ways; this can.
#[test]
fn our_encoding_of_pytorch_events_is_byte_identical() {
    let bytes = std::fs::read(golden()).unwrap();
    let (records, err) = parse_records(&bytes);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(records.len(), 6);
    let mut ours = Vec::new();
    for r in &records {
        let event = Event::decode(&r.data).unwrap();
        assert_eq!(event.encode(), r.data, "{event:?}");
        ours.extend(frame(&event.encode()));
    }
    assert_eq!(ours, bytes);
}

/// Trains 2 steps of `fixture` (plus `extra` keys) and returns the run folder.
fn train(dir: &Path, fixture: &str, extra: serde_json::Value) -> PathBuf {
    let cfg = write_config(dir, fixture, &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    run_folder(dir)
}

/// `train_log.jsonl`'s records.
fn jsonl(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `key` of each JSONL record that has it, as TensorBoard's (step, f32) points.
fn jsonl_points(records: &[serde_json::Value], key: &str) -> Vec<(i64, f32)> {
    records
        .iter()
        .filter_map(|r| Some((r["step"].as_i64()?, r[key].as_f64()? as f32)))
        .collect()
}

/// The run folder's events hold the JSONL log's numbers under their tags, step by step.
fn check_run(run: &Path, want_tags: &[&str]) {
    let events = read_dir(run).unwrap();
    assert_eq!(events[0].what, What::FileVersion(FILE_VERSION.into()));
    let got = tags(&events);
    for t in want_tags {
        assert!(got.iter().any(|g| g == t), "tag {t} missing from {got:?}");
    }
    let records = jsonl(run);
    for (tag, key) in [
        ("loss", "loss"),
        ("lr/unet", "lr_unet"),
        ("lr/text_encoder", "lr_text_encoder"),
        ("grad_norm", "grad_norm"),
        ("images_per_s", "images_per_s"),
        ("val_loss", "val_loss"),
    ] {
        assert_eq!(scalars(&events, tag), jsonl_points(&records, key), "{tag}");
    }
    assert_eq!(
        scalars(&events, "loss")
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        [1, 2]
    );
    if records[0]["memory"].is_object() {
        let mib = records[0]["memory"]["peak_bytes"].as_f64().unwrap() / 1048576.0;
        assert_eq!(scalars(&events, "memory/peak_mib")[0], (1, mib as f32));
    }
}

/// A full fine-tune of SD1.5 (UNet and text encoder), with a save point after step 1, then
/// resumed from it: step 2 is trained again, its old events are dropped and the new ones go into
/// a second file, so the folder holds steps 1 and 2 once each, with the resumed run's numbers.
#[test]
fn tiny_sd15_logs_both_groups_and_resumes_without_duplicate_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(
        tmp.path(),
        "tiny-sd15",
        serde_json::json!({"save_every_n_steps": 1}),
    );
    let want = [
        "loss",
        "lr/unet",
        "lr/text_encoder",
        "grad_norm",
        "images_per_s",
    ];
    check_run(&run, &want);
    assert_eq!(event_files(&run).unwrap().len(), 1);
    let cfg = tmp.path().join("train.json");
    let resume = format!("resume_ckpt={}", run.join("state-step-000001").display());
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--set", &resume],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(event_files(&run).unwrap().len(), 2);
    check_run(&run, &want);
}

/// SD2.1 (v-prediction) with validation after each step: `val_loss` at steps 1 and 2.
#[test]
fn tiny_sd21_logs_validation_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "mode": "lora", "validation_split": 0.25, "validation_every_n_steps": 1,
    });
    let run = train(tmp.path(), "tiny-sd21", extra);
    check_run(
        &run,
        &["loss", "lr/unet", "grad_norm", "images_per_s", "val_loss"],
    );
    let val: Vec<i64> = scalars(&read_dir(&run).unwrap(), "val_loss")
        .iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(val, [1, 2]);
}

/// SDXL, with `logdir`: the event files go beside the JSONL log, in `<logdir>/<run name>/`.
#[test]
fn tiny_sdxl_writes_into_logdir() {
    let tmp = tempfile::tempdir().unwrap();
    let logdir = tmp.path().join("logs");
    let extra = serde_json::json!({"mode": "lora", "logdir": logdir});
    let run = train(tmp.path(), "tiny-sdxl", extra);
    assert!(event_files(&run).unwrap().is_empty());
    let logs = logdir.join(run.file_name().unwrap());
    check_run(&logs, &["loss", "lr/unet", "grad_norm", "images_per_s"]);
}
