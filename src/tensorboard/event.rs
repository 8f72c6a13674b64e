//! The messages of an event file, as far as sdtrain writes and reads them, with their field
//! numbers from TensorBoard's `tensorboard/compat/proto/event.proto` and `summary.proto`:
//!
//! ```text
//! Event          { double wall_time = 1; int64 step = 2;
//!                  oneof what { string file_version = 3; Summary summary = 5; … }
//!                  SourceMetadata source_metadata = 10; }
//! SourceMetadata { string writer = 1; }
//! Summary        { repeated Value value = 1; }
//! Summary.Value  { string tag = 1; oneof value { float simple_value = 2; Image image = 4; … } }
//! Summary.Image  { int32 height = 1; int32 width = 2; int32 colorspace = 3;
//!                  bytes encoded_image_string = 4; }
//! ```
//!
//! A `simple_value` scalar and an encoded image are what PyTorch's `SummaryWriter.add_scalar`
//! and `add_image` write; TensorBoard reads both into its scalar and image dashboards.

use super::error::EventFileError;
use super::proto::{fields, Encoder, Field};

/// The first event of every file names the format (TensorBoard checks the `brain.Event:` prefix).
pub const FILE_VERSION: &str = "brain.Event:2";

/// One event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    pub step: i64,
    pub what: What,
    /// `SourceMetadata.writer`, set on the first event of a file.
    pub source_writer: Option<String>,
}

/// The `what` of an event.
#[derive(Debug, Clone, PartialEq)]
pub enum What {
    FileVersion(String),
    Summary(Vec<Value>),
    /// Something else (a graph, a session log, …): read past, never written.
    Other,
}

/// One tagged value of a summary.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub tag: String,
    pub data: ValueData,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ValueData {
    /// `simple_value`: a scalar, stored as f32.
    Scalar(f32),
    Image(Image),
    /// Another kind of value (a histogram, a tensor, …): read past, never written.
    Other,
}

/// `Summary.Image`: an encoded image (PNG here) and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub height: i32,
    pub width: i32,
    /// 1 grayscale, 2 grayscale + alpha, 3 RGB, 4 RGBA.
    pub colorspace: i32,
    pub encoded: Vec<u8>,
}

