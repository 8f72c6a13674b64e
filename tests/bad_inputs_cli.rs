//! Bad inputs a new user tried (issue 20, item 6), each run through the `sdtrain` binary in its
//! own temp folder: the exit code, and a message that says what is wrong and what to do. Each
//! test is named after what used to happen.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn run(cfg: &Path, dir: &Path, extra_args: &[&str]) -> std::process::Output {
    let mut args = vec!["--config", cfg.to_str().unwrap(), "--cpu"];
    args.extend(extra_args);
    sdtrain(&args, dir)
}

/// The model had loaded before the run failed: its report line was printed.
fn model_loaded(out: &std::process::Output) -> bool {
    text(out).contains("model:")
}

/// `aspects: [[63, 64]]` was refused only after the model had loaded, with exit 1. It is a
/// config error: exit 2, before anything loads, naming the entry.
#[test]
fn an_unaligned_aspect_was_refused_after_the_model_loaded() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"aspects": [[64, 64], [63, 64]]});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = run(&cfg, tmp.path(), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("`aspects`") && msg.contains("entry 1 is 63x64") && msg.contains("of 8"),
        "{msg}"
    );
    assert!(!model_loaded(&out), "the model loaded first: {msg}");
    assert!(!tmp.path().join("out").exists(), "a run folder was made");
}

/// A `resume_ckpt` that does not exist, beside a `model`, was reported as "`model` … but
/// `resume_ckpt` …; give one of them". Now it says the path does not exist, where it looked, and
/// what resuming needs.
#[test]
fn a_missing_resume_path_was_reported_as_a_model_conflict() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"resume_ckpt": "out/sdtrain-20240101-000000"});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = run(&cfg, tmp.path(), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("`resume_ckpt` is \"out/sdtrain-20240101-000000\", which does not exist"),
        "{msg}"
    );
    let looked = tmp.path().join("out/sdtrain-20240101-000000");
    assert!(msg.contains(looked.to_str().unwrap()), "{msg}");
    assert!(msg.contains("state-step-NNNNNN"), "{msg}");
    assert!(!model_loaded(&out), "{msg}");
}

/// Resuming a save point with another model failed naming a parameter the run does not train.
/// It now says which model the save point was made from and which this run uses.
#[test]
fn resuming_with_another_model_named_a_parameter() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "save_every_n_steps": 1, "max_steps": 2});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = run(&cfg, tmp.path(), &[]);
    assert!(out.status.success(), "{}", text(&out));
    let run_dir = run_folder(tmp.path());
    assert!(run_dir.join("state-step-000001").is_dir());
    let sdxl = common::fixture("tiny-sdxl");
    let set_model = format!("model={}", sdxl.display());
    let set_resume = format!("resume_ckpt={}", run_dir.display());
    let out = run(
        &cfg,
        tmp.path(),
        &["--set", &set_model, "--set", &set_resume],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let msg = text(&out);
    let sd15 = common::fixture("tiny-sd15");
    let want = format!(
        "was made from model {}, and this run uses model {}",
        sd15.display(),
        sdxl.display()
    );
    assert!(msg.contains(&want), "{msg}");
}

/// An empty `sample_prompts` file was accepted: the run reported "4 prompts" and sampled random
/// captions, none of them from the file. It is refused, naming the file.
#[test]
fn an_empty_sample_prompts_file_sampled_four_random_captions() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, "\n\n").unwrap();
    let extra = serde_json::json!({"sample_prompts": prompts});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = run(&cfg, tmp.path(), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("`sample_prompts`")
            && msg.contains(prompts.to_str().unwrap())
            && msg.contains("holds no prompts"),
        "{msg}"
    );
    assert!(!msg.contains("4 prompts"), "{msg}");
    assert!(!model_loaded(&out), "{msg}");
}

/// `--set mode=full` on a LoRA config was refused because the `adapter` section would go unused,
/// without saying how to get past it. The error names `--set adapter=null`, and that trains a
/// full fine-tune end to end.
#[test]
fn switching_a_lora_config_to_full_did_not_say_how() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "adapter": {"rank": 8}, "max_steps": 1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = run(&cfg, tmp.path(), &["--set", "mode=full"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("`--set adapter=null`"),
        "{}",
        text(&out)
    );
    let out = run(
        &cfg,
        tmp.path(),
        &["--set", "mode=full", "--set", "adapter=null"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let run_dir = run_folder(tmp.path());
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["mode"], "full");
    assert!(plan["adapter"].is_null(), "{plan}");
    // A full fine-tune's output: a diffusers folder, not a LoRA file.
    assert!(run_dir.join("final/unet").is_dir(), "{}", text(&out));
    assert!(!run_dir.join("sdtrain.safetensors").exists());
}
