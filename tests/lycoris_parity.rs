//! sdtrain's adapters against LyCORIS (lycoris-lora 4.1.3), from the numbers
//! tests/fixtures/lycoris_reference.py wrote under tests/fixtures/lycoris/ (rerun command there):
//!
//! - per module (LoCon, LoHa, LoKr with full, low-rank and `factor` w2, DoRA; linear, 3×3 conv
//!   with stride 1 and 2, 1×1 conv): the update a LyCORIS state dict encodes, rebuilt by the file
//!   path (`KohyaModule::weight_update`, what merging and `sample --lora` use), equals the update
//!   LyCORIS's forward builds; the same tensors in a `LoraModule` (what training runs) give
//!   LyCORIS's layer output; and a fresh module has LyCORIS's tensor names and shapes;
//! - files sdtrain writes (all five modes, tiny-sd15, UNet and text encoder) load into
//!   `create_lycoris_from_weights` with every module placed and no missing or unexpected key, and
//!   LyCORIS's UNet output with them equals sdtrain's;
//! - files LyCORIS writes (LoHa, LoKr, DoRA, LoCon) load as `adapter.init_from` and merge
//!   (`sdtrain sample --lora`), giving LyCORIS's UNet output.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use sdtrain::adapter::kohya_file::{load_kohya, KohyaModule};
use sdtrain::adapter::{AdapterComponent, Algo, LoraKind, LoraModule, LoraShape, ModuleAlgo};
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::nn::{BaseWeight, LayerAdapter};
use sdtrain::train::adapters::attach_with;

const MODES: [(&str, TrainMode); 5] = [
    ("lora", TrainMode::Lora),
    ("locon", TrainMode::Locon),
    ("loha", TrainMode::Loha),
    ("lokr", TrainMode::Lokr),
    ("dora", TrainMode::Dora),
];

fn dir() -> PathBuf {
    common::fixture("lycoris")
}

