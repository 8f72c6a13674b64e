//! Model loading on the tiny fixtures: family detection, hub-cache resolution in offline mode,
//! weight-file selection (fp16 variants, sharded sets, pickle refusal) and reading the selected
//! files through `Weights::from_files`. Each test works in its own temp directory.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use sdtrain::model::family::{FamilyError, ModelFamily, PredictionType};
use sdtrain::model::files::{self, Component, FilesError};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::source::{HubEnv, ModelSource, Origin, SourceError};
use sdtrain::model::weights::Weights;

const COMMIT_MAIN: &str = "1111111111111111111111111111111111111111";
const COMMIT_V1: &str = "2222222222222222222222222222222222222222";

/// A copy of a fixture pipeline in a fresh temp directory.
fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    common::copy_dir(&common::fixture(name), &dir);
    (tmp, dir)
}

/// Builds `<cache>/models--tiny--sd15` holding the tiny-sd15 fixture as two snapshots: `main` →
/// COMMIT_MAIN (plain copies) and `v1` → COMMIT_V1 (on unix, relative links into `blobs/`, as
/// `huggingface_hub` and hf-hub store them).
fn hub_cache(cache: &Path) -> PathBuf {
    let repo = cache.join("models--tiny--sd15");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    common::copy_dir(
        &common::fixture("tiny-sd15"),
        &repo.join("snapshots").join(COMMIT_MAIN),
    );
    std::fs::write(repo.join("refs/main"), COMMIT_MAIN).unwrap();
    link_snapshot(
        &common::fixture("tiny-sd15"),
        &repo,
        &repo.join("snapshots").join(COMMIT_V1),
        Path::new("../.."),
    );
    std::fs::write(repo.join("refs/v1"), format!("{COMMIT_V1}\n")).unwrap();
    repo
}

/// Copies each file of `from` into `repo/blobs/<n>` and links it from `snapshot`; `up` leads from
/// a link's folder back to `repo`.
#[cfg(unix)]
fn link_snapshot(from: &Path, repo: &Path, snapshot: &Path, up: &Path) {
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(snapshot).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = snapshot.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            link_snapshot(&entry.path(), repo, &target, &up.join(".."));
        } else {
            let blob = format!(
                "blob{}",
                std::fs::read_dir(repo.join("blobs")).unwrap().count()
            );
            std::fs::copy(entry.path(), repo.join("blobs").join(&blob)).unwrap();
            std::os::unix::fs::symlink(up.join("blobs").join(&blob), &target).unwrap();
        }
    }
}

#[cfg(not(unix))]
fn link_snapshot(from: &Path, _repo: &Path, snapshot: &Path, _up: &Path) {
    common::copy_dir(from, snapshot);
}

fn load_all(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Reads every tensor of `expected` through `Weights` over `files` (as f32) and checks the
/// values, and that nothing in the files was left unread.
fn assert_weights_match(files: &[PathBuf], expected: &HashMap<String, Tensor>) {
    let w = Weights::from_files(files, "unet", DType::F32, &Device::Cpu, false).unwrap();
    for (name, want) in expected {
        let got = w.get(want.shape().clone(), name).unwrap();
        assert_eq!(got.dtype(), DType::F32, "{name}");
        assert_eq!(values(&got), values(want), "{name}");
    }
    assert!(w.unused().is_empty(), "unused: {:?}", w.unused());
}

#[test]
fn detects_family_prediction_and_resolution_of_each_fixture() {
    let cases = [
        ("tiny-sd15", ModelFamily::Sd1, PredictionType::Epsilon),
        ("tiny-sd21", ModelFamily::Sd2, PredictionType::VPrediction),
        ("tiny-sdxl", ModelFamily::Sdxl, PredictionType::Epsilon),
    ];
    for (name, family, prediction) in cases {
        let (_tmp, dir) = fixture_copy(name);
        let layout = ModelLayout::read(&dir, None).unwrap();
        assert_eq!(layout.family, family, "{name}");
        assert_eq!(layout.prediction_type, prediction, "{name}");
        // sample_size 32 × 2 (two VAE levels).
        assert_eq!(layout.native_resolution, 64, "{name}");
        let comps: Vec<Component> = layout.components.iter().map(|c| c.component).collect();
        assert_eq!(comps, family.components(), "{name}");
        assert_eq!(
            layout.tokenizers.len(),
            if family.has_second_text_encoder() {
                2
            } else {
                1
            },
            "{name}"
        );
        for c in &layout.components {
            assert_eq!(c.weights().len(), 1, "{name}/{}", c.component);
            assert!(c.weights()[0].is_file());
        }
    }
}

#[test]
fn hub_cache_resolves_offline_by_branch_tag_and_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let repo = hub_cache(&cache);
    let env = HubEnv::offline(cache.clone());
    for (spec, commit) in [
        ("tiny/sd15", COMMIT_MAIN),
        ("tiny/sd15@main", COMMIT_MAIN),
        ("tiny/sd15@v1", COMMIT_V1),
        (&format!("tiny/sd15@{COMMIT_V1}") as &str, COMMIT_V1),
    ] {
        let dir = ModelSource::parse(spec)
            .unwrap()
            .resolve_with(&env, None)
            .unwrap();
        assert_eq!(dir.path, repo.join("snapshots").join(commit), "{spec}");
        match &dir.origin {
            Origin::Hub {
                repo_id, commit: c, ..
            } => {
                assert_eq!(repo_id, "tiny/sd15");
                assert_eq!(c, commit);
            }
            Origin::Local | Origin::Converted { .. } => panic!("{spec}: resolved as a local file"),
        }
        let layout = ModelLayout::read(&dir.path, None).unwrap();
        assert_eq!(layout.family, ModelFamily::Sd1);
    }
}

