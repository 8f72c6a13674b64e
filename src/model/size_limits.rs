//! The largest sizes a model `config.json` may declare, checked where each config is read so
//! that a garbled or hostile value (`"layers_per_block": 1099511627776`) is refused with the file
//! and key named before anything is allocated for it, instead of aborting the process on a
//! failed allocation or overflowing a product of sizes.
//!
//! The bounds sit far above every SD-family model (SDXL's widest layer is 2816, its deepest
//! block 10 transformer layers, OpenCLIP bigG has 32 layers and 1280 channels), so no real model
//! meets them.

/// Channels, hidden sizes, embedding widths and head counts.
pub const MAX_WIDTH: usize = 1 << 16;
/// Layers per block, transformer layers per block, hidden layers.
pub const MAX_DEPTH: usize = 1 << 10;
/// A text encoder's vocabulary (CLIP's is 49408).
pub const MAX_VOCAB: usize = 1 << 22;
/// A text encoder's positions (CLIP's is 77).
pub const MAX_POSITIONS: usize = 1 << 16;

/// `Ok` when `min <= value <= max`, else what is wrong, to follow the key's name:
/// "is 1099511627776; sdtrain accepts 1 to 65536".
pub fn check(value: usize, min: usize, max: usize) -> Result<(), String> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(format!("is {value}; sdtrain accepts {min} to {max}"))
    }
}

/// [`check`] for each entry of a list, naming the entry's index.
pub fn check_each(values: &[usize], min: usize, max: usize) -> Result<(), String> {
    for (i, &v) in values.iter().enumerate() {
        check(v, min, max).map_err(|e| format!("entry {i} {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_messages_name_the_entry() {
        assert!(check(1, 1, 4).is_ok() && check(4, 1, 4).is_ok());
        assert_eq!(check(0, 1, 4).unwrap_err(), "is 0; sdtrain accepts 1 to 4");
        assert_eq!(
            check_each(&[2, 1 << 40], 1, MAX_WIDTH).unwrap_err(),
            "entry 1 is 1099511627776; sdtrain accepts 1 to 65536"
        );
    }
}
