//! `sdtrain --config onetrainer.json`: a OneTrainer config, written by OneTrainer's own code
//! (tests/fixtures/make_onetrainer_configs.py, from its built-in presets), trains what it says,
//! read with OneTrainer's defaults. The translation is checked end to end against a train.json,
//! an optimizer.json and a dataset config written by hand with the same meaning (the two runs
//! save the same weights bit for bit); then the text encoders' epoch stop, samples from
//! OneTrainer's samples file, the concepts' prompt sources, and the refusals.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, sdtrain, sdtrain_ok, sdtrain_refused, text};
use common::fixture;

/// The OneTrainer fixtures and a copy of the demo images (`data/`) in `dir`, as OneTrainer's
/// working directory holds them.
fn workspace(dir: &Path) {
    for f in [
        "sd15-lora.json",
        "sd15-finetune-export.json",
        "sd15-embedding.json",
        "concepts.json",
        "samples.json",
    ] {
        std::fs::copy(fixture("onetrainer").join(f), dir.join(f)).unwrap();
    }
    common::copy_dir(&demo_data(), &dir.join("data"));
}

fn model_arg() -> String {
    format!("base_model_name={}", fixture("tiny-sd15").display())
}

/// `sdtrain --config cfg --cpu` on the tiny SD1.5 model in f32, with OneTrainer's `sets`
/// (`key=value`, as `--set`), which must succeed: its output.
fn train_ot(cfg: &Path, dir: &Path, sets: &[&str]) -> String {
    let model = model_arg();
    let mut args = vec!["--set", model.as_str(), "--set", "train_dtype=FLOAT_32"];
    for s in sets {
        args.extend(["--set", s]);
    }
    sdtrain_ok(cfg, dir, &args)
}

/// The first run folder in `dir` (a OneTrainer config's `workspace_dir`).
fn only_run(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap_or_else(|| panic!("no run folder in {}", dir.display()))
}

/// The newest file in `dir` whose name ends with `suffix`.
fn saved(dir: &Path, suffix: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    found.sort();
    found
        .pop()
        .unwrap_or_else(|| panic!("no *{suffix} in {}", dir.display()))
}

/// The hand translation of sd15-lora.json (with a cosine schedule, f32 and no samples):
/// OneTrainer's values for every key where sdtrain's own defaults differ.
fn hand_translation(dir: &Path) -> PathBuf {
    let aspects: Vec<[i64; 2]> = vec![[64, 64], [128, 64], [64, 128]];
    let train = serde_json::json!({
        "model": fixture("tiny-sd15"),
        "dataset_config": "ds.toml",
        "output_dir": dir.join("hand"),
        "project_name": "tiny-lora",
        "resolution": 64,
        "enable_bucket": true,
        "aspects": aspects,
        "cache_latents": true,
        "batch_size": 2,
        "grad_accum": 1,
        "max_epochs": 2,
        "max_grad_norm": 1.0,
        "amp": false,
        "gradient_checkpointing": true,
        "loss_type": "mse",
        "noise_offset": 0.0,
        "cond_dropout": 0.0,
        "mode": "lora",
        "adapter": {"rank": 4, "alpha": 2.0, "save_dtype": "fp32"},
        "optimizer_config": "opt.json",
    });
    let optimizer = serde_json::json!({
        "base": {"optimizer": "adamw", "lr": 3e-4, "betas": [0.9, 0.999], "epsilon": 1e-8,
                 "weight_decay": 0.01, "lr_scheduler": "cosine", "lr_warmup_steps": 2,
                 "lr_decay_steps": 16},
    });
    let ds = format!(
        "[[datasets]]\n[[datasets.subsets]]\nimage_dir = {:?}\nnum_repeats = 2\n\
         caption_extension = \".txt\"\nflip_aug = true\nshuffle_caption = true\n\
         keep_tokens = 1\ncaption_dropout_rate = 0.0\n",
        dir.join("data").display().to_string()
    );
    std::fs::write(dir.join("ds.toml"), ds).unwrap();
    std::fs::write(dir.join("opt.json"), optimizer.to_string()).unwrap();
    let path = dir.join("hand.json");
    std::fs::write(&path, train.to_string()).unwrap();
    path
}

