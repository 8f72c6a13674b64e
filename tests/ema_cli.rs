//! EMA from the CLI on the tiny SD1.5 fixture: each save writes the EMA weights beside the
//! normal ones (`<name>-ema.safetensors` for LoRA, `<folder>-ema/` for a full fine-tune), and
//! they follow `ema = d·ema + (1 − d)·weights` from the weights at the start, updated after
//! every step here (`ema_update_interval: 1`).

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// Not 0.5, so that a swapped `d` and `1 − d` gives other numbers.
const DECAY: f64 = 0.75;

fn load(path: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|(n, t): (String, Tensor)| {
            let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            (n, v.to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// `got[name] == d·prev[name] + (1 − d)·now[name]` for every tensor of `got`, to f32 rounding.
fn assert_ema_step(
    got: &HashMap<String, Vec<f32>>,
    prev: &HashMap<String, Vec<f32>>,
    now: &HashMap<String, Vec<f32>>,
    what: &str,
) {
    assert_eq!(got.len(), now.len(), "{what}: tensor count");
    for (name, g) in got {
        let (p, n) = (&prev[name], &now[name]);
        for ((g, p), n) in g.iter().zip(p).zip(n) {
            let want = DECAY * f64::from(*p) + (1.0 - DECAY) * f64::from(*n);
            let tol = 1e-6 * (f64::from(p.abs()) + f64::from(n.abs())) + 1e-12;
            assert!(
                (f64::from(*g) - want).abs() <= tol,
                "{what}: {name}: EMA {g}, want {want} from {p} and {n}"
            );
        }
    }
}

fn differs(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) -> bool {
    a.iter().any(|(n, v)| v != &b[n])
}

fn train(dir: &Path, extra: serde_json::Value) -> std::path::PathBuf {
    let mut cfg = serde_json::json!({"ema_decay_rate": DECAY, "ema_update_interval": 1});
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let cfg = write_config(dir, "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    // The summary lists the EMA weights among what was saved.
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("saved ")
                && (l.ends_with("-ema") || l.ends_with("-ema.safetensors"))),
        "{summary}"
    );
    run_folder(dir)
}

/// Two LoRA steps with a save after each. The EMA starts at the fresh adapter, whose `up`
/// weights are zeros: after step 1 an `up` EMA is `(1 − d)·up₁`; after step 2 every EMA is
/// `d·ema₁ + (1 − d)·w₂`. Catches the EMA not saved, saved as the live weights, a wrong start,
/// a swapped decay, or an update skipped.
#[test]
fn lora_ema_files_follow_the_closed_form() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "mode": "lora", "adapter": {"save_dtype": "fp32"}, "save_every_n_steps": 1,
    });
    let run = train(tmp.path(), extra);
    let w1 = load(&run.join("sdtrain-step-000001.safetensors"));
    let e1 = load(&run.join("sdtrain-step-000001-ema.safetensors"));
    let w2 = load(&run.join("sdtrain.safetensors"));
    let e2 = load(&run.join("sdtrain-ema.safetensors"));
    let zeros: HashMap<String, Vec<f32>> = w1
        .iter()
        .filter(|(n, _)| n.contains("lora_up"))
        .map(|(n, v)| (n.clone(), vec![0.0; v.len()]))
        .collect();
    assert!(!zeros.is_empty());
    let e1_up: HashMap<String, Vec<f32>> = e1
        .iter()
        .filter(|(n, _)| zeros.contains_key(*n))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let w1_up: HashMap<String, Vec<f32>> = w1
        .iter()
        .filter(|(n, _)| zeros.contains_key(*n))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    assert_ema_step(&e1_up, &zeros, &w1_up, "step 1 lora_up");
    assert_ema_step(&e2, &e1, &w2, "step 2");
    assert!(differs(&e2, &w2), "the EMA file holds the live weights");
    // The save point keeps the EMA for a resume.
    assert!(run.join("state-step-000001/ema.safetensors").is_file());
}

/// One full fine-tune step: `final-ema/` is a complete diffusers folder whose UNet is
/// `d·base + (1 − d)·final`. Catches the EMA folder missing, the live weights saved in it, or
/// the EMA not starting at the base model.
#[test]
fn full_ema_folder_is_the_closed_form_of_one_step() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(
        tmp.path(),
        serde_json::json!({"mode": "full", "max_steps": 1}),
    );
    let unet = "unet/diffusion_pytorch_model.safetensors";
    let base = load(&common::fixture("tiny-sd15").join(unet));
    let last = load(&run.join("final").join(unet));
    let ema = load(&run.join("final-ema").join(unet));
    assert!(run.join("final-ema/model_index.json").is_file());
    assert!(differs(&last, &base), "the step changed nothing");
    assert_ema_step(&ema, &base, &last, "final-ema");
    assert!(
        differs(&ema, &last),
        "the EMA folder holds the live weights"
    );
}

/// EveryDream2's `ema_resume_model`: a second run's EMA starts from the first run's EMA weights
/// (a LoRA `-ema.safetensors` file, a full fine-tune's `final-ema/` folder). With one step and
/// a decay of 0.75 the second EMA is `d·loaded + (1 − d)·weights`, so it equals neither the
/// second run's start nor its weights: the key ignored fails the closed form.
#[test]
fn ema_resume_model_starts_the_ema_from_saved_weights() {
    for (mode, unet_file) in [
        ("lora", None),
        ("full", Some("unet/diffusion_pytorch_model.safetensors")),
    ] {
        let first = tempfile::tempdir().unwrap();
        let mut extra = serde_json::json!({ "mode": mode });
        if mode == "lora" {
            extra["adapter"] = serde_json::json!({"save_dtype": "fp32"});
        }
        let run1 = train(first.path(), extra.clone());
        let (source, loaded) = match unet_file {
            None => {
                let f = run1.join("sdtrain-ema.safetensors");
                (f.clone(), load(&f))
            }
            Some(u) => (
                run1.join("final-ema"),
                load(&run1.join("final-ema").join(u)),
            ),
        };
        let second = tempfile::tempdir().unwrap();
        extra["ema_resume_model"] = serde_json::json!(source);
        extra["max_steps"] = serde_json::json!(1);
        extra["seed"] = serde_json::json!(99);
        let run2 = train(second.path(), extra);
        let (now, ema) = match unet_file {
            None => (
                load(&run2.join("sdtrain.safetensors")),
                load(&run2.join("sdtrain-ema.safetensors")),
            ),
            Some(u) => (
                load(&run2.join("final").join(u)),
                load(&run2.join("final-ema").join(u)),
            ),
        };
        assert_ema_step(&ema, &loaded, &now, &format!("{mode}: ema_resume_model"));
    }
    // Without EMA the key is refused, as is "findlast" outside a resumed run.
    let tmp = tempfile::tempdir().unwrap();
    for (extra, want) in [
        (
            serde_json::json!({"ema_resume_model": "x", "ema_decay_rate": null}),
            "EMA is off",
        ),
        (
            serde_json::json!({"ema_resume_model": "findlast", "ema_decay_rate": 0.9}),
            "findlast",
        ),
    ] {
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(want), "{}", text(&out));
    }
}
