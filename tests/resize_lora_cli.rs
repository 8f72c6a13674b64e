//! `sdtrain resize-lora` against kohya sd-scripts' `networks/resize_lora.py`, run unmodified by
//! tests/fixtures/resize_lora_reference.py on tests/fixtures/resize_lora_input.safetensors: each
//! module's new rank, alpha and weight change, the header, the tensors kept; a diffusers/PEFT
//! file keeps its weight changes; bad input is refused with the reason.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::cli::{file_metadata, sdtrain, text};
use sdtrain::adapter::kohya_file::{load_kohya, KohyaFile};

fn input() -> PathBuf {
    common::fixture("resize_lora_input.safetensors")
}

fn resize(dir: &Path, lora: &Path, flags: &[&str]) -> std::process::Output {
    let lora = lora.display().to_string();
    let mut args = vec!["resize-lora", "--lora", &lora, "--out", "out.safetensors"];
    args.extend_from_slice(flags);
    sdtrain(&args, dir)
}

/// The weight change each module of a file makes, `(alpha/rank)·up·down` flattened to
/// `out × in·k·k`, as sdtrain's own reader reads the file.
fn changes(file: &KohyaFile) -> HashMap<String, Tensor> {
    file.modules
        .iter()
        .filter(|m| m.up().is_some())
        .map(|m| {
            let out = m.up().unwrap().dim(0).unwrap();
            let w: Vec<usize> = match m.down().unwrap().dims() {
                [_, i] => vec![out, *i],
                [_, i, kh, kw] => vec![out, *i, *kh, *kw],
                d => panic!("{d:?}"),
            };
            let delta = m.weight_update(&w, None).unwrap();
            (m.name.clone(), delta.flatten_from(1).unwrap())
        })
        .collect()
}

/// The flags of the reference's case.
fn flags(case: &serde_json::Value) -> Vec<String> {
    let f = &case["flags"];
    let mut out = vec!["--rank".to_string(), f["new_rank"].to_string()];
    if let Some(c) = f["new_conv_rank"].as_u64() {
        out.extend(["--conv-rank".to_string(), c.to_string()]);
    }
    if let Some(m) = f["dynamic_method"].as_str() {
        out.extend(["--dynamic-method".to_string(), m.to_string()]);
        out.extend([
            "--dynamic-param".to_string(),
            f["dynamic_param"].to_string(),
        ]);
    }
    out
}

/// Every case of the reference: the rank kohya picks (capped at the module's own 8, where kohya
/// adds zero directions), the alpha at kohya's scale, and the weight change to 1e-5 of its
/// largest entry; 1×1 convs resized at the Linear rank (kohya's "fixed_same" case), and kohya's
/// header lines. Catches a missing "+1" of the dynamic rules, alpha not rescaled, Σ dropped, the
/// conv flattened the wrong way, the 1×1 conv given the conv rank, or the comment misworded.
#[test]
fn resized_files_match_kohyas() {
    let reference = common::reference_json("reference/resize_lora.json");
    let products = common::reference("resize_lora");
    let tmp = tempfile::tempdir().unwrap();
    let cases = reference["cases"].as_object().unwrap();
    for (name, case) in cases {
        let args = flags(case);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = resize(tmp.path(), &input(), &args);
        assert!(out.status.success(), "{name}: {}", text(&out));
        let path = tmp.path().join("out.safetensors");
        let file = load_kohya(&path, &Device::Cpu).unwrap();
        let got = changes(&file);
        for (module, want) in case["modules"].as_object().unwrap() {
            // kohya's fixed case gives the 1×1 conv the conv rank; sdtrain the Linear one, which
            // kohya's "fixed_same" case (conv rank = rank) shows.
            let (want, from) = match (name.as_str(), module.contains("conv_shortcut")) {
                ("fixed", true) => (&cases["fixed_same"]["modules"][module], "fixed_same"),
                _ => (want, name.as_str()),
            };
            let m = file.modules.iter().find(|m| &m.name == module).unwrap();
            let kohya_rank = want["rank"].as_u64().unwrap() as usize;
            assert_eq!(m.rank(), kohya_rank.min(8), "{name}: {module} rank");
            let kohya_scale = want["alpha"].as_f64().unwrap() / kohya_rank as f64;
            let scale = f64::from(m.alpha) / m.rank() as f64;
            assert!((scale - kohya_scale).abs() < 1e-7, "{name}: {module} alpha");
            let r = common::get(&products, &format!("{from}/{module}"));
            let g = &got[module];
            let big = r.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let big = big.to_scalar::<f32>().unwrap().max(1e-6);
            let diff = common::max_abs_diff(g, &r);
            assert!(diff <= 1e-5 * big, "{name}: {module} off by {diff}");
        }
        let meta = file_metadata(&path);
        let want = &case["metadata"];
        for key in ["ss_training_comment", "modelspec.title", "ss_network_args"] {
            assert_eq!(meta[key], want[key].as_str().unwrap(), "{name}: {key}");
        }
        let (dim, alpha) = match name.as_str() {
            // kohya writes the rank asked for; sdtrain the rank the modules got.
            "above" => ("8", "8.0"),
            _ => (
                want["ss_network_dim"].as_str().unwrap(),
                want["ss_network_alpha"].as_str().unwrap(),
            ),
        };
        assert_eq!(meta["ss_network_dim"], dim, "{name}");
        assert_eq!(meta["ss_network_alpha"], alpha, "{name}");
    }
}

