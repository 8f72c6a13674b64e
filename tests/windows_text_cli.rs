//! Text files as Windows editors save them: a UTF-8 byte order mark at the start of train.json,
//! optimizer.json, a sample prompts file and a model's configs is skipped. Before, serde_json
//! stopped at line 1, column 1 ("expected value"), and a prompts `.txt` began its first prompt
//! with U+FEFF.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

const BOM: &str = "\u{feff}";

fn prepend_bom(path: &std::path::Path) {
    let body = std::fs::read_to_string(path).unwrap();
    std::fs::write(path, format!("{BOM}{body}")).unwrap();
}

#[test]
fn byte_order_marks_are_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    for rel in [
        "model_index.json",
        "unet/config.json",
        "scheduler/scheduler_config.json",
    ] {
        prepend_bom(&model.join(rel));
    }
    let optimizer = tmp.path().join("optimizer.json");
    std::fs::write(
        &optimizer,
        format!(r#"{BOM}{{"base": {{"optimizer": "adamw", "lr": 1e-3}}}}"#),
    )
    .unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, format!("{BOM}a red cat\n")).unwrap();
    let extra = serde_json::json!({
        "model": model, "optimizer_config": optimizer, "sample_prompts": prompts,
        "sample_steps": 1, "max_steps": 1, "mode": "lora",
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    prepend_bom(&cfg);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let samples = run_folder(tmp.path()).join("samples");
    let txt = std::fs::read_dir(&samples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "txt"))
        .unwrap();
    let described = std::fs::read_to_string(&txt).unwrap();
    assert!(
        described.starts_with("prompt: a red cat\n"),
        "{described:?}"
    );
    assert!(txt
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .ends_with("-a_red_cat.txt"));
}

/// Windows PowerShell 5's `>` writes UTF-16 LE with a byte-order mark: such a train.json and
/// prompts file are read. A train.json in a legacy code page is a config error (exit 2) naming
/// the file and the first byte that is not UTF-8. Before, both stopped with "stream did not
/// contain valid UTF-8" and exit 1.
#[test]
fn utf16_configs_are_read_and_legacy_code_pages_named() {
    let utf16 = |text: &str| -> Vec<u8> {
        let mut out = vec![0xFF, 0xFE];
        for unit in text.encode_utf16() {
            out.extend(unit.to_le_bytes());
        }
        out
    };
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.json");
    let set =
        r#"{"num_inference_steps": 2, "resolution": 32, "samples": [{"prompt": "a red cat"}]}"#;
    std::fs::write(&prompts, utf16(set)).unwrap();
    let extra = serde_json::json!({
        "sample_prompts": prompts, "sample_steps": 1, "max_steps": 1, "mode": "lora",
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let json = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, utf16(&json)).unwrap();
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let samples = run_folder(tmp.path()).join("samples");
    let txt = std::fs::read_to_string(samples.join("gs00001-000-a_red_cat.txt")).unwrap();
    assert!(txt.contains("size: 32x32"), "{txt}");

    let latin1 = tmp.path().join("latin1.json");
    std::fs::write(&latin1, b"{\"run_name\": \"caf\xe9\"}").unwrap();
    let out = sdtrain(
        &["--config", latin1.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains(latin1.to_str().unwrap()) && msg.contains("byte 17 is 0xe9"),
        "{msg}"
    );
}
