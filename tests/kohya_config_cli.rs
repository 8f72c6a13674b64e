//! `sdtrain --config kohya.toml`: a kohya sd-scripts config file trains what it says, read with
//! kohya's defaults. The translation is checked end to end against a train.json, an
//! optimizer.json and a dataset config written by hand with the same meaning: the two runs save
//! the same weights bit for bit. Then the refusals, the pass-through of sdtrain's own keys and
//! `--set` in kohya's names.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text};
use common::fixture;

/// `train_data_dir` with one `<repeats>_<class tokens>` folder of the demo images.
fn kohya_images(dir: &Path) -> PathBuf {
    let root = dir.join("img");
    let sub = root.join("2_sks shape");
    std::fs::create_dir_all(&sub).unwrap();
    for e in std::fs::read_dir(demo_data()).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, sub.join(p.file_name().unwrap())).unwrap();
        }
    }
    root
}

fn kohya_toml(dir: &Path, body: &str) -> PathBuf {
    let images = kohya_images(dir);
    let text = format!(
        "pretrained_model_name_or_path = {model:?}\ntrain_data_dir = {images:?}\n\
         output_dir = {out:?}\n{body}",
        model = fixture("tiny-sd15").display().to_string(),
        images = images.display().to_string(),
        out = dir.join("out").display().to_string(),
    );
    let path = dir.join("kohya.toml");
    std::fs::write(&path, text).unwrap();
    path
}

const LORA: &str = r#"
output_name = "kt"
resolution = "64,64"
network_module = "networks.lora"
network_dim = 4
network_alpha = 2
network_args = ["conv_dim=2", "conv_alpha=1"]
learning_rate = 1e-3
text_encoder_lr = 5e-4
optimizer_type = "AdamW"
optimizer_args = ["weight_decay=0.1", "betas=(0.8,0.95)"]
lr_scheduler = "cosine"
lr_warmup_steps = 0.25
max_train_steps = 4
seed = 7
caption_extension = ".txt"

[sections_are_lifted]
save_precision = "float"
xformers = true
"#;

/// The kohya config and its hand translation train the same weights. Catches a kohya default
/// not applied (EveryDream2's 0.02 noise offset or 0.04 caption dropout, optimizer.json's
/// weight decay, sdtrain's automatic decay of 1.5× the run), the warmup fraction or the alpha
/// lost, or `network_args` dropped.
#[test]
fn a_kohya_config_trains_as_its_translation_does() {
    let k = tempfile::tempdir().unwrap();
    let toml = kohya_toml(k.path(), LORA);
    let out = sdtrain(&["--config", toml.to_str().unwrap(), "--cpu"], k.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("xformers"),
        "the no-effect note names it: {log}"
    );
    let kohya = common::f32_tensors(&run_folder(k.path()).join("kt.safetensors"));

    let j = tempfile::tempdir().unwrap();
    let images = kohya_images(j.path());
    let dataset = j.path().join("d.toml");
    std::fs::write(
        &dataset,
        format!(
            "[general]\nresolution = 64\nbatch_size = 1\nenable_bucket = false\ncaption_extension = '.txt'\n\
             caption_dropout_rate = 0.0\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = {:?}\n\
             num_repeats = 2\nclass_tokens = 'sks shape'\n",
            images.join("2_sks shape").display().to_string()
        ),
    )
    .unwrap();
    let train = serde_json::json!({
        "model": fixture("tiny-sd15"), "output_dir": j.path().join("out"),
        "project_name": "kt", "dataset_config": dataset, "mode": "locon",
        "adapter": {"rank": 4, "alpha": 2.0, "conv_rank": 2, "conv_alpha": 1.0,
                    "text_encoder_lr": 5e-4, "save_dtype": "fp32"},
        "max_steps": 4, "seed": 7, "amp": false, "max_grad_norm": 1.0,
        "zero_frequency_noise_ratio": 0.0, "cond_dropout": 0.0,
        "optimizer_config": "optimizer.json",
    });
    // Cosine over the 4 steps (kohya's num_training_steps), warmup int(0.25 · 4) = 1.
    let optimizer = serde_json::json!({"base": {
        "optimizer": "adamw", "lr": 1e-3, "betas": [0.8, 0.95], "epsilon": 1e-8,
        "weight_decay": 0.1, "lr_scheduler": "cosine", "lr_warmup_steps": 1,
        "lr_decay_steps": 4}});
    std::fs::write(j.path().join("train.json"), train.to_string()).unwrap();
    std::fs::write(j.path().join("optimizer.json"), optimizer.to_string()).unwrap();
    let out = sdtrain(&["--config", "train.json", "--cpu"], j.path());
    assert!(out.status.success(), "{}", text(&out));
    let ours = common::f32_tensors(&run_folder(j.path()).join("kt.safetensors"));
    assert_eq!(kohya.len(), ours.len());
    assert!(kohya.keys().any(|k| k.contains("lora_te_")));
    for (name, v) in &ours {
        assert_eq!(&kohya[name], v, "{name} differs");
    }
}

