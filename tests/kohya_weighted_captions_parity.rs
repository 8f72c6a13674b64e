//! kohya's `weighted_captions` in training against kohya's own tokenizing and encoding
//! (tests/fixtures/kohya_weighted_captions_reference.py → reference/kohya_weighted_captions.json):
//! tiny-sd15's context for captions with A1111 emphasis, at 75 tokens and at
//! `max_token_length` 150.

mod common;

use candle_core::DType;
use sdtrain::model::pipeline::StableDiffusion;
use sdtrain::train::weighted_captions::encode;

fn tiny(name: &str) -> StableDiffusion {
    common::load_frozen_f32(name)
}

fn values(t: &candle_core::Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Each caption's context is kohya's: its tokens' places times their weights, the chunks of a
/// 150-token caption merged as kohya merges them. Catches a weight on the wrong place (one
/// off for BOS), the brackets tokenized as text, or a mean rescaling (the sampling rule).
#[test]
fn weighted_captions_encode_as_kohya_trains() {
    let r = common::reference_json("reference/kohya_weighted_captions.json");
    let sd = tiny("tiny-sd15");
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 7);
    for case in cases {
        let caption = case["caption"].as_str().unwrap();
        let chunks = case["max_token_length"]
            .as_u64()
            .map_or(1, |n| n as usize / 75);
        let got = encode(&sd, &[caption], 0, chunks, true).unwrap();
        let shape: Vec<usize> = common::dims(&case["shape"]);
        assert_eq!(got.context.dims(), shape.as_slice(), "{caption:?}");
        let want: Vec<f64> = case["context"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let worst = values(&got.context)
            .iter()
            .zip(&want)
            .map(|(g, w)| (*g as f64 - w).abs() / w.abs().max(1.0))
            .fold(0.0, f64::max);
        assert!(worst < 1e-4, "{caption:?} ({chunks} chunks): worst {worst}");
    }
}

/// A caption without emphasis encodes exactly as without `weighted_captions`, at one and at two
/// chunks: the token rows are the unweighted path's.
#[test]
fn a_caption_without_emphasis_is_unchanged() {
    let sd = tiny("tiny-sd15");
    for chunks in [1, 2] {
        let captions = ["plain words only", "a cat, on a mat"];
        let plain = encode(&sd, &captions, 0, chunks, false).unwrap();
        let weighted = encode(&sd, &captions, 0, chunks, true).unwrap();
        assert_eq!(
            values(&plain.context),
            values(&weighted.context),
            "{chunks}"
        );
    }
}

/// SDXL (kohya's `strategy_sdxl.encode_tokens_with_weights`): both encoders' places of a
/// weighted token scale by its weight, every other place and the pooled embedding stay as
/// without emphasis. Catches the second encoder left unweighted, the pooled embedding
/// weighted, or a place off by one.
#[test]
fn sdxl_weights_both_encoders_and_not_the_pooled_embedding() {
    let sd = tiny("tiny-sdxl");
    for chunks in [1, 2] {
        let plain = encode(&sd, &["a red cat"], 0, chunks, false).unwrap();
        let weighted = encode(&sd, &["a (red:1.5) cat"], 0, chunks, true).unwrap();
        assert_eq!(
            values(plain.pooled.as_ref().unwrap()),
            values(weighted.pooled.as_ref().unwrap())
        );
        let (_, places, width) = plain.context.dims3().unwrap();
        let (p, w) = (values(&plain.context), values(&weighted.context));
        for place in 0..places {
            for d in 0..width {
                let i = place * width + d;
                // "a" is place 1, "red" place 2 (after BOS).
                let want = if place == 2 { p[i] * 1.5 } else { p[i] };
                assert!(
                    (w[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{chunks} chunks, place {place}, dim {d}: {} vs {want}",
                    w[i]
                );
            }
        }
    }
}
