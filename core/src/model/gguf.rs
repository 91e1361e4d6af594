//! GGUF (versions 2 and 3): the reader, the writer, and the loader that turns a
//! GGUF file into [`ModelFiles`].
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

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use super::config::{ModelConfig, RopeScaling};
use super::{check_tensors, Bytes, ModelFiles, TensorInfo, TensorStore};
use crate::backend::RopeStyle;
use crate::quant::WeightFormat;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

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

/// A parsed GGUF file: its metadata, and where each tensor lies in `bytes`.
pub struct GgufFile {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    /// Offsets are absolute (from the start of the file) and checked to be in bounds.
    pub tensors: Vec<TensorInfo>,
    pub bytes: Arc<Bytes>,
}

/// Builds a GGUF v3 file in memory: metadata, then tensors, each aligned.
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
    alignment: usize,
}

struct PendingTensor {
    name: String,
    ggml_type: u32,
    shape: Vec<usize>,
    data: Vec<u8>,
}

const MAGIC: &[u8; 4] = b"GGUF";
const WRITTEN_VERSION: u32 = 3;
const DEFAULT_ALIGNMENT: usize = 32;
const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML tensors have at most four dimensions.
const MAX_DIMS: usize = 4;
/// Real files nest arrays at most one deep; the bound keeps a hostile file from
/// recursing the reader off its stack.
const MAX_ARRAY_NESTING: usize = 8;
/// Smallest possible encodings, used to reject counts the rest of the file cannot hold:
/// a metadata entry is an empty key, a type and a one-byte value; a tensor info
/// is an empty name, `n_dims`, a type and an offset.
const MIN_METADATA_ENTRY_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// Arrays longer than this are shown in `inspect` by their length only.
const INSPECT_MAX_ARRAY: usize = 16;
/// Strings longer than this (chat templates) are shown in `inspect` by their length only.
const INSPECT_MAX_STRING: usize = 120;

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

/// Bytes taken by the smallest value of a type (an empty string or array for
/// those), or `None` for an unknown type id.
fn min_value_bytes(type_id: u32) -> Option<u64> {
    match type_id {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        8 => Some(8),
        9 => Some(4 + 8),
        10..=12 => Some(8),
        _ => None,
    }
}

/// GGML's names for type ids Tandem does not read, so an error can say what the file uses.
fn ggml_type_name(id: u32) -> Option<&'static str> {
    let name = match id {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    };
    Some(name)
}

fn supported_formats() -> String {
    WeightFormat::GGML.map(WeightFormat::name).join(", ")
}

/// Why a read from the file failed, before the caller adds what it was reading.
enum ReadError {
    /// The item runs past the end of the file.
    Truncated,
    /// A length or count field claims more than the rest of the file can hold.
    TooLong {
        what: &'static str,
        value: u64,
    },
    Invalid(String),
}

/// A cursor over the file's bytes; every read is bounds-checked.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or(ReadError::Truncated)?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        <[u8; N]>::try_from(self.take(N)?).map_err(|_| ReadError::Truncated)
    }

    fn u32(&mut self) -> Result<u32, ReadError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, ReadError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A `u64` count of items of at least `min_item_bytes` each, checked to fit in the rest of the file.
    fn count(&mut self, what: &'static str, min_item_bytes: u64) -> Result<usize, ReadError> {
        let value = self.u64()?;
        let fits = value
            .checked_mul(min_item_bytes)
            .is_some_and(|bytes| bytes <= self.remaining());
        match usize::try_from(value) {
            Ok(count) if fits => Ok(count),
            _ => Err(ReadError::TooLong { what, value }),
        }
    }

    fn string(&mut self) -> Result<String, ReadError> {
        let len = self.count("string length", 1)?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ReadError::Invalid("string is not valid UTF-8".into()))
    }

    fn value(&mut self, type_id: u32, nesting: usize) -> Result<GgufValue, ReadError> {
        Ok(match type_id {
            0 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()? {
                [0] => GgufValue::Bool(false),
                [1] => GgufValue::Bool(true),
                [b] => return Err(ReadError::Invalid(format!("bool value is {b}, not 0 or 1"))),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if nesting >= MAX_ARRAY_NESTING {
                    return Err(ReadError::Invalid(format!(
                        "arrays nested more than {MAX_ARRAY_NESTING} deep"
                    )));
                }
                let item_type = self.u32()?;
                let min_item_bytes = min_value_bytes(item_type).ok_or_else(|| {
                    ReadError::Invalid(format!("array of unknown value type {item_type}"))
                })?;
                let count = self.count("array length", min_item_bytes)?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(item_type, nesting + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(ReadError::Invalid(format!("unknown value type {other}"))),
        })
    }
}

/// A tensor info as stored, before its shape, type and offset are checked.
struct RawTensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

/// Parses the header, metadata and tensor infos of one file, turning read
/// failures into messages that say what was being read.
struct Parser<'a> {
    reader: Reader<'a>,
    path: &'a Path,
}