/// OneTrainer's SD1.5 LoRA preset trains as its hand translation does, bit for bit. Catches a
/// OneTrainer default not applied (sdtrain's own 0.02 noise offset or 0.04 caption dropout, its
/// automatic warmup or 1.5× decay, an alpha or rank lost), the warmup not divided as OneTrainer
/// divides it, the concept's repeats, flip or tag shuffle dropped, or other buckets.
#[test]
fn a_onetrainer_lora_config_trains_as_its_translation_does() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let log = train_ot(
        &cfg,
        d.path(),
        &["learning_rate_scheduler=COSINE", "sample_after_unit=NEVER"],
    );
    assert!(log.contains("backup_after"), "the no-effect note: {log}");
    assert!(log.contains("unlike OneTrainer"), "the differences: {log}");
    let ot = common::f32_tensors(&saved(&d.path().join("models"), "-tiny-lora.safetensors"));
    let hand = hand_translation(d.path());
    sdtrain_ok(&hand, d.path(), &[]);
    let run = only_run(&d.path().join("hand"));
    let theirs = common::f32_tensors(&run.join("tiny-lora.safetensors"));
    assert_eq!(ot.len(), theirs.len());
    assert!(ot.len() > 100, "{}", ot.len());
    for (k, v) in &theirs {
        assert_eq!(ot.get(k), Some(v), "{k}");
    }
}

/// A text encoder that OneTrainer stops after one epoch (`stop_training_after` 1, unit EPOCH)
/// trains in epoch 1 and not after; the UNet trains on. Saves every epoch in the original
/// single-file layout (`save_every` 1 EPOCH, ORIGINAL_SINGLE_FILE), captions from file names
/// (prompt source "filename"). Catches the stop not applied, applied a step off, or applied to
/// the UNet.
#[test]
fn the_text_encoders_stop_after_their_epochs() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-finetune-export.json");
    let log = train_ot(
        &cfg,
        d.path(),
        &[
            "epochs=3",
            "learning_rate=1e-4",
            "save_every=1",
            "save_every_unit=EPOCH",
        ],
    );
    assert!(log.contains("concepts[0]: 8 images"), "{log}");
    let dry = sdtrain_ok(
        &cfg,
        d.path(),
        &["--dry-run", "--set", &model_arg(), "--set", "epochs=3"],
    );
    assert!(
        dry.contains("trained (every layer); stops after 1 epoch"),
        "{dry}"
    );
    assert!(dry.contains("captions from file names"), "{dry}");
    let models = d.path().join("models");
    let first = common::f32_tensors(&saved(&models, "-epoch-0001.safetensors"));
    let second = common::f32_tensors(&saved(&models, "-epoch-0002.safetensors"));
    let last = common::f32_tensors(&saved(&models, "-final.safetensors"));
    let moved = |a: &std::collections::HashMap<String, Vec<f32>>,
                 b: &std::collections::HashMap<String, Vec<f32>>,
                 prefix: &str| {
        a.iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .any(|(k, v)| b.get(k) != Some(v))
    };
    let te = "cond_stage_model.";
    let unet = "model.diffusion_model.";
    assert!(
        !moved(&first, &second, te),
        "the text encoder trained in epoch 2"
    );
    assert!(
        !moved(&second, &last, te),
        "the text encoder trained in epoch 3"
    );
    assert!(moved(&first, &second, unet) && moved(&second, &last, unet));
    let plan = std::fs::read_to_string(only_run(&d.path().join("workspace/run")).join("plan.json"))
        .unwrap();
    assert!(
        plan.contains("\"stop_text_encoder_training_epochs\": 1"),
        "{plan}"
    );
}

