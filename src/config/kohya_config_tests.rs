//! Tests of `super` (kohya config files) through `TrainPlan::resolve`.
use crate::config::{TrainMode, TrainPlan};

/// A kohya config of `body` over tiny-sd15 and a `train_data_dir` with one subset folder.
fn resolve(body: &str) -> Result<TrainPlan, String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("img").join("3_cat")).unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let text = format!(
        "pretrained_model_name_or_path = '{root}/tests/fixtures/tiny-sd15'\n\
         train_data_dir = '{}'\n{body}",
        dir.path().join("img").display()
    );
    let path = dir.path().join("k.toml");
    std::fs::write(&path, text).unwrap();
    TrainPlan::resolve(&path, &[]).map_err(|e| e.to_string())
}

fn lycoris(args: &str) -> Result<TrainPlan, String> {
    resolve(&format!(
        "network_module = 'lycoris.kohya'\nnetwork_args = [{args}]\n"
    ))
}

/// Catches a LyCORIS algo mapped to the wrong mode, `conv_dim` not making a LoCon, or
/// `dora_wd` ignored.
#[test]
fn network_modules_and_algos_become_modes() {
    let mode = |p: Result<TrainPlan, String>| p.map(|p| p.mode).unwrap();
    assert_eq!(
        mode(resolve("network_module = 'networks.lora'")),
        TrainMode::Lora
    );
    let locon =
        resolve("network_module = 'networks.lora'\nnetwork_args = 'conv_dim=8 conv_alpha=4'");
    let locon = locon.unwrap();
    assert_eq!(locon.mode, TrainMode::Locon);
    let a = locon.adapter.unwrap();
    assert_eq!((a.conv_rank, a.conv_alpha), (8, 4.0));
    assert_eq!(mode(lycoris("'algo=loha'")), TrainMode::Loha);
    assert_eq!(mode(lycoris("'algo=lokr', 'factor=4'")), TrainMode::Lokr);
    assert_eq!(
        mode(lycoris("'algo=lora', 'dora_wd=True'")),
        TrainMode::Dora
    );
    assert_eq!(
        mode(lycoris("'algo=locon', 'conv_dim=4'")),
        TrainMode::Locon
    );
    assert_eq!(mode(lycoris("")), TrainMode::Lora);
    let e = lycoris("'algo=ia3'").unwrap_err();
    assert!(e.contains("algo=ia3"), "{e}");
    let e = lycoris("'preset=attn-only'").unwrap_err();
    assert!(e.contains("preset"), "{e}");
    let e = resolve("network_module = 'networks.lora'\nnetwork_args = ['bogus=1']").unwrap_err();
    assert!(e.contains("bogus=1"), "{e}");
    let e = resolve("network_dim = 8").unwrap_err();
    assert!(e.contains("network_module"), "{e}");
}

/// kohya's `text_encoder_lr`: a list of one, two equal, or 0 (no text encoder training).
#[test]
fn text_encoder_learning_rates() {
    let lora = "network_module = 'networks.lora'\n";
    let p = resolve(&format!("{lora}text_encoder_lr = [1e-5, 1e-5]")).unwrap();
    assert_eq!(p.adapter.unwrap().text_encoder_lr, Some(1e-5));
    let e = resolve(&format!("{lora}text_encoder_lr = [1e-5, 2e-5]")).unwrap_err();
    assert!(e.contains("one rate"), "{e}");
    let p = resolve(&format!("{lora}text_encoder_lr = 0.0")).unwrap();
    assert!(!p.adapter.unwrap().train_text_encoder);
    let p = resolve(&format!("{lora}unet_lr = 0.0")).unwrap();
    assert!(!p.train_unet && !p.adapter.unwrap().train_unet);
    // A full fine-tune: the text encoder trains only with train_text_encoder.
    assert!(!resolve("").unwrap().train_text_encoder);
    let p = resolve("train_text_encoder = true\nlearning_rate_te = 3e-6").unwrap();
    assert!(p.train_text_encoder);
    assert_eq!(p.optimizer.text_encoder.lr, 3e-6);
    let e = resolve("learning_rate_te1 = 1e-6\nlearning_rate_te2 = 2e-6").unwrap_err();
    assert!(e.contains("one rate"), "{e}");
    let e = resolve(&format!("{lora}learning_rate_te = 1e-6")).unwrap_err();
    assert!(e.contains("learning_rate_te"), "{e}");
}