/// The LoHa module and every float tensor are written in `--save-dtype`, the LoHa's values
/// unchanged; the `sshs_model_hash` is the SHA-256 of the tensors as written. Catches a kept
/// tensor dropped, left in its dtype, or a hash of the input.
#[test]
fn other_tensors_are_kept_and_the_file_is_hashed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = resize(tmp.path(), &input(), &["--save-dtype", "fp16"]);
    assert!(out.status.success(), "{}", text(&out));
    let path = tmp.path().join("out.safetensors");
    let before = candle_core::safetensors::load(input(), &Device::Cpu).unwrap();
    let after = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let reference = common::reference_json("reference/resize_lora.json");
    let keys = reference["cases"]["fixed"]["keys"].as_array().unwrap();
    let mut names: Vec<&String> = after.keys().collect();
    names.sort();
    assert_eq!(
        names,
        keys.iter().map(|k| k.as_str().unwrap()).collect::<Vec<_>>()
    );
    assert!(after.values().all(|t| t.dtype() == DType::F16));
    for part in ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"] {
        let key = format!("lora_unet_down_blocks_0_resnets_0_time_emb_proj.{part}");
        let want = before[&key].to_dtype(DType::F16).unwrap();
        assert_eq!(common::max_abs_diff(&after[&key], &want), 0.0, "{key}");
    }
    let bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    use sha2::Digest;
    let hash: String = sha2::Sha256::digest(&bytes[8 + header..])
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(file_metadata(&path)["sshs_model_hash"], hash);
}

/// A diffusers PEFT file whose alphas come from `lora_adapter_metadata` (rsLoRA in the text
/// encoder, an `alpha_pattern` in the UNet), resized to its own rank, makes the same weight
/// changes: the scales are folded into `up`, no `.alpha` keys are added and the metadata (the
/// old ranks) is dropped. At rank 2 each change keeps the top of its spectrum. Catches the
/// metadata scale ignored, folded twice, or left beside the folded factors.
#[test]
fn a_peft_file_keeps_its_weight_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let peft = common::fixture("diffusers_lora/sd15_peft.safetensors");
    let out = resize(tmp.path(), &peft, &["--rank", "4"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("lora_adapter_metadata"),
        "{}",
        text(&out)
    );
    let path = tmp.path().join("out.safetensors");
    let (before, after) = (
        changes(&load_kohya(&peft, &Device::Cpu).unwrap()),
        changes(&load_kohya(&path, &Device::Cpu).unwrap()),
    );
    assert_eq!(before.len(), after.len());
    for (name, b) in &before {
        let a = &after[name];
        let big = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let big = big.to_scalar::<f32>().unwrap();
        assert!(common::max_abs_diff(a, b) <= 1e-5 * big, "{name}");
    }
    let meta = file_metadata(&path);
    assert!(!meta.contains_key("lora_adapter_metadata"));
    let stored = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    assert!(stored.keys().all(|k| !k.ends_with(".alpha")));

    let out = resize(tmp.path(), &peft, &["--rank", "2"]);
    assert!(out.status.success(), "{}", text(&out));
    let after = changes(&load_kohya(&path, &Device::Cpu).unwrap());
    for (name, b) in &before {
        let (fb, fa) = (common::frobenius(b), common::frobenius(&after[name]));
        assert!(fa < fb && fa > 0.5 * fb, "{name}: ‖ΔW‖ {fb} → {fa}");
    }
}