/// OneTrainer's samples file (`sample_definition_file_name`) is drawn at the start and after
/// every epoch, each entry at its own size, seed, steps and scheduler; its prompts are read as
/// A1111's, and a random-weight model's unweighted prompt draws (kohya's rescale of the mean
/// left out where it is 0/0). Catches the samples file not read, or NaN samples.
#[test]
fn onetrainers_samples_are_drawn() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let log = train_ot(
        &cfg,
        d.path(),
        &["epochs=1", "sample_after=1", "sample_after_unit=EPOCH"],
    );
    assert!(!log.contains("NaN"), "{log}");
    let run = only_run(&d.path().join("workspace/run"));
    let grids: Vec<_> = std::fs::read_dir(run.join("samples"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with("-grid.png"))
        .collect();
    assert_eq!(
        grids.len(),
        2,
        "before training and after epoch 1: {grids:?}\n{log}"
    );
}

/// A concept's several caption lines are drawn one per sample (OneTrainer's), which turns the
/// text-encoder cache off; a one-line concept keeps it. The concept's prompt file (`concept`)
/// captions every image.
#[test]
fn caption_lines_and_the_concept_prompt_file() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    std::fs::write(d.path().join("prompts.txt"), "a shape\n\nsks shape\n").unwrap();
    let concepts = serde_json::json!([{
        "__version": 2, "path": "data", "balancing": 1.0,
        "text": {"prompt_source": "concept", "prompt_path": "prompts.txt"},
    }]);
    std::fs::write(d.path().join("c2.json"), concepts.to_string()).unwrap();
    let cfg = d.path().join("sd15-lora.json");
    let base = [
        "--set".to_string(),
        model_arg(),
        "--set".into(),
        "train_dtype=FLOAT_32".into(),
        "--set".into(),
        "concept_file_name=c2.json".into(),
        "--set".into(),
        "text_encoder.train=false".into(),
    ];
    let args: Vec<&str> = base.iter().map(String::as_str).collect();
    let out = sdtrain(
        &[
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            &args[..],
        ]
        .concat(),
        d.path(),
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("captions from"), "{log}");
    assert!(log.contains("several lines draw one"), "{log}");
    std::fs::write(d.path().join("prompts.txt"), "sks shape\n").unwrap();
    let out = sdtrain(
        &[
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            &args[..],
        ]
        .concat(),
        d.path(),
    );
    let log = text(&out);
    assert!(log.contains("text cache     on"), "{log}");
    // OneTrainer's tag dropout modes are taken (FULL, its default); special tags are refused.
    let full = serde_json::json!([{
        "__version": 2, "path": "data", "text": {"tag_dropout_enable": true,
        "tag_dropout_probability": 0.3, "tag_dropout_mode": "FULL"},
    }]);
    std::fs::write(d.path().join("c3.json"), full.to_string()).unwrap();
    let mut args3 = args.clone();
    args3[5] = "concept_file_name=c3.json";
    let out = sdtrain(
        &[
            &["--config", cfg.to_str().unwrap(), "--cpu", "--dry-run"],
            &args3[..],
        ]
        .concat(),
        d.path(),
    );
    let log = text(&out);
    assert!(
        out.status.success() && log.contains("tag dropout 0.3"),
        "{log}"
    );
    let special = serde_json::json!([{
        "__version": 2, "path": "data", "text": {"tag_dropout_enable": true,
        "tag_dropout_probability": 0.3, "tag_dropout_special_tags_mode": "BLACKLIST"},
    }]);
    std::fs::write(d.path().join("c3.json"), special.to_string()).unwrap();
    let log = sdtrain_refused(&cfg, d.path(), &args3);
    assert!(log.contains("tag_dropout_special_tags_mode"), "{log}");
}

