//! `mode: "textual_inversion"` from the CLI: the embedding file a run saves (kohya's keys, the
//! token in its header), that only the new vectors train, resume, `embedding.init_from`,
//! kohya's caption templates, SDXL's two vector sets, checkpointing, and the errors that name
//! their key. The numbers of one step are checked against kohya in
//! tests/textual_inversion_parity.rs.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

/// The demo images with captions that name `mytok` (all but the last two).
fn captioned_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for (i, entry) in std::fs::read_dir(demo_data()).unwrap().enumerate() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "png") {
            let stem = p.file_stem().unwrap().to_string_lossy().to_string();
            std::fs::copy(&p, data.join(format!("{stem}.png"))).unwrap();
            let caption = match i % 4 {
                3 => format!("a {stem}"),
                _ => format!("a photo of mytok, {stem}"),
            };
            std::fs::write(data.join(format!("{stem}.txt")), caption).unwrap();
        }
    }
    data
}

fn ti_config(dir: &Path, fixture: &str, data: &Path, extra: serde_json::Value) -> PathBuf {
    let mut cfg = serde_json::json!({
        "mode": "textual_inversion",
        "embedding": {"token_string": "mytok", "init_word": "green dog",
                      "num_vectors_per_token": 3},
        "lr": 5e-3,
        "max_steps": 4,
    });
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    write_config(dir, fixture, data, cfg)
}

/// A file's tensors by name: f32 values and shape.
type Tensors = HashMap<String, (Vec<f32>, Vec<usize>)>;

/// The file's tensors and header.
fn read_file(path: &Path) -> (Tensors, HashMap<String, String>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (v, view.shape().to_vec()))
        })
        .collect();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    (tensors, header.metadata().clone().unwrap_or_default())
}

/// A folder with [`captioned_data`] and a tiny-sd15 config of `extra` over [`ti_config`]: the
/// folder and the config.
fn sd15_config(extra: serde_json::Value) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let data = captioned_data(dir.path());
    let cfg = ti_config(dir.path(), "tiny-sd15", &data, extra);
    (dir, cfg)
}

/// A run of `fixture` on `data` with `extra` over [`ti_config`], in a folder of its own; the
/// saved file's tensors.
fn run_file(fixture: &str, data: &Path, extra: serde_json::Value) -> Tensors {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ti_config(dir.path(), fixture, data, extra);
    run_ok(dir.path(), &cfg, &[]);
    read_file(&run_folder(dir.path()).join("sdtrain.safetensors")).0
}

/// A one-step run at a learning rate too small to move anything: the file holds the vectors the
/// run started from.
fn start_of(fixture: &str, data: &Path, embedding: Option<serde_json::Value>) -> Tensors {
    let mut extra = serde_json::json!({"max_steps": 1, "lr": 1e-30});
    if let Some(e) = embedding {
        extra["embedding"] = e;
    }
    run_file(fixture, data, extra)
}

/// Runs `cfg` in `dir`; the run folder.
fn run_in(dir: &Path, cfg: &Path) -> PathBuf {
    run_ok(dir, cfg, &[]);
    run_folder(dir)
}

fn run_ok(dir: &Path, cfg: &Path, extra: &[&str]) -> String {
    let mut args = vec!["--config", cfg.to_str().unwrap(), "--cpu"];
    args.extend_from_slice(extra);
    let out = sdtrain(&args, dir);
    assert!(out.status.success(), "{}", text(&out));
    text(&out)
}

/// A run saves `emb_params` `[3, 32]` in fp32 with the token in the header; the vectors moved
/// from their start; and a run continued from the file with a zero learning rate saves it
/// unchanged (`init_from` reads the vectors back exactly). Catches vectors that never train
/// (detached, or left out of the optimizer) and a file of the wrong layout.
#[test]
fn an_sd15_run_trains_the_vectors_and_saves_kohyas_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = captioned_data(dir.path());
    let cfg = ti_config(dir.path(), "tiny-sd15", &data, serde_json::json!({}));
    let log = run_ok(dir.path(), &cfg, &[]);
    assert!(log.contains("`mytok` stands for 3 new token(s)"), "{log}");
    assert!(log.contains("captions do not name `mytok`"), "{log}");
    let run = run_folder(dir.path());
    let file = run.join("sdtrain.safetensors");
    let (tensors, header) = read_file(&file);
    assert_eq!(tensors.keys().collect::<Vec<_>>(), ["emb_params"]);
    let (trained, shape) = &tensors["emb_params"];
    assert_eq!(shape, &[3, 32]);
    assert_eq!(header["token_string"], "mytok");
    assert_eq!(header["num_vectors_per_token"], "3");
    assert_eq!(step_losses(&run).len(), 4);
    let out = sdtrain(&["inspect", "--model", file.to_str().unwrap()], dir.path());
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("textual-inversion embedding")
            && report.contains("mytok (3 vector(s))")
            && report.contains("emb_params [3, 32] F32"),
        "{report}"
    );

    // Zero steps' worth of change: lr 0 from the trained file keeps it exactly.
    let cont = start_of(
        "tiny-sd15",
        &data,
        Some(
            serde_json::json!({"token_string": "mytok", "num_vectors_per_token": 3,
                                "init_from": file}),
        ),
    );
    assert_eq!(
        &cont["emb_params"].0, trained,
        "init_from reads the vectors exactly"
    );

    // And the starting vectors (lr 0 from the init word) differ from the trained ones.
    let init = start_of("tiny-sd15", &data, None);
    let moved = init["emb_params"]
        .0
        .iter()
        .zip(trained)
        .filter(|(a, b)| a != b)
        .count();
    assert!(moved > 80, "only {moved} of 96 values trained");
}

