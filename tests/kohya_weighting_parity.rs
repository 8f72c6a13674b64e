//! kohya sd-scripts' sample prompt weighting against kohya's own code
//! (`tests/fixtures/kohya_prompt_reference.py`):
//! - A1111's emphasis parser on 409 prompts (kohya's docstring examples and random strings of
//!   its syntax): the pieces exactly, their weights to 1e-12, and the prompts kohya stops on;
//! - the conditionings of the tiny fixtures' text encoders for kohya's samples: SD1/SD2 through
//!   `get_weighted_text_embeddings` (one, two and three 75-token chunks, the prompt and the
//!   negative prompt padded to the same length, SD2's chunk ends, clip skip, the mean kept),
//!   SDXL through `encode_tokens_with_weights` (weights without rescaling, pooled unweighted).

mod common;

use std::collections::HashMap;

use candle_core::Tensor;
use common::max_abs_diff as max_diff;
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::sample::a1111_syntax::parse;
use sdtrain::sample::prompts::PromptSyntax;
use sdtrain::sample::PromptConds;

#[test]
fn a1111_parser_matches_kohya() {
    let cases = common::reference_json("reference/kohya_a1111_syntax.json");
    let cases = cases.as_array().unwrap();
    assert!(cases.len() > 400);
    let mut wrong = Vec::new();
    let mut weighted = 0;
    for case in cases {
        let prompt = case[0].as_str().unwrap();
        let ours = parse(prompt);
        let ok = match case[1].as_array() {
            None => ours.is_err(),
            Some(pieces) => {
                weighted += usize::from(pieces.iter().any(|p| p[1].as_f64() != Some(1.0)));
                matches!(&ours, Ok(o) if o.len() == pieces.len()
                && o.iter().zip(pieces).all(|((t, w), p)| {
                    p[0].as_str() == Some(t.as_str())
                        && (w - p[1].as_f64().unwrap()).abs() < 1e-12
                }))
            }
        };
        if !ok {
            wrong.push(format!("{prompt:?}: kohya {}, sdtrain {ours:?}", case[1]));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {}:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    assert!(weighted > 200, "{weighted}");
}

/// The fixture with its text encoder's final LayerNorm given the reference's bias
/// ([`common::with_text_ln_bias`]).
fn load(fixture: &str, dir: &std::path::Path) -> StableDiffusion {
    common::load_frozen_f32_at(&common::with_text_ln_bias(fixture, dir))
}

#[test]
fn conditionings_match_kohya() {
    let meta = common::reference_json("reference/kohya_prompts.json");
    let tensors = common::reference("kohya_prompts");
    let tmp = tempfile::tempdir().unwrap();
    let mut models: HashMap<String, StableDiffusion> = HashMap::new();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let negative = case["negative"].as_str().unwrap();
        let guided = case["guided"].as_bool().unwrap();
        let skip = case["clip_skip"].as_u64().unwrap() as usize;
        let sd = models
            .entry(fixture.to_string())
            .or_insert_with(|| load(fixture, tmp.path()));
        let ours = PromptConds::encode(
            sd,
            prompt,
            negative,
            guided,
            skip,
            false,
            PromptSyntax::Kohya,
        )
        .unwrap();
        let check = |what: &str, a: &Tensor| {
            let theirs = &tensors[&format!("{name}.{what}")];
            let d = max_diff(a, theirs);
            assert!(d < 2e-5, "{name} {what} ({prompt:?}): differs by {d}");
        };
        check("cond", &ours.cond.context);
        match (guided, &ours.uncond) {
            (true, Some(u)) => check("uncond", &u.context),
            (false, None) => {}
            _ => panic!(
                "{name}: guided {guided} but uncond {:?}",
                ours.uncond.is_some()
            ),
        }
        if fixture == "tiny-sdxl" {
            check("cond_pooled", ours.cond.pooled.as_ref().unwrap());
            check(
                "uncond_pooled",
                ours.uncond.as_ref().unwrap().pooled.as_ref().unwrap(),
            );
        }
    }
}

/// kohya's training on long captions (`max_token_length` 150 and 225): batches of captions in
/// 75-token chunks against `SdTextEncodingStrategy.encode_tokens` and SDXL's
/// `_get_hidden_states_sdxl` (a short caption beside a long one, a caption cut at 225 tokens,
/// SD2's and SDXL's second tokenizer padding with `!`, clip skip, SDXL's first-chunk pooled).
#[test]
fn long_captions_match_kohya() {
    let meta = common::reference_json("reference/kohya_prompts.json");
    let tensors = common::reference("kohya_prompts");
    let cases = meta["captions"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    let mut models: HashMap<String, StableDiffusion> = HashMap::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let chunks = case["chunks"].as_u64().unwrap() as usize;
        let skip = case["clip_skip"].as_u64().unwrap() as usize;
        let captions: Vec<&str> = case["captions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        let sd = models
            .entry(fixture.to_string())
            .or_insert_with(|| common::load_frozen_f32(fixture));
        let ours = sd.encode_prompts_long(&captions, skip, chunks).unwrap();
        let d = max_diff(&ours.context, &tensors[&format!("{name}.context")]);
        assert!(d < 2e-5, "{name}: context differs by {d}");
        if let Some(p) = tensors.get(&format!("{name}.pooled")) {
            let d = max_diff(ours.pooled.as_ref().unwrap(), p);
            assert!(d < 2e-5, "{name}: pooled differs by {d}");
        }
    }
}