impl Event {
    /// The protobuf bytes of the event.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.double(1, self.wall_time);
        e.int(2, self.step);
        match &self.what {
            What::FileVersion(v) => e.bytes_set(3, v.as_bytes()),
            What::Summary(values) => e.bytes_set(5, &encode_summary(values)),
            What::Other => {}
        }
        if let Some(writer) = &self.source_writer {
            let mut meta = Encoder::default();
            meta.bytes(1, writer.as_bytes());
            e.bytes_set(10, &meta.buf);
        }
        e.buf
    }

    /// Reads an event; unknown fields are skipped, as protobuf does.
    pub fn decode(bytes: &[u8]) -> Result<Self, EventFileError> {
        let mut event = Event {
            wall_time: 0.0,
            step: 0,
            what: What::Other,
            source_writer: None,
        };
        for f in fields(bytes)? {
            match f {
                Field::Fixed64(1, bits) => event.wall_time = f64::from_bits(bits),
                Field::Varint(2, v) => event.step = v as i64,
                Field::Len(3, s) => event.what = What::FileVersion(utf8(s, "file_version")?),
                Field::Len(5, s) => event.what = What::Summary(decode_summary(s)?),
                Field::Len(10, meta) => {
                    for f in fields(meta)? {
                        if let Field::Len(1, w) = f {
                            event.source_writer = Some(utf8(w, "source_metadata.writer")?);
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(event)
    }
}

fn encode_summary(values: &[Value]) -> Vec<u8> {
    let mut summary = Encoder::default();
    for v in values {
        let mut value = Encoder::default();
        value.bytes(1, v.tag.as_bytes());
        match &v.data {
            ValueData::Scalar(x) => value.float_set(2, *x),
            ValueData::Image(img) => {
                let mut m = Encoder::default();
                m.int(1, i64::from(img.height));
                m.int(2, i64::from(img.width));
                m.int(3, i64::from(img.colorspace));
                m.bytes(4, &img.encoded);
                value.bytes_set(4, &m.buf);
            }
            ValueData::Other => {}
        }
        summary.bytes_set(1, &value.buf);
    }
    summary.buf
}

fn decode_summary(bytes: &[u8]) -> Result<Vec<Value>, EventFileError> {
    let mut values = Vec::new();
    for f in fields(bytes)? {
        let Field::Len(1, v) = f else { continue };
        let mut value = Value {
            tag: String::new(),
            data: ValueData::Other,
        };
        for f in fields(v)? {
            match f {
                Field::Len(1, tag) => value.tag = utf8(tag, "tag")?,
                Field::Fixed32(2, bits) => value.data = ValueData::Scalar(f32::from_bits(bits)),
                Field::Len(4, img) => value.data = ValueData::Image(decode_image(img)?),
                _ => {}
            }
        }
        values.push(value);
    }
    Ok(values)
}

fn decode_image(bytes: &[u8]) -> Result<Image, EventFileError> {
    let mut img = Image {
        height: 0,
        width: 0,
        colorspace: 0,
        encoded: Vec::new(),
    };
    for f in fields(bytes)? {
        match f {
            Field::Varint(1, v) => img.height = v as i32,
            Field::Varint(2, v) => img.width = v as i32,
            Field::Varint(3, v) => img.colorspace = v as i32,
            Field::Len(4, b) => img.encoded = b.to_vec(),
            _ => {}
        }
    }
    Ok(img)
}

fn utf8(bytes: &[u8], what: &str) -> Result<String, EventFileError> {
    String::from_utf8(bytes.to_vec())
        .map_err(|_| EventFileError::Proto(format!("{what} is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalar(tag: &str, x: f32) -> Value {
        Value {
            tag: tag.into(),
            data: ValueData::Scalar(x),
        }
    }

    #[test]
    fn events_round_trip() {
        let events = [
            Event {
                wall_time: 1.7e9 + 0.25,
                step: 0,
                what: What::FileVersion(FILE_VERSION.into()),
                source_writer: Some("sdtrain".into()),
            },
            Event {
                wall_time: 1.7e9 + 1.5,
                step: 3,
                what: What::Summary(vec![
                    scalar("loss", 0.125),
                    scalar("lr/unet", 0.0),
                    Value {
                        tag: "samples/0".into(),
                        data: ValueData::Image(Image {
                            height: 2,
                            width: 3,
                            colorspace: 3,
                            encoded: vec![0x89, b'P', b'N', b'G'],
                        }),
                    },
                ]),
                source_writer: None,
            },
        ];
        for e in events {
            assert_eq!(Event::decode(&e.encode()).unwrap(), e);
        }
    }

    /// The bytes of a one-scalar event, worked out by hand from the field numbers:
    /// `09 <wall_time f64>`, `10 07` (step 7), `2a 0b` (summary, 11 bytes) holding `0a 09` (value,
    /// 9 bytes) holding `0a 02 "lr"` (tag) and `15 <0.5f32>` (simple_value).
    #[test]
    fn scalar_event_bytes() {
        let e = Event {
            wall_time: 2.0,
            step: 7,
            what: What::Summary(vec![scalar("lr", 0.5)]),
            source_writer: None,
        };
        let mut want = vec![0x09];
        want.extend(2.0f64.to_le_bytes());
        want.extend([
            0x10, 0x07, 0x2a, 0x0b, 0x0a, 0x09, 0x0a, 0x02, b'l', b'r', 0x15,
        ]);
        want.extend(0.5f32.to_le_bytes());
        assert_eq!(e.encode(), want);
    }
}