/// Resumed from its step-2 save point (continuing in its run folder), a run ends with the vectors
/// of the run that went straight through, bit for bit on the CPU: the save point holds the
/// vectors and their optimizer state.
#[test]
fn a_resumed_run_ends_with_the_same_vectors() {
    let (dir, cfg) = sd15_config(serde_json::json!({"save_every_n_steps": 2}));
    let run = run_in(dir.path(), &cfg);
    let file = run.join("sdtrain.safetensors");
    let (whole, _) = read_file(&file);
    let losses = step_losses(&run);
    std::fs::remove_file(&file).unwrap();
    let resume = format!("resume_ckpt={}", run.join("state-step-000002").display());
    let log = run_ok(dir.path(), &cfg, &["--set", &resume]);
    assert!(log.contains("resum"), "{log}");
    let (end, _) = read_file(&file);
    assert_eq!(end["emb_params"].0, whole["emb_params"].0);
    // The log is cut back to the save point and continued.
    assert_eq!(step_losses(&run), losses);
}

/// SDXL: `clip_l` and `clip_g`, both trained; with gradient checkpointing the run is the same to
/// f32 rounding (the UNet's recomputed blocks pass the gradient on to the text encoders).
#[test]
fn sdxl_saves_both_vector_sets_and_checkpointing_changes_nothing() {
    let plain = tempfile::tempdir().unwrap();
    let data = captioned_data(plain.path());
    let a = run_file("tiny-sdxl", &data, serde_json::json!({"max_steps": 2}));
    let mut keys: Vec<&String> = a.keys().collect();
    keys.sort();
    assert_eq!(keys, ["clip_g", "clip_l"]);
    assert_eq!(a["clip_l"].1, [3, 32]);
    assert_eq!(a["clip_g"].1, [3, 32]);

    let b = run_file(
        "tiny-sdxl",
        &data,
        serde_json::json!({"max_steps": 2, "gradient_checkpointing": true}),
    );
    for k in ["clip_l", "clip_g"] {
        let worst = a[k]
            .0
            .iter()
            .zip(&b[k].0)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-6,
            "{k}: checkpointing changed a value by {worst}"
        );
    }

    let start = start_of("tiny-sdxl", &data, None);
    for k in ["clip_l", "clip_g"] {
        assert_ne!(start[k].0, a[k].0, "{k} did not train");
    }
}

/// Captions that never name the token stop the run with what to do; with kohya's object
/// template the same images train (every caption is a template naming the token).
#[test]
fn captions_without_the_token_are_refused_unless_a_template_captions_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ti_config(dir.path(), "tiny-sd15", &demo_data(), serde_json::json!({}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir.path());
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("no training caption names `mytok`") && log.contains("embedding.template"),
        "{log}"
    );
    let tdir = tempfile::tempdir().unwrap();
    let cfg = ti_config(
        tdir.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"max_steps": 2, "embedding": {"token_string": "mytok",
            "template": "object"}}),
    );
    run_ok(tdir.path(), &cfg, &[]);
    let (t, _) = read_file(&run_folder(tdir.path()).join("sdtrain.safetensors"));
    assert_eq!(t["emb_params"].1, [1, 32]);
}