impl Parser<'_> {
    fn file_len(&self) -> usize {
        self.reader.data.len()
    }

    fn bad(&self, reason: String) -> Error {
        Error::bad_file(self.path, reason)
    }

    fn fail(&self, context: &str, error: ReadError) -> Error {
        let len = self.file_len();
        self.bad(match error {
            ReadError::Truncated => {
                format!("truncated: {context} runs past the end of the file (size {len} bytes)")
            }
            ReadError::TooLong { what, value } => format!(
                "{context}: {what} {value} runs past the end of the file (size {len} bytes); \
                 the file is truncated or corrupt"
            ),
            ReadError::Invalid(reason) => format!("{context}: {reason}"),
        })
    }

    fn header(&mut self) -> Result<(u32, usize, usize)> {
        let magic = self.reader.array::<4>().map_err(|_| {
            self.bad(format!(
                "not a GGUF file (only {} bytes long)",
                self.file_len()
            ))
        })?;
        if &magic != MAGIC {
            return Err(self.bad(format!(
                "not a GGUF file (magic is '{}')",
                magic.escape_ascii()
            )));
        }
        let version = self.reader.u32().map_err(|e| self.fail("header", e))?;
        match version {
            2 | 3 => {}
            v if (1..=3).contains(&v.swap_bytes()) => {
                return Err(self.bad(format!(
                    "big-endian GGUF (version {}) is not supported",
                    v.swap_bytes()
                )))
            }
            v => {
                return Err(self.bad(format!(
                    "unsupported GGUF version {v} (Tandem reads versions 2 and 3)"
                )))
            }
        }
        let tensor_count = self
            .reader
            .count("tensor count", MIN_TENSOR_INFO_BYTES)
            .map_err(|e| self.fail("header", e))?;
        let metadata_count = self
            .reader
            .count("metadata entry count", MIN_METADATA_ENTRY_BYTES)
            .map_err(|e| self.fail("header", e))?;
        Ok((version, tensor_count, metadata_count))
    }

    fn metadata(&mut self, count: usize) -> Result<Vec<(String, GgufValue)>> {
        let mut entries = Vec::with_capacity(count);
        let mut keys = HashSet::with_capacity(count);
        for i in 1..=count {
            let context = format!("metadata entry {i} of {count}");
            let key = self.reader.string().map_err(|e| self.fail(&context, e))?;
            let context = format!("{context} ('{key}')");
            let value = self
                .reader
                .u32()
                .and_then(|type_id| self.reader.value(type_id, 0))
                .map_err(|e| self.fail(&context, e))?;
            if !keys.insert(key.clone()) {
                return Err(self.bad(format!("metadata key '{key}' appears twice")));
            }
            entries.push((key, value));
        }
        Ok(entries)
    }

    fn tensor_infos(&mut self, count: usize) -> Result<Vec<RawTensorInfo>> {
        let mut infos = Vec::with_capacity(count);
        for i in 1..=count {
            let context = format!("tensor info {i} of {count}");
            let name = self.reader.string().map_err(|e| self.fail(&context, e))?;
            let context = format!("{context} ('{name}')");
            let n_dims = self.reader.u32().map_err(|e| self.fail(&context, e))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(self.bad(format!(
                    "{context}: {n_dims} dimensions (GGML tensors have 1 to {MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(self.reader.u64().map_err(|e| self.fail(&context, e))?);
            }
            let ggml_type = self.reader.u32().map_err(|e| self.fail(&context, e))?;
            let offset = self.reader.u64().map_err(|e| self.fail(&context, e))?;
            infos.push(RawTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        Ok(infos)
    }

    /// Checks a tensor's type, shape and data range; `data_start` is the absolute offset of the data section.
    fn tensor(&self, raw: RawTensorInfo, alignment: u64, data_start: u64) -> Result<TensorInfo> {
        let RawTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        } = raw;
        let format =
            WeightFormat::from_ggml_type(ggml_type).ok_or_else(|| {
                match ggml_type_name(ggml_type) {
                    Some(known) => Error::Unsupported(format!(
                        "{}: tensor '{name}' is stored as {known} (ggml type {ggml_type}); \
                     Tandem reads {}",
                        self.path.display(),
                        supported_formats()
                    )),
                    None => self.bad(format!(
                        "tensor '{name}' has unknown ggml type id {ggml_type}"
                    )),
                }
            })?;
        let too_large = || {
            self.bad(format!(
                "tensor '{name}' has absurd shape {dims:?}: its size overflows"
            ))
        };
        // `TensorInfo::rows()` multiplies all but the first dimension, so even
        // with a zero among them the product of the others must fit a usize.
        let nonzero_product = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
            .filter(|&p| usize::try_from(p).is_ok())
            .ok_or_else(too_large)?;
        let elems = if dims.contains(&0) {
            0
        } else {
            nonzero_product
        };
        let block = format.block_elems() as u64;
        let cols = dims.first().copied().unwrap_or(1);
        if cols % block != 0 {
            return Err(self.bad(format!(
                "tensor '{name}' ({format}) has {cols} columns, not a multiple of the format's block of {block}"
            )));
        }
        let len = format
            .bytes_for(elems / cols.max(1), cols)
            .ok_or_else(too_large)?;
        if offset % alignment != 0 {
            return Err(self.bad(format!(
                "tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let file_len = self.file_len();
        let start = data_start.checked_add(offset);
        let end = start
            .and_then(|start| start.checked_add(len))
            .filter(|&end| end <= file_len as u64);
        let (Some(start), Some(_)) = (start, end) else {
            return Err(self.bad(format!(
                "tensor '{name}' ({format}, shape {dims:?}: {len} bytes at data offset {offset}) \
                 runs past the end of the file (size {file_len} bytes): the file is truncated or corrupt"
            )));
        };
        // Each dimension is at most `nonzero_product` and the range lies inside
        // the file, so all of them fit a usize.
        Ok(TensorInfo {
            name,
            format,
            shape: dims.iter().map(|&d| d as usize).collect(),
            file: 0,
            offset: start as usize,
            len: len as usize,
        })
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &Path) -> Result<Self> {
        Self::parse(Arc::new(Bytes::map(path)?), path)
    }

    /// Parses a whole file held in `bytes`; `path` only names it in errors.
    pub fn parse(bytes: Arc<Bytes>, path: &Path) -> Result<Self> {
        let mut parser = Parser {
            reader: Reader {
                data: &bytes,
                pos: 0,
            },
            path,
        };
        let (version, tensor_count, metadata_count) = parser.header()?;
        let metadata = parser.metadata(metadata_count)?;
        let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some((_, value)) => value
                .as_usize()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| {
                    parser.bad(format!(
                        "{ALIGNMENT_KEY} is {value:?}; it must be a power of two"
                    ))
                })?,
        };
        let raw_tensors = parser.tensor_infos(tensor_count)?;
        let data_start = parser
            .reader
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| parser.bad(format!("{ALIGNMENT_KEY} {alignment} is absurd")))?
            as u64;
        let mut names = HashSet::with_capacity(raw_tensors.len());
        let mut tensors = Vec::with_capacity(raw_tensors.len());
        for raw in raw_tensors {
            if !names.insert(raw.name.clone()) {
                return Err(parser.bad(format!("tensor '{}' appears twice", raw.name)));
            }
            tensors.push(parser.tensor(raw, alignment as u64, data_start)?);
        }
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            bytes,
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any integer type holding a non-negative value.
    pub fn get_usize(&self, key: &str) -> Option<usize> {
        self.get(key)?.as_usize()
    }

    /// An `f32` or `f64` value.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn get_array(&self, key: &str) -> Option<&[GgufValue]> {
        self.get(key)?.as_array()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of one of this file's tensors.
    pub fn tensor_data(&self, info: &TensorInfo) -> Option<&[u8]> {
        self.bytes
            .get(info.offset..info.offset.checked_add(info.len)?)
    }
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Adds a metadata entry. Arrays must hold values of one type;
    /// `general.alignment` (a power of two) also sets the writer's alignment.
    pub fn add_metadata(&mut self, key: &str, value: GgufValue) -> Result<()> {
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(Error::InvalidRequest(format!(
                "GGUF metadata key '{key}' added twice"
            )));
        }
        check_homogeneous(key, &value)?;
        if key == ALIGNMENT_KEY {
            self.alignment = match value {
                GgufValue::U32(a) if a.is_power_of_two() => a as usize,
                _ => {
                    return Err(Error::InvalidRequest(format!(
                        "{ALIGNMENT_KEY} must be a u32 power of two, not {value:?}"
                    )))
                }
            };
        }
        self.metadata.push((key.to_string(), value));
        Ok(())
    }

    /// Adds a tensor of `shape` (innermost first) whose `data` is stored in `format`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        format: WeightFormat,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        let invalid = |reason: String| {
            Err(Error::InvalidRequest(format!(
                "GGUF tensor '{name}': {reason}"
            )))
        };
        if self.tensors.iter().any(|t| t.name == name) {
            return invalid("added twice".into());
        }
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return invalid(format!(
                "{} dimensions (1 to {MAX_DIMS} allowed)",
                shape.len()
            ));
        }
        let Some(ggml_type) = format.ggml_type() else {
            return invalid(format!(
                "GGUF cannot hold {format}, a Tandem format (safetensors can)"
            ));
        };
        if !shape[0].is_multiple_of(format.block_elems()) {
            return invalid(format!(
                "{} columns is not a multiple of {format}'s block of {}",
                shape[0],
                format.block_elems()
            ));
        }
        let rows = shape[1..].iter().product();
        if let Some(reason) = super::data_size_mismatch(format, rows, shape[0], data.len()) {
            return invalid(reason);
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ggml_type,
            shape: shape.to_vec(),
            data,
        });
        Ok(())
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.emit(&mut |chunk| out.extend_from_slice(chunk));
        out
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn write(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        let io_error = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io_error)?);
        let mut result = Ok(());
        self.emit(&mut |chunk| {
            if result.is_ok() {
                result = out.write_all(chunk);
            }
        });
        result.and_then(|()| out.flush()).map_err(io_error)
    }

    /// Passes the file to `sink` in pieces, in order.
    fn emit(&self, sink: &mut dyn FnMut(&[u8])) {
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&WRITTEN_VERSION.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut header, key);
            header.extend_from_slice(&value.type_id().to_le_bytes());
            write_value(&mut header, value);
        }
        let mut offset = 0usize;
        for tensor in &self.tensors {
            write_string(&mut header, &tensor.name);
            header.extend_from_slice(&(tensor.shape.len() as u32).to_le_bytes());
            for &d in &tensor.shape {
                header.extend_from_slice(&(d as u64).to_le_bytes());
            }
            header.extend_from_slice(&tensor.ggml_type.to_le_bytes());
            header.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + tensor.data.len()).next_multiple_of(self.alignment);
        }
        header.resize(header.len().next_multiple_of(self.alignment), 0);
        sink(&header);
        let padding = vec![0u8; self.alignment];
        for tensor in &self.tensors {
            sink(&tensor.data);
            let pad = tensor.data.len().next_multiple_of(self.alignment) - tensor.data.len();
            sink(&padding[..pad]);
        }
    }
}

