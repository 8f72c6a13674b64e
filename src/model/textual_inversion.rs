//! Textual inversion in a loaded pipeline: an embedding's tokens join every text encoder's
//! tokenizer, and its vectors become rows after that encoder's token embedding
//! ([`crate::nn::Embedding::add_rows`]). A prompt that names the token is then encoded with them,
//! in training and sampling alike.
//!
//! Token names are kohya sd-scripts' (`train_textual_inversion.py`): an embedding of `n` vectors
//! under `tok` adds `tok`, `tok1`, … `tok{n-1}`, and `tok` in a prompt stands for all of them.

use candle_core::{DType, Device, Tensor};

use super::clip::TokenizerError;
use super::pipeline::{StableDiffusion, TextEncoder};

#[derive(Debug, thiserror::Error)]
pub enum TextualInversionError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("init_word {word:?} has no tokens for text encoder {encoder}")]
    EmptyInitWord { word: String, encoder: usize },
    #[error(
        "{encoders} text encoder(s) but vectors for {given}; an embedding needs one set per \
         text encoder"
    )]
    EncoderCount { encoders: usize, given: usize },
    #[error(
        "text encoder {encoder}: its tokenizer gives the next token id {next}, but its token \
         embedding has {rows} rows; the tokenizer's added tokens do not match the model"
    )]
    IdMismatch {
        encoder: usize,
        next: usize,
        rows: usize,
    },
    #[error("text encoder {encoder}: {vectors} vectors of width {width}, but its embedding is {dim} wide")]
    Width {
        encoder: usize,
        vectors: usize,
        width: usize,
        dim: usize,
    },
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// kohya's token strings for `n` vectors: `tok`, `tok1`, … `tok{n-1}`.
pub fn token_strings(token: &str, n: usize) -> Vec<String> {
    std::iter::once(token.to_string())
        .chain((1..n).map(|i| format!("{token}{i}")))
        .collect()
}

/// The starting vectors `init_word` gives text encoder `index`: the embedding rows of its tokens,
/// repeated or cut to `n` (kohya: vector `i` is the row of token `i % len`), `[n, dim]` in f32
/// on `device`.
pub fn init_word_vectors(
    te: &TextEncoder,
    index: usize,
    word: &str,
    n: usize,
    device: &Device,
) -> Result<Tensor, TextualInversionError> {
    let ids = te.tokenizer.tokenize(word)?;
    if ids.is_empty() {
        return Err(TextualInversionError::EmptyInitWord {
            word: word.to_string(),
            encoder: index,
        });
    }
    let picked: Vec<u32> = (0..n).map(|i| ids[i % ids.len()]).collect();
    let emb = &te.model.token_embedding;
    let ids = Tensor::from_vec(picked, n, emb.weight.device())?;
    Ok(emb
        .forward(&ids)?
        .to_dtype(DType::F32)?
        .to_device(device)?
        .detach())
}

/// Adds the embedding `vectors` (one `[n, dim]` tensor per text encoder, in the pipeline's
/// order) under `token`, and returns each encoder's new ids. The tensors become the rows as they
/// are, so a `Var`'s tensor trains. Nothing is changed when a check fails.
pub fn add_embedding(
    sd: &mut StableDiffusion,
    token: &str,
    vectors: &[Tensor],
) -> Result<Vec<Vec<u32>>, TextualInversionError> {
    if vectors.len() != sd.text_encoders.len() {
        return Err(TextualInversionError::EncoderCount {
            encoders: sd.text_encoders.len(),
            given: vectors.len(),
        });
    }
    for (i, (te, v)) in sd.text_encoders.iter().zip(vectors).enumerate() {
        let (vectors, width) = v.dims2()?;
        let emb = &te.model.token_embedding;
        if width != emb.dim() {
            return Err(TextualInversionError::Width {
                encoder: i,
                vectors,
                width,
                dim: emb.dim(),
            });
        }
        let next = te
            .tokenizer
            .largest_id()
            .map_or(0, |(_, id)| id as usize + 1);
        if next != emb.vocab_size() {
            return Err(TextualInversionError::IdMismatch {
                encoder: i,
                next,
                rows: emb.vocab_size(),
            });
        }
        // The tokens must be new to every encoder before any encoder changes.
        let mut probe = te.tokenizer.clone();
        probe.add_embedding_tokens(&token_strings(token, vectors))?;
    }
    let mut all = Vec::with_capacity(vectors.len());
    for (te, v) in sd.text_encoders.iter_mut().zip(vectors) {
        let ids = te
            .tokenizer
            .add_embedding_tokens(&token_strings(token, v.dims()[0]))?;
        te.model.token_embedding.add_rows(v.clone())?;
        all.push(ids);
    }
    Ok(all)
}