/// Precision, the run's length and the saved dtype, in kohya's names.
#[test]
fn precision_length_and_saves() {
    use crate::config::{AmpChoice, BaseWeightDtype};
    let p = resolve("mixed_precision = 'bf16'\nfull_bf16 = true\nmax_train_epochs = 3").unwrap();
    assert_eq!(p.precision.amp, AmpChoice::Set(crate::precision::Amp::Bf16));
    assert_eq!(
        p.precision.weight_dtype,
        crate::precision::WeightDtype::Bf16
    );
    assert_eq!((p.max_epochs, p.max_steps), (Some(3), None));
    let p = resolve("network_module = 'networks.lora'\nfp8_base = true").unwrap();
    assert_eq!(p.precision.base_weight_dtype, BaseWeightDtype::Fp8);
    // fp8_base_unet wins over fp8_base, as in kohya's train_network.py.
    for both in ["", "fp8_base = true\n"] {
        let p = resolve(&format!(
            "network_module = 'networks.lora'\n{both}fp8_base_unet = true"
        ))
        .unwrap();
        assert_eq!(p.precision.base_weight_dtype, BaseWeightDtype::Fp8Unet);
    }
    // sdxl_train.py's block_lr, as text; an adapter config's is refused by train.json's rule.
    let rates = vec!["1e-5"; 23].join(",");
    let p = resolve(&format!("block_lr = '{rates}'")).unwrap();
    assert_eq!(p.block_lr, Some(vec![1e-5; 23]));
    let e = resolve(&format!(
        "network_module = 'networks.lora'\nblock_lr = '{rates}'"
    ))
    .unwrap_err();
    assert!(
        e.contains("block_lr") && e.contains("full fine-tune"),
        "{e}"
    );
    let p = resolve("network_module = 'networks.lora'\nsave_precision = 'bf16'").unwrap();
    assert_eq!(
        p.adapter.unwrap().save_dtype,
        crate::config::SaveDtype::Bf16
    );
    assert!(resolve("save_precision = 'bf16'").is_err());
    let e = resolve("mixed_precision = 'fp8'").unwrap_err();
    assert!(e.contains("mixed_precision"), "{e}");
    let p = resolve("loss_type = 'huber'").unwrap();
    assert!(matches!(
        p.objective.loss.loss_type,
        crate::diffusion::loss::LossType::PseudoHuber(_)
    ));
}

/// The command line is the level under a dataset config's `[general]`: a subset that says
/// nothing takes the kohya config's `shuffle_caption` and `keep_tokens` (0 shuffles every
/// tag, which train.json's `keep_tags` cannot say), and its own value wins.
#[test]
fn dataset_options_fall_under_a_dataset_config() {
    let dir = tempfile::tempdir().unwrap();
    for s in ["a", "b"] {
        std::fs::create_dir_all(dir.path().join(s)).unwrap();
    }
    let dataset = dir.path().join("d.toml");
    std::fs::write(
        &dataset,
        "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n\
         [[datasets.subsets]]\nimage_dir = 'b'\nkeep_tokens = 2\n",
    )
    .unwrap();
    let p = resolve(&format!(
        "dataset_config = '{}'\nshuffle_caption = true\ncaption_dropout_rate = 0.25\n\
         train_batch_size = 3",
        dataset.display()
    ))
    .unwrap();
    let subsets = &p.data.dataset_config.as_ref().unwrap().subsets;
    assert!(subsets[0].captions.shuffle && subsets[1].captions.shuffle);
    assert_eq!(subsets[0].captions.keep_tokens, 0);
    assert_eq!(subsets[1].captions.keep_tokens, 2);
    assert_eq!(subsets[0].caption_dropout, 0.25);
    assert_eq!(p.batch_size, 3);
}

