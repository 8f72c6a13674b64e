//! Samples during training from the CLI, on the three tiny fixtures: which rounds run, the files
//! each writes (a strip per prompt with one image per guidance scale, a `.txt`, a grid), the
//! EMA weights' samples, a released VAE and text encoders (caches), and that sampling leaves
//! training's numbers alone.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use sdtrain::tensorboard::event::{ValueData, What};

fn train(dir: &Path, fixture: &str, prompts: (&str, &str), extra: serde_json::Value) -> PathBuf {
    let file = dir.join(prompts.0);
    std::fs::write(&file, prompts.1).unwrap();
    let mut cfg = serde_json::json!({"sample_prompts": file});
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let cfg = write_config(dir, fixture, &demo_data(), cfg);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    run_folder(dir)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn dims(path: &Path) -> (u32, u32) {
    image::image_dimensions(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A full fine-tune of tiny SD1.5 with samples before training and after each step: two
/// prompts, one at 64x32 and one a random caption at the file's resolution, each at cfg 1 and
/// 4 side by side. The losses equal those of the same run without samples.
#[test]
fn full_fine_tune_samples_each_step_and_keeps_training_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = r#"{"cfgs": [1, 4], "num_inference_steps": 2, "resolution": 32,
        "generate_pretrain_samples": true, "seed": 7,
        "samples": [{"prompt": "a red cat", "size": [64, 32], "negative_prompt": "blurry"},
                    {"random_caption": true, "scheduler": "euler_a"}]}"#;
    let run = train(
        tmp.path(),
        "tiny-sd15",
        ("prompts.json", prompts),
        serde_json::json!({"sample_steps": 1}),
    );
    let got = names(&run.join("samples"));
    for step in ["00000", "00001", "00002"] {
        let grid = format!("gs{step}-grid.png");
        assert!(got.contains(&grid), "{grid} missing from {got:?}");
        let cat = format!("gs{step}-000-a_red_cat.png");
        assert!(got.contains(&cat), "{cat} missing from {got:?}");
        assert!(
            got.contains(&format!("gs{step}-000-a_red_cat.txt")),
            "{got:?}"
        );
    }
    // 3 rounds × (2 strips + 2 txt + 1 grid).
    assert_eq!(got.len(), 15, "{got:?}");
    let s = run.join("samples");
    assert_eq!(dims(&s.join("gs00001-000-a_red_cat.png")), (128, 32));
    assert_eq!(dims(&s.join("gs00001-grid.png")), (128, 64));
    let txt = std::fs::read_to_string(s.join("gs00002-000-a_red_cat.txt")).unwrap();
    assert!(
        txt.contains("negative prompt: blurry") && txt.contains("seed: 7"),
        "{txt}"
    );
    // TensorBoard has each strip, as the PNG on disk, at each round's step.
    let events = sdtrain::tensorboard::reader::read_dir(&run).unwrap();
    let mut seen = Vec::new();
    for e in &events {
        let What::Summary(values) = &e.what else {
            continue;
        };
        for v in values {
            if let (ValueData::Image(im), "samples/000_a_red_cat") = (&v.data, v.tag.as_str()) {
                assert_eq!((im.width, im.height), (128, 32));
                let png = format!("gs{:05}-000-a_red_cat.png", e.step);
                assert_eq!(im.encoded, std::fs::read(s.join(png)).unwrap());
                seen.push(e.step);
            }
        }
    }
    assert_eq!(seen, [0, 1, 2]);

    let plain = tempfile::tempdir().unwrap();
    let cfg = write_config(
        plain.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], plain.path());
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        common::cli::step_losses(&run),
        common::cli::step_losses(&run_folder(plain.path()))
    );
}

/// LoRA on tiny SDXL with EMA, latents and captions cached (so the VAE and the text encoders
/// are released): both the trained and the EMA weights are sampled, the VAE is loaded again.
#[test]
fn sdxl_lora_samples_trained_and_ema_weights_with_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(
        tmp.path(),
        "tiny-sdxl",
        ("prompts.txt", "a house by the sea\n"),
        serde_json::json!({
            "mode": "lora", "sample_steps": 2, "cache_latents": true,
            "disable_textenc_training": true, "ema_decay_rate": 0.5, "ema_update_interval": 1,
            "ema_sample_ema_model": true, "ema_sample_nonema_model": true,
        }),
    );
    let got = names(&run.join("samples"));
    // The default cfgs [7, 4, 1.01] side by side at the run's 64 px.
    let trained = run.join("samples/gs00002-000-a_house_by_the_sea.png");
    let ema = run.join("samples/gs00002-000-ema-a_house_by_the_sea.png");
    assert_eq!(dims(&trained), (192, 64), "{got:?}");
    assert_eq!(dims(&ema), (192, 64), "{got:?}");
    assert!(got.contains(&"gs00002-ema-grid.png".to_string()), "{got:?}");
    assert!(!got.iter().any(|n| n.starts_with("gs00001")), "{got:?}");
}