fn check_homogeneous(key: &str, value: &GgufValue) -> Result<()> {
    let GgufValue::Array(items) = value else {
        return Ok(());
    };
    if let Some(first) = items.first() {
        if let Some(other) = items.iter().find(|v| v.type_id() != first.type_id()) {
            return Err(Error::InvalidRequest(format!(
                "GGUF metadata '{key}': array mixes {} and {}",
                first.type_name(),
                other.type_name()
            )));
        }
    }
    items
        .iter()
        .try_for_each(|item| check_homogeneous(key, item))
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => write_string(out, s),
        GgufValue::Array(items) => {
            // An empty array's element type is never read back; u8 is as good as any.
            let item_type = items.first().map_or(0, GgufValue::type_id);
            out.extend_from_slice(&item_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|item| write_value(out, item));
        }
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Maps, parses and checks a GGUF model file.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_gguf(path: &Path) -> Result<ModelFiles> {
    model_from_gguf(GgufFile::open(path)?, path)
}

/// Builds the model from a parsed file: its configuration, checked tensors, tokenizer and metadata.
pub fn model_from_gguf(file: GgufFile, path: &Path) -> Result<ModelFiles> {
    let config = config_from_gguf(&file, path)?;
    config.validate().map_err(|e| match e {
        Error::Unsupported(reason) => {
            Error::bad_file(path, format!("bad model configuration: {reason}"))
        }
        other => other,
    })?;
    let mut tensors = TensorStore::default();
    tensors.add_file(file.bytes.clone());
    for info in &file.tensors {
        tensors.insert(info.clone());
    }
    check_tensors(&config, &tensors, path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let metadata = inspect_metadata(&file);
    Ok(ModelFiles {
        path: path.to_path_buf(),
        config,
        tensors,
        tokenizer,
        metadata,
    })
}

/// Reads `{arch}.*` keys, telling a missing key from one of the wrong type.
struct ArchKeys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
    path: &'a Path,
}

impl ArchKeys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn typed<T>(
        &self,
        suffix: &str,
        expected: &str,
        convert: impl Fn(&GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let key = self.key(suffix);
        let Some(value) = self.file.get(&key) else {
            return Ok(None);
        };
        convert(value).map(Some).ok_or_else(|| {
            Error::bad_file(
                self.path,
                format!("metadata key '{key}' is {value:?}, expected {expected}"),
            )
        })
    }

    fn usize(&self, suffix: &str) -> Result<Option<usize>> {
        self.typed(suffix, "a non-negative integer", GgufValue::as_usize)
    }

    fn f32(&self, suffix: &str) -> Result<Option<f32>> {
        self.typed(suffix, "a float", GgufValue::as_f32)
    }

    fn str(&self, suffix: &str) -> Result<Option<&str>> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(other) => Err(Error::bad_file(
                self.path,
                format!("metadata key '{key}' is {other:?}, expected a string"),
            )),
        }
    }

    fn required<T>(&self, suffix: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| {
            Error::bad_file(
                self.path,
                format!("missing metadata key '{}'", self.key(suffix)),
            )
        })
    }

    fn required_usize(&self, suffix: &str) -> Result<usize> {
        self.required(suffix, self.usize(suffix)?)
    }
}