/// What sdtrain cannot do as OneTrainer does is refused, naming the key and why, before
/// anything loads.
#[test]
fn what_sdtrain_cannot_do_is_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let bad = serde_json::json!([{"path": "data", "balancing": -1.0}]);
    std::fs::write(d.path().join("frac.json"), bad.to_string()).unwrap();
    let cases = [
        ("ema=ON", "`ema`"),
        (
            "learning_rate_scheduler=ADAFACTOR",
            "`learning_rate_scheduler`",
        ),
        ("mse_strength=0", "`mse_strength`"),
        (
            "timestep_distribution=EXPONENTIAL",
            "`timestep_distribution`",
        ),
        ("model_type=STABLE_DIFFUSION_15_INPAINTING", "`model_type`"),
        ("optimizer.optimizer=ADEMAMIX", "`optimizer.optimizer`"),
        ("resolution=512,768", "`resolution`"),
        ("concept_file_name=frac.json", "balancing`"),
        ("concept_file_name=missing.json", "`concept_file_name`"),
        ("lerning_rate=1", "did you mean `learning_rate`"),
    ];
    for (set, expect) in cases {
        let model = model_arg();
        let log = sdtrain_refused(&cfg, d.path(), &["--set", &model, "--set", set]);
        assert!(log.contains(expect), "--set {set}: {log}");
    }
    // A file of an older OneTrainer, which OneTrainer itself migrates when it opens it.
    let mut old: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    old["__version"] = serde_json::json!(9);
    let old_cfg = d.path().join("old.json");
    std::fs::write(&old_cfg, old.to_string()).unwrap();
    let log = sdtrain_refused(&old_cfg, d.path(), &[]);
    assert!(
        log.contains("`__version`") && log.contains("older OneTrainer"),
        "{log}"
    );
}

/// OneTrainer's schedule numbers: a warmup above 1 counts micro-batches (divided by the
/// accumulation), at most 1 is a fraction of the run; `learning_rate_scaler` multiplies the
/// rates by the square root of the batch; clip skip counts from 1. Catches the warmup taken as
/// optimizer steps, the scaler's square root missed, or clip skip off by one.
#[test]
fn schedule_numbers_are_onetrainers() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let model = model_arg();
    let log = sdtrain_ok(
        &cfg,
        d.path(),
        &[
            "--dry-run",
            "--set",
            &model,
            "--set",
            "gradient_accumulation_steps=2",
            "--set",
            "learning_rate_warmup_steps=9",
            "--set",
            "batch_size=4",
            "--set",
            "learning_rate_scaler=BATCH",
            "--set",
            "text_encoder_layer_skip=1",
        ],
    );
    assert!(log.contains("warmup 4,"), "9 micro-batches over 2: {log}");
    assert!(log.contains("lr 6e-4"), "3e-4 · √4: {log}");
    assert!(log.contains("clip_skip      2"), "{log}");
    let log = sdtrain_ok(
        &cfg,
        d.path(),
        &[
            "--dry-run",
            "--set",
            &model,
            "--set",
            "learning_rate_warmup_steps=0.5",
            // A number, which OneTrainer takes for its text `resolution` (`str(value)`).
            "--set",
            "resolution=128",
        ],
    );
    assert!(log.contains("warmup 0.5 of the run's steps"), "{log}");
    assert!(log.contains("resolution     128 px"), "{log}");
    // OneTrainer's smooth restarts, cos(2π·c·p), are twice as many half waves; its min factor
    // floors them; its REX is REX.
    for (scheduler, expect) in [
        (
            "COSINE_WITH_RESTARTS",
            "cosine_with_min_lr schedule, warmup 2, decay the run's steps, 3 cycles, floor 0.1",
        ),
        (
            "COSINE_WITH_HARD_RESTARTS",
            "cosine_with_restarts schedule, warmup 2, decay the run's steps, 1.5 cycles, floor 0.1",
        ),
        (
            "REX",
            "rex schedule, warmup 2, decay the run's steps, floor 0.1",
        ),
    ] {
        let log = sdtrain_ok(
            &cfg,
            d.path(),
            &[
                "--dry-run",
                "--set",
                &model,
                "--set",
                &format!("learning_rate_scheduler={scheduler}"),
                "--set",
                "learning_rate_cycles=1.5",
                "--set",
                "learning_rate_min_factor=0.1",
            ],
        );
        assert!(log.contains(expect), "{scheduler}: {log}");
    }
}

