//! The five adapter modes from the CLI on the three tiny fixtures: each trains, saves its keys
//! under kohya's names with LyCORIS's metadata, and `--dry-run`'s optimizer-state line counts
//! exactly the parameters the saved file holds; `sdtrain sample --lora` merges LyCORIS's own
//! files and sdtrain's, and `--lora-scale 0` draws the base model's image; a OneTrainer file with a
//! bundled embedding samples and starts a run from its LoRA part, with a warning.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

const MODES: [(&str, &str); 5] = [
    ("lora", "lora_down.weight"),
    ("locon", "lora_down.weight"),
    ("loha", "hada_w1_a"),
    ("lokr", "lokr_w1"),
    ("dora", "dora_scale"),
];

fn extra(mode: &str) -> serde_json::Value {
    serde_json::json!({"mode": mode, "adapter": {"rank": 4, "alpha": 2, "conv_rank": 2}})
}

/// The UNet and text-encoder parameter counts `--dry-run` prints.
fn dry_run_params(dir: &Path, fixture: &str, mode: &str) -> u64 {
    let cfg = write_config(dir, fixture, &demo_data(), extra(mode));
    let out = sdtrain(
        &["train", "--config", cfg.to_str().unwrap(), "--dry-run"],
        dir,
    );
    assert!(out.status.success(), "{}", text(&out));
    text(&out)
        .lines()
        .filter(|l| l.starts_with("optim. state"))
        .map(|l| {
            let n = l.split(", ").nth(1).unwrap();
            n.strip_suffix(" trained parameters")
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum()
}

#[test]
fn every_mode_trains_every_fixture_and_the_plan_counts_its_parameters() {
    for fixture in ["tiny-sd15", "tiny-sd21", "tiny-sdxl"] {
        for (mode, key) in MODES {
            let tmp = tempfile::tempdir().unwrap();
            let planned = dry_run_params(tmp.path(), fixture, mode);
            let cfg = write_config(tmp.path(), fixture, &demo_data(), extra(mode));
            let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
            assert!(out.status.success(), "{fixture} {mode}: {}", text(&out));
            let file = run_folder(tmp.path()).join("sdtrain.safetensors");
            let bytes = std::fs::read(&file).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let names = st.names();
            assert!(
                names.iter().any(|n| n.ends_with(key)),
                "{fixture} {mode}: no {key}"
            );
            assert!(names.iter().all(|n| !n.contains("lora_unet_conv_in")));
            let trained: u64 = st
                .tensors()
                .iter()
                .filter(|(n, _)| !n.ends_with(".alpha"))
                .map(|(_, v)| v.shape().iter().product::<usize>() as u64)
                .sum();
            assert_eq!(
                planned, trained,
                "{fixture} {mode}: --dry-run vs the saved file"
            );
            let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            let meta = header.metadata().clone().unwrap();
            let lycoris = matches!(mode, "loha" | "lokr" | "dora");
            let module = if lycoris {
                "lycoris.kohya"
            } else {
                "networks.lora"
            };
            assert_eq!(meta["ss_network_module"], module, "{fixture} {mode}");
            eprintln!("{fixture} {mode}: {trained} parameters");
        }
    }
}

#[test]
fn sample_merges_lycoris_files_and_scale_zero_is_the_base_model() {
    let tmp = tempfile::tempdir().unwrap();
    let run =
        |out: &str, extra: &[&str]| common::cli::sample_tiny("tiny-sd15", tmp.path(), out, extra);
    let (_, base) = run("base.png", &[]);
    for mode in ["loha", "lokr", "dora", "locon"] {
        let lora = common::fixture(&format!("lycoris/lycoris_{mode}.safetensors"));
        let lora = lora.display().to_string();
        let (log, img) = run(&format!("{mode}.png"), &["--lora", &lora]);
        assert!(log.contains("merged 222 modules"), "{mode}: {log}");
        assert_ne!(img, base, "{mode}: the file changed nothing");
        let (_, zero) = run(
            &format!("{mode}0.png"),
            &["--lora", &lora, "--lora-scale", "0"],
        );
        assert_eq!(zero, base, "{mode}: --lora-scale 0 is not the base model");
    }
}

/// A LoRA file with OneTrainer's bundled embedding (`bundle_emb.<placeholder>.clip_l`, as its
/// `StableDiffusionLoRASaver` writes): `sample --lora` adds the embedding under its placeholder
/// (a prompt without it samples as the same file without the bundle), and `adapter.init_from`
/// starts a run from the LoRA part with a warning naming the file and the placeholder. Such files
/// were refused whole before.
#[test]
fn onetrainer_bundled_embedding_samples_and_is_left_out_of_init_from_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = common::fixture("lycoris/lycoris_locon.safetensors");
    let mut tensors = candle_core::safetensors::load(&plain, &candle_core::Device::Cpu).unwrap();
    tensors.insert(
        "bundle_emb.<mytoken>.clip_l".into(),
        common::randn(&[2, 32], 9),
    );
    let bundle = tmp.path().join("onetrainer.safetensors");
    candle_core::safetensors::save(&tensors, &bundle).unwrap();
    let bundle_s = bundle.display().to_string();
    let warning =
        format!("warning: {bundle_s}: the bundled textual-inversion embedding(s) `<mytoken>`");

    let run =
        |out: &str, extra: &[&str]| common::cli::sample_tiny("tiny-sd15", tmp.path(), out, extra);
    let (_, want) = run("plain.png", &["--lora", &plain.display().to_string()]);
    let (log, img) = run("bundle.png", &["--lora", &bundle_s]);
    assert!(
        log.contains("embedding: `<mytoken>` stands for 2 vector(s)"),
        "{log}"
    );
    assert!(log.contains("merged 222 modules"), "{log}");
    assert_eq!(
        img, want,
        "the LoRA part is not what the plain file applies"
    );

    let extra = serde_json::json!({
        "mode": "locon",
        "max_steps": 1,
        "adapter": {
            "rank": 2, "alpha": 1.5, "conv_rank": 2, "conv_alpha": 1.5,
            "init_from": bundle,
        },
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains(&warning), "{log}");
    assert!(log.contains("(222 modules loaded, 0 new)"), "{log}");
}