/// diffusers' training-script layout (`….to_q.lora.down.weight`, `….q_proj.lora_linear_layer.
/// down.weight`) with an alpha beside each module under the name loaders give it
/// (`unet.….to_q.alpha`): resized to its own rank, every weight change is kept, so that alpha is
/// found and rewritten. Catches the alpha looked up at `….to_q.lora.alpha` (the module would
/// come out at the old alpha over the new rank).
#[test]
fn a_diffusers_script_file_keeps_its_alphas() {
    let tmp = tempfile::tempdir().unwrap();
    let scripts = common::fixture("diffusers_lora/sd15_scripts.safetensors");
    let mut tensors = candle_core::safetensors::load(&scripts, &Device::Cpu).unwrap();
    let modules: Vec<String> = tensors
        .keys()
        .filter_map(|k| {
            k.strip_suffix(".lora.down.weight")
                .or_else(|| k.strip_suffix(".lora_linear_layer.down.weight"))
                .map(str::to_string)
        })
        .collect();
    assert!(!modules.is_empty());
    for m in &modules {
        tensors.insert(
            format!("{m}.alpha"),
            Tensor::new(2.0f32, &Device::Cpu).unwrap(),
        );
    }
    let input = tmp.path().join("scripts-alpha.safetensors");
    candle_core::safetensors::save(&tensors, &input).unwrap();
    let out = resize(tmp.path(), &input, &["--rank", "4"]);
    assert!(out.status.success(), "{}", text(&out));
    let before = changes(&load_kohya(&input, &Device::Cpu).unwrap());
    let after = changes(&load_kohya(&tmp.path().join("out.safetensors"), &Device::Cpu).unwrap());
    assert_eq!(before.len(), after.len());
    for (name, b) in &before {
        let big = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let big = big.to_scalar::<f32>().unwrap();
        assert!(
            common::max_abs_diff(&after[name], b) <= 1e-5 * big,
            "{name}"
        );
    }
}

/// Bad flags and bad files end with an error naming the flag, the file or the tensor.
#[test]
fn bad_resizes_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    for (flags, needle) in [
        (
            &["--rank", "0"][..],
            "--rank and --conv-rank must be at least 1",
        ),
        (
            &["--dynamic-method", "sv_fro"][..],
            "--dynamic-method needs --dynamic-param",
        ),
        (
            &["--dynamic-param", "0.5"][..],
            "--dynamic-param needs --dynamic-method",
        ),
        (
            &["--dynamic-method", "sv_fro", "--dynamic-param", "1.5"][..],
            "--dynamic-param 1.5: must be in (0, 1]",
        ),
        (
            &["--dynamic-method", "sv_ratio", "--dynamic-param", "0.5"][..],
            "must be 1 or more",
        ),
    ] {
        let out = resize(tmp.path(), &input(), flags);
        assert!(!out.status.success(), "{flags:?}");
        assert!(text(&out).contains(needle), "{flags:?}: {}", text(&out));
    }
    let lora = input().display().to_string();
    let out = sdtrain(
        &["resize-lora", "--lora", &lora, "--out", "out.ckpt"],
        tmp.path(),
    );
    assert!(text(&out).contains("name it so"), "{}", text(&out));

    let write = |name: &str, tensors: Vec<(&str, Tensor)>| {
        let path = tmp.path().join(name);
        let map: HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        candle_core::safetensors::save(&map, &path).unwrap();
        path
    };
    let t = |shape: &[usize]| Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap();
    let loha = write(
        "loha.safetensors",
        vec![("m.hada_w1_a", t(&[4, 2])), ("m.hada_w1_b", t(&[2, 4]))],
    );
    let lonely = write(
        "lonely.safetensors",
        vec![("m.lora_down.weight", t(&[2, 4]))],
    );
    let skewed = write(
        "skewed.safetensors",
        vec![
            ("m.lora_down.weight", t(&[2, 4])),
            ("m.lora_up.weight", t(&[4, 3])),
        ],
    );
    let nan = (t(&[4, 2]) * f64::NAN).unwrap();
    let broken = write(
        "nan.safetensors",
        vec![
            ("m.lora_down.weight", t(&[2, 4])),
            ("m.lora_up.weight", nan),
        ],
    );
    let empty = write(
        "empty.safetensors",
        vec![
            ("m.lora_down.weight", t(&[2, 4])),
            ("m.lora_up.weight", t(&[0, 2])),
        ],
    );
    let tucker = write(
        "tucker.safetensors",
        vec![
            ("m.lora_down.weight", t(&[2, 4, 1, 1])),
            ("m.lora_mid.weight", t(&[2, 2, 3, 3])),
            ("m.lora_up.weight", t(&[4, 2, 1, 1])),
        ],
    );
    let text_file = tmp.path().join("notes.safetensors");
    std::fs::write(&text_file, "not a tensor file").unwrap();
    for (file, needle) in [
        (&loha, "no LoRA/LoCon module to resize"),
        (
            &lonely,
            "`m.lora_down.weight` has no `m.lora_up.weight` beside it",
        ),
        (&skewed, "are not a LoRA pair"),
        (&broken, "`m.lora_up.weight` holds NaN"),
        (&text_file, "is not a safetensors file"),
        (&empty, "a LoRA pair has no empty dimension"),
        (&tucker, "is a LyCORIS Tucker LoCon"),
        (&tmp.path().join("missing.safetensors"), "cannot read"),
    ] {
        let out = resize(tmp.path(), file, &[]);
        assert!(!out.status.success(), "{}", file.display());
        let said = text(&out);
        assert!(said.contains(needle), "{}: {said}", file.display());
        assert!(
            said.contains(&*file.file_name().unwrap().to_string_lossy()),
            "{said}"
        );
    }
}