/// Each optimizer as OneTrainer's UI writes it when picked (its table of defaults, with
/// settings the optimizer does not take, which OneTrainer's `create.py` does not pass either)
/// is taken, with OneTrainer's values. Catches a setting of another optimizer refused, or a
/// picked value (Prodigy's `decouple`, CAME's weight decay) lost.
#[test]
fn optimizers_as_onetrainers_ui_writes_them_are_taken() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let picked: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(fixture("onetrainer/ui-optimizers.json")).unwrap(),
    )
    .unwrap();
    let expect = [
        (
            "ADAMW",
            "adamw lr 3e-4, betas (0.9, 0.999), epsilon 1e-8, weight_decay 0.01",
        ),
        ("ADAMW_8BIT", "adamw8bit lr 3e-4"),
        (
            "ADAM",
            "adamw lr 3e-4, betas (0.9, 0.999), epsilon 1e-8, weight_decay 0;",
        ),
        ("LION", "lion lr 3e-4, betas (0.9, 0.99)"),
        ("ADAFACTOR", "adafactor"),
        ("PRODIGY", "prodigy"),
        ("CAME", "came"),
        ("DADAPT_ADAM", "dadapt_adam"),
        ("SCHEDULE_FREE_ADAMW", "adamw_schedulefree"),
    ];
    assert_eq!(picked.len(), expect.len());
    for (name, shown) in expect {
        let set = format!("optimizer={}", picked[name]);
        let model = model_arg();
        let log = sdtrain_ok(
            &cfg,
            d.path(),
            &["--dry-run", "--set", &model, "--set", &set],
        );
        assert!(log.contains(shown), "{name}: {log}");
        if name == "PRODIGY" {
            assert!(log.contains("slice_p"), "the note: {log}");
        }
    }
}

/// OneTrainer's EMA (`ema` CPU) keeps an average with its decay warm-up, saved beside the
/// trained LoRA. Catches the warm-up not carried into the plan, or the EMA file not saved.
#[test]
fn onetrainers_ema_is_kept_and_saved() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let log = train_ot(
        &cfg,
        d.path(),
        &[
            "epochs=1",
            "sample_after_unit=NEVER",
            "ema=CPU",
            "ema_update_step_interval=1",
        ],
    );
    assert!(log.contains("ema: decay 0.999 every 1 steps"), "{log}");
    saved(&d.path().join("models"), "-tiny-lora-ema.safetensors");
    let run = only_run(&d.path().join("workspace/run"));
    let plan = std::fs::read_to_string(run.join("plan.json")).unwrap();
    assert!(plan.contains("\"warmup\": true"), "{plan}");
}

/// OneTrainer's balancing: REPEATS 0.5 trains half of a concept's 8 images each epoch, SAMPLES 6
/// six of another concept of the same folder (both are trained, as OneTrainer trains two
/// concepts of one folder). Catches the fraction rounded to a whole repeat, SAMPLES taken as
/// repeats, or the second concept dropped as a kohya duplicate.
#[test]
fn balancing_sets_each_concepts_samples_per_epoch() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let concepts = serde_json::json!([
        {"__version": 2, "path": "data", "balancing": 0.5},
        {"__version": 2, "path": "data", "seed": 5, "balancing": 6,
         "balancing_strategy": "SAMPLES", "text": {"prompt_source": "filename"}},
    ]);
    std::fs::write(d.path().join("frac.json"), concepts.to_string()).unwrap();
    let cfg = d.path().join("sd15-lora.json");
    let log = train_ot(
        &cfg,
        d.path(),
        &[
            "concept_file_name=frac.json",
            "sample_after_unit=NEVER",
            "epochs=1",
        ],
    );
    assert!(
        log.contains("× 0.5 repeats") && log.contains("× 0.75 repeats"),
        "{log}"
    );
    assert!(log.contains("10 samples/epoch"), "{log}");
    assert!(log.contains("fractional repeats"), "the difference: {log}");
}

