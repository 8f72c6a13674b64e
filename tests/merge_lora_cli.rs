//! `sdtrain merge-lora`: LoRA files folded into a model and saved. The saved model holds the
//! weights diffusers fuses from the same file (tests/fixtures/diffusers_lora_reference.py,
//! diffusers 0.42.1 `fuse_lora`), and nothing else changes; a merged single file and folder draw
//! the image `sdtrain sample --lora` draws; bad input is refused with the reason.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use common::cli::{sample_bytes, sdtrain, text};

fn fixture_str(name: &str) -> String {
    common::fixture(name).display().to_string()
}

fn merge(dir: &Path, model: &str, loras: &[(&str, &str)], out: &str) -> std::process::Output {
    let mut args = vec![
        "merge-lora".to_string(),
        "--model".into(),
        model.into(),
        "--out".into(),
        out.into(),
    ];
    for (file, ratio) in loras {
        args.extend([
            "--lora".into(),
            file.to_string(),
            "--ratio".into(),
            ratio.to_string(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sdtrain(&args, dir)
}

fn layer<'a>(all: &'a HashMap<String, Tensor>, key: &str) -> &'a Tensor {
    common::layer_weight(all, key).unwrap_or_else(|| panic!("no layer {key}"))
}

/// Merged into a diffusers folder, each adapted layer is the weight diffusers fuses (SD1.5 and
/// SDXL, PEFT files with their header's alphas), and every other layer is the base's, bit for
/// bit. Catches a stored name mismatched (the tensor would stay the base's or the export would
/// fail), a text encoder's update written to the other, or the ratio dropped.
#[test]
fn merged_models_hold_the_weights_diffusers_fuses() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, fixture) in [("sd15", "tiny-sd15"), ("sdxl", "tiny-sdxl")] {
        let file = fixture_str(&format!("diffusers_lora/{model}_peft.safetensors"));
        let out = merge(tmp.path(), &fixture_str(fixture), &[(&file, "1")], model);
        assert!(out.status.success(), "{model}: {}", text(&out));
        let reference: HashMap<String, Tensor> = candle_core::safetensors::load(
            common::fixture(&format!("diffusers_lora/merged_{model}_peft.safetensors")),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let merged =
            common::layer_weights(&mut common::load_frozen_f32_at(&tmp.path().join(model)));
        let base = common::layer_weights(&mut common::load_frozen_f32(fixture));
        for (key, want) in &reference {
            let err = common::rel_err(layer(&merged, key), want);
            assert!(err <= 1e-6, "{model}: {key}: rel err {err}");
        }
        let changed = base
            .iter()
            .filter(|(k, w)| common::max_abs_diff(w, &merged[*k]) > 0.0)
            .count();
        assert_eq!(changed, reference.len(), "{model}: layers changed");
    }
}

/// A kohya LoRA and a diffusers one merged at 0.7 into a single file and into a folder draw the
/// image the base model draws with both files at `--lora-scale 0.7`, byte for byte; the base
/// alone draws another. Catches a file merged twice or left out, the ratio applied to one file
/// only, or a single file whose names the loader maps elsewhere.
#[test]
fn a_merged_model_draws_what_the_loras_draw() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture_str("tiny-sd15");
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let peft = fixture_str("diffusers_lora/sd15_peft.safetensors");
    let files = [(kohya.as_str(), "0.7"), (peft.as_str(), "0.7")];
    for out in ["merged.safetensors", "merged"] {
        let o = merge(tmp.path(), &base, &files, out);
        assert!(o.status.success(), "{out}: {}", text(&o));
    }
    let loras = ["--lora", &kohya, "--lora", &peft, "--lora-scale", "0.7"];
    let with_loras = sample_bytes(tmp.path(), &base, "loras.png", &loras);
    let single = sample_bytes(tmp.path(), "merged.safetensors", "single.png", &[]);
    let folder = sample_bytes(tmp.path(), "merged", "folder.png", &[]);
    let plain = sample_bytes(tmp.path(), &base, "base.png", &[]);
    assert!(single == with_loras, "the single file draws another image");
    assert!(folder == with_loras, "the folder draws another image");
    assert!(plain != with_loras);
}

