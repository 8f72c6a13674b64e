//! kohya's `weighted_captions`: a caption's A1111 emphasis (`(words:1.2)`, `[words]`) weighs its
//! tokens' encodings in training, as kohya's `tokenize_with_weights` and
//! `encode_tokens_with_weights` do (`library/strategy_base.py`, `strategy_sd.py`,
//! `strategy_sdxl.py`): each piece is tokenized on its own, the brackets are dropped from the
//! text, and each token's place in the context is multiplied by its weight (BOS, EOS and
//! padding by 1, no rescaling; SDXL's pooled embedding unweighted). Every caption's emphasis is
//! checked before the run starts: kohya stops mid-run on a weight that is not a number.

use std::path::Path;

use crate::model::family::ModelFamily;
use crate::model::pipeline::{StableDiffusion, TextConditioning};
use crate::sample::kohya_weighting::weighted_tokens;

/// The conditioning of `prompts` (`chunks` 75-token chunks), weighted by their emphasis when
/// `weighted`, else [`StableDiffusion::encode_prompts_long`].
pub fn encode(
    sd: &StableDiffusion,
    prompts: &[&str],
    clip_skip: usize,
    chunks: usize,
    weighted: bool,
) -> candle_core::Result<TextConditioning> {
    if !weighted {
        return sd.encode_prompts_long(prompts, clip_skip, chunks);
    }
    sd.require_text_encoders()?;
    let encoders = match sd.family() {
        ModelFamily::Sdxl => 2,
        ModelFamily::Sd1 | ModelFamily::Sd2 => 1,
    };
    let mut per_encoder = Vec::with_capacity(encoders);
    for te in sd.text_encoders.iter().take(encoders) {
        let room = (te.tokenizer.max_length() - 2) * chunks.max(1);
        let tokens = prompts
            .iter()
            .map(|p| weighted_tokens(&te.tokenizer, p, room))
            .collect::<candle_core::Result<Vec<_>>>()?;
        per_encoder.push(tokens);
    }
    sd.encode_weighted_long(&per_encoder, clip_skip, chunks)
}

/// A caption whose emphasis does not read, naming its image.
#[derive(Debug, thiserror::Error)]
#[error("weighted_captions: the caption of {} does not read as A1111's emphasis: {why}", path.display())]
pub struct CaptionWeightError {
    pub path: std::path::PathBuf,
    pub why: String,
}

/// Every caption's emphasis reads (kohya's parser raises on a weight that is not a number).
pub fn check_captions<'a>(
    captions: impl IntoIterator<Item = (&'a Path, &'a str)>,
) -> Result<(), CaptionWeightError> {
    for (path, caption) in captions {
        if let Err(why) = crate::sample::a1111_syntax::parse(caption) {
            return Err(CaptionWeightError {
                path: path.to_path_buf(),
                why,
            });
        }
    }
    Ok(())
}
