//! compel's prompt weighting from the CLI (EveryDream2's samples run every prompt through
//! compel): `sdtrain sample` and a run's prompts file read `word+`, `(words)0.5` and
//! `.blend()`; a prompt without weights draws exactly the plain prompt's image; what compel
//! refuses, or sdtrain's samples cannot draw, is refused up front naming the flag or the file's
//! line. kohya's prompt files, and `--prompt-syntax kohya`, read A1111's `(words:1.3)` as kohya
//! sd-scripts' samples do. The numbers themselves are checked against compel in
//! tests/compel_parity.rs and against kohya in tests/kohya_weighting_parity.rs.

mod common;

use std::path::Path;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

/// `sdtrain sample` of `model` at 32×32 in 2 steps into `dir/out`: `prompt_args` are the prompt
/// and any flags after it.
fn draw(dir: &Path, model: &str, prompt_args: &[&str], out: &str) -> image::RgbImage {
    draw_said(dir, model, prompt_args, out).0
}

/// [`draw`], and what the command printed.
fn draw_said(
    dir: &Path,
    model: &str,
    prompt_args: &[&str],
    out: &str,
) -> (image::RgbImage, String) {
    let mut args = vec!["sample", "--model", model, "--prompt"];
    args.extend_from_slice(prompt_args);
    args.extend([
        "--steps", "2", "--width", "32", "--height", "32", "--out", out, "--cpu",
    ]);
    let o = sdtrain(&args, dir);
    assert!(o.status.success(), "{prompt_args:?}: {}", text(&o));
    (image::open(dir.join(out)).unwrap().to_rgb8(), text(&o))
}

#[test]
fn sample_command_reads_compel_weights() {
    let tmp = tempfile::tempdir().unwrap();
    for fixture in ["tiny-sd15", "tiny-sdxl"] {
        let model = common::fixture(fixture).display().to_string();
        let draw = |prompt: &str, out: &str| {
            draw(
                tmp.path(),
                &model,
                &[prompt, "--negative-prompt", "blurry-"],
                out,
            )
        };
        let plain = draw("a red cat on a boat", "plain.png");
        // Parentheses with weight 1 are grouping only: the same tokens, the same image. (Not
        // for SDXL: its pooled embedding is of the prompt's raw text, parentheses and all, as
        // compel 2 computes it.)
        let grouped = draw("a (red cat)1 on a boat", "grouped.png");
        let sdxl = fixture == "tiny-sdxl";
        assert!((plain == grouped) != sdxl, "{fixture}: weight 1");
        let down = draw("a (red cat)0.3 on a boat", "down.png");
        assert!(plain != down, "{fixture}: down-weighting changed nothing");
        let up = draw("a red++ cat on a boat", "up.png");
        assert!(plain != up, "{fixture}: up-weighting changed nothing");
        let blend = draw(r#"("a red cat", "a boat").blend(0.5, 0.5)"#, "blend.png");
        assert!(plain != blend, "{fixture}: the blend changed nothing");

        for (flag, prompt, needle) in [
            ("--prompt", r#"("a cat", "a dog").and(1, 1)"#, "`.and()`"),
            ("--prompt", "a (cat).swap(dog)", "`.swap()`"),
            (
                "--negative-prompt",
                "withLora(style, 0.5) blurry",
                "withLora",
            ),
        ] {
            let mut args = vec!["sample", "--model", &model, "--cpu"];
            if flag == "--prompt" {
                args.extend(["--prompt", prompt]);
            } else {
                args.extend(["--prompt", "x", flag, prompt]);
            }
            let o = sdtrain(&args, tmp.path());
            let msg = text(&o);
            assert_eq!(o.status.code(), Some(1), "{prompt}: {msg}");
            assert!(
                msg.contains(flag) && msg.contains(needle),
                "{prompt}: {msg}"
            );
        }
    }
}

#[test]
fn a_prompts_file_with_compel_operators_sdtrain_cannot_draw_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, prompts, needles) in [
        (
            "p.txt",
            "a (red cat)1.3\n(cat).swap(dog) on a mat\n",
            &["p.txt: line 2: prompt `(cat).swap(dog) on a mat`: compel's `.swap()`"][..],
        ),
        (
            "n.json",
            r#"{"samples": [{"prompt": "a cat", "negative_prompt": "useLora(x) ugly"}]}"#,
            &["n.json: `samples[0]`: negative prompt `useLora(x) ugly`", "`--lora`"][..],
        ),
        (
            "k.txt",
            "a cat --n (ugly:1..2)\n",
            &["k.txt: line 1: negative prompt `(ugly:1..2)`: `:1..2)`: the weight is not a number"][..],
        ),
        (
            "q.json",
            r#"{"samples": [{"prompt": "a cat"}, {"prompt": "(a, b).blend(0.5)"}]}"#,
            &["q.json: `samples[1]`: prompt `(a, b).blend(0.5)`: `.blend()` has 2 prompts and 1 weights"][..],
        ),
    ] {
        let msg = common::cli::refused_with_prompts(tmp.path(), name, prompts);
        assert!(needles.iter().all(|n| msg.contains(n)), "{name}: {msg}");
    }
}

