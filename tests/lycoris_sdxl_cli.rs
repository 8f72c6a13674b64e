//! LyCORIS's SDXL files from the CLI on tiny-sdxl (the numbers are checked in
//! tests/lycoris_sdxl_parity.rs): a file LyCORIS wrote on the diffusers UNet and both text
//! encoders (`lora_unet_down_blocks_…`, `lora_te1_…`, `lora_te2_…`) and one written as
//! SimpleTuner writes them (`lycoris_down_blocks_…`, UNet only) merge into `sdtrain sample --lora`
//! with every module, change the image, and `--lora-scale 0` draws the base model's image; a
//! LyCORIS file starts a run as `adapter.init_from` with every module of the model loaded.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn lycoris(file: &str) -> String {
    common::fixture("lycoris/sdxl")
        .join(file)
        .display()
        .to_string()
}

/// Module count of a kohya-layout file (one `.alpha` per module).
fn modules_in(file: &str) -> usize {
    let bytes = std::fs::read(lycoris(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.names().iter().filter(|n| n.ends_with(".alpha")).count()
}

fn sample(dir: &Path, out: &str, extra: &[&str]) -> (String, image::RgbImage) {
    common::cli::sample_tiny("tiny-sdxl", dir, out, extra)
}

#[test]
fn sample_merges_lycoris_and_simpletuner_sdxl_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, base) = sample(tmp.path(), "base.png", &[]);
    for file in ["lycoris_loha.safetensors", "simpletuner_lokr.safetensors"] {
        let lora = lycoris(file);
        let (log, img) = sample(tmp.path(), "with.png", &["--lora", &lora]);
        let want = format!("merged {} modules", modules_in(file));
        assert!(log.contains(&want), "{file}: want `{want}` in {log}");
        assert_ne!(img, base, "{file}: the file changed nothing");
        let args = ["--lora", &lora, "--lora-scale", "0"];
        let (_, zero) = sample(tmp.path(), "zero.png", &args);
        assert_eq!(zero, base, "{file}: --lora-scale 0 is not the base model");
    }
}

#[test]
fn lycoris_sdxl_file_starts_a_run_as_init_from() {
    let tmp = tempfile::tempdir().unwrap();
    let file = "lycoris_lokr.safetensors";
    // The shapes lycoris_sdxl_reference.py gave LyCORIS: rank = conv rank 2, alpha 1.5.
    let extra = serde_json::json!({
        "mode": "lokr",
        "max_steps": 1,
        "adapter": {
            "rank": 2, "alpha": 1.5, "conv_rank": 2, "conv_alpha": 1.5,
            "init_from": lycoris(file),
        },
    });
    let cfg = write_config(tmp.path(), "tiny-sdxl", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let want = format!("({} modules loaded, 0 new)", modules_in(file));
    assert!(log.contains(&want), "want `{want}` in {log}");
    assert!(run_folder(tmp.path()).join("sdtrain.safetensors").exists());
}
