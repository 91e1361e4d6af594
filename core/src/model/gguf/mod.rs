//! GGUF (versions 2 and 3): the [`reader`], the [`writer`], and the
//! [`loader`] that turns a GGUF file into [`ModelFiles`](super::ModelFiles).
//!
//! A file is, all little-endian: the magic `GGUF`, the version (`u32`), the
//! tensor count and the metadata count (`u64` each), the metadata entries (key
//! string, value type `u32`, value), the tensor infos (name string, `n_dims:
//! u32`, `n_dims` dimensions `u64` innermost first, ggml type `u32`, data
//! offset `u64` relative to the data section), padding to `general.alignment`
//! (default 32), then the data section. A string is a `u64` byte length and
//! UTF-8 bytes; an array is an element type `u32`, a `u64` count and the
//! elements.
//!
//! The reader treats the file as hostile: every count, length, offset and size
//! is checked against the bytes that remain before it is used, so a corrupt
//! count fails with a message instead of a huge allocation, and every tensor
//! left in a [`GgufFile`] lies inside the file. Metadata is held compactly
//! ([`value`]) and what parsing the header allocates is charged to a budget
//! ([`cursor`]), so a file cannot take much more memory than it is long either.

mod cursor;
mod loader;
mod reader;
mod value;
mod writer;

pub use cursor::{HEADER_MEMORY_CAP, MAX_ARRAY_LEN};
#[cfg(not(target_arch = "wasm32"))]
pub use loader::load_gguf;
pub use loader::model_from_gguf;
pub use reader::GgufFile;
pub use value::{GgufArray, GgufValue, StringArray};
pub use writer::GgufWriter;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML tensors have at most four dimensions.
const MAX_DIMS: usize = 4;

/// Helpers the reader, writer and loader tests share.
#[cfg(test)]
mod testing {
    use std::path::Path;
    use std::sync::Arc;

    use super::GgufFile;
    use crate::model::Bytes;
    use crate::Result;

    pub fn parse(bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(Arc::new(Bytes::Owned(bytes)), Path::new("test.gguf"))
    }

    pub fn test_values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0).collect()
    }
}
