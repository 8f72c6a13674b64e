//! `sdtrain inspect` end to end: the binary on the three tiny fixtures and on a hub-cache layout
//! in offline mode, plus the exit codes of its error paths. Every run gets its own temp directory
//! as working directory and a hub environment that points only into it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `sdtrain <args>` in `cwd` with a hermetic hub environment: the cache at `cwd/hub`,
/// offline, no token.
fn sdtrain(cwd: &Path, args: &[&str]) -> Run {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HUB_CACHE", cwd.join("hub"))
        .env("SDTRAIN_CACHE", cwd.join("sdtrain-cache"))
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HOME")
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT")
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Element count of every tensor in the safetensors files of `dir/<component>`.
fn fixture_params(dir: &Path, component: &str) -> u64 {
    let mut total = 0u64;
    for entry in std::fs::read_dir(dir.join(component)).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
            total += tensors.values().map(|t| t.elem_count() as u64).sum::<u64>();
        }
    }
    total
}

/// The parameter count printed on the line that starts with `label`.
fn printed_params(stdout: &str, label: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{stdout}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn assert_report(run: &Run, fixture: &Path, family: &str, prediction: &str, components: &[&str]) {
    assert_eq!(run.code, 0, "stderr: {}", run.stderr);
    let out = &run.stdout;
    assert!(out.contains(&format!("family      {family}\n")), "{out}");
    assert!(
        out.contains(&format!("prediction  {prediction}\n")),
        "{out}"
    );
    assert!(out.contains("resolution  64x64\n"), "{out}");
    let mut total = 0;
    for c in components {
        let want = fixture_params(fixture, c);
        assert_eq!(printed_params(out, c), want, "{c}\n{out}");
        total += want;
        assert!(out.contains(&format!("  {c}/config.json\n")), "{out}");
    }
    assert_eq!(printed_params(out, "total"), total, "{out}");
    assert!(out.contains("  model_index.json\n"), "{out}");
    assert!(out.contains("  scheduler/scheduler_config.json\n"), "{out}");
    assert!(
        out.contains("  unet/diffusion_pytorch_model.safetensors\n"),
        "{out}"
    );
    assert!(out.contains("  tokenizer/vocab.json\n"), "{out}");
}

#[test]
fn inspect_reports_each_fixture() {
    let cases: [(&str, &str, &str, &[&str]); 3] = [
        (
            "tiny-sd15",
            "SD1",
            "epsilon",
            &["unet", "vae", "text_encoder"],
        ),
        (
            "tiny-sd21",
            "SD2",
            "v_prediction",
            &["unet", "vae", "text_encoder"],
        ),
        (
            "tiny-sdxl",
            "SDXL",
            "epsilon",
            &["unet", "vae", "text_encoder", "text_encoder_2"],
        ),
    ];
    for (name, family, prediction, components) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let fixture = common::fixture(name);
        let run = sdtrain(
            tmp.path(),
            &["inspect", "--model", fixture.to_str().unwrap()],
        );
        assert_report(&run, &fixture, family, prediction, components);
        assert!(run.stdout.contains("(local folder)"), "{}", run.stdout);
        if name == "tiny-sdxl" {
            assert!(run.stdout.contains("  tokenizer_2/"), "{}", run.stdout);
        } else {
            assert!(!run.stdout.contains("text_encoder_2"), "{}", run.stdout);
        }
    }
}

/// `cwd/hub/models--tiny--sd15` with refs `main` and `v1` pointing at one snapshot of tiny-sd15.
fn hub_cache(cwd: &Path) -> PathBuf {
    let repo = cwd.join("hub/models--tiny--sd15");
    let snapshot = repo.join("snapshots").join(COMMIT);
    common::copy_dir(&common::fixture("tiny-sd15"), &snapshot);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    std::fs::write(repo.join("refs/v1"), format!("{COMMIT}\n")).unwrap();
    snapshot
}

#[test]
fn inspect_reads_the_hub_cache_offline() {
    for spec in [
        "tiny/sd15",
        "tiny/sd15@v1",
        &format!("tiny/sd15@{COMMIT}") as &str,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let snapshot = hub_cache(tmp.path());
        let run = sdtrain(tmp.path(), &["inspect", "--model", spec]);
        assert_report(
            &run,
            &snapshot,
            "SD1",
            "epsilon",
            &["unet", "vae", "text_encoder"],
        );
        assert!(
            run.stdout
                .contains(&format!("model       {spec} (hub cache, commit {COMMIT})")),
            "{}",
            run.stdout
        );
        assert!(
            run.stdout.contains(&snapshot.display().to_string()),
            "{}",
            run.stdout
        );
    }
}

#[test]
fn inspect_offline_cache_miss_exits_1_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    hub_cache(tmp.path());
    let run = sdtrain(tmp.path(), &["inspect", "--model", "tiny/absent@dev"]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("tiny/absent@dev"), "{}", run.stderr);
    assert!(run.stderr.contains("offline mode is on"), "{}", run.stderr);
    assert!(
        run.stderr
            .contains(&tmp.path().join("hub").display().to_string()),
        "{}",
        run.stderr
    );
}

#[test]
fn inspect_usage_errors_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    // Not a folder and not a repo id.
    let run = sdtrain(tmp.path(), &["inspect", "--model", "./no/such/folder"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("neither an existing folder"),
        "{}",
        run.stderr
    );
    // Missing argument (clap).
    let run = sdtrain(tmp.path(), &["inspect"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    // A .safetensors file that is not one.
    std::fs::write(tmp.path().join("model.safetensors"), b"x").unwrap();
    let run = sdtrain(tmp.path(), &["inspect", "--model", "model.safetensors"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr
            .contains("model.safetensors: not a valid safetensors file"),
        "{}",
        run.stderr
    );
    // A `.ckpt` that is no torch archive.
    std::fs::write(tmp.path().join("model.ckpt"), b"x").unwrap();
    let run = sdtrain(tmp.path(), &["inspect", "--model", "model.ckpt"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("model.ckpt: not a torch checkpoint"),
        "{}",
        run.stderr
    );
}

#[test]
fn inspect_model_with_a_broken_bin_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    std::fs::remove_file(model.join("unet/diffusion_pytorch_model.safetensors")).unwrap();
    std::fs::write(model.join("unet/diffusion_pytorch_model.bin"), b"pickle").unwrap();
    let run = sdtrain(tmp.path(), &["inspect", "--model", "model"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("not a torch checkpoint"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("diffusion_pytorch_model.bin"),
        "{}",
        run.stderr
    );
}

/// Each error in the chain is printed once: the message names the file, and the parser's cause
/// follows through `{:#}` (regression: messages quoted their `{source}` and chained it too).
#[test]
fn inspect_error_names_each_cause_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    let broken = "{ not json";
    std::fs::write(model.join("unet/config.json"), broken).unwrap();
    let cause = serde_json::from_str::<serde_json::Value>(broken)
        .unwrap_err()
        .to_string();
    let run = sdtrain(tmp.path(), &["inspect", "--model", "model"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    let line = run.stderr.trim_end();
    assert!(
        line.starts_with("error: cannot inspect `model`: "),
        "{line}"
    );
    assert!(
        line.ends_with(&format!("unet/config.json: {cause}")),
        "{line}"
    );
    assert_eq!(line.matches(&cause).count(), 1, "{line}");
    assert_eq!(line.matches("unet/config.json").count(), 1, "{line}");
    assert_eq!(line.matches("cannot parse").count(), 1, "{line}");
}