#[test]
fn hub_repo_missing_from_cache_is_a_clear_offline_error() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    hub_cache(&cache);
    let env = HubEnv::offline(cache.clone());
    for spec in ["tiny/other", "tiny/sd15@v2"] {
        let err = ModelSource::parse(spec)
            .unwrap()
            .resolve_with(&env, None)
            .unwrap_err();
        assert!(
            matches!(err, SourceError::NotCached { .. }),
            "{spec}: {err}"
        );
        let msg = err.to_string();
        let (repo, rev) = spec.split_once('@').unwrap_or((spec, "main"));
        assert!(msg.contains(&format!("{repo}@{rev}")), "{msg}");
        assert!(msg.contains(&cache.display().to_string()), "{msg}");
        assert!(msg.contains("offline mode is on"), "{msg}");
    }
}

#[test]
fn complete_cached_snapshot_is_used_without_the_network() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let repo = hub_cache(&cache);
    // Online, but with an endpoint nothing listens on: any request would fail.
    let env = HubEnv {
        offline: false,
        endpoint: Some("http://127.0.0.1:9".to_string()),
        ..HubEnv::offline(cache)
    };
    let dir = ModelSource::parse("tiny/sd15@v1")
        .unwrap()
        .resolve_with(&env, None)
        .unwrap();
    assert_eq!(dir.path, repo.join("snapshots").join(COMMIT_V1));

    // An incomplete snapshot does go to the hub (and here fails to reach it).
    std::fs::remove_file(
        repo.join("snapshots")
            .join(COMMIT_V1)
            .join("vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let err = ModelSource::parse("tiny/sd15@v1")
        .unwrap()
        .resolve_with(&env, None)
        .unwrap_err();
    assert!(matches!(err, SourceError::Hub { .. }), "{err}");
    assert!(err.to_string().contains("tiny/sd15@v1"), "{err}");
}

/// A snapshot Python's `huggingface_hub` filled with `.bin` weights (diffusers downloads `.bin`
/// for every component when one lacks safetensors): online, the hub is asked for the
/// safetensors the repo may have (here the request fails); offline, the pickle refusal stands.
/// Catches the refusal returned online without a request.
#[test]
fn a_snapshot_holding_only_bin_weights_goes_to_the_hub_online() {
    let tmp = tempfile::tempdir().unwrap();
    // The `.bin` weights' converted copies go here (no other test of this binary converts).
    std::env::set_var("SDTRAIN_CACHE", tmp.path().join("sdtrain-cache"));
    let cache = tmp.path().join("hub");
    let repo = hub_cache(&cache);
    let unet = repo.join("snapshots").join(COMMIT_MAIN).join("unet");
    std::fs::remove_file(unet.join("diffusion_pytorch_model.safetensors")).unwrap();
    let online = HubEnv {
        offline: false,
        endpoint: Some("http://127.0.0.1:9".to_string()),
        ..HubEnv::offline(cache.clone())
    };
    let resolve = |env: &HubEnv| {
        ModelSource::parse("tiny/sd15")
            .unwrap()
            .resolve_with(env, None)
    };
    // Unreadable `.bin` weights: online, the hub is asked for safetensors; offline, the error.
    std::fs::write(unet.join("diffusion_pytorch_model.bin"), b"pickle").unwrap();
    let err = resolve(&online).unwrap_err();
    assert!(matches!(err, SourceError::Hub { .. }), "{err}");
    let err = anyhow::Error::new(resolve(&HubEnv::offline(cache.clone())).unwrap_err());
    assert!(
        format!("{err:#}").contains("not a torch checkpoint"),
        "{err:#}"
    );
    // Real ones: online, the hub is asked first, and the snapshot used when it cannot answer;
    // offline, the snapshot is used.
    std::fs::copy(
        common::fixture("torch-files/tiny-sd15-bin/unet/diffusion_pytorch_model.bin"),
        unet.join("diffusion_pytorch_model.bin"),
    )
    .unwrap();
    for env in [online, HubEnv::offline(cache)] {
        let dir = resolve(&env).unwrap();
        let layout = ModelLayout::read(&dir.path, None).unwrap();
        let unet = layout.component(Component::Unet).unwrap();
        assert_eq!(
            unet.torch_files(),
            [dir.path.join("unet/diffusion_pytorch_model.bin")]
        );
    }
}

#[test]
fn incomplete_cached_snapshot_is_an_error_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let repo = hub_cache(&cache);
    std::fs::remove_file(
        repo.join("snapshots")
            .join(COMMIT_MAIN)
            .join("unet/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let err = ModelSource::parse("tiny/sd15")
        .unwrap()
        .resolve_with(&HubEnv::offline(cache), None)
        .unwrap_err();
    assert!(
        matches!(err, SourceError::IncompleteOffline { .. }),
        "{err}"
    );
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(chain.contains("incomplete"), "{chain}");
    assert!(chain.contains("unet"), "{chain}");
}

#[test]
fn fp16_variant_is_chosen_and_loads_as_f32() {
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    let unet = dir.join("unet");
    let plain = unet.join("diffusion_pytorch_model.safetensors");
    let originals = load_all(&plain);
    let halves: HashMap<String, Tensor> = originals
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::F16).unwrap()))
        .collect();
    let fp16 = unet.join("diffusion_pytorch_model.fp16.safetensors");
    candle_core::safetensors::save(&halves, &fp16).unwrap();

    // Both present: plain by default, fp16 when asked.
    assert_eq!(
        files::component_weights(&dir, "unet", None).unwrap(),
        vec![plain.clone()]
    );
    assert_eq!(
        files::component_weights(&dir, "unet", Some("fp16")).unwrap(),
        vec![fp16.clone()]
    );
    // Only the variant present: it is the fallback.
    std::fs::remove_file(&plain).unwrap();
    let chosen = files::component_weights(&dir, "unet", None).unwrap();
    assert_eq!(chosen, vec![fp16.clone()]);
    assert_weights_match(&chosen, &halves);
    // The f32 values are exactly the f16-rounded originals.
    let w = Weights::from_files(&chosen, "unet", DType::F32, &Device::Cpu, false).unwrap();
    let (name, orig) = originals.iter().next().unwrap();
    let got = values(&w.get(orig.shape().clone(), name).unwrap());
    let want: Vec<f32> = values(orig)
        .into_iter()
        .map(|x| half::f16::from_f32(x).to_f32())
        .collect();
    assert_eq!(got, want, "{name}");

    // transformers naming: model.fp16.safetensors.
    let te = dir.join("text_encoder");
    std::fs::rename(
        te.join("model.safetensors"),
        te.join("model.fp16.safetensors"),
    )
    .unwrap();
    let layout = ModelLayout::read(&dir, None).unwrap();
    let te_files = layout.component(Component::TextEncoder).unwrap();
    assert_eq!(te_files.weights(), vec![te.join("model.fp16.safetensors")]);
}

