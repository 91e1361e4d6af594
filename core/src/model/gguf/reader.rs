//! The GGUF reader: parses the header, metadata and tensor infos of a file it
//! treats as hostile, checking every count, length, offset and size against the
//! bytes that remain before using it.
//!
//! Memory is bounded as well as reads: the [`cursor`](super::cursor) charges
//! every allocation to a budget, and a file over it fails with an error naming
//! the entry being read.

use std::path::Path;
use std::sync::Arc;

use super::cursor::{
    Budget, ReadError, Reader, HEADER_MEMORY_CAP, HEADER_MEMORY_PER_FILE_BYTE, HEADER_MEMORY_SLACK,
};
use super::{GgufArray, GgufValue, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::model::{Bytes, TensorInfo};
use crate::quant::WeightFormat;
use crate::{Error, Result};

/// A parsed GGUF file: its metadata, and where each tensor lies in `bytes`.
pub struct GgufFile {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    /// Offsets are absolute (from the start of the file) and checked to be in bounds.
    pub tensors: Vec<TensorInfo>,
    pub bytes: Arc<Bytes>,
}

/// Smallest possible encodings, used to reject counts the rest of the file cannot hold:
/// a metadata entry is an empty key, a type and a one-byte value; a tensor info
/// is an empty name, `n_dims`, a type and an offset.
const MIN_METADATA_ENTRY_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

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
            ReadError::OverLimit { what, value, limit } => {
                format!("{context}: {what} {value} is over the limit of {limit}")
            }
            ReadError::OverBudget { budget } => format!(
                "{context}: the metadata and tensor infos would take more than {budget} bytes \
                 of memory (the limit is {HEADER_MEMORY_CAP} bytes, or \
                 {HEADER_MEMORY_PER_FILE_BYTE} times the file's size plus \
                 {HEADER_MEMORY_SLACK} when smaller)"
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
        self.reader
            .budget
            .charge_items::<(String, GgufValue)>(count)
            .map_err(|e| self.fail(&format!("metadata ({count} entries)"), e))?;
        let mut entries = Vec::with_capacity(count);
        for i in 1..=count {
            let context = format!("metadata entry {i} of {count}");
            let key = self.reader.string().map_err(|e| self.fail(&context, e))?;
            let context = format!("{context} ('{key}')");
            let value = self
                .reader
                .u32()
                .and_then(|type_id| self.reader.value(type_id, 0))
                .map_err(|e| self.fail(&context, e))?;
            entries.push((key, value));
        }
        let keys = entries.iter().map(|(key, _)| key.as_str());
        if let Some(key) = self.duplicate("metadata", keys)? {
            return Err(self.bad(format!("metadata key '{key}' appears twice")));
        }
        Ok(entries)
    }

    /// The first name that appears twice among `names`, found by sorting a
    /// list of them (charged to the budget: one `&str` per name).
    fn duplicate<'n>(
        &mut self,
        what: &str,
        names: impl ExactSizeIterator<Item = &'n str>,
    ) -> Result<Option<&'n str>> {
        self.reader
            .budget
            .charge_items::<&str>(names.len())
            .map_err(|e| self.fail(&format!("{what} names"), e))?;
        let mut sorted: Vec<&str> = names.collect();
        sorted.sort_unstable();
        Ok(sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]))
    }

    fn tensor_infos(&mut self, count: usize) -> Result<Vec<RawTensorInfo>> {
        self.reader
            .budget
            .charge_items::<RawTensorInfo>(count)
            .map_err(|e| self.fail(&format!("tensor infos ({count} tensors)"), e))?;
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
            self.reader
                .budget
                .charge_items::<u64>(n_dims as usize)
                .map_err(|e| self.fail(&context, e))?;
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
        let budget = Budget::for_file(bytes.len());
        Self::parse_within(bytes, path, budget)
    }

    pub(super) fn parse_within(bytes: Arc<Bytes>, path: &Path, budget: Budget) -> Result<Self> {
        let mut parser = Parser {
            reader: Reader {
                data: &bytes,
                pos: 0,
                budget,
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
                        "{ALIGNMENT_KEY} is {}; it must be a power of two",
                        value.brief()
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
        let names = raw_tensors.iter().map(|raw| raw.name.as_str());
        if let Some(name) = parser.duplicate("tensor", names)? {
            return Err(parser.bad(format!("tensor '{name}' appears twice")));
        }
        parser
            .reader
            .budget
            .charge_items::<TensorInfo>(raw_tensors.len())
            .map_err(|e| parser.fail(&format!("tensor infos ({tensor_count} tensors)"), e))?;
        let tensors = raw_tensors
            .into_iter()
            .map(|raw| parser.tensor(raw, alignment as u64, data_start))
            .collect::<Result<_>>()?;
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            bytes,
        })
    }

    /// Bytes the metadata takes in memory: the entries, their keys and values.
    pub fn metadata_memory(&self) -> usize {
        let entries = self.metadata.capacity() * size_of::<(String, GgufValue)>();
        let held: usize = self
            .metadata
            .iter()
            .map(|(key, value)| key.capacity() + value.heap_bytes())
            .sum();
        entries + held
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

    pub fn get_array(&self, key: &str) -> Option<&GgufArray> {
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

#[cfg(test)]
mod tests;
