//! A `zero_terminal_snr` run samples and saves the schedule it trains on: its samples draw on
//! the rescaled schedule with guidance rescale 0.7 (EveryDream2's), and the saved diffusers
//! folder and single file declare the schedule, so `sdtrain sample` on them (and diffusers)
//! draws what the run's own samples drew.

mod common;

use common::cli::{demo_data, rewrite_after_first_log, run_folder, sdtrain, text, write_config};
use sdtrain::model::layout::ModelLayout;
use sdtrain::sample::SchedulerConfig;

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Largest per-channel difference between two PNGs of the same size.
fn max_level_diff(a: &std::path::Path, b: &std::path::Path) -> u8 {
    let (a, b) = (
        image::open(a).unwrap().to_rgb8(),
        image::open(b).unwrap().to_rgb8(),
    );
    assert_eq!(a.dimensions(), b.dimensions());
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap()
}

/// SD1.5's `PNDMScheduler` ignores diffusers' `rescale_betas_zero_snr`, so the saved folder's
/// scheduler becomes DDIM with the key, in its config and in `model_index.json`. The run's
/// last sample is redrawn from the saved folder by `sdtrain sample` with `--guidance-rescale
/// 0.7`: the same image (to a level), while plain guidance or the base model's schedule draw
/// another. Catches samples or saves left on the base schedule, or the class left as PNDM.
#[test]
fn a_zero_terminal_snr_run_samples_and_saves_its_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.json");
    std::fs::write(
        &prompts,
        r#"{"cfgs": [20], "num_inference_steps": 4, "resolution": 32, "seed": 9,
            "samples": [{"prompt": "a red cat", "negative_prompt": "blurry"}]}"#,
    )
    .unwrap();
    let extra = serde_json::json!({
        "mode": "full", "zero_terminal_snr": true, "save_ckpt_format": "both",
        "sample_prompts": prompts, "sample_steps": 2,
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());

    let folder = run.join("final");
    let scheduler = read_json(&folder.join("scheduler/scheduler_config.json"));
    assert_eq!(scheduler["_class_name"], "DDIMScheduler", "{scheduler}");
    assert_eq!(scheduler["rescale_betas_zero_snr"], true, "{scheduler}");
    assert_eq!(scheduler["clip_sample"], false, "{scheduler}");
    assert_eq!(
        scheduler["steps_offset"], 1,
        "the base's fields stay: {scheduler}"
    );
    let index = read_json(&folder.join("model_index.json"));
    assert_eq!(
        index["scheduler"],
        serde_json::json!(["diffusers", "DDIMScheduler"])
    );
    // The single file declares it in the scheduler config its metadata carries.
    let file = ModelLayout::read(&run.join("final.safetensors"), None).unwrap();
    assert!(
        SchedulerConfig::from_layout(&file)
            .unwrap()
            .zero_terminal_snr
    );

    let drawn = run.join("samples/gs00002-000-a_red_cat.png");
    let txt = std::fs::read_to_string(drawn.with_extension("txt")).unwrap();
    assert!(txt.contains("guidance rescale: 0.7"), "{txt}");
    let redraw = |model: &std::path::Path, name: &str, rescale: &str| {
        let model = model.display().to_string();
        let args = [
            "sample",
            "--model",
            &model,
            "--prompt",
            "a red cat",
            "--negative-prompt",
            "blurry",
            "--steps",
            "4",
            "--cfg",
            "20",
            "--seed",
            "9",
            "--width",
            "32",
            "--height",
            "32",
            "--cpu",
            "--guidance-rescale",
            rescale,
            "--out",
            name,
        ];
        let o = sdtrain(&args, tmp.path());
        assert!(o.status.success(), "{}", text(&o));
        tmp.path().join(name)
    };
    let same = max_level_diff(&drawn, &redraw(&folder, "same.png", "0.7"));
    assert!(
        same <= 1,
        "the saved folder redraws the sample: {same} levels apart"
    );
    let plain = max_level_diff(&drawn, &redraw(&folder, "plain.png", "0"));
    assert!(plain > 4, "plain guidance draws another image ({plain})");
    // The base's own schedule, with the trained weights: the saved folder with its scheduler
    // config put back.
    let base_schedule = tmp.path().join("base-schedule");
    common::copy_dir(&folder, &base_schedule);
    std::fs::copy(
        common::fixture("tiny-sd15").join("scheduler/scheduler_config.json"),
        base_schedule.join("scheduler/scheduler_config.json"),
    )
    .unwrap();
    let unscaled = max_level_diff(&drawn, &redraw(&base_schedule, "base.png", "0.7"));
    assert!(
        unscaled > 4,
        "the unrescaled schedule draws another image ({unscaled})"
    );
}

/// A v-prediction single file saved by a zero-terminal-SNR run carries ComfyUI's `ztsnr`
/// marker beside `v_pred`; the same run without the option carries `v_pred` alone.
#[test]
fn a_v_prediction_single_file_carries_the_ztsnr_marker() {
    for zero_snr in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let extra = serde_json::json!({
            "mode": "full", "zero_terminal_snr": zero_snr, "save_ckpt_format": "safetensors",
            "max_steps": 1,
        });
        let cfg = write_config(tmp.path(), "tiny-sd21", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{}", text(&out));
        let file = run_folder(tmp.path()).join("final.safetensors");
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let names: Vec<&str> = st.names();
        assert!(names.contains(&"v_pred"));
        assert_eq!(names.contains(&"ztsnr"), zero_snr, "zero_snr {zero_snr}");
    }
}

/// `load_settings_every_epoch` turning `zero_terminal_snr` on after the first epoch turns the
/// samples over with it: step 8's round (epoch 1) is plain, step 16's has guidance rescale.
#[test]
fn a_reloaded_zero_terminal_snr_switches_the_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let prompts = dir.join("prompts.json");
    std::fs::write(
        &prompts,
        r#"{"cfgs": [5], "num_inference_steps": 2, "resolution": 32, "samples": [{"prompt": "a cat"}]}"#,
    )
    .unwrap();
    let cfg = write_config(
        &dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({
            "mode": "lora", "max_steps": null, "max_epochs": 2, "zero_terminal_snr": false,
            "load_settings_every_epoch": true, "sample_prompts": prompts, "sample_steps": 8,
        }),
    );
    let original = std::fs::read_to_string(&cfg).unwrap();
    let changed = original.replace(
        "\"zero_terminal_snr\": false",
        "\"zero_terminal_snr\": true",
    );
    assert_ne!(original, changed);
    // Rewrite train.json once the first step is logged (8 steps an epoch).
    let watcher = rewrite_after_first_log(&dir, &cfg, changed);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], &dir);
    assert!(watcher.join().unwrap(), "the first step was never logged");
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("applied"), "{}", text(&out));
    let samples = run_folder(&dir).join("samples");
    let described = |step: usize| {
        std::fs::read_to_string(samples.join(format!("gs{step:05}-000-a_cat.txt"))).unwrap()
    };
    assert!(
        !described(8).contains("guidance rescale"),
        "{}",
        described(8)
    );
    assert!(
        described(16).contains("guidance rescale: 0.7"),
        "{}",
        described(16)
    );
}