/// Splits `tensors` into two shard files named `<stem>-0000N-of-00002.safetensors` plus an
/// index `index_name` in `dir`.
fn write_shards(dir: &Path, tensors: &HashMap<String, Tensor>, stem: &str, index_name: &str) {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [a, b].into_iter().enumerate() {
        let file = format!("{stem}-{:05}-of-00002.safetensors", i + 1);
        let shard: HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&shard, dir.join(&file)).unwrap();
        for n in part {
            weight_map.insert((*n).clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({ "metadata": {"total_size": 0}, "weight_map": weight_map });
    std::fs::write(dir.join(index_name), index.to_string()).unwrap();
}

#[test]
fn sharded_unet_loads_the_same_tensors() {
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    let unet = dir.join("unet");
    let plain = unet.join("diffusion_pytorch_model.safetensors");
    let originals = load_all(&plain);
    std::fs::remove_file(&plain).unwrap();
    write_shards(
        &unet,
        &originals,
        "diffusion_pytorch_model",
        "diffusion_pytorch_model.safetensors.index.json",
    );
    let chosen = files::component_weights(&dir, "unet", None).unwrap();
    assert_eq!(
        chosen,
        vec![
            unet.join("diffusion_pytorch_model-00001-of-00002.safetensors"),
            unet.join("diffusion_pytorch_model-00002-of-00002.safetensors"),
        ]
    );
    assert_weights_match(&chosen, &originals);
    let layout = ModelLayout::read(&dir, None).unwrap();
    let unet_files = layout.component(Component::Unet).unwrap();
    assert_eq!(
        unet_files.index(),
        Some(
            unet.join("diffusion_pytorch_model.safetensors.index.json")
                .as_path()
        )
    );

    // A missing shard is named.
    std::fs::remove_file(&chosen[1]).unwrap();
    let err = files::component_weights(&dir, "unet", None).unwrap_err();
    assert!(matches!(err, FilesError::MissingShard { .. }), "{err}");
    assert!(err.to_string().contains("00002-of-00002"), "{err}");
}

#[test]
fn sharded_fp16_variant_index_is_used() {
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    let unet = dir.join("unet");
    let plain = unet.join("diffusion_pytorch_model.safetensors");
    let halves: HashMap<String, Tensor> = load_all(&plain)
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F16).unwrap()))
        .collect();
    write_shards(
        &unet,
        &halves,
        "diffusion_pytorch_model.fp16",
        "diffusion_pytorch_model.safetensors.index.fp16.json",
    );
    assert_eq!(
        files::component_weights(&dir, "unet", None).unwrap(),
        vec![plain.clone()]
    );
    std::fs::remove_file(&plain).unwrap();
    for variant in [None, Some("fp16")] {
        let chosen = files::component_weights(&dir, "unet", variant).unwrap();
        assert_eq!(chosen.len(), 2, "{variant:?}");
        assert_weights_match(&chosen, &halves);
    }
}

