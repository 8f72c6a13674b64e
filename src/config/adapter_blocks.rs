//! train.json's block-wise keys of `adapter` (kohya's `network_args` `block_dims`,
//! `block_alphas`, `conv_block_dims`, `conv_block_alphas`, `down_lr_weight`, `mid_lr_weight`,
//! `up_lr_weight`, `block_lr_zero_threshold`), read into [`BlockSettings`]. Each list is a JSON
//! array or kohya's comma-separated string, so a kohya config's values can be pasted as they
//! are. The lengths are checked against the family when the model is known
//! ([`BlockSettings::resolve`]); here only that they fit one of the two.

use serde_json::Value;

use super::adapter_file::AdapterFile;
use crate::adapter::block_weights::{block_count, parse_numbers, BlockSettings, LrWeights};

/// A key's name and what is wrong with it (completing "`adapter.<key>` …").
type KeyError = (&'static str, String);

/// The block-wise settings, or `None` when no block key is set. `low_rank`: the mode is "lora"
/// or "locon" (kohya's `networks.lora`, which has them); `locon`: the 3×3 convs are trained.
pub(super) fn block_settings(
    a: &AdapterFile,
    low_rank: bool,
    locon: bool,
    dim_from_weights: bool,
) -> Result<Option<BlockSettings>, KeyError> {
    let keys = [
        ("block_dims", &a.block_dims),
        ("block_alphas", &a.block_alphas),
        ("conv_block_dims", &a.conv_block_dims),
        ("conv_block_alphas", &a.conv_block_alphas),
        ("down_lr_weight", &a.down_lr_weight),
        ("mid_lr_weight", &a.mid_lr_weight),
        ("up_lr_weight", &a.up_lr_weight),
    ];
    let set: Vec<&'static str> = keys
        .iter()
        .filter(|(_, v)| v.is_some())
        .map(|(k, _)| *k)
        .collect();
    if set.is_empty() {
        if a.block_lr_zero_threshold.is_some() {
            return Err((
                "block_lr_zero_threshold",
                "zeroes the small weights of down_lr_weight, mid_lr_weight and up_lr_weight, \
                 and none of them is set"
                    .into(),
            ));
        }
        return Ok(None);
    }
    if !low_rank {
        return Err((
            set[0],
            "is a block-wise setting of kohya's LoRA (`networks.lora`); use \"mode\": \"lora\" \
             or \"locon\""
                .into(),
        ));
    }
    let s = BlockSettings {
        dims: a
            .block_dims
            .as_ref()
            .map(|v| ranks("block_dims", v))
            .transpose()?,
        alphas: a
            .block_alphas
            .as_ref()
            .map(|v| alphas("block_alphas", v))
            .transpose()?,
        conv_dims: (a.conv_block_dims.as_ref())
            .map(|v| ranks("conv_block_dims", v))
            .transpose()?,
        conv_alphas: (a.conv_block_alphas.as_ref())
            .map(|v| alphas("conv_block_alphas", v))
            .transpose()?,
        down_lr_weight: (a.down_lr_weight.as_ref())
            .map(|v| side_weights("down_lr_weight", v))
            .transpose()?,
        mid_lr_weight: (a.mid_lr_weight.as_ref())
            .map(|v| mid_weights(v))
            .transpose()?,
        up_lr_weight: (a.up_lr_weight.as_ref())
            .map(|v| side_weights("up_lr_weight", v))
            .transpose()?,
        zero_threshold: match a.block_lr_zero_threshold {
            Some(t) if !t.is_finite() => {
                return Err((
                    "block_lr_zero_threshold",
                    format!("must be a number (got {t})"),
                ))
            }
            Some(_)
                if !(a.down_lr_weight.is_some()
                    || a.mid_lr_weight.is_some()
                    || a.up_lr_weight.is_some()) =>
            {
                return Err((
                    "block_lr_zero_threshold",
                    "zeroes the small weights of down_lr_weight, mid_lr_weight and \
                     up_lr_weight, and none of them is set"
                        .into(),
                ))
            }
            t => t.unwrap_or(0.0),
        },
    };
    check_combination(&s, locon, dim_from_weights)?;
    Ok(Some(s))
}

/// What kohya ignores silently is refused here, naming the key.
fn check_combination(
    s: &BlockSettings,
    locon: bool,
    dim_from_weights: bool,
) -> Result<(), KeyError> {
    let on = s.is_set();
    if s.alphas.is_some() && !on {
        return Err((
            "block_alphas",
            "is read with block_dims or a learning-rate weight (kohya ignores it otherwise); \
             set block_dims"
                .into(),
        ));
    }
    for (key, given) in [
        ("conv_block_dims", s.conv_dims.is_some()),
        ("conv_block_alphas", s.conv_alphas.is_some()),
    ] {
        if given && !locon {
            return Err((
                key,
                "sets the ranks of the 3×3 convs, which only \"mode\": \"locon\" adapts".into(),
            ));
        }
    }
    if s.conv_dims.is_some() && !on {
        return Err((
            "conv_block_dims",
            "is read with block_dims or a learning-rate weight (kohya ignores it otherwise); \
             set block_dims too"
                .into(),
        ));
    }
    if s.conv_alphas.is_some() && s.conv_dims.is_none() {
        return Err((
            "conv_block_alphas",
            "is read with conv_block_dims (kohya ignores it otherwise); set conv_block_dims".into(),
        ));
    }
    if dim_from_weights {
        let ranks = [
            ("block_dims", s.dims.is_some()),
            ("block_alphas", s.alphas.is_some()),
            ("conv_block_dims", s.conv_dims.is_some()),
            ("conv_block_alphas", s.conv_alphas.is_some()),
        ];
        if let Some((key, _)) = ranks.iter().find(|(_, given)| *given) {
            return Err((
                key,
                "sets ranks that dim_from_weights takes from init_from's file; remove one of \
                 the two (the learning-rate weights work with both)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// A list of numbers: a JSON array, or kohya's comma-separated string.
fn numbers(key: &'static str, v: &Value) -> Result<Vec<f64>, KeyError> {
    let list = match v {
        Value::String(s) => parse_numbers(s).map_err(|m| (key, m))?,
        Value::Array(items) => items
            .iter()
            .map(|x| x.as_f64().filter(|f| f.is_finite()))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| (key, format!("must hold numbers only (got {v})")))?,
        other => {
            return Err((
                key,
                format!(
                    "must be an array of numbers or kohya's comma-separated string, found {}",
                    super::strict::describe_value(other)
                ),
            ))
        }
    };
    if list.is_empty() {
        return Err((key, "is empty".into()));
    }
    Ok(list)
}

/// One entry per block: SD1/SD2 have 25 blocks, SDXL 23.
fn per_block(key: &'static str, list: Vec<f64>) -> Result<Vec<f64>, KeyError> {
    let (sd, xl) = (block_count(false), block_count(true));
    if list.len() != sd && list.len() != xl {
        return Err((
            key,
            format!(
                "has {} entries; give one per UNet block: {sd} for SD1/SD2, {xl} for SDXL",
                list.len()
            ),
        ));
    }
    Ok(list)
}

fn ranks(key: &'static str, v: &Value) -> Result<Vec<usize>, KeyError> {
    per_block(key, numbers(key, v)?)?
        .into_iter()
        .map(|r| match r {
            r if r.fract() == 0.0 && (0.0..=4096.0).contains(&r) => Ok(r as usize),
            r => Err((
                key,
                format!("holds {r}; each rank must be an integer in 0..=4096 (0: no adapter)"),
            )),
        })
        .collect()
}

fn alphas(key: &'static str, v: &Value) -> Result<Vec<f64>, KeyError> {
    let list = per_block(key, numbers(key, v)?)?;
    match list.iter().find(|&&a| a < 0.0) {
        Some(a) => Err((
            key,
            format!("holds {a}; an alpha must be 0 or more (0: the rank)"),
        )),
        None => Ok(list),
    }
}

/// `down_lr_weight`/`up_lr_weight`: a list, or a curve name with an optional offset.
fn side_weights(key: &'static str, v: &Value) -> Result<LrWeights, KeyError> {
    match v {
        Value::String(s) => LrWeights::parse(s).map_err(|m| (key, m)),
        v => numbers(key, v).map(LrWeights::List),
    }
}

/// `mid_lr_weight`: a list (kohya always splits it on commas), or one number.
fn mid_weights(v: &Value) -> Result<Vec<f64>, KeyError> {
    match v {
        Value::Number(n) => Ok(vec![n.as_f64().unwrap_or(f64::NAN)]),
        v => numbers("mid_lr_weight", v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn file(v: Value) -> AdapterFile {
        serde_json::from_value(v).unwrap()
    }

    fn err(v: Value, locon: bool) -> KeyError {
        block_settings(&file(v), true, locon, false).unwrap_err()
    }

    #[test]
    fn arrays_and_kohya_strings_read_alike() {
        let dims: Vec<i64> = (0..25).map(|i| i % 5).collect();
        let text = dims
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let a = block_settings(&file(json!({"block_dims": dims})), true, false, false).unwrap();
        let b = block_settings(&file(json!({"block_dims": text})), true, false, false).unwrap();
        assert_eq!(a, b);
        let s = block_settings(
            &file(
                json!({"down_lr_weight": "sine+0.5", "mid_lr_weight": 0.5, "up_lr_weight": [1, 0]}),
            ),
            true,
            false,
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.mid_lr_weight, Some(vec![0.5]));
        assert_eq!(s.up_lr_weight, Some(LrWeights::List(vec![1.0, 0.0])));
        assert_eq!(
            block_settings(&file(json!({})), true, true, false),
            Ok(None)
        );
    }

    #[test]
    fn mistakes_name_their_key() {
        let cases = [
            (
                json!({"block_dims": [4, 4]}),
                "block_dims",
                "25 for SD1/SD2, 23 for SDXL",
            ),
            (
                json!({"block_dims": vec![2.5; 25]}),
                "block_dims",
                "integer",
            ),
            (json!({"block_dims": {"a": 1}}), "block_dims", "an object"),
            (
                json!({"block_alphas": vec![1; 25]}),
                "block_alphas",
                "set block_dims",
            ),
            (json!({"down_lr_weight": "half"}), "down_lr_weight", "sine"),
            (
                json!({"mid_lr_weight": "x"}),
                "mid_lr_weight",
                "not a number",
            ),
            (
                json!({"block_lr_zero_threshold": 0.1}),
                "block_lr_zero_threshold",
                "none of them",
            ),
            (
                json!({"block_dims": vec![4; 25], "conv_block_alphas": vec![1; 25]}),
                "conv_block_alphas",
                "locon",
            ),
        ];
        for (v, key, says) in cases {
            let (k, m) = err(v.clone(), false);
            assert_eq!(k, key, "{v}");
            assert!(m.contains(says), "{v}: {m}");
        }
        let (k, m) = err(
            json!({"block_dims": vec![4; 23], "conv_block_alphas": vec![1; 23]}),
            true,
        );
        assert_eq!(k, "conv_block_alphas");
        assert!(m.contains("conv_block_dims"), "{m}");
        let (k, m) = block_settings(
            &file(json!({"up_lr_weight": "linear"})),
            false,
            false,
            false,
        )
        .unwrap_err();
        assert_eq!(k, "up_lr_weight");
        assert!(m.contains("\"lora\""), "{m}");
        let (k, _) = block_settings(&file(json!({"block_dims": vec![4; 25]})), true, false, true)
            .unwrap_err();
        assert_eq!(k, "block_dims");
        assert!(
            block_settings(&file(json!({"up_lr_weight": "linear"})), true, false, true).is_ok(),
            "learning-rate weights work with dim_from_weights"
        );
    }
}