/// `--prompt-syntax kohya` reads A1111's weights: `(red cat:1.3)` weighs the words, where
/// compel reads `red cat:1 . 3` as text; a weight Python cannot read is refused. (On the tiny
/// SD1.5 with a non-zero final LayerNorm bias, as real CLIP has: kohya's mean-keeping rescale
/// divides by the zero-bias fixture's ~1e-9 mean.)
#[test]
fn sample_command_reads_a1111_weights_as_kohya() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::with_text_ln_bias("tiny-sd15", tmp.path());
    let model = model.display().to_string();
    let draw = |syntax: &str, prompt: &str, out: &str| {
        draw(
            tmp.path(),
            &model,
            &[prompt, "--prompt-syntax", syntax],
            out,
        )
    };
    let kohya = draw("kohya", "a (red cat:1.3) on a boat", "k.png");
    // Without --prompt-syntax, A1111's `(words:1.3)` picks kohya's reading, and says so.
    let auto = draw_said(tmp.path(), &model, &["a (red cat:1.3) on a boat"], "a.png");
    assert!(
        auto.0 == kohya && auto.1.contains("prompt weights: A1111's"),
        "{}",
        auto.1
    );
    let compel = draw("compel", "a (red cat:1.3) on a boat", "c.png");
    let plain = draw("kohya", "a red cat on a boat", "p.png");
    let compel_plain = draw("compel", "a red cat on a boat", "cp.png");
    assert!(
        kohya != compel && kohya != plain,
        "the weight changed nothing"
    );
    // Without weights both read the prompt as diffusers does (SD1.5 pads with EOS either way).
    assert!(
        plain == compel_plain,
        "plain prompts differ between the syntaxes"
    );
    // Past 75 tokens kohya reads on (the context grows to 2 chunks); compel cuts the prompt.
    let head = (0..14)
        .map(|i| format!("tag{i} word{i}"))
        .collect::<Vec<_>>();
    let long = |tail: &str| format!("{}, {tail}", head.join(", "));
    let (k1, k2) = (
        draw("kohya", &long("a red cat"), "k1.png"),
        draw("kohya", &long("a blue dog"), "k2.png"),
    );
    let (c1, c2) = (
        draw("compel", &long("a red cat"), "c1.png"),
        draw("compel", &long("a blue dog"), "c2.png"),
    );
    assert!(k1 != k2, "kohya's reading cut the prompt at 75 tokens");
    assert!(c1 == c2, "compel's reading went past 75 tokens");
    let args = [
        "sample",
        "--model",
        &model,
        "--prompt",
        "a (cat:1..2)",
        "--prompt-syntax",
        "kohya",
        "--cpu",
    ];
    let o = sdtrain(&args, tmp.path());
    let msg = text(&o);
    assert_eq!(o.status.code(), Some(1), "{msg}");
    assert!(
        msg.contains("--prompt `a (cat:1..2)`") && msg.contains("A1111"),
        "{msg}"
    );
}

/// A prompts file with kohya's options (or comments, or A1111 weights) is kohya's: its samples
/// are weighted as kohya weights them, and the `.txt` beside each says so; an EveryDream2 file
/// is compel's.
#[test]
fn kohya_prompt_files_are_weighted_as_kohya() {
    for (file, prompts, kohya) in [
        ("k.txt", "a (red cat:1.3) --n (blurry:1.2) --s 2\n", true),
        ("a.txt", "a (red cat:1.3)\n", true),
        ("e.txt", "a (red cat)1.3\n", false),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(file);
        std::fs::write(&path, prompts).unwrap();
        // kohya's weighting needs a non-zero final LayerNorm bias (see above).
        let model = common::with_text_ln_bias("tiny-sd15", tmp.path());
        let cfg = write_config(
            tmp.path(),
            "tiny-sd15",
            &demo_data(),
            serde_json::json!({"model": model, "sample_prompts": path, "max_steps": 1,
                "sample_steps": 1}),
        );
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{file}: {}", text(&out));
        let samples = run_folder(tmp.path()).join("samples");
        let txt: Vec<_> = std::fs::read_dir(&samples)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        assert!(!txt.is_empty(), "{file}: no sample .txt");
        for t in txt {
            let said = std::fs::read_to_string(&t).unwrap();
            assert_eq!(said.contains("A1111"), kohya, "{file}: {said}");
        }
    }
}