/// LoCon on SD2.1 (v-prediction) with Euler ancestral, in bf16, with an EMA on the device: rounds
/// every 2 steps only, of the trained weights.
#[test]
fn sd21_euler_ancestral_samples_on_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = r#"{"scheduler": "euler_a", "cfgs": [5], "num_inference_steps": 3,
        "samples": [{"prompt": "a dog"}, {"prompt": "a tree", "seed": -1}]}"#;
    let run = train(
        tmp.path(),
        "tiny-sd21",
        ("p.json", prompts),
        serde_json::json!({
            "sample_steps": 2, "max_steps": 3, "amp": "bf16", "mode": "locon",
            "ema_decay_rate": 0.9, "ema_update_interval": 1, "ema_device": "cuda",
        }),
    );
    // EMA on: its LoCon file is saved beside the trained one; only the trained weights are
    // sampled (neither ema_sample_* key is set).
    assert!(run.join("sdtrain-ema.safetensors").is_file());
    let got = names(&run.join("samples"));
    assert_eq!(
        got,
        [
            "gs00002-000-a_dog.png",
            "gs00002-000-a_dog.txt",
            "gs00002-001-a_tree.png",
            "gs00002-001-a_tree.txt",
            "gs00002-grid.png"
        ]
    );
}

/// A prompts file with an error stops the run before any step, naming the file and the key.
#[test]
fn a_bad_prompts_file_is_refused_up_front() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, prompts, needles) in [
        (
            "p.json",
            r#"{"samples": [{"prompt": "x", "size": [30, 30]}]}"#,
            &["p.json: samples[0]: size 30x30 must be a positive multiple of 8"][..],
        ),
        (
            "q.json",
            r#"{"scheduler": "heun"}"#,
            &["q.json", "`scheduler` is \"heun\"; the samplers are"][..],
        ),
        (
            "r.json",
            r#"{"samples": [{"prompt": "x", "size": [81920, 64]}]}"#,
            &["r.json: samples[0]", "at most 8192"][..],
        ),
        (
            "k.txt",
            "a cat\n# a comment\na dog --cn pose.png\n",
            &["k.txt: line 3: `--cn` (a ControlNet image) is not supported"][..],
        ),
        (
            "k.toml",
            "[prompt]\nwidth = 512\n",
            &["k.toml: has no `[[prompt.subset]]` entry"][..],
        ),
        (
            "l.toml",
            "[prompt]\nwidth = 512\n[[prompt.subset]]\nprompt = \"a cat\"\nwidth = \"wide\"\n",
            &["l.toml: `[[prompt.subset]]` 0 `width` is not a whole number"][..],
        ),
    ] {
        let msg = common::cli::refused_with_prompts(tmp.path(), name, prompts);
        assert!(needles.iter().all(|n| msg.contains(n)), "{name}: {msg}");
    }
}

