//! compel's prompt weighting, as EveryDream2's samples apply it, against compel itself
//! (`tests/fixtures/compel_reference.py`: compel 1.1.6 for SD1/SD2, compel 2.1.1 for SDXL):
//! - the parser on 1,224 prompts: hand-written ones, realistic weighted prompts and random
//!   strings of compel's syntax characters; the fragments' texts exactly, their weights to
//!   1e-12, and every prompt compel refuses (or that sdtrain cannot draw) refused;
//! - the conditionings of the tiny fixtures' text encoders: up- and down-weighting (the masked
//!   encodings and their `tan` shares), nesting, truncation inside a down-weighted fragment,
//!   blends with and without normalisation, SD2's penultimate layer, SDXL's two encoders and
//!   pooled embedding.

mod common;

use std::collections::HashMap;

use common::max_abs_diff as max_diff;
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::sample::compel_syntax::{parse, Fragment, WeightedPrompt};
use sdtrain::sample::weighted_prompt;
use serde_json::Value;

fn fragments(v: &Value) -> Vec<(String, f64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|f| (f[0].as_str().unwrap().to_string(), f[1].as_f64().unwrap()))
        .collect()
}

fn same(ours: &[Fragment], theirs: &[(String, f64)]) -> bool {
    ours.len() == theirs.len()
        && ours
            .iter()
            .zip(theirs)
            .all(|(a, (t, w))| a.text == *t && (a.weight - w).abs() < 1e-12)
}

#[test]
fn parser_matches_compel() {
    let cases = common::reference_json("reference/compel_syntax.json");
    let cases = cases.as_array().unwrap();
    assert!(cases.len() > 1000, "{} cases", cases.len());
    let (mut weighted, mut blends, mut refused) = (0, 0, 0);
    let mut wrong = Vec::new();
    for case in cases {
        let prompt = case[0].as_str().unwrap();
        let expected = &case[1];
        let ours = parse(prompt);
        let ok = if let Some(f) = expected.get("fragments") {
            let f = fragments(f);
            weighted += usize::from(f.iter().any(|(_, w)| *w != 1.0));
            matches!(&ours, Ok(WeightedPrompt::Fragments(o)) if same(o, &f))
        } else if let Some(b) = expected.get("blend") {
            blends += 1;
            let prompts: Vec<_> = b["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .map(fragments)
                .collect();
            let weights: Vec<f64> = b["weights"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_f64().unwrap())
                .collect();
            let normalize = b["normalize"].as_bool().unwrap();
            match &ours {
                Ok(WeightedPrompt::Blend {
                    prompts: p,
                    weights: w,
                    normalize: n,
                }) => {
                    *n == normalize
                        && w == &weights
                        && p.len() == prompts.len()
                        && p.iter().zip(&prompts).all(|(a, b)| same(a, b))
                }
                _ => false,
            }
        } else {
            refused += 1;
            ours.is_err()
        };
        if !ok {
            wrong.push(format!("{prompt:?}: compel {expected}, sdtrain {ours:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {}:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    // The corpus exercises each outcome.
    assert!(
        weighted > 300 && blends > 30 && refused > 4,
        "{weighted} {blends} {refused}"
    );
}

#[test]
fn conditionings_match_compel() {
    let meta = common::reference_json("reference/compel_embeddings.json");
    let tensors = common::reference("compel_embeddings");
    let mut models: HashMap<String, StableDiffusion> = HashMap::new();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 12);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let skip = case["clip_skip"].as_u64().unwrap() as usize;
        let sd = models
            .entry(fixture.to_string())
            .or_insert_with(|| common::load_frozen_f32(fixture));
        let ours = weighted_prompt::encode(sd, prompt, skip).unwrap();
        let theirs = &tensors[&format!("{name}.context")];
        let d = max_diff(&ours.context, theirs);
        assert!(d < 2e-5, "{name} ({prompt:?}): context differs by {d}");
        // The weighting moved it: the plain encoding of the prompt is far from compel's.
        let plain = sd.encode_prompts(&[prompt], skip).unwrap();
        assert!(
            max_diff(&plain.context, theirs) > 1e-3,
            "{name}: the plain encoding already matches"
        );
        if let Some(p) = tensors.get(&format!("{name}.pooled")) {
            let d = max_diff(ours.pooled.as_ref().unwrap(), p);
            assert!(d < 2e-5, "{name}: pooled differs by {d}");
        }
    }
}