/// `train_data_dir` with `in_json` is kohya's fine-tuning dataset; without, its
/// `<repeats>_<tokens>` folders.
#[test]
fn train_data_dir_becomes_kohyas_subsets() {
    let p = resolve("").unwrap();
    let s = &p.data.dataset_config.as_ref().unwrap().subsets;
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].num_repeats, 3);
    match &s[0].source {
        crate::data::kohya_subsets::SubsetSource::DreamBooth { class_tokens, .. } => {
            assert_eq!(class_tokens.as_deref(), Some("cat"))
        }
        other => panic!("{other:?}"),
    }
    let e = resolve("in_json = 'missing.json'").unwrap_err();
    assert!(e.contains("missing.json"), "{e}");
}

/// `ast.literal_eval` of the values kohya's optimizer arguments take.
#[test]
fn python_literals() {
    use super::super::kohya_optimizer::py_literal;
    use serde_json::json;
    assert_eq!(py_literal("0.9,0.99"), Some(json!([0.9, 0.99])));
    assert_eq!(py_literal("(0.9, 0.999)"), Some(json!([0.9, 0.999])));
    assert_eq!(py_literal("[1, 2]"), Some(json!([1, 2])));
    assert_eq!(py_literal("True"), Some(json!(true)));
    assert_eq!(py_literal("None"), Some(json!(null)));
    assert_eq!(py_literal("'x'"), Some(json!("x")));
    assert_eq!(py_literal("1e-3"), Some(json!(1e-3)));
    assert_eq!(py_literal("10"), Some(json!(10)));
    assert_eq!(
        py_literal("true"),
        None,
        "Python's booleans are capitalised"
    );
}

/// An unnamed run's files are kohya's `last`; sdtrain's `project_name` names them instead.
#[test]
fn an_unnamed_run_is_last() {
    assert_eq!(resolve("").unwrap().project_name, "last");
    assert_eq!(
        resolve("project_name = 'mine'").unwrap().project_name,
        "mine"
    );
    assert_eq!(resolve("output_name = 'kt'").unwrap().project_name, "kt");
}

/// A state folder kohya's accelerate saved is named as such, not taken for a model.
#[test]
fn a_kohya_state_folder_is_refused_by_name() {
    let state = tempfile::tempdir().unwrap();
    std::fs::write(state.path().join("optimizer.bin"), b"x").unwrap();
    let e = resolve(&format!(
        "network_module = 'networks.lora'\nresume = '{}'",
        state.path().display()
    ))
    .unwrap_err();
    assert!(e.contains("resume") && e.contains("accelerate"), "{e}");
}

/// kohya's old spelling `caption_extention` wins over `caption_extension`, as its
/// `prepare_dataset_args` copies it over.
#[test]
fn the_old_caption_extension_spelling_wins() {
    let p = resolve("caption_extention = '.txt'\ncaption_extension = '.caption'").unwrap();
    let s = &p.data.dataset_config.as_ref().unwrap().subsets[0];
    match &s.source {
        crate::data::kohya_subsets::SubsetSource::DreamBooth {
            caption_extension, ..
        } => assert_eq!(caption_extension, ".txt"),
        other => panic!("{other:?}"),
    }
}

/// kohya's `save_last_n_*_state` as a count of save points, where one kind of save makes them.
#[test]
fn states_kept_become_a_count_of_save_points() {
    let p = resolve("save_every_n_epochs = 1\nsave_last_n_epochs_state = 3").unwrap();
    assert_eq!(p.saving.total_limit, Some(3));
    // Every 10 steps, the last 30 steps: kohya keeps 20, 30, 40 and 50 at step 50.
    let p = resolve("save_every_n_steps = 10\nsave_last_n_steps_state = 30").unwrap();
    assert_eq!(p.saving.total_limit, Some(4));
    let e =
        resolve("save_every_n_epochs = 1\nsave_every_n_steps = 10\nsave_last_n_epochs_state = 3")
            .unwrap_err();
    assert!(e.contains("save_last_n_epochs_state"), "{e}");
    assert!(resolve("save_last_n_steps_state = 30").is_err());
}