/// What kohya's file says, in the dry run: its defaults (learning rate 2e-6, 1600 steps, the
/// global norm clipped at 1, alpha 1), sdtrain's own keys passed through, and `--set` in kohya's
/// names.
#[test]
fn the_dry_run_shows_kohyas_defaults_and_passes_sdtrains_keys() {
    let d = tempfile::tempdir().unwrap();
    let toml = kohya_toml(
        d.path(),
        "network_module = \"networks.lora\"\nvram_limit_gb = 6.5\n",
    );
    let out = sdtrain(
        &[
            "--config",
            toml.to_str().unwrap(),
            "--dry-run",
            "--set",
            "network_dim=8",
        ],
        d.path(),
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    for needle in [
        "LoRA rank 8 alpha 1",
        "adamw lr 2e-6",
        "weight_decay 0.01",
        "1600 steps",
        "global L2 norm to 1",
        "6.5",
    ] {
        assert!(log.contains(needle), "{needle} missing from:\n{log}");
    }
}

/// Each refusal names the option and the reason; nothing trains.
#[test]
fn what_sdtrain_cannot_honour_is_refused_by_name() {
    for (body, needle) in [
        ("network_module = \"networks.dylora\"", "network_module"),
        (
            "network_module = \"networks.lora\"\nnetwork_args = [\"algo=loha\"]",
            "lycoris.kohya",
        ),
        (
            "network_module = \"networks.lora\"\nnetwork_args = [\"use_tucker=True\"]",
            "use_tucker",
        ),
        ("optimizer_type = \"SGDNesterov\"", "optimizer_type"),
        ("optimizer_type = \"AdaFactor\"", "relative_step"),
        (
            "lr_scheduler = \"constant\"\nlr_warmup_steps = 10",
            "constant_with_warmup",
        ),
        ("lr_scheduler = \"cosine_with_min_lr\"", "lr_scheduler"),
        ("save_last_n_epochs = 3", "save_last_n_epochs"),
        ("huggingface_repo_id = \"me/lora\"", "huggingface_repo_id"),
        ("color_aug = true", "color_aug"),
        ("shuffle_caption = \"yes\"", "shuffle_caption"),
        ("learning_rte = 1e-4", "learning_rate"),
        ("[a]\nseed = 1\n[b]\nseed = 2", "seed"),
        ("unet_lr = 1e-4", "unet_lr"),
        (
            "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'",
            "dataset_config",
        ),
        ("t5xxl = \"t5.safetensors\"", "FLUX.1"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let body = if body.contains("optimizer_type = \"AdaFactor\"") {
            format!("{body}\noptimizer_args = [\"relative_step=True\"]")
        } else {
            body.to_string()
        };
        let toml = kohya_toml(d.path(), &body);
        let out = sdtrain(&["--config", toml.to_str().unwrap(), "--dry-run"], d.path());
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{body}: {log}");
        assert!(log.contains(needle), "{body}: {needle} missing from {log}");
    }
}

/// What kohya_ss's GUI writes (its `config_lora-*.toml`, keys sorted, unset ones dropped): its
/// own `epoch` and `noise_offset_type`, which sd-scripts does not read, LyCORIS's switches
/// written off, empty scheduler arguments, worker counts. It runs, with one note for each kind.
#[test]
fn a_kohya_ss_gui_config_runs() {
    let d = tempfile::tempdir().unwrap();
    let toml = kohya_toml(
        d.path(),
        r#"bucket_no_upscale = true
bucket_reso_steps = 64
cache_latents = true
caption_dropout_every_n_epochs = 0
caption_dropout_rate = 0.05
caption_extension = ".txt"
clip_skip = 1
dynamo_backend = "no"
enable_bucket = true
epoch = 1
gradient_accumulation_steps = 1
huber_c = 0.1
huber_schedule = "snr"
keep_tokens = 0
learning_rate = 0.0001
loss_type = "l2"
lr_scheduler = "cosine_with_restarts"
lr_scheduler_args = []
lr_scheduler_num_cycles = 1
lr_scheduler_power = 1
lr_warmup_steps = 0
max_bucket_reso = 2048
max_data_loader_n_workers = 0
max_grad_norm = 1
max_timestep = 1000
max_token_length = 75
max_train_steps = 2
min_bucket_reso = 64
mixed_precision = "no"
network_alpha = 1
network_args = [ "preset=full", "conv_dim=2", "conv_alpha=1", "use_tucker=False", "rank_dropout=0", "bypass_mode=False", "dora_wd=False", "module_dropout=0", "use_scalar=False", "rank_dropout_scale=False", "algo=locon", "train_norm=False",]
network_dim = 4
network_module = "lycoris.kohya"
noise_offset_type = "Original"
optimizer_args = [ "weight_decay=0.01", "betas=0.9,0.999",]
optimizer_type = "AdamW8bit"
output_name = "gui"
persistent_data_loader_workers = 1
prior_loss_weight = 1
resolution = "64,64"
save_every_n_epochs = 1
save_model_as = "safetensors"
save_precision = "fp16"
text_encoder_lr = [ 5e-5,]
train_batch_size = 1
unet_lr = 0.0001
wandb_run_name = "gui"
xformers = true
"#,
    );
    let out = sdtrain(&["--config", toml.to_str().unwrap(), "--cpu"], d.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("epoch, noise_offset_type are kohya_ss's own"),
        "{log}"
    );
    assert!(log.contains("persistent_data_loader_workers"), "{log}");
    assert!(run_folder(d.path()).join("gui.safetensors").is_file());
}

/// A LoRA file's ModelSpec keys equal what kohya's `get_sai_model_spec` writes for the same
/// options (tests/fixtures/kohya_config_reference.py), but for the date and the implementation
/// version, which name the run and the trainer. Catches a `metadata_*` option dropped, the
/// title not taken from `metadata_title`, the thumbnail not embedded as a data URL, and
/// `clip_skip` or the timestep range left out or written in another form.
#[test]
fn modelspec_metadata_is_kohyas() {
    let reference = common::reference_json("reference/kohya_config.json");
    for case in reference["modelspec"].as_array().unwrap() {
        let d = tempfile::tempdir().unwrap();
        let mut body = String::from(
            "network_module = \"networks.lora\"\nmax_train_steps = 1\nlearning_rate = 1e-4\n\
             caption_extension = \".txt\"\n",
        );
        for (k, v) in case["case"].as_object().unwrap() {
            let v = match k.as_str() {
                "metadata_thumbnail" => serde_json::json!(fixture(v.as_str().unwrap())),
                _ => v.clone(),
            };
            body.push_str(&format!("{k} = {v}\n"));
        }
        let toml = kohya_toml(d.path(), &body);
        let out = sdtrain(&["--config", toml.to_str().unwrap(), "--cpu"], d.path());
        assert!(out.status.success(), "{}", text(&out));
        let file = run_folder(d.path()).join("kt.safetensors");
        let bytes = std::fs::read(&file).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone().unwrap_or_default();
        let ours: std::collections::BTreeMap<&String, &String> = meta
            .iter()
            .filter(|(k, _)| k.starts_with("modelspec."))
            .collect();
        let want = case["modelspec"].as_object().unwrap();
        for (k, v) in want {
            if k == "modelspec.date" || k == "modelspec.implementation_version" {
                assert!(ours.contains_key(k), "{k} missing");
                continue;
            }
            assert_eq!(
                ours.get(k).map(|s| s.as_str()),
                v.as_str(),
                "{k} in {:?}",
                case["case"]
            );
        }
        assert_eq!(ours.len(), want.len(), "{ours:?}");
    }
}