fn config_from_gguf(file: &GgufFile, path: &Path) -> Result<ModelConfig> {
    let arch = match file.get("general.architecture") {
        Some(GgufValue::String(arch)) => arch.as_str(),
        Some(other) => {
            return Err(Error::bad_file(
                path,
                format!("general.architecture is {other:?}, expected a string"),
            ))
        }
        None => {
            return Err(Error::bad_file(
                path,
                "missing metadata key 'general.architecture'",
            ))
        }
    };
    let rope_style = match arch {
        // llama.cpp's converter permutes these models' Q/K rows for adjacent-pair RoPE.
        "llama" | "mistral" => RopeStyle::Interleaved,
        "qwen2" => RopeStyle::NeoX,
        other => {
            return Err(Error::Unsupported(format!(
                "{}: architecture '{other}' (Tandem runs llama, mistral and qwen2)",
                path.display()
            )))
        }
    };
    let keys = ArchKeys { file, arch, path };
    let hidden_size = keys.required_usize("embedding_length")?;
    let num_heads = keys.required_usize("attention.head_count")?;
    let num_kv_heads = keys.usize("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = match keys.usize("attention.key_length")? {
        Some(d) => d,
        None if num_heads == 0 => 0,
        None => hidden_size / num_heads,
    };
    if let Some(value_dim) = keys.usize("attention.value_length")? {
        if value_dim != head_dim {
            return Err(Error::Unsupported(format!(
                "{}: value head size {value_dim} differs from key head size {head_dim}",
                path.display()
            )));
        }
    }
    let vocab_size = match keys.usize("vocab_size")? {
        Some(v) => v,
        None => file
            .tensor("token_embd.weight")
            .map(TensorInfo::rows)
            .ok_or_else(|| Error::bad_file(path, "missing tensor 'token_embd.weight'"))?,
    };
    let rotary_dim = keys.usize("rope.dimension_count")?.unwrap_or(head_dim);
    let rms_eps = keys.f32("attention.layer_norm_rms_epsilon")?;
    let rope_scaling = rope_scaling(file, &keys, rotary_dim)?;
    Ok(ModelConfig {
        arch: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: keys.required_usize("feed_forward_length")?,
        num_layers: keys.required_usize("block_count")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        rms_eps: keys.required("attention.layer_norm_rms_epsilon", rms_eps)?,
        rope_theta: keys.f32("rope.freq_base")?.unwrap_or(10000.0),
        rope_scaling,
        rope_style,
        max_context: keys.required_usize("context_length")?,
        tied_embeddings: file.tensor("output.weight").is_none(),
        qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        sliding_window: keys.usize("attention.sliding_window")?,
    })
}

/// `rope_freqs.weight` (per-pair divisors) or `rope.scaling.type` linear.
fn rope_scaling(file: &GgufFile, keys: &ArchKeys, rotary_dim: usize) -> Result<RopeScaling> {
    let path = keys.path;
    let linear = match keys.str("rope.scaling.type")? {
        None | Some("none") => None,
        Some("linear") => {
            let factor = keys.f32("rope.scaling.factor")?;
            let factor = keys.required("rope.scaling.factor", factor)?;
            if factor.is_nan() || factor <= 0.0 {
                return Err(Error::bad_file(
                    path,
                    format!("rope scaling factor {factor} must be positive"),
                ));
            }
            Some(factor)
        }
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "{}: RoPE scaling '{other}' (Tandem supports linear and per-frequency factors)",
                path.display()
            )))
        }
    };
    let Some(info) = file.tensor("rope_freqs.weight") else {
        return Ok(linear.map_or(RopeScaling::None, |factor| RopeScaling::Linear { factor }));
    };
    if linear.is_some() {
        return Err(Error::Unsupported(format!(
            "{}: both linear RoPE scaling and rope_freqs.weight",
            path.display()
        )));
    }
    let pairs = rotary_dim / 2;
    if info.format != WeightFormat::F32 || info.elems() != pairs {
        return Err(Error::bad_file(
            path,
            format!(
                "tensor 'rope_freqs.weight' is {} of shape {:?}, expected F32 of shape [{pairs}]",
                info.format, info.shape
            ),
        ));
    }
    let data = file
        .tensor_data(info)
        .ok_or_else(|| Error::bad_file(path, "tensor 'rope_freqs.weight' lies outside the file"))?;
    let factors = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(RopeScaling::FreqFactors(factors))
}

/// The metadata `inspect` shows: scalars and short strings as they are, long
/// strings and arrays (the tokenizer's vocabulary) by their length.
fn inspect_metadata(file: &GgufFile) -> Vec<(String, String)> {
    let mut shown = vec![("gguf.version".to_string(), file.version.to_string())];
    shown.extend(
        file.metadata
            .iter()
            .map(|(key, value)| (key.clone(), describe_value(value))),
    );
    shown
}

