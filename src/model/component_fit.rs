//! Checks that a pipeline's text encoders and UNet fit each other, from their configs alone and
//! before any weights are read. Each component's weights match its own config (the loader checks
//! every shape), but two components taken from different models, or a hand-edited config, can
//! disagree on the width they exchange, and the first step then fails in a matmul naming no
//! file. diffusers fails there too; sdtrain says which keys of which files disagree:
//! - the UNet's `cross_attention_dim` is the text context width: the text encoder's
//!   `hidden_size` (SDXL: the sum of both encoders');
//! - SDXL's `projection_class_embeddings_input_dim` is `text_encoder_2`'s `projection_dim`
//!   plus 6 × `addition_time_embed_dim` (the pooled text and six time ids);
//! - every id a tokenizer gives is a row of its text encoder's token embedding (`vocab_size`):
//!   a tokenizer from another model, or added tokens the embedding lacks, failed at the first
//!   prompt with an index error naming no file.

use std::path::{Path, PathBuf};

use super::clip::{ClipTextConfig, ClipTokenizer};
use super::unet::UnetConfig;

/// A key of one component's config that another component contradicts.
#[derive(Debug, thiserror::Error)]
#[error("{}: `{field}` is {value}, but {found}; the components do not belong together", file.display())]
pub struct MisfitError {
    /// The config file holding `field`.
    pub file: PathBuf,
    pub field: &'static str,
    pub value: usize,
    /// What the other components give, naming their files.
    pub found: String,
}

/// Checks `unet` (read from `unet_file`) against the text encoders' configs, in pipeline order
/// (`text_encoder`, then SDXL's `text_encoder_2`), each with the file it was read from.
pub fn check_text_fit(
    unet: &UnetConfig,
    unet_file: &Path,
    encoders: &[(ClipTextConfig, PathBuf)],
) -> Result<(), MisfitError> {
    if encoders.is_empty() {
        return Ok(());
    }
    let width: usize = encoders.iter().map(|(c, _)| c.hidden_size).sum();
    let parts: Vec<String> = encoders
        .iter()
        .map(|(c, f)| format!("`hidden_size` {} in {}", c.hidden_size, f.display()))
        .collect();
    if let Some(b) = unet
        .down_blocks
        .iter()
        .find(|b| b.cross_attention_dim != width)
    {
        return Err(MisfitError {
            file: unet_file.to_path_buf(),
            field: "cross_attention_dim",
            value: b.cross_attention_dim,
            found: format!("the text context is {width} wide ({})", parts.join(" + ")),
        });
    }
    let (Some(tt), Some((te2, te2_file))) = (unet.text_time, encoders.get(1)) else {
        return Ok(());
    };
    let want = te2.projection_dim + 6 * tt.time_embed_dim;
    if tt.input_dim != want {
        return Err(MisfitError {
            file: unet_file.to_path_buf(),
            field: "projection_class_embeddings_input_dim",
            value: tt.input_dim,
            found: format!(
                "`projection_dim` {} in {} plus 6 × `addition_time_embed_dim` {} is {want}",
                te2.projection_dim,
                te2_file.display(),
                tt.time_embed_dim
            ),
        });
    }
    Ok(())
}

/// Checks that every id `tokenizer` gives is below `vocab_size`, the rows of the text encoder
/// whose config is `te_config`.
pub fn check_vocab_fit(
    tokenizer: &ClipTokenizer,
    vocab_size: usize,
    te_config: &Path,
) -> Result<(), MisfitError> {
    match tokenizer.largest_id() {
        Some((token, id)) if id as usize >= vocab_size => Err(MisfitError {
            file: te_config.to_path_buf(),
            field: "vocab_size",
            value: vocab_size,
            found: format!(
                "the tokenizer in {} gives `{token}` the id {id}",
                tokenizer.dir().display()
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn te(hidden: usize, projection: usize, file: &str) -> (ClipTextConfig, PathBuf) {
        let json = format!(r#"{{"hidden_size": {hidden}, "projection_dim": {projection}}}"#);
        let cfg = ClipTextConfig::from_json(&json, Path::new(file)).unwrap();
        (cfg, PathBuf::from(file))
    }

    /// The tiny SDXL fixture's shape: 32 + 32 wide context, 32 + 6 × 8 = 80 added inputs.
    fn sdxl_unet(time_embed_dim: usize) -> UnetConfig {
        let json = format!(
            r#"{{"addition_embed_type":"text_time","addition_time_embed_dim":{time_embed_dim},
            "attention_head_dim":[2,4],"block_out_channels":[8,16],"cross_attention_dim":64,
            "down_block_types":["DownBlock2D","CrossAttnDownBlock2D"],"norm_num_groups":8,
            "projection_class_embeddings_input_dim":80,
            "up_block_types":["CrossAttnUpBlock2D","UpBlock2D"]}}"#
        );
        UnetConfig::from_json(&json, "u").unwrap()
    }

    /// A UNet whose `addition_time_embed_dim` disagrees with its added-embedding input failed
    /// at the first step with "input has 128 features, weight [32, 80] wants 80" and no file;
    /// a context narrower than `cross_attention_dim` likewise. Both now name the keys and files.
    #[test]
    fn mismatched_widths_name_both_files_and_the_key() {
        let encoders = [
            te(32, 32, "m/te/config.json"),
            te(32, 32, "m/te2/config.json"),
        ];
        check_text_fit(&sdxl_unet(8), Path::new("m/unet/config.json"), &encoders).unwrap();
        let e = check_text_fit(&sdxl_unet(16), Path::new("m/unet/config.json"), &encoders)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("m/unet/config.json: `projection_class_embeddings_input_dim` is 80")
                && e.contains("m/te2/config.json")
                && e.contains("is 128"),
            "{e}"
        );
        let narrow = [
            te(32, 32, "m/te/config.json"),
            te(16, 32, "m/te2/config.json"),
        ];
        let e = check_text_fit(&sdxl_unet(8), Path::new("m/unet/config.json"), &narrow)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`cross_attention_dim` is 64") && e.contains("48 wide"),
            "{e}"
        );
    }

    /// A tokenizer whose ids pass the text encoder's rows failed at the first prompt with
    /// "token id … is out of range" naming no file; it is refused at load naming both.
    #[test]
    fn a_tokenizer_past_the_embedding_names_both() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-sd15/tokenizer");
        let tok = ClipTokenizer::from_dir(&dir).unwrap();
        check_vocab_fit(&tok, 2514, Path::new("m/te/config.json")).unwrap();
        let e = check_vocab_fit(&tok, 2000, Path::new("m/te/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("m/te/config.json: `vocab_size` is 2000")
                && e.contains(dir.to_str().unwrap())
                && e.contains("the id 2513"),
            "{e}"
        );
    }
}
