//! OneTrainer's layer filter (`adapter.layer_filter`, `layer_filter_regex`) from the CLI: the
//! saved file holds exactly the UNet modules the filter picks among the mode's targets, the
//! text encoders' untouched; the memory plan prices only them; a pattern that matches nothing
//! is refused naming it; and a OneTrainer config's filter trains the same modules.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// The saved module names (kohya's, `lora_unet_…`/`lora_te_…`).
fn saved_modules(file: &Path) -> BTreeSet<String> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.names()
        .iter()
        .filter_map(|n| n.strip_suffix(".lora_down.weight").map(str::to_string))
        .collect()
}

/// One LoCon step on tiny-sd15 with these adapter keys: the saved modules and the log.
fn run(dir: &Path, adapter_extra: serde_json::Value) -> (BTreeSet<String>, String) {
    let mut adapter = serde_json::json!({"rank": 2, "alpha": 2, "train_text_encoder": true});
    for (k, v) in adapter_extra.as_object().unwrap() {
        adapter[k] = v.clone();
    }
    let extra = serde_json::json!({"mode": "locon", "max_steps": 1, "adapter": adapter});
    let cfg = write_config(dir, "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    (
        saved_modules(&run_folder(dir).join("sdtrain.safetensors")),
        log,
    )
}

fn unet(modules: &BTreeSet<String>) -> Vec<&String> {
    modules
        .iter()
        .filter(|m| m.starts_with("lora_unet_"))
        .collect()
}

/// Catches the filter ignored, applied to the text encoders, taken as "every pattern must
/// match", or a regex read as a substring.
#[test]
fn the_filter_picks_the_unets_modules() {
    let all = tempfile::tempdir().unwrap();
    let (every, _) = run(all.path(), serde_json::json!({}));
    let te: Vec<&String> = every.iter().filter(|m| m.starts_with("lora_te_")).collect();
    assert!(!te.is_empty());

    let sub = tempfile::tempdir().unwrap();
    let (picked, _) = run(
        sub.path(),
        serde_json::json!({"layer_filter": "attn1, resnets.0.conv1"}),
    );
    let want: Vec<&String> = unet(&every)
        .into_iter()
        .filter(|m| m.contains("_attn1_") || m.contains("_resnets_0_conv1"))
        .collect();
    assert!(!want.is_empty() && want.len() < unet(&every).len());
    assert_eq!(unet(&picked), want);
    // The text encoders keep every module: OneTrainer filters the UNet alone.
    assert!(te.iter().all(|m| picked.contains(*m)));

    let re = tempfile::tempdir().unwrap();
    let (picked, _) = run(
        re.path(),
        serde_json::json!({"layer_filter": [r"attn2_?\.to_[qk]$"], "layer_filter_regex": true}),
    );
    let want: Vec<&String> = unet(&every)
        .into_iter()
        .filter(|m| m.ends_with("_attn2_to_q") || m.ends_with("_attn2_to_k"))
        .collect();
    assert!(!want.is_empty());
    assert_eq!(unet(&picked), want);
}

/// The memory plan prices the filtered adapters; an unmatched pattern and a bad regular
/// expression are refused naming them.
#[test]
fn the_plan_prices_the_filter_and_bad_filters_are_refused() {
    let dry = |adapter: serde_json::Value| {
        let tmp = tempfile::tempdir().unwrap();
        let extra = serde_json::json!({"mode": "locon", "adapter": adapter});
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            tmp.path(),
        );
        (out.status.code(), text(&out))
    };
    let params = |log: &str| -> u64 {
        let line = log
            .lines()
            .find(|l| l.contains("unet:") && l.contains("trained parameters"))
            .unwrap_or_else(|| panic!("{log}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        let i = words.iter().position(|w| *w == "trained").unwrap();
        words[i - 1].parse().unwrap()
    };
    let (code, every) = dry(serde_json::json!({}));
    assert_eq!(code, Some(0), "{every}");
    let (code, some) = dry(serde_json::json!({"layer_filter": "attn1"}));
    assert_eq!(code, Some(0), "{some}");
    assert!(
        some.contains("UNet layers matching any of [\"attn1\"] (layer_filter)"),
        "{some}"
    );
    assert!(params(&some) < params(&every) / 4, "{some}\n{every}");

    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "locon", "max_steps": 1,
                                   "adapter": {"layer_filter": "attn1, atn2"}});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(
        log.contains("layer_filter") && log.contains("atn2"),
        "{log}"
    );

    let (code, log) = dry(serde_json::json!({"layer_filter": "attn(", "layer_filter_regex": true}));
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("adapter.layer_filter") && log.contains("attn("),
        "{log}"
    );
}
