//! Weights files a download or a clone got wrong, through the binary: each error names the file
//! and says what it is instead ([`sdtrain::file_sniff`]). Before, every one of them ended in the
//! safetensors parser's "header too large" or "incomplete metadata".

mod common;

use std::path::Path;

use common::cli::{demo_data, sdtrain, text, write_config};

const LFS: &str = "version https://git-lfs.github.com/spec/v1\n\
    oid sha256:1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809\n\
    size 3438167536\n";

fn failed_with(out: &std::process::Output, file: &Path, what: &str) {
    assert!(!out.status.success(), "{}", text(out));
    let msg = text(out);
    let line = msg.lines().find(|l| l.starts_with("error:")).unwrap_or("");
    assert!(line.contains(file.to_str().unwrap()), "{msg}");
    assert!(line.contains(what), "{msg}");
    assert!(!msg.contains("panicked"), "{msg}");
}

/// A Hugging Face folder cloned without Git LFS: training stops at the UNet's pointer file.
#[test]
fn a_clone_without_git_lfs_is_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    let unet = model.join("unet/diffusion_pytorch_model.safetensors");
    for rel in ["unet", "vae", "text_encoder"] {
        for e in std::fs::read_dir(model.join(rel)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                std::fs::write(&p, LFS).unwrap();
            }
        }
    }
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({ "model": model }),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    failed_with(&out, &unet, "it is a Git LFS pointer");
    assert!(text(&out).contains("git lfs pull"), "{}", text(&out));
    let out = sdtrain(&["inspect", "--model", model.to_str().unwrap()], tmp.path());
    failed_with(&out, &unet, "it is a Git LFS pointer");
}

/// A single file saved from a `blob/` link, and one that is a gated model's error reply.
#[test]
fn a_web_page_or_an_error_reply_saved_as_a_checkpoint_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let page = tmp.path().join("model.safetensors");
    std::fs::write(
        &page,
        "<!DOCTYPE html>\n<html class=\"\" lang=\"en\">\n<head>",
    )
    .unwrap();
    let out = sdtrain(&["inspect", "--model", page.to_str().unwrap()], tmp.path());
    failed_with(&out, &page, "it is a web page (HTML)");
    let reply = tmp.path().join("gated.safetensors");
    std::fs::write(
        &reply,
        r#"{"error":"Access to model org/x is restricted."}"#,
    )
    .unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({ "model": reply }),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    failed_with(
        &out,
        &reply,
        "error reply, not the file: {\"error\":\"Access to model",
    );
}

/// A LoRA whose download stopped 100 bytes short: `sdtrain sample --lora` says it is truncated and by
/// how much.
#[test]
fn a_truncated_lora_is_named_as_truncated() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = std::fs::read(common::fixture("kohya_tiny_sd15.safetensors")).unwrap();
    let cut = tmp.path().join("cut.safetensors");
    std::fs::write(&cut, &whole[..whole.len() - 100]).unwrap();
    let model = common::fixture("tiny-sd15");
    let args = [
        "sample",
        "--model",
        model.to_str().unwrap(),
        "--lora",
        cut.to_str().unwrap(),
        "--prompt",
        "a cat",
        "--steps",
        "1",
        "--cpu",
    ];
    let out = sdtrain(&args, tmp.path());
    let what = format!(
        "it is truncated: {} bytes where its header needs {}",
        whole.len() - 100,
        whole.len()
    );
    failed_with(&out, &cut, &what);
}