/// A concept's `loss_weight` multiplies its samples' loss, as OneTrainer's
/// `losses *= loss_weight`: at weight 0.5 the first step's loss (the same draws) is exactly half.
/// Catches the weight dropped, squared, or applied to the gradient but not the logged loss.
#[test]
fn a_concepts_loss_weight_scales_its_loss() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let first_loss = |weight: f64, name: &str| -> f64 {
        let concepts = serde_json::json!([
            {"__version": 2, "path": "data", "balancing": 1.0, "loss_weight": weight},
        ]);
        std::fs::write(d.path().join(format!("{name}.json")), concepts.to_string()).unwrap();
        let concept_arg = format!("concept_file_name={name}.json");
        let workspace_arg = format!("workspace_dir=ws-{name}");
        train_ot(
            &cfg,
            d.path(),
            &[
                &concept_arg,
                &workspace_arg,
                "sample_after_unit=NEVER",
                "epochs=1",
            ],
        );
        let run = only_run(&d.path().join(format!("ws-{name}")));
        common::cli::step_losses(&run)[0]
    };
    let whole = first_loss(1.0, "whole");
    let half = first_loss(0.5, "half");
    assert!(whole > 0.0);
    assert_eq!(half, whole * 0.5, "{half} vs {whole}");
}

/// OneTrainer's own built-in presets for SD1.5, SD2.x and SDXL (tests/fixtures/onetrainer/
/// presets, copied from its `training_presets/`), read as its UI loads them, all translate; its
/// inpainting and SD3 presets are refused by `model_type`. Catches a key of OneTrainer's presets
/// that sdtrain refuses or misreads.
#[test]
fn onetrainers_own_presets_translate() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    std::fs::create_dir_all(d.path().join("training_concepts")).unwrap();
    std::fs::copy(
        d.path().join("concepts.json"),
        d.path().join("training_concepts/concepts.json"),
    )
    .unwrap();
    let presets = fixture("onetrainer/presets");
    let mut names: Vec<String> = std::fs::read_dir(&presets)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 17, "{names:?}");
    let mut translated = 0;
    for name in &names {
        let model = match name.as_str() {
            n if n.starts_with("sd_2") => "tiny-sd21",
            n if n.starts_with("sdxl") => "tiny-sdxl",
            _ => "tiny-sd15",
        };
        let model_arg = format!("base_model_name={}", fixture(model).display());
        let cfg = presets.join(name);
        let refused = name.contains("inpaint") || name.starts_with("sd_3");
        let args = ["--set", model_arg.as_str(), "--set", "resolution=64"];
        if refused {
            let log = sdtrain_refused(&cfg, d.path(), &args);
            assert!(log.contains("`model_type`"), "{name}: {log}");
        } else {
            let log = sdtrain_ok(&cfg, d.path(), &[&["--dry-run"], &args[..]].concat());
            assert!(log.contains("mode "), "{name}: {log}");
            translated += 1;
        }
    }
    assert_eq!(translated, 10);
}

/// OneTrainer's FLOAT_8 weights: the UNet alone (kohya's fp8_base_unet), or with the text
/// encoders. Catches a FLOAT_8 UNet taken as an fp8 text encoder too, and the reverse.
#[test]
fn a_float8_unet_keeps_its_text_encoder_in_the_compute_dtype_unless_it_is_float8_too() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let model = model_arg();
    for (te, expect) in [
        ("FLOAT_16", "frozen UNet fp8"),
        ("FLOAT_8", "frozen base fp8"),
    ] {
        let log = sdtrain_ok(
            &cfg,
            d.path(),
            &[
                "--dry-run",
                "--set",
                &model,
                "--set",
                "unet.weight_dtype=FLOAT_8",
                "--set",
                &format!("text_encoder.weight_dtype={te}"),
            ],
        );
        assert!(log.contains(expect), "{te}: {log}");
    }
}