/// `merge-lora --out out.safetensors` with `args` fails saying `needle`, writing nothing.
fn refused(dir: &Path, args: &[&str], needle: &str) {
    let mut all = vec!["merge-lora", "--out", "out.safetensors"];
    all.extend_from_slice(args);
    let o = sdtrain(&all, dir);
    assert!(!o.status.success(), "{all:?}");
    assert!(text(&o).contains(needle), "{all:?}: {}", text(&o));
    assert!(!dir.join("out.safetensors").exists());
}

/// Bad input ends with an error that names the flag or the file; nothing is written.
#[test]
fn bad_merges_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture_str("tiny-sd15");
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let sdxl_lora = fixture_str("diffusers_lora/sdxl_peft.safetensors");
    let missing = tmp.path().join("missing.safetensors").display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--lora", &kohya, "--ratio", "1", "--ratio", "2"],
            "2 --ratio for 1 --lora",
        ),
        (
            vec!["--lora", &kohya, "--ratio", "nan"],
            "must be a finite number",
        ),
        (vec!["--lora", &sdxl_lora], "does not fit the weight"),
        (vec!["--lora", &missing], "cannot read"),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["--model", base.as_str()];
        args.extend(flags);
        refused(tmp.path(), &args, needle);
    }
    let o = sdtrain(
        &[
            "merge-lora",
            "--model",
            &base,
            "--lora",
            &kohya,
            "--out",
            &base,
            "--overwrite",
        ],
        tmp.path(),
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains("would replace the base model"),
        "{}",
        text(&o)
    );
    // A folder of other files is not replaced (a mistyped --out).
    std::fs::create_dir(tmp.path().join("notes")).unwrap();
    std::fs::write(tmp.path().join("notes/keep.txt"), "mine").unwrap();
    let o = sdtrain(
        &[
            "merge-lora",
            "--model",
            &base,
            "--lora",
            &kohya,
            "--out",
            "notes",
        ],
        tmp.path(),
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains("is not a diffusers folder"),
        "{}",
        text(&o)
    );
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("notes/keep.txt")).unwrap(),
        "mine"
    );
}