/// `sdtrain sample`: numbered PNGs at the asked size, the same seed gives the same image, a LoRA
/// merged in changes it, and bad sizes or a LoRA for another model are refused with the reason.
#[test]
fn sample_command_draws_pngs_with_and_without_a_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("tiny-sd15").display().to_string();
    let lora = common::fixture("kohya_tiny_sd15.safetensors")
        .display()
        .to_string();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "sample",
            "--model",
            &model,
            "--prompt",
            "a red cat",
            "--steps",
            "3",
            "--width",
            "32",
            "--height",
            "48",
            "--cpu",
        ];
        args.extend_from_slice(extra);
        sdtrain(&args, tmp.path())
    };
    let out = run(&["--count", "2", "--out", "a.png"]);
    assert!(out.status.success(), "{}", text(&out));
    let a0 = image::open(tmp.path().join("a-0.png")).unwrap().to_rgb8();
    assert_eq!(a0.dimensions(), (32, 48));
    let a1 = image::open(tmp.path().join("a-1.png")).unwrap().to_rgb8();
    assert_ne!(a0, a1, "seeds 555 and 556 drew the same image");
    let out = run(&["--out", "b.png"]);
    assert!(out.status.success(), "{}", text(&out));
    let b = image::open(tmp.path().join("b.png")).unwrap().to_rgb8();
    assert_eq!(a0, b, "the same seed drew another image");
    let out = run(&["--out", "c.png", "--lora", &lora, "--sampler", "euler_a"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("merged 8 modules"), "{}", text(&out));
    let out = run(&["--out", "d.png", "--lora", &lora, "--lora-scale", "3"]);
    assert!(out.status.success(), "{}", text(&out));
    let d = image::open(tmp.path().join("d.png")).unwrap().to_rgb8();
    assert_ne!(b, d, "the LoRA changed nothing");

    // A single-file checkpoint (SD2.1, v-prediction detected) draws too.
    let single = common::fixture("single-file/tiny-sd21.safetensors")
        .display()
        .to_string();
    let out = sdtrain(
        &[
            "sample", "--model", &single, "--prompt", "a dog", "--steps", "2", "--width", "32",
            "--height", "32", "--out", "e.png", "--cpu",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(dims(&tmp.path().join("e.png")), (32, 32));

    let out = sdtrain(
        &[
            "sample", "--model", &model, "--prompt", "x", "--width", "30", "--cpu",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("multiple of 8"), "{}", text(&out));
    // Found by fuzzing the command: a 100000 px side aborted on a failed allocation, and a NaN
    // guidance scale drew a NaN image.
    for (args, needle) in [
        (
            &["--width", "100000", "--height", "100000"][..],
            "at most 8192",
        ),
        (&["--cfg", "NaN"][..], "--cfg must be a finite number"),
        (
            &["--lora-scale", "inf"][..],
            "--lora-scale must be a finite",
        ),
    ] {
        let mut all = vec!["sample", "--model", &model, "--prompt", "x", "--cpu"];
        all.extend_from_slice(args);
        let out = sdtrain(&all, tmp.path());
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(needle), "{args:?}: {}", text(&out));
    }
    let sdxl = common::fixture("tiny-sdxl").display().to_string();
    let out = sdtrain(
        &[
            "sample", "--model", &sdxl, "--prompt", "x", "--lora", &lora, "--cpu",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("kohya_tiny_sd15.safetensors") && text(&out).contains("name nothing"),
        "{}",
        text(&out)
    );
}

/// EveryDream2's shipped sample_prompts.json names `"scheduler": "dpm++"` (DPM-Solver++ 2M): a run
/// on SDXL draws with it, and `sdtrain sample` draws with the SDE Karras form.
#[test]
fn dpm_solver_samples_in_a_run_and_from_the_command() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = r#"{"scheduler": "dpm++", "cfgs": [7], "num_inference_steps": 4,
        "samples": [{"prompt": "a cat"}]}"#;
    let run = train(
        tmp.path(),
        "tiny-sdxl",
        ("p.json", prompts),
        serde_json::json!({"sample_steps": 2, "max_steps": 2}),
    );
    let got = names(&run.join("samples"));
    assert!(
        got.contains(&"gs00002-000-a_cat.png".to_string()),
        "{got:?}"
    );
    let txt = std::fs::read_to_string(run.join("samples/gs00002-000-a_cat.txt")).unwrap();
    assert!(txt.contains("dpm++_2m, 4 steps"), "{txt}");
    let out = common::cli::sdtrain(
        &[
            "sample",
            "--model",
            common::fixture("tiny-sd15").to_str().unwrap(),
            "--prompt",
            "a cat",
            "--steps",
            "4",
            "--width",
            "64",
            "--height",
            "64",
            "--sampler",
            "dpm++_2m_sde_k",
            "--out",
            "d.png",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", common::cli::text(&out));
    assert!(tmp.path().join("d.png").is_file());
}

/// EveryDream2's other sampler names, as a run's sample prompts (one sample each, naming its
/// `scheduler`) and as `sdtrain sample --sampler`: each draws a PNG and its `.txt` names it.
/// Catches a name parsed but not wired to its sampler, or a sampler that fails on a real model.
#[test]
fn every_everydream2_sampler_draws_in_a_run_and_from_the_command() {
    const NAMES: [&str; 9] = [
        "euler",
        "ddpm",
        "pndm",
        "lms",
        "kdpm2",
        "dpm++_2s",
        "dpm++_2s_k",
        "dpm++_sde",
        "dpm++_sde_k",
    ];
    let tmp = tempfile::tempdir().unwrap();
    let samples: Vec<serde_json::Value> = NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| serde_json::json!({"prompt": format!("cat {i}"), "scheduler": n}))
        .collect();
    let prompts = serde_json::json!({"cfgs": [3], "num_inference_steps": 2, "resolution": 32,
        "samples": samples});
    let run = train(
        tmp.path(),
        "tiny-sd15",
        ("p.json", &prompts.to_string()),
        serde_json::json!({"sample_steps": 1, "max_steps": 1}),
    );
    for (i, n) in NAMES.iter().enumerate() {
        let stem = format!("gs00001-{i:03}-cat_{i}");
        let txt = run.join(format!("samples/{stem}.txt"));
        let txt = std::fs::read_to_string(&txt).unwrap_or_else(|e| {
            panic!("{}: {e}; {:?}", txt.display(), names(&run.join("samples")))
        });
        assert!(txt.contains(&format!("{n}, 2 steps")), "{txt}");
        let out = common::cli::sdtrain(
            &[
                "sample",
                "--model",
                common::fixture("tiny-sd15").to_str().unwrap(),
                "--prompt",
                "a cat",
                "--steps",
                "2",
                "--width",
                "32",
                "--height",
                "32",
                "--sampler",
                n,
                "--out",
                &format!("{i}.png"),
                "--cpu",
            ],
            tmp.path(),
        );
        assert!(out.status.success(), "{n}: {}", common::cli::text(&out));
        assert_eq!(dims(&tmp.path().join(format!("{i}.png"))), (32, 32), "{n}");
    }
}

/// A kohya sd-scripts prompts file (`.txt` with ` --` options and `#` comments, its `.json`
/// list, and its `.toml` subsets over `[prompt]` defaults) draws what kohya's options ask: size, seed, steps, guidance scale, sampler and
/// negative prompt, as each sample's `.txt` records.
#[test]
fn kohya_prompt_files_draw_what_their_options_ask() {
    for (name, prompts) in [
        (
            "prompts.txt",
            "# kohya's comment line\na red cat --n blurry --w 32 --h 48 --d 7 --l 3 --s 2 --ss k_euler_a\n",
        ),
        (
            "prompts.json",
            r#"[{"prompt": "a red cat", "negative_prompt": "blurry", "width": 32, "height": 48,
                "seed": 7, "scale": 3, "sample_steps": 2, "sample_sampler": "k_euler_a"}]"#,
        ),
        (
            "prompts.toml",
            "[prompt]\nnegative_prompt = \"blurry\"\nwidth = 32\nheight = 48\nscale = 3.0\n\
             sample_steps = 2\nsample_sampler = \"k_euler_a\"\n\n\
             [[prompt.subset]]\nprompt = \"a red cat\"\nseed = 7\n",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "sample_steps": 1});
        let run = train(tmp.path(), "tiny-sd15", (name, prompts), extra);
        let samples = run.join("samples");
        assert_eq!(
            names(&samples),
            ["gs00001-000-a_red_cat.png", "gs00001-000-a_red_cat.txt", "gs00001-grid.png"],
            "{name}"
        );
        assert_eq!(dims(&samples.join("gs00001-000-a_red_cat.png")), (32, 48));
        let txt = std::fs::read_to_string(samples.join("gs00001-000-a_red_cat.txt")).unwrap();
        assert_eq!(
            txt,
            "prompt: a red cat\nnegative prompt: blurry\nseed: 7\nsize: 32x48\n\
             sampler: euler_a, 2 steps\ncfg (left to right): 3\n\
             prompt weights: A1111's, as kohya sd-scripts reads them\n",
            "{name}"
        );
    }
}