fn tensors(file: &str) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(dir().join(file), &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

/// A `KohyaModule` from a LyCORIS state dict (`<case>.sd.<key>`).
fn file_module(all: &BTreeMap<String, Tensor>, case: &str) -> KohyaModule {
    let prefix = format!("{case}.sd.");
    let mut tensors = BTreeMap::new();
    let mut alpha = None;
    for (k, v) in all {
        if let Some(suffix) = k.strip_prefix(&prefix) {
            if suffix == "alpha" {
                alpha = Some(v.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap());
            } else {
                tensors.insert(suffix.to_string(), v.clone());
            }
        }
    }
    let suffixes: Vec<&str> = tensors.keys().map(String::as_str).collect();
    let algo = Algo::detect(&suffixes).unwrap_or_else(|| panic!("{case}: {suffixes:?}"));
    KohyaModule {
        name: case.to_string(),
        algo,
        tensors,
        alpha: alpha.unwrap(),
        alpha_in_file: true,
    }
}

fn module_algo(meta: &serde_json::Value) -> ModuleAlgo {
    let algo = match meta["algo"].as_str().unwrap() {
        "LoConModule" => Algo::LowRank,
        "LohaModule" => Algo::Hadamard,
        "LokrModule" => Algo::Kron,
        other => panic!("{other}"),
    };
    ModuleAlgo {
        algo,
        factor: meta["factor"].as_i64().unwrap(),
        dora: meta["dora"].as_bool().unwrap(),
    }
}

#[test]
fn module_updates_and_outputs_match_lycoris() {
    let all = tensors("modules.safetensors");
    let meta = common::reference_json("lycoris/modules.json");
    let cases = meta.as_object().unwrap();
    assert_eq!(cases.len(), 12);
    for (case, m) in cases {
        let get = |k: &str| all[&format!("{case}.{k}")].clone();
        let w = get("W");
        let f = file_module(&all, case);
        // The file path: merge and `sample --lora`.
        let update = f.weight_update(w.dims(), Some(&w)).unwrap();
        let err = common::max_abs_diff(&update, &get("update"));
        eprintln!("{case}: update max abs err {err:.2e}");
        assert!(err <= 2e-6, "{case}: update max abs err {err}");

        // The training path: a fresh module has LyCORIS's keys and shapes; with its tensors it
        // gives LyCORIS's layer output.
        let dims = w.dims().to_vec();
        let kind = if dims.len() == 2 {
            LoraKind::Linear
        } else {
            LoraKind::Conv {
                kernel: dims[2],
                stride: m["stride"].as_u64().unwrap() as usize,
                padding: m["padding"].as_u64().unwrap() as usize,
            }
        };
        let shape = LoraShape {
            module_path: case.clone(),
            component: AdapterComponent::Unet,
            kind,
            in_dim: dims[1],
            out_dim: dims[0],
        };
        let rank = m["rank"].as_u64().unwrap() as usize;
        let alpha = m["alpha"].as_f64().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let algo = module_algo(m);
        let module = LoraModule::with_algo(
            shape,
            algo,
            rank,
            alpha,
            0.0,
            Some(&w),
            &mut rng,
            &Device::Cpu,
        )
        .unwrap();
        let ours: Vec<(String, Vec<usize>)> = module
            .params
            .iter()
            .map(|(s, v)| (s.to_string(), v.dims().to_vec()))
            .collect();
        let theirs: Vec<(String, Vec<usize>)> = ours
            .iter()
            .map(|(s, _)| {
                (
                    s.clone(),
                    f.get(s).map(|t| t.dims().to_vec()).unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(ours, theirs, "{case}: fresh module's tensors");
        assert_eq!(ours.len(), f.tensors.len(), "{case}: tensor count");
        for (suffix, v) in &module.params {
            v.set(f.get(suffix).unwrap()).unwrap();
        }
        let x = get("x");
        let y = module.delta_on(&x, &BaseWeight::plain(&w)).unwrap();
        let err = common::rel_err(&y, &get("y_delta"));
        eprintln!("{case}: layer output rel err {err:.2e}");
        assert!(err <= 1e-5, "{case}: layer output rel err {err}");
    }
}

fn load_sd15() -> StableDiffusion {
    common::load_frozen_f32("tiny-sd15")
}

/// The settings lycoris_reference.py uses.
fn plan(init_from: Option<PathBuf>) -> AdapterPlan {
    common::lycoris_plan(init_from, SaveDtype::Fp32)
}

fn unet_out(sd: &StableDiffusion) -> Tensor {
    common::sd15_unet_out(sd)
}

/// Writes sdtrain's file for `mode` (seed 7, every factor randomised) to `path`.
fn write_sdtrain_file(mode: TrainMode, path: &Path) {
    common::write_random_adapter(load_sd15(), mode, plan(None), path);
}

/// Regenerates the committed `sdtrain_<mode>.safetensors` that lycoris_reference.py reads.
#[test]
#[ignore = "writes tests/fixtures/lycoris/sdtrain_*.safetensors for lycoris_reference.py"]
fn write_sdtrain_files() {
    for (name, mode) in MODES {
        write_sdtrain_file(mode, &dir().join(format!("sdtrain_{name}.safetensors")));
    }
}

#[test]
fn sdtrain_files_load_into_lycoris_and_give_its_output() {
    let report = common::reference_json("lycoris/from_sdtrain.json");
    let outs = tensors("from_sdtrain.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    for (name, mode) in MODES {
        // The committed file is what sdtrain writes today.
        let committed = dir().join(format!("sdtrain_{name}.safetensors"));
        let fresh = tmp.path().join(format!("{name}.safetensors"));
        write_sdtrain_file(mode, &fresh);
        let (a, b) = (tensors_of(&committed), tensors_of(&fresh));
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, t) in &a {
            assert_eq!(common::max_abs_diff(t, &b[k]), 0.0, "{name}: {k}");
        }
        // LyCORIS placed every module and found every key.
        for prefix in ["lora_unet", "lora_te"] {
            let r = &report[name][prefix];
            assert!(r["file_modules"].as_u64().unwrap() > 0, "{name} {prefix}");
            assert_eq!(
                r["file_modules"], r["lycoris_modules"],
                "{name} {prefix}: {r}"
            );
            for list in [
                "file_modules_without_layer",
                "missing_keys",
                "unexpected_keys",
            ] {
                assert_eq!(
                    r[list].as_array().unwrap().len(),
                    0,
                    "{name} {prefix} {list}: {r}"
                );
            }
        }
        // LyCORIS's UNet output with the file is sdtrain's.
        let mut sd = load_sd15();
        let a = attach_with(&mut sd, mode, plan(Some(committed)), 1).unwrap();
        sdtrain::adapter::set_training(&a.modules, false);
        let ours = unet_out(&sd);
        let change = common::rel_err(&outs["base"], &outs[name]);
        assert!(
            change > 1e-2,
            "{name}: the adapter changes LyCORIS's output by {change}"
        );
        let err = common::rel_err(&ours, &outs[name]);
        eprintln!("{name}: sdtrain file, UNet rel err against LyCORIS {err:.2e}");
        assert!(err <= 1e-5, "{name}: UNet rel err against LyCORIS {err}");
    }
}

fn tensors_of(path: &Path) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn lycoris_files_load_as_init_from_and_merge() {
    let outs = tensors("from_lycoris.safetensors");
    for (name, mode) in [
        ("loha", TrainMode::Loha),
        ("lokr", TrainMode::Lokr),
        ("dora", TrainMode::Dora),
        ("locon", TrainMode::Locon),
    ] {
        let file = dir().join(format!("lycoris_{name}.safetensors"));
        let mut sd = load_sd15();
        let a = attach_with(&mut sd, mode, plan(Some(file.clone())), 1).unwrap();
        sdtrain::adapter::set_training(&a.modules, false);
        let err = common::rel_err(&unet_out(&sd), &outs[name]);
        eprintln!("{name}: LyCORIS file as init_from, UNet rel err {err:.2e}");
        assert!(
            err <= 1e-5,
            "{name}: init_from UNet rel err against LyCORIS {err}"
        );

        let kohya = load_kohya(&file, &Device::Cpu).unwrap();
        let mut merged = load_sd15();
        let naming = sdtrain::adapter::kohya_naming(&merged);
        let n = sdtrain::adapter::merge::merge_kohya(&mut merged, &naming, &kohya, 1.0).unwrap();
        assert_eq!(n, a.modules.len(), "{name}: every module merged");
        let err = common::rel_err(&unet_out(&merged), &outs[name]);
        eprintln!("{name}: LyCORIS file merged, UNet rel err {err:.2e}");
        assert!(
            err <= 1e-5,
            "{name}: merged UNet rel err against LyCORIS {err}"
        );
    }
}