/// Config errors exit 2 and name the key.
#[test]
fn config_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let data = demo_data();
    for (extra, key) in [
        (
            serde_json::json!({"embedding": null}),
            "embedding.token_string",
        ),
        (serde_json::json!({"mode": "full"}), "embedding"),
        (serde_json::json!({"adapter": {"rank": 4}}), "adapter"),
        (
            serde_json::json!({"disable_textenc_training": true}),
            "disable_textenc_training",
        ),
        (serde_json::json!({"weight_dtype": "bf16"}), "weight_dtype"),
        (
            serde_json::json!({"embedding": {"token_string": "mytok", "init_word": "dog",
                "init_from": "missing.safetensors"}}),
            "embedding.init_from",
        ),
    ] {
        let cfg = ti_config(dir.path(), "tiny-sd15", &data, extra.clone());
        let out = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--dry-run"],
            dir.path(),
        );
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{extra}: {log}");
        assert!(log.contains(key), "{extra}: {log}");
    }
}

/// A token the vocabulary already has would never reach the new vectors: refused, naming it.
#[test]
fn a_token_already_in_the_vocabulary_is_refused() {
    let (dir, cfg) = sd15_config(serde_json::json!({"embedding": {"token_string": "dog"}}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir.path());
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("embedding.token_string") && log.contains("already in the vocabulary"),
        "{log}"
    );
}

/// `sdtrain sample` on the tiny SD1.5 fixture: `prompt` with `extra` arguments; the image.
fn draw(dir: &Path, out: &str, prompt: &str, extra: &[&str]) -> (String, image::RgbImage) {
    let model = common::fixture("tiny-sd15").display().to_string();
    let mut args = vec![
        "sample", "--model", &model, "--prompt", prompt, "--steps", "3", "--width", "32",
        "--height", "32", "--seed", "7", "--cpu", "--out", out,
    ];
    args.extend_from_slice(extra);
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{extra:?}: {}", text(&o));
    (text(&o), image::open(dir.join(out)).unwrap().to_rgb8())
}

/// One step of `sample` on the fixture `model` with the embedding file `embedding`.
fn sample_with_embedding(
    dir: &Path,
    model: &str,
    prompt: &str,
    embedding: &str,
) -> std::process::Output {
    let model = common::fixture(model).display().to_string();
    let args = [
        "sample",
        "--model",
        &model,
        "--prompt",
        prompt,
        "--steps",
        "1",
        "--width",
        "32",
        "--height",
        "32",
        "--cpu",
        "--embedding",
        embedding,
    ];
    sdtrain(&args, dir)
}

/// An embedding whose one vector is the word "dog"'s row (a run at a learning rate too small to
/// move it) draws, under its token, exactly what "dog" draws; the same prompt without the
/// embedding draws something else. The token is the one the file records, or the one given as
/// `TOKEN=FILE`. Catches an embedding that does not reach the prompt's encoding.
#[test]
fn sampling_with_an_embedding_of_a_words_vector_draws_what_the_word_draws() {
    let (dir, cfg) = sd15_config(
        serde_json::json!({"max_steps": 1, "lr": 1e-30, "embedding": {
            "token_string": "mytok", "init_word": "dog"}}),
    );
    run_ok(dir.path(), &cfg, &[]);
    let file = run_folder(dir.path()).join("sdtrain.safetensors");
    let file = file.to_str().unwrap();
    let (_, dog) = draw(dir.path(), "dog.png", "a photo of dog", &[]);
    let (log, tok) = draw(
        dir.path(),
        "tok.png",
        "a photo of mytok",
        &["--embedding", file],
    );
    assert!(log.contains("`mytok` stands for 1 vector(s)"), "{log}");
    assert_eq!(tok, dog);
    let named = format!("<other-tok>={file}");
    let (_, other) = draw(
        dir.path(),
        "other.png",
        "a photo of <other-tok>",
        &["--embedding", &named],
    );
    assert_eq!(other, dog);
    let (_, plain) = draw(dir.path(), "plain.png", "a photo of mytok", &[]);
    assert_ne!(plain, dog);
    // An SD1.5 embedding for SDXL is refused, naming the file.
    let o = sample_with_embedding(dir.path(), "tiny-sdxl", "mytok", file);
    let log = text(&o);
    assert!(!o.status.success(), "{log}");
    assert!(
        log.contains("SD1/SD2 embedding") && log.contains(file),
        "{log}"
    );
}

