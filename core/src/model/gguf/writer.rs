//! The GGUF writer: builds a version 3 file in memory or on disk.

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use super::{GgufArray, GgufValue, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::quant::WeightFormat;
use crate::{Error, Result};

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

const WRITTEN_VERSION: u32 = 3;

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

    /// Adds a metadata entry; `general.alignment` (a power of two) also sets
    /// the writer's alignment.
    pub fn add_metadata(&mut self, key: &str, value: GgufValue) -> Result<()> {
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(Error::InvalidRequest(format!(
                "GGUF metadata key '{key}' added twice"
            )));
        }
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
        if let Some(reason) = crate::model::data_size_mismatch(format, rows, shape[0], data.len()) {
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
        GgufValue::Array(items) => write_array(out, items),
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

fn write_array(out: &mut Vec<u8>, items: &GgufArray) {
    fn each<T: Copy, const N: usize>(out: &mut Vec<u8>, items: &[T], bytes: fn(T) -> [u8; N]) {
        items.iter().for_each(|&v| out.extend_from_slice(&bytes(v)));
    }
    out.extend_from_slice(&items.element_type_id().to_le_bytes());
    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
    match items {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => each(out, v, i8::to_le_bytes),
        GgufArray::U16(v) => each(out, v, u16::to_le_bytes),
        GgufArray::I16(v) => each(out, v, i16::to_le_bytes),
        GgufArray::U32(v) => each(out, v, u32::to_le_bytes),
        GgufArray::I32(v) => each(out, v, i32::to_le_bytes),
        GgufArray::F32(v) => each(out, v, f32::to_le_bytes),
        GgufArray::Bool(v) => each(out, v, |b| [u8::from(b)]),
        GgufArray::String(strings) => strings.iter().for_each(|s| write_string(out, s)),
        GgufArray::Array(arrays) => arrays.iter().for_each(|a| write_array(out, a)),
        GgufArray::U64(v) => each(out, v, u64::to_le_bytes),
        GgufArray::I64(v) => each(out, v, i64::to_le_bytes),
        GgufArray::F64(v) => each(out, v, f64::to_le_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{parse, test_values};
    use super::*;
    use crate::quant::quantize_row;

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
                GgufValue::Array(GgufArray::String(["a", "", "Ġthe"].into_iter().collect())),
            ),
            (
                "t.floats",
                GgufValue::Array(GgufArray::F32(vec![1.0, -1.0])),
            ),
            ("t.empty", GgufValue::Array(GgufArray::U64(vec![]))),
            (
                "t.nested",
                GgufValue::Array(GgufArray::Array(vec![
                    GgufArray::I32(vec![1]),
                    GgufArray::Bool(vec![false, true]),
                ])),
            ),
            ("t.u8s", GgufValue::Array(GgufArray::U8(vec![0, 255]))),
            ("t.i8s", GgufValue::Array(GgufArray::I8(vec![-128, 127]))),
            ("t.u16s", GgufValue::Array(GgufArray::U16(vec![65535]))),
            ("t.i16s", GgufValue::Array(GgufArray::I16(vec![-32768]))),
            ("t.u32s", GgufValue::Array(GgufArray::U32(vec![u32::MAX]))),
            (
                "t.u64s",
                GgufValue::Array(GgufArray::U64(vec![u64::MAX, 0])),
            ),
            ("t.i64s", GgufValue::Array(GgufArray::I64(vec![i64::MIN]))),
            (
                "t.f64s",
                GgufValue::Array(GgufArray::F64(vec![0.5, -1e300])),
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
        assert_eq!(file.get_array("t.strings").map(GgufArray::len), Some(3));
        let strings = file.get_array("t.strings").unwrap().as_strings().unwrap();
        assert_eq!(strings.iter().collect::<Vec<_>>(), ["a", "", "Ġthe"]);
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
                // A k-quant super-block, so every format's rows are whole blocks.
                let cols = crate::quant::QK_K;
                let shape = vec![cols, i + 1];
                let data = quantize_row(format, &test_values(cols * (i + 1)));
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
        w.add_metadata("k", GgufValue::U8(1)).unwrap();
        assert!(w.add_metadata("k", GgufValue::U8(2)).is_err());
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
}