/// Without `--model`, kohya's LoRA and a second file (rank 3, one module the first lacks, a 3×3
/// conv) at 0.7 and −0.4 merge into kohya's `svd_merge_lora.py` result (its lines in
/// tests/fixtures/svd_merge_lora_reference.py): every tensor to 1e-5 of its largest entry, alpha
/// the rank, and kohya's minimum header. Catches a file's alpha or ratio dropped, the negative
/// ratio's sign lost, the 3×3 conv given the Linear rank, or the clamp skipped.
#[test]
fn loras_merge_into_one_as_kohyas_svd_merge_does() {
    let tmp = tempfile::tempdir().unwrap();
    let first = fixture_str("kohya_tiny_sd15.safetensors");
    let second = fixture_str("svd_merge_input.safetensors");
    let o = sdtrain(
        &[
            "merge-lora",
            "--lora",
            &first,
            "--ratio",
            "0.7",
            "--lora",
            &second,
            "--ratio",
            "-0.4",
            "--rank",
            "3",
            "--conv-rank",
            "2",
            "--out",
            "merged.safetensors",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let path = tmp.path().join("merged.safetensors");
    let got = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    let want = common::reference("svd_merge_lora");
    let mut keys: Vec<&String> = got.keys().collect();
    keys.sort();
    let mut want_keys: Vec<&String> = want.keys().collect();
    want_keys.sort();
    assert_eq!(keys, want_keys);
    for (key, w) in &want {
        let big = w.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let big = big.to_scalar::<f32>().unwrap();
        let diff = common::max_abs_diff(&got[key], w);
        assert!(diff <= 1e-5 * big, "{key}: off by {diff}");
    }
    let meta = common::cli::file_metadata(&path);
    for (key, value) in [
        ("ss_network_module", "networks.lora"),
        ("ss_network_dim", "3"),
        ("ss_network_alpha", "3"),
        ("ss_network_args", "{\"conv_dim\": 2, \"conv_alpha\": 2}"),
        ("ss_base_model_version", "sd_v1"),
        ("modelspec.title", "merged"),
    ] {
        assert_eq!(meta[key], value, "{key}");
    }
}

/// The LoRA merge refuses what it would lose or misread, naming the file and module.
#[test]
fn bad_lora_merges_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture_str("tiny-sd15");
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let loha = fixture_str("resize_lora_input.safetensors");
    let peft = fixture_str("diffusers_lora/sd15_peft.safetensors");
    let cases: Vec<(Vec<&str>, &str)> =
        vec![
        (vec!["--lora", &kohya], "or --rank to merge them into one LoRA"),
        (vec!["--lora", &kohya, "--model", &base, "--rank", "4"], "written without --model"),
        (vec!["--lora", &kohya, "--rank", "0"], "must be at least 1"),
        (
            vec!["--lora", &kohya, "--lora", &loha, "--rank", "4"],
            "module `lora_unet_down_blocks_0_resnets_0_time_emb_proj` is not a LoRA/LoCon module",
        ),
        (vec!["--lora", &peft, "--rank", "4"], "is in diffusers' layout"),
    ];
    for (flags, needle) in cases {
        refused(tmp.path(), &flags, needle);
    }
    let o = sdtrain(
        &[
            "merge-lora",
            "--lora",
            &kohya,
            "--rank",
            "4",
            "--out",
            "out.ckpt",
        ],
        tmp.path(),
    );
    assert!(text(&o).contains("name it so"), "{}", text(&o));
}

/// A file merged with itself has only its own directions: at `--rank 8` its rank-4 modules stay
/// at most 4, with no dead row. A merge whose clamp quantile is negative (torch then sets every value
/// to it) ends without a panic. Catches dead directions kept, or `f64::clamp` with min above max.
#[test]
fn repeated_and_negative_merges_stay_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let cpu = candle_core::Device::Cpu;
    let kohya = fixture_str("kohya_tiny_sd15.safetensors");
    let o = sdtrain(
        &[
            "merge-lora",
            "--lora",
            &kohya,
            "--ratio",
            "0.5",
            "--lora",
            &kohya,
            "--ratio",
            "0.5",
            "--rank",
            "8",
            "--out",
            "twice.safetensors",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let merged =
        candle_core::safetensors::load(tmp.path().join("twice.safetensors"), &cpu).unwrap();
    let original =
        candle_core::safetensors::load(common::fixture("kohya_tiny_sd15.safetensors"), &cpu)
            .unwrap();
    for (key, down) in merged
        .iter()
        .filter(|(k, _)| k.ends_with(".lora_down.weight"))
    {
        // At most the file's rank (some of its modules have rank 3 at 4: a down row repeats).
        assert!(
            down.dim(0).unwrap() <= original[key].dim(0).unwrap(),
            "{key}"
        );
        let rows = down.flatten_from(1).unwrap().sqr().unwrap().sum(1).unwrap();
        let rows: Vec<f32> = rows.to_vec1().unwrap();
        assert!(rows.iter().all(|r| *r > 0.05), "{key}: row norms² {rows:?}");
    }

    // up [200, 1] = [1, −0.5, …], down [1, 10] = −1: most values negative, the 0.99 quantile too.
    let mut up = vec![-0.5f32; 200];
    up[0] = 1.0;
    let tensors: HashMap<String, Tensor> = [
        (
            "lora_unet_x.lora_up.weight",
            Tensor::from_vec(up, (200, 1), &cpu).unwrap(),
        ),
        (
            "lora_unet_x.lora_down.weight",
            Tensor::from_vec(vec![-1.0f32; 10], (1, 10), &cpu).unwrap(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    candle_core::safetensors::save(&tensors, tmp.path().join("negative.safetensors")).unwrap();
    let o = sdtrain(
        &[
            "merge-lora",
            "--lora",
            "negative.safetensors",
            "--rank",
            "1",
            "--out",
            "n.safetensors",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
}
