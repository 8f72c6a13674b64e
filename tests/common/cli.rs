//! Running the `sdtrain` binary from the integration tests: a train.json in a temp folder, the
//! run, its output and its run folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn demo_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/demo")
}

/// Writes train.json into `dir` with the given extra keys, using absolute paths.
pub fn write_config(
    dir: &Path,
    fixture: &str,
    data_root: &Path,
    extra: serde_json::Value,
) -> PathBuf {
    let mut cfg = serde_json::json!({
        "model": super::fixture(fixture),
        "data_root": data_root,
        "output_dir": dir.join("out"),
        "resolution": 64,
        "batch_size": 1,
        "max_steps": 2,
        "lr": 1e-3,
        "log_step": 1,
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let path = dir.join("train.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

/// `sdtrain args` in `cwd`, with sdtrain's cache (converted torch files) under it, never the
/// user's.
pub fn sdtrain(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(args)
        .current_dir(cwd)
        .env("SDTRAIN_CACHE", cwd.join("sdtrain-cache"))
        .output()
        .unwrap()
}

/// The one run folder under `dir/out` (the disk latent cache's folder beside it is not a run).
pub fn run_folder(dir: &Path) -> PathBuf {
    let out = dir.join("out");
    let mut runs: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.ends_with("latent_cache"))
        .collect();
    assert_eq!(
        runs.len(),
        1,
        "expected one run folder in {}",
        out.display()
    );
    runs.pop().unwrap()
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Each logged step's training loss, in step order (the run folder's train_log.jsonl).
pub fn step_losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// `sdtrain --config cfg --cpu` with `more` arguments, run in `cwd`, which must succeed: its
/// output (stdout and stderr).
pub fn sdtrain_ok(cfg: &Path, cwd: &Path, more: &[&str]) -> String {
    let mut args = vec!["--config", cfg.to_str().unwrap(), "--cpu"];
    args.extend_from_slice(more);
    let out = sdtrain(&args, cwd);
    let log = text(&out);
    assert!(out.status.success(), "sdtrain {args:?}:\n{log}");
    log
}

/// `sdtrain --config cfg --cpu --dry-run` with `more` arguments, run in `cwd`, which must be
/// refused as a usage error (exit 2): its output.
pub fn sdtrain_refused(cfg: &Path, cwd: &Path, more: &[&str]) -> String {
    let mut args = vec!["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"];
    args.extend_from_slice(more);
    let out = sdtrain(&args, cwd);
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "sdtrain {args:?}:\n{log}");
    log
}

/// Writes a kohya dataset config to `path` with two datasets of `image_dir`'s images: 64 px in
/// micro-batches of 2, and 128 px one at a time (`.txt` captions, no buckets).
pub fn two_resolution_datasets(path: &Path, image_dir: &Path) {
    let text = format!(
        "[general]\ncaption_extension = \".txt\"\nenable_bucket = false\n\
         [[datasets]]\nresolution = 64\nbatch_size = 2\n\
         [[datasets.subsets]]\nimage_dir = {image_dir:?}\n\
         [[datasets]]\nresolution = 128\nbatch_size = 1\n\
         [[datasets.subsets]]\nimage_dir = {image_dir:?}\n"
    );
    std::fs::write(path, text).unwrap();
}

/// The `__metadata__` of the safetensors file at `path` (an adapter file's kohya keys).
pub fn file_metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    header.metadata().clone().unwrap_or_default()
}

/// `sdtrain sample` on the tiny fixture `fixture` (2 steps, 32×32, "a red cat", on the CPU) with
/// `extra` arguments, writing `out` under `dir`: the log and the image. Fails the test when the
/// command fails.
pub fn sample_tiny(
    fixture: &str,
    dir: &Path,
    out: &str,
    extra: &[&str],
) -> (String, image::RgbImage) {
    let model = super::fixture(fixture).display().to_string();
    let mut args = vec![
        "sample",
        "--model",
        &model,
        "--prompt",
        "a red cat",
        "--steps",
        "2",
        "--width",
        "32",
        "--height",
        "32",
        "--cpu",
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{extra:?}: {}", text(&o));
    (text(&o), image::open(dir.join(out)).unwrap().to_rgb8())
}

/// The arguments of [`sample_bytes`]'s `sdtrain sample` (4 DDIM steps at 64×64, "a cat", seed
/// 3, fp32), writing `out`.
pub fn sample_args<'a>(model: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "sample",
        "--model",
        model,
        "--prompt",
        "a cat",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "4",
        "--seed",
        "3",
        "--precision",
        "fp32",
        "--out",
        out,
    ]
}

/// `sdtrain sample` of `model` (4 DDIM steps at 64×64, "a cat", seed 3, fp32) with `more`
/// arguments, writing `out` under `dir`; returns the image file's bytes, for byte-for-byte
/// comparisons. Fails the test when the command fails.
pub fn sample_bytes(dir: &Path, model: &str, out: &str, more: &[&str]) -> Vec<u8> {
    let mut args = sample_args(model, out);
    args.extend_from_slice(more);
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{more:?}: {}", text(&o));
    std::fs::read(dir.join(out)).unwrap()
}

/// Rewrites `cfg` with `changed` as soon as the run under `dir/out` has logged its first step
/// (for `load_settings_every_epoch`); the thread returns whether it did, within 60 s.
pub fn rewrite_after_first_log(
    dir: &Path,
    cfg: &Path,
    changed: String,
) -> std::thread::JoinHandle<bool> {
    let (dir, cfg) = (dir.to_path_buf(), cfg.to_path_buf());
    std::thread::spawn(move || {
        for _ in 0..6000 {
            let logged = std::fs::read_dir(dir.join("out"))
                .ok()
                .and_then(|mut runs| runs.next())
                .and_then(|run| {
                    std::fs::read_to_string(run.ok()?.path().join("train_log.jsonl")).ok()
                })
                .is_some_and(|log| !log.is_empty());
            if logged {
                std::fs::write(&cfg, &changed).unwrap();
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        false
    })
}

/// Runs a tiny SD1.5 training with `sample_prompts` = `dir/name` holding `prompts`, which must
/// fail, and returns what it said.
pub fn refused_with_prompts(dir: &Path, name: &str, prompts: &str) -> String {
    let file = dir.join(name);
    std::fs::write(&file, prompts).unwrap();
    let cfg = write_config(
        dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"sample_prompts": file}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(!out.status.success(), "{name} was accepted");
    text(&out)
}
