//! The ModelSpec keys of a textual inversion embedding and of a full fine-tune's single file
//! equal what kohya's `get_sai_model_spec` writes for them (`textual_inversion`, and
//! `is_stable_diffusion_ckpt`; tests/fixtures/kohya_config_reference.py), but for the date and the
//! implementation version, which name the run and the trainer. Adapter files are checked in
//! tests/kohya_config_cli.rs.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use common::fixture;

/// The demo images, each caption naming `mytok`.
fn captioned(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for e in std::fs::read_dir(demo_data()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "png") {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            std::fs::copy(&p, data.join(format!("{stem}.png"))).unwrap();
            std::fs::write(data.join(format!("{stem}.txt")), format!("mytok, {stem}")).unwrap();
        }
    }
    data
}

fn modelspec(file: &Path) -> BTreeMap<String, String> {
    let bytes = std::fs::read(file).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("modelspec."))
        .collect()
}

fn check(ours: &BTreeMap<String, String>, want: &serde_json::Value, what: &str) {
    let want = want.as_object().unwrap();
    for (k, v) in want {
        if k == "modelspec.date" || k == "modelspec.implementation_version" {
            assert!(ours.contains_key(k), "{what}: {k} missing");
            continue;
        }
        assert_eq!(ours.get(k).map(String::as_str), v.as_str(), "{what}: {k}");
    }
    // A checkpoint also declares ComfyUI's `predict_key`.
    let extra: Vec<&String> = ours
        .keys()
        .filter(|k| !want.contains_key(*k) && *k != "modelspec.predict_key")
        .collect();
    assert!(extra.is_empty(), "{what}: {extra:?} are not kohya's");
}

/// Catches the architecture without `/textual-inversion` (or with `/lora`), the implementation
/// left at diffusers, the title not the run's name, and the `metadata_*` fields, `clip_skip` or
/// the timestep range missing from either kind of file.
#[test]
fn embeddings_and_checkpoints_carry_kohyas_modelspec() {
    let reference = common::reference_json("reference/kohya_config.json");
    for case in reference["modelspec"].as_array().unwrap() {
        let mut keys = serde_json::Map::new();
        for (k, v) in case["case"].as_object().unwrap() {
            let v = match k.as_str() {
                "metadata_thumbnail" => serde_json::json!(fixture(v.as_str().unwrap())),
                "resolution" => serde_json::json!(64),
                "output_name" => continue,
                _ => v.clone(),
            };
            keys.insert(k.clone(), v);
        }
        keys.insert("project_name".into(), case["case"]["output_name"].clone());
        keys.insert("max_steps".into(), serde_json::json!(1));

        let d = tempfile::tempdir().unwrap();
        let mut ti = serde_json::Value::Object(keys.clone());
        ti["mode"] = serde_json::json!("textual_inversion");
        ti["embedding"] = serde_json::json!({"token_string": "mytok", "init_word": "dog"});
        let path = write_config(d.path(), "tiny-sd15", &captioned(d.path()), ti);
        let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], d.path());
        assert!(out.status.success(), "{}", text(&out));
        let file = run_folder(d.path()).join("kt.safetensors");
        check(&modelspec(&file), &case["textual_inversion"], "embedding");

        let d = tempfile::tempdir().unwrap();
        let mut full = serde_json::Value::Object(keys);
        full["mode"] = serde_json::json!("full");
        full["save_ckpt_format"] = serde_json::json!("safetensors");
        let path = write_config(d.path(), "tiny-sd15", &demo_data(), full);
        let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], d.path());
        assert!(out.status.success(), "{}", text(&out));
        let file = run_folder(d.path()).join("final.safetensors");
        check(&modelspec(&file), &case["checkpoint"], "checkpoint");
    }
}
