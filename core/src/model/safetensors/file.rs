//! The safetensors reader: checks the header length and every tensor's
//! dtype, shape and byte range against the file before using them.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::{FORMAT_METADATA_PREFIX, METADATA_KEY, QUANTIZED_DTYPE};
use crate::model::{Bytes, TensorInfo};
use crate::quant::WeightFormat;
use crate::{Error, Result};

/// A parsed safetensors file.
pub struct SafetensorsFile {
    /// Names as in the file; shapes innermost first; offsets absolute and in
    /// bounds; `file` is 0.
    pub tensors: Vec<TensorInfo>,
    /// The header's `__metadata__` entries.
    pub metadata: Vec<(String, String)>,
    pub bytes: Arc<Bytes>,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// The reference implementation's limit; a larger header is corrupt.
const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Weight tensors of the models Tandem runs have at most two dimensions; GGUF allows four.
const MAX_DIMS: usize = 4;

fn dtype_format(dtype: &str) -> Option<WeightFormat> {
    match dtype {
        "F32" => Some(WeightFormat::F32),
        "F16" => Some(WeightFormat::F16),
        "BF16" => Some(WeightFormat::BF16),
        _ => None,
    }
}

impl SafetensorsFile {
    /// Memory-maps and parses `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &Path) -> Result<Self> {
        Self::parse(Arc::new(Bytes::map(path)?), path)
    }

    /// Parses a whole file held in `bytes`; `path` only names it in errors.
    pub fn parse(bytes: Arc<Bytes>, path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::bad_file(path, reason);
        let file_len = bytes.len();
        let header_len = bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| {
                bad(format!(
                    "truncated: {file_len} bytes is too short for a safetensors header"
                ))
            })?;
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {header_len} exceeds {MAX_HEADER_BYTES} bytes: not a safetensors file"
            )));
        }
        let data_start = 8 + header_len as usize;
        if data_start > file_len {
            return Err(bad(format!(
                "truncated: header length {header_len} runs past the end of the file (size {file_len} bytes)"
            )));
        }
        let header: serde_json::Map<String, Value> = bytes
            .get(8..data_start)
            .ok_or_else(|| bad("header lies outside the file".into()))
            .and_then(|json| {
                serde_json::from_slice(json)
                    .map_err(|e| bad(format!("header is not a JSON object: {e}")))
            })?;
        let mut header = header;
        let data_len = (file_len - data_start) as u64;
        let metadata = match header.remove(METADATA_KEY) {
            Some(value) => parse_metadata(value).map_err(&bad)?,
            None => Vec::new(),
        };
        let mut quantized = BTreeMap::new();
        for (key, value) in &metadata {
            if let Some(tensor) = key.strip_prefix(FORMAT_METADATA_PREFIX) {
                let format = WeightFormat::from_name(value)
                    .filter(|f| f.is_quantized())
                    .ok_or_else(|| {
                        bad(format!(
                            "{key} is '{value}', not a quantized format Tandem knows"
                        ))
                    })?;
                quantized.insert(tensor.to_string(), format);
            }
        }
        if let Some(name) = quantized.keys().find(|name| !header.contains_key(*name)) {
            return Err(bad(format!(
                "{FORMAT_METADATA_PREFIX}{name} names a tensor the file does not have"
            )));
        }
        let mut tensors = Vec::with_capacity(header.len());
        for (name, value) in header {
            let entry: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| bad(format!("tensor '{name}': malformed header entry: {e}")))?;
            let format = quantized.remove(&name);
            tensors.push(check_entry(name, entry, format, data_start, data_len).map_err(&bad)?);
        }
        check_coverage(&tensors, data_start, data_len).map_err(&bad)?;
        Ok(SafetensorsFile {
            tensors,
            metadata,
            bytes,
        })
    }
}

