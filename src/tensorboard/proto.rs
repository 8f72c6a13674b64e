//! The few pieces of the protocol-buffer wire format that events need
//! (<https://protobuf.dev/programming-guides/encoding/>): varints, `double`/`float` as fixed64/
//! fixed32, and length-delimited strings, bytes and sub-messages. Each field is a key
//! `(field_number << 3) | wire_type` followed by its payload.
//!
//! The encoder writes fields in field-number order and leaves out proto3 defaults (0, empty),
//! except where the caller says a field is set (a `oneof` member), which is what Python's and
//! C++'s serializers do, so the bytes match theirs.

use super::error::EventFileError;

pub const VARINT: u8 = 0;
pub const FIXED64: u8 = 1;
pub const LEN: u8 = 2;
pub const FIXED32: u8 = 5;

/// A message being encoded.
#[derive(Debug, Default)]
pub struct Encoder {
    pub buf: Vec<u8>,
}

impl Encoder {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire));
    }

    /// An `int32`/`int64` field; proto3 leaves out 0. Negative numbers take ten bytes, as in
    /// protobuf (sign-extended to 64 bits).
    pub fn int(&mut self, field: u32, v: i64) {
        if v != 0 {
            self.key(field, VARINT);
            self.varint(v as u64);
        }
    }

    /// A `double` field; proto3 leaves out 0.
    pub fn double(&mut self, field: u32, v: f64) {
        if v.to_bits() != 0 {
            self.key(field, FIXED64);
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// A `float` member of a `oneof`: written even when 0.
    pub fn float_set(&mut self, field: u32, v: f32) {
        self.key(field, FIXED32);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// A `string`/`bytes` field; proto3 leaves out an empty one.
    pub fn bytes(&mut self, field: u32, v: &[u8]) {
        if !v.is_empty() {
            self.bytes_set(field, v);
        }
    }

    /// A `string`/`bytes` field or sub-message that is set: written even when empty.
    pub fn bytes_set(&mut self, field: u32, v: &[u8]) {
        self.key(field, LEN);
        self.varint(v.len() as u64);
        self.buf.extend_from_slice(v);
    }
}

/// One field as read: its number and payload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Field<'a> {
    Varint(u32, u64),
    Fixed64(u32, u64),
    Len(u32, &'a [u8]),
    Fixed32(u32, u32),
}

/// The fields of one message, in the order written. Unknown wire types (the deprecated groups)
/// are an error; unknown field numbers are returned for the caller to skip.
pub fn fields(mut msg: &[u8]) -> Result<Vec<Field<'_>>, EventFileError> {
    let mut out = Vec::new();
    while !msg.is_empty() {
        let key = read_varint(&mut msg)?;
        let field = u32::try_from(key >> 3).map_err(|_| bad("field number out of range"))?;
        let f = match (key & 7) as u8 {
            VARINT => Field::Varint(field, read_varint(&mut msg)?),
            FIXED64 => Field::Fixed64(
                field,
                u64::from_le_bytes(take(&mut msg, 8)?.try_into().map_err(|_| bad("fixed64"))?),
            ),
            LEN => {
                let len = usize::try_from(read_varint(&mut msg)?).map_err(|_| bad("length"))?;
                Field::Len(field, take(&mut msg, len)?)
            }
            FIXED32 => Field::Fixed32(
                field,
                u32::from_le_bytes(take(&mut msg, 4)?.try_into().map_err(|_| bad("fixed32"))?),
            ),
            w => return Err(bad(&format!("wire type {w} in field {field}"))),
        };
        out.push(f);
    }
    Ok(out)
}

fn read_varint(msg: &mut &[u8]) -> Result<u64, EventFileError> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&b, rest) = msg
            .split_first()
            .ok_or_else(|| bad("varint runs past the end"))?;
        *msg = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Ok(v);
        }
    }
    Err(bad("varint longer than 10 bytes"))
}

fn take<'a>(msg: &mut &'a [u8], n: usize) -> Result<&'a [u8], EventFileError> {
    if msg.len() < n {
        return Err(bad("field runs past the end of its message"));
    }
    let (head, rest) = msg.split_at(n);
    *msg = rest;
    Ok(head)
}

fn bad(why: &str) -> EventFileError {
    EventFileError::Proto(why.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoding guide's examples: 150 as field 1 is `08 96 01`; "testing" as field 2 is
    /// `12 07 74 65 73 74 69 6e 67`.
    #[test]
    fn encodes_the_guide_examples() {
        let mut e = Encoder::default();
        e.int(1, 150);
        e.bytes(2, b"testing");
        assert_eq!(
            e.buf,
            [0x08, 0x96, 0x01, 0x12, 0x07, b't', b'e', b's', b't', b'i', b'n', b'g']
        );
        assert_eq!(
            fields(&e.buf).unwrap(),
            [Field::Varint(1, 150), Field::Len(2, b"testing")]
        );
    }

    #[test]
    fn proto3_defaults_are_left_out_but_a_set_oneof_is_not() {
        let mut e = Encoder::default();
        e.int(1, 0);
        e.double(2, 0.0);
        e.bytes(3, b"");
        assert!(e.buf.is_empty());
        e.float_set(2, 0.0);
        assert_eq!(e.buf, [0x15, 0, 0, 0, 0]);
    }

    #[test]
    fn negative_ints_take_ten_bytes_and_read_back() {
        let mut e = Encoder::default();
        e.int(2, -1);
        assert_eq!(e.buf.len(), 11);
        assert_eq!(fields(&e.buf).unwrap(), [Field::Varint(2, u64::MAX)]);
    }

    #[test]
    fn a_field_past_the_end_is_an_error() {
        assert!(fields(&[0x12, 0x05, b'a']).is_err());
        assert!(fields(&[0x08, 0x96]).is_err());
    }
}