fn describe_value(value: &GgufValue) -> String {
    match value {
        GgufValue::U8(v) => v.to_string(),
        GgufValue::I8(v) => v.to_string(),
        GgufValue::U16(v) => v.to_string(),
        GgufValue::I16(v) => v.to_string(),
        GgufValue::U32(v) => v.to_string(),
        GgufValue::I32(v) => v.to_string(),
        GgufValue::U64(v) => v.to_string(),
        GgufValue::I64(v) => v.to_string(),
        GgufValue::F32(v) => v.to_string(),
        GgufValue::F64(v) => v.to_string(),
        GgufValue::Bool(v) => v.to_string(),
        GgufValue::String(s) if s.len() <= INSPECT_MAX_STRING => s.clone(),
        GgufValue::String(s) => format!("({} bytes of text)", s.len()),
        GgufValue::Array(items) => {
            let item_type = items.first().map_or("value", GgufValue::type_name);
            if items.len() <= INSPECT_MAX_ARRAY && item_type != "array" {
                let shown: Vec<String> = items.iter().map(describe_value).collect();
                format!("[{}]", shown.join(", "))
            } else {
                format!("({} × {item_type})", items.len())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::model::synthetic::llama_tensor_shapes;
    use crate::quant::quantize_row;

    fn parse(bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(Arc::new(Bytes::Owned(bytes)), Path::new("test.gguf"))
    }

    /// The message of a parse failure, which must be a `BadModelFile` naming the file.
    fn parse_error(bytes: Vec<u8>) -> String {
        match parse(bytes) {
            Err(e @ Error::BadModelFile { .. }) => {
                let message = e.to_string();
                assert!(message.starts_with("test.gguf: "), "{message}");
                message
            }
            Err(other) => panic!("expected a BadModelFile error, got {other}"),
            Ok(_) => panic!("parsed a bad file"),
        }
    }

    fn find(bytes: &[u8], needle: &str) -> usize {
        bytes
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .unwrap_or_else(|| panic!("{needle} not in the file"))
    }

    fn put_u32(bytes: &mut [u8], at: usize, value: u32) {
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    /// Where the fields of the tensor info named `name` start: (n_dims, dims, type, offset).
    fn tensor_info_fields(bytes: &[u8], name: &str) -> (usize, usize, usize, usize) {
        let n_dims_at = find(bytes, name) + name.len();
        let n_dims = u32::from_le_bytes(bytes[n_dims_at..n_dims_at + 4].try_into().unwrap());
        let type_at = n_dims_at + 4 + 8 * n_dims as usize;
        (n_dims_at, n_dims_at + 4, type_at, type_at + 4)
    }

    fn test_values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0).collect()
    }

    /// A small file: two metadata entries and two tensors, one quantized.
    fn sample_file() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.add_metadata("general.name", GgufValue::String("sample".into()))
            .unwrap();
        w.add_metadata(
            "test.array",
            GgufValue::Array(vec![GgufValue::U32(1), GgufValue::U32(2)]),
        )
        .unwrap();
        let a = quantize_row(WeightFormat::F32, &test_values(8));
        w.add_tensor("tensor_a", WeightFormat::F32, &[4, 2], a)
            .unwrap();
        let b = quantize_row(WeightFormat::Q8_0, &test_values(32));
        w.add_tensor("tensor_b", WeightFormat::Q8_0, &[32, 1], b)
            .unwrap();
        w.to_bytes()
    }

    #[test]
    fn round_trip_keeps_every_metadata_type() {
        let values = vec![
            ("t.u8", GgufValue::U8(200)),
            ("t.i8", GgufValue::I8(-100)),
            ("t.u16", GgufValue::U16(60000)),
            ("t.i16", GgufValue::I16(-30000)),
            ("t.u32", GgufValue::U32(4_000_000_000)),
            ("t.i32", GgufValue::I32(-2_000_000_000)),
            ("t.f32", GgufValue::F32(1.5e-5)),
            ("t.bool", GgufValue::Bool(true)),
            ("t.string", GgufValue::String("héllo wörld".into())),
            ("t.u64", GgufValue::U64(u64::MAX)),
            ("t.i64", GgufValue::I64(i64::MIN)),
            ("t.f64", GgufValue::F64(-2.5e100)),
            (
                "t.strings",
                GgufValue::Array(vec![
                    GgufValue::String("a".into()),
                    GgufValue::String(String::new()),
                    GgufValue::String("Ġthe".into()),
                ]),
            ),
            (
                "t.floats",
                GgufValue::Array(vec![GgufValue::F32(1.0), GgufValue::F32(-1.0)]),
            ),
            ("t.empty", GgufValue::Array(vec![])),
            (
                "t.nested",
                GgufValue::Array(vec![
                    GgufValue::Array(vec![GgufValue::I32(1)]),
                    GgufValue::Array(vec![GgufValue::Bool(false), GgufValue::Bool(true)]),
                ]),
            ),
        ];
        let mut w = GgufWriter::new();
        for (key, value) in &values {
            w.add_metadata(key, value.clone()).unwrap();
        }
        let file = parse(w.to_bytes()).unwrap();
        assert_eq!(file.version, 3);
        assert!(file.tensors.is_empty());
        let expected: Vec<(String, GgufValue)> = values
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(file.metadata, expected);
        assert_eq!(file.get_usize("t.u32"), Some(4_000_000_000));
        assert_eq!(
            file.get_usize("t.i8"),
            None,
            "negative integers are not sizes"
        );
        assert_eq!(file.get_f32("t.f64"), Some(-2.5e100_f64 as f32));
        assert_eq!(file.get_str("t.string"), Some("héllo wörld"));
        assert_eq!(file.get_array("t.strings").map(<[_]>::len), Some(3));
        assert_eq!(file.get_str("t.u8"), None);
    }

    #[test]
    fn round_trip_keeps_every_weight_format() {
        for alignment in [DEFAULT_ALIGNMENT, 64] {
            let mut w = GgufWriter::new();
            w.add_metadata(ALIGNMENT_KEY, GgufValue::U32(alignment as u32))
                .unwrap();
            let mut written = Vec::new();
            for (i, format) in WeightFormat::GGML.into_iter().enumerate() {
                let shape = vec![64, i + 1];
                let data = quantize_row(format, &test_values(64 * (i + 1)));
                let name = format!("w.{format}");
                w.add_tensor(&name, format, &shape, data.clone()).unwrap();
                written.push((name, format, shape, data));
            }
            let file = parse(w.to_bytes()).unwrap();
            assert_eq!(file.tensors.len(), written.len());
            for (info, (name, format, shape, data)) in file.tensors.iter().zip(&written) {
                assert_eq!(&info.name, name);
                assert_eq!(info.format, *format);
                assert_eq!(&info.shape, shape);
                assert_eq!(info.file, 0);
                assert_eq!(info.offset % alignment, 0, "{name} is not aligned");
                assert_eq!(file.tensor_data(info), Some(data.as_slice()));
            }
        }
    }

    #[test]
    fn writer_refuses_inconsistent_input() {
        let mut w = GgufWriter::new();
        let mixed = GgufValue::Array(vec![GgufValue::U8(1), GgufValue::I8(1)]);
        assert!(w.add_metadata("k", mixed).is_err());
        assert!(w.add_metadata(ALIGNMENT_KEY, GgufValue::U32(48)).is_err());
        assert!(w
            .add_tensor("q", WeightFormat::Q4_0, &[48, 1], vec![0; 27])
            .is_err());
        assert!(w
            .add_tensor("f", WeightFormat::F32, &[4], vec![0; 15])
            .is_err());
        assert!(w
            .add_tensor("i", WeightFormat::Int8PerChannel, &[32, 1], vec![0; 36])
            .is_err());
        w.add_tensor("f", WeightFormat::F32, &[4], vec![0; 16])
            .unwrap();
        assert!(w
            .add_tensor("f", WeightFormat::F32, &[4], vec![0; 16])
            .is_err());
    }

    #[test]
    fn truncated_file_fails_cleanly_wherever_it_is_cut() {
        let bytes = sample_file();
        let last = parse(bytes.clone()).unwrap().tensors.pop().unwrap();
        // Past the last tensor's data there is only padding, which a reader need not see.
        for cut in 0..last.offset + last.len {
            let message = parse_error(bytes[..cut].to_vec());
            assert!(
                message.contains("truncated")
                    || message.contains("past the end")
                    || message.contains("not a GGUF file"),
                "cut at {cut}: {message}"
            );
        }
        let in_header = parse_error(bytes[..12].to_vec());
        assert!(
            in_header.contains("truncated: header runs past the end of the file (size 12 bytes)"),
            "{in_header}"
        );
        let in_metadata = parse_error(bytes[..find(&bytes, "test.array") + 20].to_vec());
        assert!(
            in_metadata
                .contains("truncated: metadata entry 2 of 2 ('test.array') runs past the end"),
            "{in_metadata}"
        );
        let in_infos = parse_error(bytes[..find(&bytes, "tensor_b") + 10].to_vec());
        assert!(
            in_infos.contains("truncated: tensor info 2 of 2 ('tensor_b') runs past the end"),
            "{in_infos}"
        );
        let in_data = parse_error(bytes[..last.offset + 10].to_vec());
        assert!(
            in_data.contains("tensor 'tensor_b'") && in_data.contains("past the end of the file"),
            "{in_data}"
        );
    }

    #[test]
    fn wrong_magic_is_named() {
        let mut bytes = sample_file();
        bytes[..4].copy_from_slice(b"PK\x03\x04");
        let message = parse_error(bytes);
        assert!(
            message.contains(r"not a GGUF file (magic is 'PK\x03\x04')"),
            "{message}"
        );
    }

    #[test]
    fn unsupported_versions_are_named() {
        let mut bytes = sample_file();
        put_u32(&mut bytes, 4, 1);
        let message = parse_error(bytes.clone());
        assert!(message.contains("unsupported GGUF version 1"), "{message}");
        put_u32(&mut bytes, 4, 3u32.swap_bytes());
        let message = parse_error(bytes.clone());
        assert!(message.contains("big-endian"), "{message}");
        put_u32(&mut bytes, 4, 2);
        assert_eq!(parse(bytes).unwrap().version, 2);
    }

    #[test]
    fn tensor_past_the_end_is_named() {
        let mut bytes = sample_file();
        let (_, _, _, offset_at) = tensor_info_fields(&bytes, "tensor_a");
        for offset in [1 << 20, u64::MAX - 31] {
            put_u64(&mut bytes, offset_at, offset);
            let message = parse_error(bytes.clone());
            assert!(
                message.contains(&format!(
                    "at data offset {offset}) runs past the end of the file"
                )),
                "{message}"
            );
        }
    }

    #[test]
    fn misaligned_tensor_offset_is_named() {
        let mut bytes = sample_file();
        let (_, _, _, offset_at) = tensor_info_fields(&bytes, "tensor_b");
        let offset = u64::from_le_bytes(bytes[offset_at..offset_at + 8].try_into().unwrap());
        put_u64(&mut bytes, offset_at, offset + 4);
        let message = parse_error(bytes);
        assert!(
            message.contains("not a multiple of the alignment 32"),
            "{message}"
        );
    }

    #[test]
    fn absurd_dimensions_are_named() {
        let mut bytes = sample_file();
        let (_, dims_at, _, _) = tensor_info_fields(&bytes, "tensor_a");
        put_u64(&mut bytes, dims_at, 1 << 40);
        put_u64(&mut bytes, dims_at + 8, 1 << 40);
        let message = parse_error(bytes);
        assert!(
            message.contains("tensor 'tensor_a' has absurd shape [1099511627776, 1099511627776]"),
            "{message}"
        );

        let mut bytes = sample_file();
        let (n_dims_at, _, _, _) = tensor_info_fields(&bytes, "tensor_a");
        put_u32(&mut bytes, n_dims_at, 7);
        let message = parse_error(bytes);
        assert!(message.contains("('tensor_a'): 7 dimensions"), "{message}");
    }

    #[test]
    fn columns_must_be_whole_blocks() {
        let mut bytes = sample_file();
        let (_, dims_at, _, _) = tensor_info_fields(&bytes, "tensor_b");
        put_u64(&mut bytes, dims_at, 16);
        put_u64(&mut bytes, dims_at + 8, 2);
        let message = parse_error(bytes);
        assert!(
            message.contains("tensor 'tensor_b' (Q8_0) has 16 columns, not a multiple"),
            "{message}"
        );
    }

    #[test]
    fn huge_string_and_array_lengths_fail_without_allocating() {
        let mut bytes = sample_file();
        let key_at = find(&bytes, "general.name");
        put_u64(&mut bytes, key_at - 8, 1 << 60);
        let message = parse_error(bytes);
        assert!(
            message.contains(
                "metadata entry 1 of 2: string length 1152921504606846976 runs past the end"
            ),
            "{message}"
        );

        let mut bytes = sample_file();
        let count_at = find(&bytes, "test.array") + "test.array".len() + 8;
        put_u64(&mut bytes, count_at, 1 << 60);
        let message = parse_error(bytes);
        assert!(
            message.contains("('test.array'): array length 1152921504606846976 runs past the end"),
            "{message}"
        );

        let mut bytes = sample_file();
        put_u64(&mut bytes, 8, u64::MAX);
        let message = parse_error(bytes);
        assert!(
            message.contains("tensor count 18446744073709551615"),
            "{message}"
        );
    }

    #[test]
    fn unknown_tensor_types_are_named() {
        let mut bytes = sample_file();
        let (_, _, type_at, _) = tensor_info_fields(&bytes, "tensor_b");
        put_u32(&mut bytes, type_at, 99);
        let message = parse_error(bytes.clone());
        assert!(
            message.contains("tensor 'tensor_b' has unknown ggml type id 99"),
            "{message}"
        );
        put_u32(&mut bytes, type_at, 12);
        let message = parse(bytes).err().unwrap().to_string();
        assert!(
            message.contains("tensor 'tensor_b' is stored as Q4_K (ggml type 12)"),
            "{message}"
        );
    }

    #[test]
    fn bad_metadata_is_named() {
        let mut w = GgufWriter::new();
        w.add_metadata("general.name", GgufValue::String("x".into()))
            .unwrap();
        let mut bytes = w.to_bytes();
        let type_at = find(&bytes, "general.name") + "general.name".len();
        put_u32(&mut bytes, type_at, 13);
        let message = parse_error(bytes.clone());
        assert!(message.contains("unknown value type 13"), "{message}");
        put_u32(&mut bytes, type_at, 8);
        let value_at = type_at + 4 + 8;
        bytes[value_at] = 0xff;
        let message = parse_error(bytes);
        assert!(message.contains("not valid UTF-8"), "{message}");

        let mut w = GgufWriter::new();
        w.add_metadata(ALIGNMENT_KEY, GgufValue::U32(64)).unwrap();
        let mut bytes = w.to_bytes();
        let value_at = find(&bytes, ALIGNMENT_KEY) + ALIGNMENT_KEY.len() + 4;
        put_u32(&mut bytes, value_at, 48);
        let message = parse_error(bytes);
        assert!(message.contains("must be a power of two"), "{message}");
    }

    /// A tiny llama-family model described as metadata and tensor shapes, so
    /// tests can break one thing before writing it.
    struct TinyModel {
        metadata: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<usize>)>,
    }

    const HIDDEN: usize = 64;
    const FFN: usize = 96;
    const HEADS: usize = 2;
    const KV_HEADS: usize = 1;
    const HEAD_DIM: usize = HIDDEN / HEADS;
    const LAYERS: usize = 2;
    const TOKENS: [&str; 8] = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "Ġa", "bc"];

    impl TinyModel {
        fn new(arch: &str) -> Self {
            let strings = |items: &[&str]| {
                GgufValue::Array(
                    items
                        .iter()
                        .map(|s| GgufValue::String(s.to_string()))
                        .collect(),
                )
            };
            let key = |suffix: &str| format!("{arch}.{suffix}");
            let metadata = vec![
                (
                    "general.architecture".into(),
                    GgufValue::String(arch.into()),
                ),
                (key("context_length"), GgufValue::U32(256)),
                (key("embedding_length"), GgufValue::U32(HIDDEN as u32)),
                (key("feed_forward_length"), GgufValue::U32(FFN as u32)),
                (key("block_count"), GgufValue::U32(LAYERS as u32)),
                (key("attention.head_count"), GgufValue::U32(HEADS as u32)),
                (
                    key("attention.head_count_kv"),
                    GgufValue::U32(KV_HEADS as u32),
                ),
                (
                    key("attention.layer_norm_rms_epsilon"),
                    GgufValue::F32(1e-5),
                ),
                (key("rope.freq_base"), GgufValue::F32(100000.0)),
                (
                    "tokenizer.ggml.model".into(),
                    GgufValue::String("gpt2".into()),
                ),
                (
                    "tokenizer.ggml.pre".into(),
                    GgufValue::String("gpt-2".into()),
                ),
                ("tokenizer.ggml.tokens".into(), strings(&TOKENS)),
                (
                    "tokenizer.ggml.merges".into(),
                    strings(&["a b", "Ġ a", "b c"]),
                ),
                ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(0)),
            ];
            let vocab = TOKENS.len();
            let tensors = llama_tensor_shapes(HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, vocab);
            TinyModel { metadata, tensors }
        }

        fn set(&mut self, key: &str, value: GgufValue) {
            self.metadata.retain(|(k, _)| k != key);
            self.metadata.push((key.to_string(), value));
        }

        fn shape_of(&mut self, name: &str) -> &mut Vec<usize> {
            let (_, shape) = self.tensors.iter_mut().find(|(n, _)| n == name).unwrap();
            shape
        }

        /// Writes every tensor as F32 (Q8_0 for the matrices when `quantize`).
        fn to_bytes(&self, quantize: bool) -> Vec<u8> {
            let mut w = GgufWriter::new();
            for (key, value) in &self.metadata {
                w.add_metadata(key, value.clone()).unwrap();
            }
            for (name, shape) in &self.tensors {
                let format = if quantize && shape.len() == 2 {
                    WeightFormat::Q8_0
                } else {
                    WeightFormat::F32
                };
                let data = quantize_row(format, &test_values(shape.iter().product()));
                w.add_tensor(name, format, shape, data).unwrap();
            }
            w.to_bytes()
        }

        fn load(&self) -> Result<ModelFiles> {
            let bytes = Arc::new(Bytes::Owned(self.to_bytes(true)));
            let path = Path::new("tiny.gguf");
            model_from_gguf(GgufFile::parse(bytes, path)?, path)
        }

        fn load_error(&self) -> String {
            match self.load() {
                Ok(_) => panic!("loaded a bad model"),
                Err(e) => e.to_string(),
            }
        }
    }

    #[test]
    fn tiny_llama_loads() {
        let model = TinyModel::new("llama").load().unwrap();
        let c = &model.config;
        assert_eq!(c.arch, "llama");
        assert_eq!(c.vocab_size, TOKENS.len());
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.num_layers),
            (HIDDEN, FFN, LAYERS)
        );
        assert_eq!(
            (c.num_heads, c.num_kv_heads, c.head_dim),
            (HEADS, KV_HEADS, HEAD_DIM)
        );
        assert_eq!(c.rotary_dim, HEAD_DIM);
        assert_eq!(
            (c.rms_eps, c.rope_theta, c.max_context),
            (1e-5, 100000.0, 256)
        );
        assert_eq!(c.rope_style, RopeStyle::Interleaved);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert!(c.tied_embeddings && !c.qkv_bias);
        assert_eq!(c.sliding_window, None);
        let q = model.tensors.view("blk.1.attn_q.weight").unwrap();
        assert_eq!(
            (q.format, q.rows, q.cols),
            (WeightFormat::Q8_0, HIDDEN, HIDDEN)
        );
        assert!(model.tokenizer.encode("ab", false).is_ok());
        let shown: HashMap<_, _> = model.metadata.into_iter().collect();
        assert_eq!(shown["llama.block_count"], "2");
        assert_eq!(
            shown["tokenizer.ggml.tokens"],
            "[<|endoftext|>, a, b, c, Ġ, ab, Ġa, bc]"
        );
    }

    #[test]
    fn qwen2_has_biases_and_neox_rope() {
        let mut tiny = TinyModel::new("qwen2");
        for layer in 0..LAYERS {
            tiny.tensors.extend([
                (format!("blk.{layer}.attn_q.bias"), vec![HIDDEN]),
                (format!("blk.{layer}.attn_k.bias"), vec![HEAD_DIM]),
                (format!("blk.{layer}.attn_v.bias"), vec![HEAD_DIM]),
            ]);
        }
        tiny.tensors
            .push(("output.weight".into(), vec![HIDDEN, TOKENS.len()]));
        let model = tiny.load().unwrap();
        assert_eq!(model.config.rope_style, RopeStyle::NeoX);
        assert!(model.config.qkv_bias && !model.config.tied_embeddings);

        tiny.tensors.retain(|(n, _)| n != "blk.1.attn_v.bias");
        let message = tiny.load_error();
        assert!(
            message.contains("missing tensor 'blk.1.attn_v.bias'"),
            "{message}"
        );
    }

    #[test]
    fn rope_options_are_read() {
        let mut tiny = TinyModel::new("mistral");
        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("linear".into()),
        );
        tiny.set("mistral.rope.scaling.factor", GgufValue::F32(4.0));
        tiny.set("mistral.attention.sliding_window", GgufValue::U32(128));
        tiny.set("mistral.rope.dimension_count", GgufValue::U32(16));
        let c = tiny.load().unwrap().config;
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 4.0 });
        assert_eq!((c.sliding_window, c.rotary_dim), (Some(128), 16));

        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("none".into()),
        );
        tiny.tensors.push(("rope_freqs.weight".into(), vec![8]));
        let c = tiny.load().unwrap().config;
        assert_eq!(c.rope_scaling, RopeScaling::FreqFactors(test_values(8)));

        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("yarn".into()),
        );
        let message = tiny.load_error();
        assert!(message.contains("RoPE scaling 'yarn'"), "{message}");
    }

    #[test]
    fn missing_tensor_is_named() {
        let mut tiny = TinyModel::new("llama");
        tiny.tensors.retain(|(n, _)| n != "blk.1.ffn_up.weight");
        let message = tiny.load_error();
        assert!(
            message.contains("missing tensor 'blk.1.ffn_up.weight' (expected shape [64, 96])"),
            "{message}"
        );
    }

    #[test]
    fn wrong_tensor_shape_is_named() {
        let mut tiny = TinyModel::new("llama");
        *tiny.shape_of("blk.0.attn_k.weight") = vec![HIDDEN, HIDDEN];
        let message = tiny.load_error();
        assert!(
            message.contains("tensor 'blk.0.attn_k.weight' has shape [64, 64], expected [64, 32]"),
            "{message}"
        );
    }

    #[test]
    fn absurd_config_is_named() {
        let mut tiny = TinyModel::new("llama");
        tiny.set("llama.attention.head_count", GgufValue::U32(0));
        let message = tiny.load_error();
        assert!(
            message.contains("num_heads = 0 is out of range"),
            "{message}"
        );

        let mut tiny = TinyModel::new("llama");
        tiny.set("llama.block_count", GgufValue::String("two".into()));
        let message = tiny.load_error();
        assert!(
            message.contains(
                "'llama.block_count' is String(\"two\"), expected a non-negative integer"
            ),
            "{message}"
        );

        let mut tiny = TinyModel::new("llama");
        tiny.metadata.retain(|(k, _)| k != "llama.embedding_length");
        let message = tiny.load_error();
        assert!(
            message.contains("missing metadata key 'llama.embedding_length'"),
            "{message}"
        );

        let tiny = TinyModel::new("gemma");
        let message = tiny.load_error();
        assert!(message.contains("architecture 'gemma'"), "{message}");
    }
}