/// OneTrainer's timestep distributions and `timestep_shift` are taken with the parameters
/// OneTrainer reads for each (BETA's raised to 1e-4 as OneTrainer raises them), and the dry run
/// says so. Catches a distribution read as another, a bias passed where OneTrainer ignores it
/// (refused by the plan), or a shift dropped.
#[test]
fn onetrainers_timestep_distributions_and_shift_are_taken() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let model = model_arg();
    let cases: [(&[&str], &str); 5] = [
        (
            &[
                "timestep_distribution=HEAVY_TAIL",
                "noising_weight=0.5",
                "noising_bias=0.3",
            ],
            "heavy-tailed timesteps (s 0.5)",
        ),
        (
            &[
                "timestep_distribution=BETA",
                "noising_weight=0.6",
                "noising_bias=0",
            ],
            "beta timesteps (α 0.6, β 0.0001)",
        ),
        (
            &[
                "timestep_distribution=COS_MAP",
                "noising_weight=2",
                "timestep_shift=3",
            ],
            "cos-map timesteps, timestep shift 3",
        ),
        (
            &[
                "timestep_distribution=SIGMOID",
                "noising_weight=4",
                "noising_bias=-0.1",
            ],
            "sigmoid timesteps (weight 4, bias -0.1)",
        ),
        (
            &[
                "timestep_distribution=INVERTED_PARABOLA",
                "noising_weight=3",
            ],
            "inverted-parabola timesteps (weight 3, bias 0)",
        ),
    ];
    for (sets, expect) in cases {
        let mut args = vec!["--dry-run", "--set", model.as_str()];
        for s in sets {
            args.extend(["--set", s]);
        }
        let log = sdtrain_ok(&cfg, d.path(), &args);
        assert!(log.contains(expect), "{sets:?}: {log}");
    }
    // A heavy tail whose map is no longer monotone is refused naming OneTrainer's key.
    let args = [
        "--set",
        model.as_str(),
        "--set",
        "timestep_distribution=HEAVY_TAIL",
        "--set",
        "noising_weight=3",
    ];
    let log = sdtrain_refused(&cfg, d.path(), &args);
    assert!(log.contains("noising_weight"), "{log}");
}

/// OneTrainer's weighted sum of losses with its Huber δ, its P2 weighting, its loss scaler, its
/// masked prior preservation, generalized offset noise and perturbation noise are taken, and
/// the dry run says so. Catches a
/// strength dropped, δ ignored, P2's γ not read, or a scaler or noise option left out.
#[test]
fn onetrainers_loss_and_noise_options_are_taken() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    let model = model_arg();
    let sets = [
        "mae_strength=0.5",
        "huber_strength=0.2",
        "huber_delta=0.5",
        "log_cosh_strength=0.1",
        "loss_weight_fn=P2",
        "loss_weight_strength=0.7",
        "loss_scaler=GLOBAL_BOTH",
        "offset_noise_weight=0.1",
        "generalized_offset_noise=true",
        "perturbation_noise_weight=0.05",
        "masked_training=true",
        "masked_prior_preservation_weight=0.5",
    ];
    let mut args = vec!["--dry-run", "--set", model.as_str()];
    for s in &sets {
        args.extend(["--set", s]);
    }
    let log = sdtrain_ok(&cfg, d.path(), &args);
    assert!(
        log.contains(
            "1·mse + 0.5·mae + 0.1·log-cosh + 0.2·huber (δ 0.5) (OneTrainer), P2 weighting γ \
             0.7, loss_scaler both, masked prior preservation 0.5, generalized offset noise \
             (ψ_t), perturbation noise 0.05"
        ),
        "{log}"
    );
}

/// OneTrainer's "attn-only" preset (`layer_filter` "attn") trains the UNet's attention
/// projections alone, its text encoder whole. Catches the filter dropped in the translation or
/// applied to the text encoder.
#[test]
fn a_onetrainer_layer_filter_picks_the_unet_layers() {
    let d = tempfile::tempdir().unwrap();
    workspace(d.path());
    let cfg = d.path().join("sd15-lora.json");
    train_ot(
        &cfg,
        d.path(),
        &[
            "layer_filter=attn",
            "layer_filter_preset=attn-only",
            "sample_after_unit=NEVER",
            "epochs=1",
        ],
    );
    let file = saved(&d.path().join("models"), "-tiny-lora.safetensors");
    let names: Vec<String> = common::f32_tensors(&file)
        .into_keys()
        .filter_map(|k| k.strip_suffix(".lora_down.weight").map(str::to_string))
        .collect();
    let unet: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("lora_unet_"))
        .collect();
    assert!(!unet.is_empty());
    for n in &unet {
        assert!(n.contains("_attn1_") || n.contains("_attn2_"), "{n}");
    }
    assert!(names
        .iter()
        .any(|n| n.starts_with("lora_te_") && n.ends_with("_mlp_fc1")));
}