/// `sdtrain sample --prompts FILE` draws a prompts file as a run's round draws it: each prompt
/// at its own size, seed, steps, sampler and scales, into `--out-dir` with its `.txt` and a grid.
/// A prompt drawn from the file equals the same prompt drawn with `--prompt` and the same
/// settings. Catches a file setting ignored (size, seed, sampler, scale) or the images misnamed.
#[test]
fn sample_command_draws_a_prompts_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("tiny-sd15").display().to_string();
    std::fs::write(
        tmp.path().join("p.toml"),
        "[prompt]\nsample_steps = 2\nscale = 3.0\nsample_sampler = \"k_euler_a\"\n\n\
         [[prompt.subset]]\nprompt = \"a red cat\"\nwidth = 32\nheight = 48\nseed = 7\n\n\
         [[prompt.subset]]\nprompt = \"a (blue:1.2) dog\"\nwidth = 40\nheight = 32\n",
    )
    .unwrap();
    let args = [
        "sample",
        "--model",
        &model,
        "--prompts",
        "p.toml",
        "--out-dir",
        "s",
        "--cpu",
    ];
    let out = sdtrain(&args, tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let s = tmp.path().join("s");
    assert_eq!(
        names(&s),
        [
            "gs00000-000-a_red_cat.png",
            "gs00000-000-a_red_cat.txt",
            "gs00000-001-a_blue12_dog.png",
            "gs00000-001-a_blue12_dog.txt",
            "gs00000-grid.png"
        ]
    );
    assert_eq!(dims(&s.join("gs00000-001-a_blue12_dog.png")), (40, 32));
    let txt = std::fs::read_to_string(s.join("gs00000-001-a_blue12_dog.txt")).unwrap();
    assert!(txt.contains("seed: 555\n"), "the --seed default: {txt}");
    let from_file = image::open(s.join("gs00000-000-a_red_cat.png"))
        .unwrap()
        .to_rgb8();
    let single = [
        "sample",
        "--model",
        &model,
        "--prompt",
        "a red cat",
        "--prompt-syntax",
        "kohya",
        "--seed",
        "7",
        "--width",
        "32",
        "--height",
        "48",
        "--steps",
        "2",
        "--cfg",
        "3",
        "--sampler",
        "euler_a",
        "--out",
        "one.png",
        "--cpu",
    ];
    let out = sdtrain(&single, tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let one = image::open(tmp.path().join("one.png")).unwrap().to_rgb8();
    assert_eq!(from_file, one, "the file's prompt drew another image");

    // A flag the file decides, and a file with a random training caption, are refused.
    let out = sdtrain(
        &[
            "sample",
            "--model",
            &model,
            "--prompts",
            "p.toml",
            "--steps",
            "3",
            "--cpu",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("--steps"), "{}", text(&out));
    std::fs::write(
        tmp.path().join("r.json"),
        r#"{"samples": [{"random_caption": true}]}"#,
    )
    .unwrap();
    let out = sdtrain(
        &["sample", "--model", &model, "--prompts", "r.json", "--cpu"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("r.json: samples[0] asks for a random training caption"),
        "{}",
        text(&out)
    );
}

/// kohya's sample keys: `sample_at_first` draws before the first step, `sample_every_n_epochs`
/// at the end of each epoch and never by steps, `sample_sampler` (kohya's name) is the
/// default sampler. Two epochs: three rounds, the last at the final step.
#[test]
fn kohyas_sample_keys_draw_by_epochs() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"max_steps": 100, "max_epochs": 2, "batch_size": 4,
                                   "sample_every_n_epochs": 1, "sample_at_first": true,
                                   "sample_sampler": "k_euler_a"});
    let run = train(
        tmp.path(),
        "tiny-sd15",
        ("prompts.txt", "a red cat --w 32 --h 32 --s 2\n"),
        extra.clone(),
    );
    let rounds: Vec<String> = names(&run.join("samples"))
        .into_iter()
        .filter(|n| n.ends_with("-000-a_red_cat.png"))
        .collect();
    assert_eq!(rounds.len(), 3, "{rounds:?}");
    assert_eq!(rounds[0], "gs00000-000-a_red_cat.png");
    let steps = std::fs::read_to_string(run.join("plan.json")).unwrap();
    assert!(steps.contains("\"every_n_epochs\": 1"), "{steps}");
    // The sampler by default, as the dry run says.
    let cfg = tmp.path().join("train.json");
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
        tmp.path(),
    );
    let log = text(&out);
    assert!(
        log.contains("at the end of every 1 epoch(s) and before training")
            && log.contains("euler_a by default"),
        "{log}"
    );
    // Epochs and a step count together are refused, as kohya would ignore the steps.
    let mut both = extra;
    both["sample_steps"] = 5.into();
    let file = tmp.path().join("prompts.txt");
    both["sample_prompts"] = serde_json::json!(file);
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), both);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("sample_every_n_epochs"),
        "{}",
        text(&out)
    );
}
