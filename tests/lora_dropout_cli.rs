//! kohya's `rank_dropout` and `module_dropout` (`network_args`) from the CLI: the file records
//! them in `ss_network_args` as kohya does, a run stopped at a save point and resumed ends with
//! the weights of the run that went straight through (each step's masks and module draws come
//! from the step's own seed), and they are refused, naming the key, where kohya's `networks.lora`
//! has none. The masks themselves are checked in `adapter::lora`'s unit tests.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn lora(dir: &Path, extra: serde_json::Value) -> std::path::PathBuf {
    let mut cfg = serde_json::json!({"mode": "locon", "max_steps": 4, "save_every_n_steps": 2,
        "adapter": {"rank": 4, "alpha": 4, "conv_rank": 2, "train_text_encoder": true,
                    "save_dtype": "fp32", "rank_dropout": 0.25, "module_dropout": 0.1}});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    write_config(dir, "tiny-sd15", &demo_data(), cfg)
}

fn file_bytes_and_args(path: &Path) -> (Vec<u8>, String) {
    let bytes = std::fs::read(path).unwrap();
    let (start, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let args = header.metadata().as_ref().unwrap()["ss_network_args"].clone();
    (bytes[8 + start..].to_vec(), args)
}

#[test]
fn rank_and_module_dropout_are_recorded_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora(dir.path(), serde_json::json!({}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(dir.path());
    let file = run.join("sdtrain.safetensors");
    let (whole, args) = file_bytes_and_args(&file);
    assert!(
        args.contains(r#""rank_dropout": "0.25""#) && args.contains(r#""module_dropout": "0.1""#),
        "{args}"
    );
    std::fs::remove_file(&file).unwrap();
    let resume = format!("resume_ckpt={}", run.join("state-step-000002").display());
    let cfg = cfg.to_str().unwrap();
    let out = sdtrain(&["--config", cfg, "--cpu", "--set", &resume], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let (resumed, _) = file_bytes_and_args(&file);
    assert!(resumed == whole, "the resumed run's tensors differ");

    // Without them the weights differ (they did act).
    let plain_dir = tempfile::tempdir().unwrap();
    let cfg = lora(
        plain_dir.path(),
        serde_json::json!({"adapter": {"rank": 4, "alpha": 4, "conv_rank": 2,
            "train_text_encoder": true, "save_dtype": "fp32"}}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu"],
        plain_dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let (plain, args) =
        file_bytes_and_args(&run_folder(plain_dir.path()).join("sdtrain.safetensors"));
    assert!(!args.contains("rank_dropout"), "{args}");
    assert!(plain != whole);
}

#[test]
fn refused_outside_lora_and_locon_and_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    for (adapter, key) in [
        (
            serde_json::json!({"rank_dropout": 0.1}),
            "adapter.rank_dropout",
        ),
        (
            serde_json::json!({"module_dropout": 0.1}),
            "adapter.module_dropout",
        ),
    ] {
        let cfg = lora(
            dir.path(),
            serde_json::json!({"mode": "loha", "adapter": adapter}),
        );
        let out = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--dry-run"],
            dir.path(),
        );
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(key), "{}", text(&out));
    }
    let cfg = lora(
        dir.path(),
        serde_json::json!({"adapter": {"rank_dropout": 1.0}}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("adapter.rank_dropout"),
        "{}",
        text(&out)
    );
}