fn parse_metadata(value: Value) -> std::result::Result<Vec<(String, String)>, String> {
    let Value::Object(map) = value else {
        return Err(format!("{METADATA_KEY} is not a JSON object"));
    };
    map.into_iter()
        .map(|(key, value)| match value {
            Value::String(s) => Ok((key, s)),
            other => Err(format!(
                "{METADATA_KEY} entry '{key}' is {other}, not a string"
            )),
        })
        .collect()
}

/// Checks one header entry's dtype, shape and data range; `quantized` is
/// the format `__metadata__` gives the tensor.
fn check_entry(
    name: String,
    entry: HeaderEntry,
    quantized: Option<WeightFormat>,
    data_start: usize,
    data_len: u64,
) -> std::result::Result<TensorInfo, String> {
    let HeaderEntry {
        dtype,
        shape,
        data_offsets: [begin, end],
    } = entry;
    if let Some(format) = quantized {
        return check_quantized_entry(
            name,
            format,
            &dtype,
            &shape,
            [begin, end],
            data_start,
            data_len,
        );
    }
    let format = dtype_format(&dtype).ok_or_else(|| {
        format!(
            "tensor '{name}' has dtype {dtype}, which Tandem does not read (F32, F16, BF16, \
             or U8 with a {FORMAT_METADATA_PREFIX} entry)"
        )
    })?;
    if shape.len() > MAX_DIMS {
        return Err(format!(
            "tensor '{name}' has {} dimensions (at most {MAX_DIMS})",
            shape.len()
        ));
    }
    // `TensorInfo::rows()` multiplies all but one dimension, so even with a
    // zero among them the product of the others must fit a usize.
    let nonzero_product = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
        .filter(|&p| usize::try_from(p).is_ok());
    let elems = nonzero_product.map(|p| if shape.contains(&0) { 0 } else { p });
    let len = elems
        .and_then(|elems| format.bytes_for(1, elems))
        .ok_or_else(|| format!("tensor '{name}' has absurd shape {shape:?}: its size overflows"))?;
    check_range(&name, [begin, end], data_len)?;
    if end - begin != len {
        return Err(format!(
            "tensor '{name}' ({dtype}, shape {shape:?}) needs {len} bytes, but its data_offsets span {}",
            end - begin
        ));
    }
    // Each dimension is at most `nonzero_product` and the range lies inside
    // the file, so all of them fit a usize.
    Ok(TensorInfo {
        name,
        format,
        shape: shape.iter().rev().map(|&d| d as usize).collect(),
        file: 0,
        offset: data_start + begin as usize,
        len: len as usize,
    })
}

fn check_range(
    name: &str,
    [begin, end]: [u64; 2],
    data_len: u64,
) -> std::result::Result<(), String> {
    if begin > end || end > data_len {
        return Err(format!(
            "tensor '{name}' data_offsets [{begin}, {end}] run past the end of the data \
             ({data_len} bytes): the file is truncated or corrupt"
        ));
    }
    Ok(())
}

/// Checks that the tensors' ranges cover the data section exactly, as the
/// format requires (the reference implementation's `Metadata::validate` and
/// `read_metadata`): sorted by offset, each starts where the one before ends
/// (the first at 0), and the last ends at the end of the file. A tensor
/// shifted, overlapping another or leaving a hole is a corrupt file, whose
/// weights would be read from the wrong bytes.
fn check_coverage(
    tensors: &[TensorInfo],
    data_start: usize,
    data_len: u64,
) -> std::result::Result<(), String> {
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|t| {
            let begin = (t.offset - data_start) as u64;
            (begin, begin + t.len as u64, t.name.as_str())
        })
        .collect();
    spans.sort_unstable();
    let mut covered: u64 = 0;
    let mut previous: Option<(u64, u64, &str)> = None;
    for &(begin, end, name) in &spans {
        match previous {
            Some((p_begin, p_end, p_name)) if begin < covered => {
                return Err(format!(
                    "tensor '{name}' data_offsets [{begin}, {end}] overlap tensor '{p_name}' \
                     ([{p_begin}, {p_end}]): the file is corrupt"
                ))
            }
            _ if begin > covered => {
                let after = previous.map_or(String::new(), |(_, _, p_name)| {
                    format!(" (after tensor '{p_name}')")
                });
                return Err(format!(
                    "tensor '{name}' data_offsets [{begin}, {end}] leave bytes {covered}..{begin} \
                     of the data to no tensor{after}: the offsets must cover the data exactly"
                ));
            }
            _ => {}
        }
        covered = end;
        previous = Some((begin, end, name));
    }
    if covered != data_len {
        return Err(format!(
            "the tensors end at byte {covered} of the data, which has {data_len}: \
             {} bytes at the end belong to no tensor",
            data_len - covered
        ));
    }
    Ok(())
}

