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
//! left in a [`GgufFile`] lies inside the file.

mod loader;
mod reader;
mod writer;

#[cfg(not(target_arch = "wasm32"))]
pub use loader::load_gguf;
pub use loader::model_from_gguf;
pub use reader::GgufFile;
pub use writer::GgufWriter;

/// One metadata value. The variant order follows GGUF's value type ids.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Every element has the same type (the writer checks it, the reader gets it so).
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML tensors have at most four dimensions.
const MAX_DIMS: usize = 4;

impl GgufValue {
    /// GGUF's id for this value's type.
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    pub fn type_name(&self) -> &'static str {
        value_type_name(self.type_id())
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type holding a non-negative value that fits a `usize`.
    pub fn as_usize(&self) -> Option<usize> {
        let wide: i128 = match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        };
        usize::try_from(wide).ok()
    }

    /// An `f32` or `f64` value (the latter rounded).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

fn value_type_name(type_id: u32) -> &'static str {
    match type_id {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "string",
        9 => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}

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
