//! A bounds-checked cursor over a GGUF file's bytes that charges every
//! allocation to a memory budget, and reads metadata values with it.
//!
//! Arrays are kept by element type ([`GgufArray`]), so an array takes at most
//! the bytes it occupies in the file, and hold at most [`MAX_ARRAY_LEN`]
//! elements. Everything parsing a header allocates (keys, values, arrays,
//! nested arrays, tensor infos, the lists that find duplicate names) is
//! charged to a [`Budget`] before it is allocated: [`HEADER_MEMORY_CAP`], or
//! four times the file's length plus 1 MiB when that is smaller. Real files
//! stay far below both: their arrays cost about what they take in the file (a
//! vocabulary), and their other entries are few; only a crafted file of many
//! tiny entries approaches the multiple.

use super::value::ARRAY_TYPE_ID;
use super::{GgufArray, GgufValue, StringArray};

/// The most elements one array may hold: 64 times the largest vocabulary of a
/// model Tandem runs (Gemma 3's 262,144 tokens), and a bound on any one
/// array's memory before the budget's.
pub const MAX_ARRAY_LEN: usize = 1 << 24;
/// The most memory parsing one file's header may take. About 40 times what
/// the largest real header needs (Gemma 3's vocabulary: 262,144 token
/// strings, scores and types, ~6 MB).
pub const HEADER_MEMORY_CAP: usize = 256 << 20;
/// The budget is also at most this many bytes per byte of the file, plus
/// [`HEADER_MEMORY_SLACK`] so small test files need not count.
pub(super) const HEADER_MEMORY_PER_FILE_BYTE: usize = 4;
pub(super) const HEADER_MEMORY_SLACK: usize = 1 << 20;

/// Real files nest arrays at most one deep; the bound keeps a hostile file from
/// recursing the reader off its stack.
const MAX_ARRAY_NESTING: usize = 8;

/// Bytes taken by the smallest value of a type (an empty string or array for
/// those), or `None` for an unknown type id.
fn min_value_bytes(type_id: u32) -> Option<u64> {
    match type_id {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        8 => Some(8),
        ARRAY_TYPE_ID => Some(4 + 8),
        10..=12 => Some(8),
        _ => None,
    }
}

/// Why a read from the file failed, before the caller adds what it was reading.
pub(super) enum ReadError {
    /// The item runs past the end of the file.
    Truncated,
    /// A length or count field claims more than the rest of the file can hold.
    TooLong {
        what: &'static str,
        value: u64,
    },
    /// A count over one of the reader's own limits.
    OverLimit {
        what: &'static str,
        value: usize,
        limit: usize,
    },
    /// Allocating the item would take the header past its memory budget.
    OverBudget {
        budget: usize,
    },
    Invalid(String),
}

/// Memory parsing may still allocate; every allocation is charged before it is made.
pub(super) struct Budget {
    total: usize,
    left: usize,
}

impl Budget {
    pub(super) fn for_file(file_len: usize) -> Self {
        let relative = file_len
            .saturating_mul(HEADER_MEMORY_PER_FILE_BYTE)
            .saturating_add(HEADER_MEMORY_SLACK);
        Self::new(relative.min(HEADER_MEMORY_CAP))
    }

    pub(super) fn new(total: usize) -> Self {
        Budget { total, left: total }
    }

    pub(super) fn charge(&mut self, bytes: usize) -> Result<(), ReadError> {
        self.left = self
            .left
            .checked_sub(bytes)
            .ok_or(ReadError::OverBudget { budget: self.total })?;
        Ok(())
    }

    /// Charges `count` items of `T`, before a `Vec::with_capacity(count)`.
    pub(super) fn charge_items<T>(&mut self, count: usize) -> Result<(), ReadError> {
        self.charge(count.saturating_mul(size_of::<T>()))
    }
}

/// A cursor over the file's bytes; every read is bounds-checked and every
/// allocation charged to the budget.
pub(super) struct Reader<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
    pub(super) budget: Budget,
}