/// Checks a quantized matrix stored as `U8 [rows, row_bytes]`.
fn check_quantized_entry(
    name: String,
    format: WeightFormat,
    dtype: &str,
    shape: &[u64],
    [begin, end]: [u64; 2],
    data_start: usize,
    data_len: u64,
) -> std::result::Result<TensorInfo, String> {
    let &[rows, row_bytes] = shape else {
        return Err(format!(
            "tensor '{name}' is {format} with shape {shape:?}; quantized tensors are stored as \
             [rows, row_bytes]"
        ));
    };
    if dtype != QUANTIZED_DTYPE {
        return Err(format!(
            "tensor '{name}' is {format} but has dtype {dtype}, not {QUANTIZED_DTYPE}"
        ));
    }
    let blocks_bytes = row_bytes.checked_sub(format.row_head_bytes() as u64);
    let cols = blocks_bytes
        .filter(|b| b % format.block_bytes() as u64 == 0)
        .map(|b| b / format.block_bytes() as u64 * format.block_elems() as u64)
        .filter(|&cols| format.bytes_for(1, cols) == Some(row_bytes))
        .ok_or_else(|| {
            format!("tensor '{name}' rows of {row_bytes} bytes are not whole rows of {format}")
        })?;
    check_range(&name, [begin, end], data_len)?;
    let len = rows.checked_mul(row_bytes);
    if len != Some(end - begin) {
        return Err(format!(
            "tensor '{name}' ({format}, {rows} rows of {row_bytes} bytes) does not match its \
             data_offsets span of {} bytes",
            end - begin
        ));
    }
    // The range lies inside the file, so rows and cols fit a usize.
    Ok(TensorInfo {
        name,
        format,
        shape: vec![cols as usize, rows as usize],
        file: 0,
        offset: data_start + begin as usize,
        len: (end - begin) as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::test_values;
    use super::super::SafetensorsWriter;
    use super::*;
    use crate::quant::quantize_row;

    fn parse(bytes: Vec<u8>) -> Result<SafetensorsFile> {
        SafetensorsFile::parse(Arc::new(Bytes::Owned(bytes)), Path::new("test.safetensors"))
    }

    fn parse_error(bytes: Vec<u8>) -> String {
        match parse(bytes) {
            Err(e @ Error::BadModelFile { .. }) => e.to_string(),
            Err(other) => panic!("expected a BadModelFile error, got {other}"),
            Ok(_) => panic!("parsed a bad file"),
        }
    }

    /// A file with `header` as its JSON and `data_len` zero bytes of data.
    fn raw_file(header: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }
    #[test]
    fn round_trip_keeps_tensors_and_metadata() {
        let mut w = SafetensorsWriter::new();
        w.add_metadata("format", "pt");
        let mut written = Vec::new();
        for (format, shape) in [
            (WeightFormat::F32, vec![2, 3]),
            (WeightFormat::F16, vec![5]),
            (WeightFormat::BF16, vec![2, 2, 2]),
        ] {
            let data = quantize_row(format, &test_values(shape.iter().product()));
            let name = format!("w.{format}");
            w.add_tensor(&name, format, &shape, data.clone()).unwrap();
            written.push((name, format, shape, data));
        }
        assert!(w
            .add_tensor("q", WeightFormat::Q8_0, &[32], vec![0; 34])
            .is_err());
        assert!(w
            .add_tensor("short", WeightFormat::F32, &[2], vec![0; 4])
            .is_err());
        let bytes = w.to_bytes();
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()) % 8, 0);
        let file = parse(bytes).unwrap();
        assert_eq!(
            file.metadata,
            vec![("format".to_string(), "pt".to_string())]
        );
        assert_eq!(file.tensors.len(), 3);
        for (name, format, shape, data) in written {
            let info = file.tensors.iter().find(|t| t.name == name).unwrap();
            assert_eq!(info.format, format);
            let innermost_first: Vec<usize> = shape.iter().rev().copied().collect();
            assert_eq!(info.shape, innermost_first);
            assert_eq!(
                &file.bytes[info.offset..info.offset + info.len],
                data.as_slice()
            );
        }
    }

    #[test]
    fn quantized_tensors_round_trip_as_bytes_with_their_format() {
        let mut w = SafetensorsWriter::new();
        // A k-quant super-block, so every format's rows are whole blocks.
        let (rows, cols) = (3, crate::quant::QK_K);
        let values = test_values(rows * cols);
        let mut written = Vec::new();
        for format in WeightFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            let data = crate::quant::quantize_matrix(format, cols, &values);
            let name = format!("w.{format}");
            w.add_tensor(&name, format, &[rows, cols], data.clone())
                .unwrap();
            written.push((name, format, data));
        }
        let int8 = WeightFormat::Int8PerChannel;
        let one_row = crate::quant::quantize_row(int8, &values[..cols]);
        assert!(w.add_tensor("flat", int8, &[cols], one_row).is_err());
        let file = parse(w.to_bytes()).unwrap();
        assert!(file.metadata.contains(&(
            format!("{FORMAT_METADATA_PREFIX}w.INT4_G128"),
            "INT4_G128".to_string()
        )));
        for (name, format, data) in written {
            let info = file.tensors.iter().find(|t| t.name == name).unwrap();
            assert_eq!(
                (info.format, info.cols(), info.rows()),
                (format, cols, rows)
            );
            assert_eq!(
                &file.bytes[info.offset..info.offset + info.len],
                data.as_slice()
            );
        }
    }

    #[test]
    fn bad_quantized_entries_are_named() {
        let meta = |format: &str, tensor: &str| {
            format!(r#""__metadata__": {{"{FORMAT_METADATA_PREFIX}{tensor}": "{format}"}}"#)
        };
        let entry = r#""w": {"dtype": "U8", "shape": [2, 68], "data_offsets": [0, 136]}"#;
        let ok = format!("{{{}, {entry}}}", meta("INT8", "w"));
        let file = parse(raw_file(&ok, 136)).unwrap();
        assert_eq!(file.tensors[0].shape, vec![64, 2]);
        let cases = [
            (meta("INT8", "v"), "names a tensor the file does not have"),
            (
                meta("Q4_0", "w"),
                "rows of 68 bytes are not whole rows of Q4_0",
            ),
            (meta("F16", "w"), "not a quantized format Tandem knows"),
            (meta("INT9", "w"), "not a quantized format Tandem knows"),
        ];
        for (metadata, expected) in cases {
            let message = parse_error(raw_file(&format!("{{{metadata}, {entry}}}"), 136));
            assert!(message.contains(expected), "{message}");
        }
        let f32_entry = r#""w": {"dtype": "F32", "shape": [2, 17], "data_offsets": [0, 136]}"#;
        let message = parse_error(raw_file(
            &format!("{{{}, {f32_entry}}}", meta("INT8", "w")),
            136,
        ));
        assert!(message.contains("has dtype F32, not U8"), "{message}");
        let short = r#""w": {"dtype": "U8", "shape": [2, 68], "data_offsets": [0, 100]}"#;
        let message = parse_error(raw_file(
            &format!("{{{}, {short}}}", meta("INT8", "w")),
            136,
        ));
        assert!(
            message.contains("does not match its data_offsets span of 100"),
            "{message}"
        );
    }

    #[test]
    fn bad_header_length_is_named() {
        let message = parse_error(vec![1, 2, 3]);
        assert!(message.contains("3 bytes is too short"), "{message}");
        let mut bytes = raw_file("{}", 0);
        bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let message = parse_error(bytes.clone());
        assert!(
            message.contains("header length 18446744073709551615 exceeds"),
            "{message}"
        );
        bytes[..8].copy_from_slice(&1000u64.to_le_bytes());
        let message = parse_error(bytes);
        assert!(
            message.contains(
                "truncated: header length 1000 runs past the end of the file (size 10 bytes)"
            ),
            "{message}"
        );
        let message = parse_error(raw_file("[1, 2]", 0));
        assert!(message.contains("header is not a JSON object"), "{message}");
    }

    #[test]
    fn offsets_past_the_end_are_named() {
        let header = r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}"#;
        let message = parse_error(raw_file(header, 31));
        assert!(
            message.contains(
                "tensor 'w' data_offsets [16, 32] run past the end of the data (31 bytes)"
            ),
            "{message}"
        );
        let header = r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(
            message.contains("needs 16 bytes, but its data_offsets span 8"),
            "{message}"
        );
        let header = r#"{"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 1099511627776], "data_offsets": [0, 8]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(message.contains("absurd shape"), "{message}");
    }

    #[test]
    fn tensors_must_cover_the_data_exactly() {
        let header = |a: [u64; 2], b: [u64; 2]| {
            format!(
                r#"{{"a": {{"dtype": "F32", "shape": [4], "data_offsets": [{}, {}]}},
                    "b": {{"dtype": "F32", "shape": [2], "data_offsets": [{}, {}]}}}}"#,
                a[0], a[1], b[0], b[1]
            )
        };
        let file = parse(raw_file(&header([8, 24], [0, 8]), 24)).unwrap();
        assert_eq!(
            file.tensors.len(),
            2,
            "in any order, as long as they tile the data"
        );
        let cases = [
            // b shifted by 4 bytes: it overlaps a.
            (
                header([0, 16], [12, 20]),
                20,
                "tensor 'b' data_offsets [12, 20] overlap tensor 'a' ([0, 16])",
            ),
            // b shifted the other way: a hole between them.
            (
                header([0, 16], [20, 28]),
                28,
                "tensor 'b' data_offsets [20, 28] leave bytes 16..20 of the data to no tensor \
                 (after tensor 'a')",
            ),
            // Both shifted: a hole at the start.
            (
                header([4, 20], [20, 28]),
                28,
                "tensor 'a' data_offsets [4, 20] leave bytes 0..4 of the data to no tensor:",
            ),
            // Both at the same place.
            (
                header([0, 16], [0, 8]),
                16,
                "tensor 'a' data_offsets [0, 16] overlap tensor 'b' ([0, 8])",
            ),
            // Bytes past the last tensor.
            (
                header([0, 16], [16, 24]),
                40,
                "the tensors end at byte 24 of the data, which has 40: 16 bytes at the end",
            ),
        ];
        for (header, data_len, expected) in cases {
            let message = parse_error(raw_file(&header, data_len));
            assert!(message.contains(expected), "{message}");
        }
        let message = parse_error(raw_file("{}", 8));
        assert!(
            message.contains("8 bytes at the end belong to no tensor"),
            "{message}"
        );
    }

    #[test]
    fn unsupported_dtype_is_named() {
        let header = r#"{"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}"#;
        let message = parse_error(raw_file(header, 16));
        assert!(message.contains("tensor 'ids' has dtype I64"), "{message}");
        let header = r#"{"w": {"dtype": "F32", "shape": [2]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(
            message.contains("tensor 'w': malformed header entry"),
            "{message}"
        );
    }
}
