//! TensorBoard event files, written without TensorFlow or a protobuf library: TFRecord framing
//! with masked CRC-32C ([`record`], [`crc32c`]) around hand-encoded `Event` protobufs
//! ([`event`], [`proto`]). [`EventWriter`] writes a file; [`reader`] reads them back.
//!
//! Why our own: the one Rust crate for this, `tensorboard-rs`, is no longer maintained (last
//! release 2022) and pulls protobuf 2 and an older `image`; the scalars and PNG images a
//! training log needs take a few hundred lines.

pub mod crc32c;
pub mod error;
pub mod event;
pub mod proto;
pub mod reader;
pub mod record;
pub mod writer;

pub use error::EventFileError;
pub use writer::EventWriter;
