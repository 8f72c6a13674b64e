//! CLIP text encoders (transformers' `CLIPTextModel` / `CLIPTextModelWithProjection`), their
//! config, and the CLIP BPE tokenizer.

pub mod builtin_bpe;
mod config;
mod text_model;
mod tokenizer;

pub use config::{ClipActivation, ClipConfigError, ClipTextConfig, RawClipTextConfig};
pub use text_model::{
    eos_positions, ClipAttention, ClipEncoderLayer, ClipMlp, ClipTextModel, ClipTextOutput,
};
pub use tokenizer::{ClipTokenizer, TokenizerError};