/// Pivotal tuning: `mode: "lora"` with an `embedding` trains the LoRA and the token's vectors
/// together and bundles the vectors in the LoRA file as OneTrainer does
/// (`bundle_emb.mytok.clip_l`); `sample --lora` adds the bundled token, so with the vector at
/// "dog"'s row "a photo of mytok" draws what "a photo of dog" draws under the same LoRA;
/// `inspect` lists it; and `embedding.init_from` continues from the LoRA file.
#[test]
fn a_lora_with_an_embedding_bundles_it_and_sample_uses_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = captioned_data(dir.path());
    let lora = serde_json::json!({"mode": "lora", "adapter": {"rank": 4,
        "train_text_encoder": true, "save_dtype": "fp32"}});
    let mut extra = lora.clone();
    extra["max_steps"] = 1.into();
    extra["lr"] = 1e-30.into();
    extra["embedding"] = serde_json::json!({"token_string": "mytok", "init_word": "dog"});
    let cfg = ti_config(dir.path(), "tiny-sd15", &data, extra);
    let log = run_ok(dir.path(), &cfg, &[]);
    assert!(log.contains("`mytok` stands for 1 new token(s)"), "{log}");
    let file = run_folder(dir.path()).join("sdtrain.safetensors");
    let (tensors, _) = read_file(&file);
    assert_eq!(tensors["bundle_emb.mytok.clip_l"].1, [1, 32]);
    assert!(
        tensors.keys().any(|k| k.starts_with("lora_te_")),
        "the LoRA is there too"
    );
    let f = file.to_str().unwrap();
    let (log, tok) = draw(dir.path(), "tok.png", "a photo of mytok", &["--lora", f]);
    assert!(log.contains("`mytok` stands for 1 vector(s)"), "{log}");
    let (_, dog) = draw(dir.path(), "dog.png", "a photo of dog", &["--lora", f]);
    assert_eq!(tok, dog);
    let out = sdtrain(&["inspect", "--model", f], dir.path());
    assert!(text(&out).contains("`mytok` (bundled"), "{}", text(&out));

    // Trained at a real rate, both parts move; a run started from the file's bundle keeps it.
    let trained = tempfile::tempdir().unwrap();
    let mut extra = lora.clone();
    extra["embedding"] = serde_json::json!({"token_string": "mytok", "init_word": "dog"});
    let cfg = ti_config(trained.path(), "tiny-sd15", &data, extra);
    run_ok(trained.path(), &cfg, &[]);
    let file = run_folder(trained.path()).join("sdtrain.safetensors");
    let (moved, _) = read_file(&file);
    let key = "bundle_emb.mytok.clip_l";
    assert_ne!(moved[key].0, tensors[key].0, "the vector trained");
    let again = tempfile::tempdir().unwrap();
    let mut extra = lora;
    extra["max_steps"] = 1.into();
    extra["lr"] = 1e-30.into();
    extra["embedding"] = serde_json::json!({"token_string": "mytok", "init_from": file});
    let cfg = ti_config(again.path(), "tiny-sd15", &data, extra);
    run_ok(again.path(), &cfg, &[]);
    let (cont, _) = read_file(&run_folder(again.path()).join("sdtrain.safetensors"));
    assert_eq!(cont[key].0, moved[key].0);
}

/// Embeddings in PyTorch's format (tests/fixtures/make_torch_embeddings.py): A1111's `.pt`
/// (`string_to_param`, the token its file name) and diffusers' `learned_embeds.bin` (one tensor
/// named for its token), each holding "dog"'s row, draw what "dog" draws; `inspect` describes
/// them; the layouts sdtrain does not read (the original repository's ParameterDict, torch's
/// legacy format) are refused, naming the file. Catches the A1111 dict not looked into, the
/// diffusers key not taken as the token, and the vectors read in the wrong dtype or shape.
#[test]
fn torch_pickled_embeddings_load_as_a1111_and_diffusers_do() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| {
        common::fixture("torch-embeddings")
            .join(name)
            .display()
            .to_string()
    };
    let (_, dog) = draw(dir.path(), "dog.png", "a photo of dog", &[]);
    for (name, token) in [
        ("dogtok.pt", "dogtok"),
        ("learned_embeds.bin", "<dog-tok>"),
        // The original textual-inversion code's layout: `string_to_param` a ParameterDict module.
        ("parameter_dict.pt", "parameter_dict"),
        // torch's legacy (pre-1.6) format.
        ("legacy.pt", "legacy"),
    ] {
        let (log, image) = draw(
            dir.path(),
            &format!("{name}.png"),
            &format!("a photo of {token}"),
            &["--embedding", &file(name)],
        );
        assert!(
            log.contains(&format!("`{token}` stands for 1 vector(s)")),
            "{log}"
        );
        assert_eq!(image, dog, "{name}");
    }

    let o = sdtrain(&["inspect", "--model", &file("dogtok.pt")], dir.path());
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("string_to_param.* [1, 32] F32") && log.contains("dogtok (1 vector(s))"),
        "{log}"
    );
}