#[test]
fn pickle_only_component_is_refused() {
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    let te = dir.join("text_encoder");
    std::fs::remove_file(te.join("model.safetensors")).unwrap();
    // A pickle under a name diffusers and transformers never save weights as.
    std::fs::write(te.join("text_encoder.ckpt"), b"not really a pickle").unwrap();
    let err = ModelLayout::read(&dir, None).unwrap_err();
    assert!(
        matches!(err, FamilyError::Files(FilesError::PickleOnly { .. })),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&te.display().to_string()), "{msg}");
    assert!(msg.contains("text_encoder.ckpt"), "{msg}");
    assert!(msg.contains("pytorch_model.bin"), "{msg}");
}

#[test]
fn missing_config_or_folder_is_named() {
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    std::fs::remove_file(dir.join("vae/config.json")).unwrap();
    let err = ModelLayout::read(&dir, None).unwrap_err();
    assert!(err.to_string().contains("vae/config.json"), "{err}");

    let (_tmp, dir) = fixture_copy("tiny-sdxl");
    std::fs::remove_dir_all(dir.join("text_encoder_2")).unwrap();
    let err = ModelLayout::read(&dir, None).unwrap_err();
    assert!(err.to_string().contains("text_encoder_2"), "{err}");

    let tmp = tempfile::tempdir().unwrap();
    let err = ModelLayout::read(tmp.path(), None).unwrap_err();
    assert!(matches!(err, FamilyError::NotAPipeline { .. }), "{err}");
    assert!(err.to_string().contains("model_index.json"), "{err}");
}

#[test]
fn local_folder_spec_resolves_to_itself() {
    let (_tmp, dir) = fixture_copy("tiny-sdxl");
    let source = ModelSource::parse(dir.to_str().unwrap()).unwrap();
    assert_eq!(source, ModelSource::Local(dir.clone()));
    let resolved = source.resolve().unwrap();
    assert_eq!(resolved.path, dir);
    assert_eq!(resolved.origin, Origin::Local);
}

/// Configs as the real models and Python write them: SDXL-base's `"upcast_attention": null` and
/// the `-Infinity` Python's `json` writes for a DPM-Solver scheduler's `lambda_min_clipped`.
/// The model opens, its UNet config and noise schedule read, and the sampler configs build.
/// Catches a strict parser (the model could not be used at all) or a null refused.
#[test]
fn configs_with_python_s_nulls_and_infinities_load() {
    use sdtrain::diffusion::NoiseSchedule;
    use sdtrain::model::unet::UnetConfig;
    let (_tmp, dir) = fixture_copy("tiny-sd15");
    let edit = |rel: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let path = dir.join(rel);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    };
    edit("unet/config.json", &|v| {
        v["upcast_attention"] = serde_json::Value::Null
    });
    edit("scheduler/scheduler_config.json", &|v| {
        v["_class_name"] = "DPMSolverMultistepScheduler".into();
        v["lambda_min_clipped"] = "@".into();
    });
    let path = dir.join("scheduler/scheduler_config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"@\"", "-Infinity")).unwrap();

    let layout = ModelLayout::read(&dir, None).unwrap();
    assert_eq!(layout.family, ModelFamily::Sd1);
    let cfg = UnetConfig::from_file(&dir.join("unet/config.json")).unwrap();
    assert!(!cfg.upcast_attention);
    NoiseSchedule::from_file(&path).unwrap();
    let sched = sdtrain::sample::scheduler_config::SchedulerConfig::from_layout(&layout).unwrap();
    assert_eq!(sched.dpm.lambda_min_clipped, Some(f64::MIN));
}