impl<'a> Reader<'a> {
    pub(super) fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or(ReadError::Truncated)?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        <[u8; N]>::try_from(self.take(N)?).map_err(|_| ReadError::Truncated)
    }

    pub(super) fn u32(&mut self) -> Result<u32, ReadError> {
        self.array().map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self) -> Result<u64, ReadError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A `u64` count of items of at least `min_item_bytes` each, checked to fit in the rest of the file.
    pub(super) fn count(
        &mut self,
        what: &'static str,
        min_item_bytes: u64,
    ) -> Result<usize, ReadError> {
        let value = self.u64()?;
        let fits = value
            .checked_mul(min_item_bytes)
            .is_some_and(|bytes| bytes <= self.remaining());
        match usize::try_from(value) {
            Ok(count) if fits => Ok(count),
            _ => Err(ReadError::TooLong { what, value }),
        }
    }

    /// A string, borrowed from the file.
    pub(super) fn str(&mut self) -> Result<&'a str, ReadError> {
        let len = self.count("string length", 1)?;
        std::str::from_utf8(self.take(len)?)
            .map_err(|_| ReadError::Invalid("string is not valid UTF-8".into()))
    }

    pub(super) fn string(&mut self) -> Result<String, ReadError> {
        let s = self.str()?;
        self.budget.charge(s.len())?;
        Ok(s.to_owned())
    }

    pub(super) fn value(&mut self, type_id: u32, nesting: usize) -> Result<GgufValue, ReadError> {
        Ok(match type_id {
            0 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => GgufValue::Bool(self.bool()?),
            8 => GgufValue::String(self.string()?),
            ARRAY_TYPE_ID => GgufValue::Array(self.gguf_array(nesting)?),
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(ReadError::Invalid(format!("unknown value type {other}"))),
        })
    }

    fn bool(&mut self) -> Result<bool, ReadError> {
        let [byte] = self.array::<1>()?;
        byte_to_bool(byte)
    }

    fn bools(&mut self, count: usize) -> Result<Vec<bool>, ReadError> {
        let bytes = self.take(count)?;
        self.budget.charge_items::<bool>(count)?;
        let mut items = Vec::with_capacity(count);
        for &byte in bytes {
            items.push(byte_to_bool(byte)?);
        }
        Ok(items)
    }

    /// An array's element type, count and elements, stored by element type.
    fn gguf_array(&mut self, nesting: usize) -> Result<GgufArray, ReadError> {
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
        if count > MAX_ARRAY_LEN {
            return Err(ReadError::OverLimit {
                what: "array length",
                value: count,
                limit: MAX_ARRAY_LEN,
            });
        }
        Ok(match item_type {
            0 => GgufArray::U8(self.scalars(count, u8::from_le_bytes)?),
            1 => GgufArray::I8(self.scalars(count, i8::from_le_bytes)?),
            2 => GgufArray::U16(self.scalars(count, u16::from_le_bytes)?),
            3 => GgufArray::I16(self.scalars(count, i16::from_le_bytes)?),
            4 => GgufArray::U32(self.scalars(count, u32::from_le_bytes)?),
            5 => GgufArray::I32(self.scalars(count, i32::from_le_bytes)?),
            6 => GgufArray::F32(self.scalars(count, f32::from_le_bytes)?),
            7 => GgufArray::Bool(self.bools(count)?),
            8 => GgufArray::String(self.strings(count)?),
            ARRAY_TYPE_ID => {
                self.budget.charge_items::<GgufArray>(count)?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.gguf_array(nesting + 1)?);
                }
                GgufArray::Array(items)
            }
            10 => GgufArray::U64(self.scalars(count, u64::from_le_bytes)?),
            11 => GgufArray::I64(self.scalars(count, i64::from_le_bytes)?),
            _ => GgufArray::F64(self.scalars(count, f64::from_le_bytes)?),
        })
    }

    /// `count` fixed-size elements of `N` bytes each, decoded in one pass.
    fn scalars<T, const N: usize>(
        &mut self,
        count: usize,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ReadError> {
        let len = count.checked_mul(N).ok_or(ReadError::Truncated)?;
        let bytes = self.take(len)?;
        self.budget.charge_items::<T>(count)?;
        let (elements, _) = bytes.as_chunks::<N>();
        Ok(elements.iter().map(|&element| decode(element)).collect())
    }

    /// `count` strings in one text buffer: a first pass checks them and sums
    /// their lengths, so the buffer is charged and allocated once, exactly.
    fn strings(&mut self, count: usize) -> Result<StringArray, ReadError> {
        let start = self.pos;
        let mut text_len = 0;
        for _ in 0..count {
            text_len += self.str()?.len();
        }
        self.budget.charge(text_len)?;
        self.budget.charge_items::<usize>(count)?;
        self.pos = start;
        let mut text = String::with_capacity(text_len);
        let mut ends = Vec::with_capacity(count);
        for _ in 0..count {
            text.push_str(self.str()?);
            ends.push(text.len());
        }
        Ok(StringArray::from_parts(text, ends))
    }
}

