//! TFRecord framing, the container of an event file. Each record is
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes | data | u32 masked CRC-32C of data
//! ```
//!
//! (TensorFlow `core/lib/io/record_writer.cc`; TensorBoard's `RecordWriter` writes the same.)

use std::io::Write;

use super::crc32c::masked_crc32c;
use super::error::EventFileError;

/// Bytes of framing around each record's data.
const HEADER: usize = 8 + 4;
const FOOTER: usize = 4;

/// Writes `data` as one record.
pub fn write_record(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc32c(&len).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc32c(data).to_le_bytes())
}

/// One record as a byte vector (framing included).
pub fn frame(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + data.len() + FOOTER);
    // Writing into a Vec cannot fail.
    let _ = write_record(&mut out, data);
    out
}

/// A record's data and the offset of its frame in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub offset: usize,
    pub data: Vec<u8>,
}

/// The records of `bytes` up to the first bad one, and the error that stopped the parse, if any.
/// A record cut short at the end is [`EventFileError::Truncated`]: what a killed writer leaves,
/// and what TensorBoard itself skips while waiting for the rest.
pub fn parse_records(bytes: &[u8]) -> (Vec<Record>, Option<EventFileError>) {
    let mut records = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        match parse_one(bytes, at) {
            Ok((data, next)) => {
                records.push(Record {
                    offset: at,
                    data: data.to_vec(),
                });
                at = next;
            }
            Err(e) => return (records, Some(e)),
        }
    }
    (records, None)
}

/// The record whose frame starts at `at`: its data and where the next frame starts.
fn parse_one(bytes: &[u8], at: usize) -> Result<(&[u8], usize), EventFileError> {
    let truncated = EventFileError::Truncated { offset: at };
    let header = bytes.get(at..at + HEADER).ok_or(truncated)?;
    let (len_bytes, len_crc) = header.split_at(8);
    let stored = u32::from_le_bytes([len_crc[0], len_crc[1], len_crc[2], len_crc[3]]);
    let computed = masked_crc32c(len_bytes);
    if stored != computed {
        return Err(EventFileError::LengthCrc {
            offset: at,
            stored,
            computed,
        });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(len_bytes);
    let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| truncated_at(at))?;
    let start = at + HEADER;
    let end = start.checked_add(len).ok_or(truncated_at(at))?;
    let data = bytes.get(start..end).ok_or(truncated_at(at))?;
    let crc = bytes.get(end..end + FOOTER).ok_or(truncated_at(at))?;
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let computed = masked_crc32c(data);
    if stored != computed {
        return Err(EventFileError::DataCrc {
            offset: at,
            stored,
            computed,
        });
    }
    Ok((data, end + FOOTER))
}

fn truncated_at(offset: usize) -> EventFileError {
    EventFileError::Truncated { offset }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let mut bytes = frame(b"first");
        bytes.extend(frame(b""));
        bytes.extend(frame(&[7u8; 300]));
        let (records, err) = parse_records(&bytes);
        assert!(err.is_none(), "{err:?}");
        let data: Vec<&[u8]> = records.iter().map(|r| r.data.as_slice()).collect();
        assert_eq!(data, [&b"first"[..], b"", &[7u8; 300][..]]);
        assert_eq!(records[1].offset, 5 + 16);
    }

    /// The frame is length, masked CRC of the length, data, masked CRC of the data, all
    /// little-endian: checked byte by byte for the empty record.
    #[test]
    fn frame_layout() {
        let f = frame(b"");
        assert_eq!(f.len(), 16);
        assert_eq!(&f[..8], &[0u8; 8]);
        assert_eq!(&f[8..12], &masked_crc32c(&[0u8; 8]).to_le_bytes());
        assert_eq!(&f[12..], &masked_crc32c(b"").to_le_bytes());
    }

    /// Any flipped byte, in the length, either CRC or the data, is caught, never read as data.
    #[test]
    fn a_corrupted_byte_is_detected() {
        let good = frame(b"some event bytes");
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            let (records, err) = parse_records(&bad);
            assert!(records.is_empty(), "byte {i}: read a corrupted record");
            let err = err.unwrap_or_else(|| panic!("byte {i}: no error"));
            assert!(
                matches!(
                    err,
                    EventFileError::LengthCrc { .. } | EventFileError::DataCrc { .. }
                ),
                "byte {i}: {err}"
            );
        }
    }

    /// A record cut short (a killed writer) ends the parse after the whole records before it.
    #[test]
    fn a_torn_last_record_keeps_the_ones_before() {
        let mut bytes = frame(b"whole");
        let second = frame(b"torn record");
        bytes.extend(&second[..second.len() - 3]);
        let (records, err) = parse_records(&bytes);
        assert_eq!(records.len(), 1);
        assert!(matches!(
            err,
            Some(EventFileError::Truncated { offset: 21 })
        ));
    }
}
