//! Single-file checkpoints from the command line, on all three tiny fixtures: a full fine-tune
//! reads diffusers' script-converted single file as `model` and saves single files
//! (`save_ckpt_format`, EveryDream2's `no_save_ckpt`); `sdtrain inspect` reports a single file.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sdtrain::model::family::ModelFamily;
use sdtrain::model::files::{Component, ComponentSource};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::single_file::ConfigOrigin;

fn script_file(name: &str) -> std::path::PathBuf {
    common::fixture("single-file").join(format!("{name}.safetensors"))
}

#[test]
fn full_finetune_reads_and_writes_single_files() {
    let cases = [
        (
            "tiny-sd15",
            ModelFamily::Sd1,
            serde_json::json!({"save_ckpt_format": "safetensors"}),
            false,
        ),
        (
            "tiny-sd21",
            ModelFamily::Sd2,
            serde_json::json!({"save_ckpt_format": "both", "prediction_type": "v_prediction"}),
            true,
        ),
        (
            "tiny-sdxl",
            ModelFamily::Sdxl,
            serde_json::json!({"no_save_ckpt": false, "model_config": common::fixture("tiny-sdxl")}),
            true,
        ),
    ];
    for (name, family, extra, folder_too) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let mut extra = extra;
        extra["model"] = serde_json::json!(script_file(name));
        extra["mode"] = serde_json::json!("full");
        // Samples at the last step: the sampler reads the single file's scheduler and pipeline
        // configs (from its metadata, detection or model_config).
        let prompts = tmp.path().join("prompts.json");
        std::fs::write(
            &prompts,
            r#"{"cfgs": [3], "num_inference_steps": 2, "resolution": 32, "samples": [{"prompt": "a cat"}]}"#,
        )
        .unwrap();
        extra["sample_prompts"] = serde_json::json!(prompts);
        extra["sample_steps"] = serde_json::json!(2);
        let cfg = write_config(tmp.path(), name, &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap()], tmp.path());
        assert!(out.status.success(), "{name}: {}", text(&out));
        let run = run_folder(tmp.path());
        // The summary lists every output of the final save.
        let summary = String::from_utf8_lossy(&out.stdout);
        let saved: Vec<&str> = summary
            .lines()
            .filter(|l| l.starts_with("saved "))
            .collect();
        assert_eq!(saved.len(), if folder_too { 2 } else { 1 }, "{summary}");
        assert!(
            saved.iter().any(|l| l.ends_with("final.safetensors")),
            "{summary}"
        );
        let file = run.join("final.safetensors");
        assert!(file.is_file(), "{name}: no final.safetensors");
        assert_eq!(run.join("final").is_dir(), folder_too, "{name}");
        assert!(
            run.join("samples/gs00002-grid.png").is_file(),
            "{name}: no samples"
        );
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
        assert!(plan["model_file"]["save_ckpt_format"].is_string(), "{plan}");
        // The saved file reopens from its own metadata, and the UNet was trained.
        let saved = ModelLayout::read(&file, None).unwrap();
        let sf = saved.single_file().unwrap();
        assert_eq!(sf.origin, ConfigOrigin::Metadata, "{name}");
        assert_eq!(saved.family, family);
        let base = ModelLayout::read(&script_file(name), None).unwrap();
        let load = |l: &ModelLayout| {
            let ComponentSource::Packed { packed: p, .. } =
                &l.component(Component::Unet).unwrap().source
            else {
                panic!("{name}: the UNet of a single file is not packed")
            };
            p.view
                .load("conv_in.weight", &candle_core::Device::Cpu)
                .unwrap()
                .to_dtype(candle_core::DType::F32)
                .unwrap()
        };
        assert!(
            common::rel_err(&load(&saved), &load(&base)) > 0.0,
            "{name}: the saved UNet equals the base"
        );
    }
}

#[test]
fn inspect_reports_a_single_file() {
    let tmp = tempfile::tempdir().unwrap();
    let file = script_file("tiny-sdxl");
    let out = sdtrain(&["inspect", "--model", file.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in [
        "(single-file checkpoint)",
        "configs     detected from the tensor shapes",
        "family      SDXL",
        "prediction  epsilon",
        "text_encoder_2",
        "built-in CLIP BPE, 2514 tokens, pad \"!\"",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    // The single-file options apply to inspect too; a folder refuses them.
    let sd21 = script_file("tiny-sd21");
    let args = |model: &str, extra: &[&str]| {
        let mut a = vec!["inspect", "--model"];
        a.push(model);
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        sdtrain(&refs, tmp.path())
    };
    let out = run(args(sd21.to_str().unwrap(), &[]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("prediction  v_prediction"),
        "{}",
        text(&out)
    );
    let out = run(args(
        sd21.to_str().unwrap(),
        &["--prediction-type", "epsilon"],
    ));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("prediction  epsilon"),
        "{}",
        text(&out)
    );
    let folder = common::fixture("tiny-sd21");
    let out = run(args(
        folder.to_str().unwrap(),
        &["--prediction-type", "epsilon"],
    ));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("prediction_type"), "{}", text(&out));
}
