//! CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as in iSCSI, RFC 3720) and TFRecord's
//! masked form, `((crc >> 15) | (crc << 17)) + 0xa282ead8` (TensorFlow `crc32c::Mask`). The mask
//! keeps a CRC of data that itself holds CRCs from being a CRC of a CRC.
//!
//! A byte-at-a-time table: an event file holds a few hundred bytes per logged step, so the speed
//! of a sliced or hardware CRC would not show.

const POLY: u32 = 0x82F6_3B78;
const MASK_DELTA: u32 = 0xa282_ead8;

/// `TABLE[b]`: the CRC register after shifting byte `b` through it.
const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// The CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The masked CRC-32C that TFRecord stores after the length and after the data.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(MASK_DELTA)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard check value of CRC-32C (the "123456789" vector of every CRC catalogue).
    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    /// RFC 3720 B.4: 32 bytes of zeros.
    #[test]
    fn crc32c_rfc3720_zeros() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    /// The mask is TensorFlow's: `((crc >> 15) | (crc << 17)) + 0xa282ead8`, wrapping. For the
    /// check value 0xE3069283 that is 0x2507c60d + 0xa282ead8 = 0xc78ab0e5 (worked by hand).
    #[test]
    fn mask_of_the_check_value() {
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }
}
