//! [`EventFileError`]: what can go wrong writing or reading an event file.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EventFileError {
    #[error("cannot {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("record at byte {offset}: the file ends inside it")]
    Truncated { offset: usize },
    #[error(
        "record at byte {offset}: the length's CRC is {stored:#010x}, the length's bytes give \
         {computed:#010x}"
    )]
    LengthCrc {
        offset: usize,
        stored: u32,
        computed: u32,
    },
    #[error(
        "record at byte {offset}: the data's CRC is {stored:#010x}, the data gives {computed:#010x}"
    )]
    DataCrc {
        offset: usize,
        stored: u32,
        computed: u32,
    },
    #[error("bad protobuf: {0}")]
    Proto(String),
    #[error("{}", path.display())]
    InFile {
        path: PathBuf,
        source: Box<EventFileError>,
    },
}

impl EventFileError {
    pub(crate) fn io(
        op: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Self::Io { op, path, source }
    }

    pub(crate) fn in_file(self, path: &std::path::Path) -> Self {
        Self::InFile {
            path: path.to_path_buf(),
            source: Box::new(self),
        }
    }
}