fn byte_to_bool(byte: u8) -> Result<bool, ReadError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(ReadError::Invalid(format!("bool value is {b}, not 0 or 1"))),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::super::testing::parse;
    use super::super::{GgufFile, GgufWriter};
    use super::*;
    use crate::model::Bytes;

    /// A file whose metadata is `entries`, without tensors.
    fn file_of(entries: Vec<(String, GgufValue)>) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (key, value) in entries {
            w.add_metadata(&key, value).unwrap();
        }
        w.to_bytes()
    }

    fn one_entry(key: &str, value: GgufValue) -> Vec<u8> {
        file_of(vec![(key.to_string(), value)])
    }

    fn error_of(parsed: crate::Result<GgufFile>) -> String {
        match parsed {
            Ok(_) => panic!("parsed a file over its limits"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn arrays_take_no_more_memory_than_their_bytes_in_the_file() {
        const N: usize = 1 << 16;
        let arrays = [
            GgufArray::U8(vec![7; N]),
            GgufArray::I8(vec![-7; N]),
            GgufArray::U16(vec![7; N]),
            GgufArray::I16(vec![-7; N]),
            GgufArray::U32(vec![7; N]),
            GgufArray::I32(vec![-7; N]),
            GgufArray::F32(vec![0.5; N]),
            GgufArray::Bool(vec![true; N]),
            GgufArray::String((0..N).map(|i| (i % 10).to_string()).collect()),
            GgufArray::U64(vec![7; N]),
            GgufArray::I64(vec![-7; N]),
            GgufArray::F64(vec![0.5; N]),
        ];
        for array in arrays {
            let type_name = array.element_type_name();
            let bytes = one_entry("big", GgufValue::Array(array.clone()));
            let file = parse(bytes.clone()).unwrap();
            assert_eq!(file.get_array("big"), Some(&array), "{type_name}");
            // The entry itself (key, value slot) is a few dozen bytes more.
            let memory = file.metadata_memory();
            assert!(
                memory <= bytes.len() + 128,
                "{type_name}: {memory} bytes in memory for a file of {} bytes",
                bytes.len()
            );
        }
    }

    #[test]
    fn an_array_longer_than_the_limit_is_refused_naming_its_key() {
        // Issue #21's file: a u8 array whose count is the bytes left in the
        // file, here just past the limit (16 MiB rather than 92 MB).
        let huge = GgufValue::Array(GgufArray::U8(vec![0; MAX_ARRAY_LEN + 1]));
        let bytes = file_of(vec![
            ("general.name".into(), GgufValue::String("huge".into())),
            ("huge.bytes".into(), huge),
        ]);
        let message = error_of(parse(bytes));
        assert!(
            message.contains(
                "metadata entry 2 of 2 ('huge.bytes'): array length 16777217 is over the limit of 16777216"
            ),
            "{message}"
        );
    }

    #[test]
    fn string_arrays_over_the_budget_are_refused_naming_their_key() {
        let tokens: StringArray = (0..10_000).map(|i| format!("token{i}")).collect();
        let bytes = one_entry(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(tokens)),
        );
        let parse_within = |budget| {
            let bytes = Arc::new(Bytes::Owned(bytes.clone()));
            GgufFile::parse_within(bytes, Path::new("test.gguf"), Budget::new(budget))
        };
        // 10,000 strings of ~9 bytes and their ends: ~170 KB.
        let message = error_of(parse_within(64 << 10));
        assert!(
            message.contains(
                "metadata entry 1 of 1 ('tokenizer.ggml.tokens'): the metadata and tensor infos \
                 would take more than 65536 bytes of memory"
            ),
            "{message}"
        );
        let file = parse_within(256 << 10).unwrap();
        assert!(file.metadata_memory() <= 256 << 10);
        assert_eq!(
            file.get_array("tokenizer.ggml.tokens").unwrap().len(),
            10_000
        );
    }

    #[test]
    fn many_tiny_entries_cannot_amplify_a_file() {
        // Each entry (a distinct 3-character key, a u8) is 16 bytes of file
        // but a 72-byte slot and its key in memory: past four times the file
        // once over the 1 MiB slack, so the slots are refused before they are
        // allocated. Written by hand: the writer checks keys one by one.
        const N: u64 = 200_000;
        const ALPHABET: &[u8; 64] =
            b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_";
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(3u32.to_le_bytes());
        bytes.extend(0u64.to_le_bytes());
        bytes.extend(N.to_le_bytes());
        for i in 0..N as usize {
            bytes.extend(3u64.to_le_bytes());
            bytes.extend([i / 4096, i / 64 % 64, i % 64].map(|d| ALPHABET[d]));
            bytes.extend(0u32.to_le_bytes());
            bytes.push(0);
        }
        let message = error_of(parse(bytes.clone()));
        let allowed = 4 * bytes.len() + HEADER_MEMORY_SLACK;
        assert!(
            message.contains(&format!(
                "metadata (200000 entries): the metadata and tensor infos would take more \
                 than {allowed} bytes"
            )),
            "{message}"
        );
    }
}
