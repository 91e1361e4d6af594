//! The safetensors writer: float tensors under their dtype, quantized
//! matrices as `U8` bytes named in `__metadata__`. A large file is written
//! piece by piece: tensors declared without their bytes, the file created
//! with its header ([`SafetensorsWriter::create`]), then each piece written
//! at its place ([`SafetensorsFileWriter::write_at`]).

use std::collections::BTreeMap;
#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use serde_json::Value;

use super::{FORMAT_METADATA_PREFIX, METADATA_KEY, QUANTIZED_DTYPE};
use crate::quant::WeightFormat;
use crate::{Error, Result};

/// Builds a safetensors file in memory.
#[derive(Default)]
pub struct SafetensorsWriter {
    tensors: Vec<PendingTensor>,
    metadata: BTreeMap<String, String>,
}

struct PendingTensor {
    name: String,
    dtype: &'static str,
    /// Outermost first, as safetensors stores it (`[rows, row_bytes]` for a
    /// quantized matrix).
    shape: Vec<usize>,
    len: usize,
    /// `None` for a declared tensor: zeros until written into the file.
    data: Option<Vec<u8>>,
}

impl SafetensorsWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a `__metadata__` entry.
    pub fn add_metadata(&mut self, key: &str, value: &str) {
        self.metadata.insert(key.to_string(), value.to_string());
    }

    /// Adds a tensor of `shape`, outermost first as safetensors stores it
    /// (`[rows, cols]` for a matrix), in any format; a quantized one is a
    /// matrix, stored as `U8 [rows, row_bytes]` with its format named in
    /// `__metadata__`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        format: WeightFormat,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        self.push(name, format, shape, data.len(), Some(data))
    }

    /// Adds a tensor like [`add_tensor`](Self::add_tensor) without its
    /// bytes, which [`SafetensorsFileWriter::write_at`] writes later.
    pub fn declare_tensor(
        &mut self,
        name: &str,
        format: WeightFormat,
        shape: &[usize],
    ) -> Result<()> {
        let (rows, cols) = rows_cols(shape);
        let len = format
            .row_bytes(cols)
            .and_then(|row| row.checked_mul(rows))
            .ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "safetensors tensor '{name}': {format} cannot hold shape {shape:?}"
                ))
            })?;
        self.push(name, format, shape, len, None)
    }

    fn push(
        &mut self,
        name: &str,
        format: WeightFormat,
        shape: &[usize],
        len: usize,
        data: Option<Vec<u8>>,
    ) -> Result<()> {
        let invalid = |reason: String| {
            Err(Error::InvalidRequest(format!(
                "safetensors tensor '{name}': {reason}"
            )))
        };
        if name == METADATA_KEY || self.tensors.iter().any(|t| t.name == name) {
            return invalid("name is reserved or already used".into());
        }
        let (rows, cols) = rows_cols(shape);
        if format.is_quantized() && shape.len() != 2 {
            return invalid(format!(
                "a {format} tensor is a matrix, but the shape is {shape:?}"
            ));
        }
        if let Some(reason) = crate::model::data_size_mismatch(format, rows, cols, len) {
            return invalid(reason);
        }
        let (dtype, shape) = if format.is_quantized() {
            self.metadata.insert(
                format!("{FORMAT_METADATA_PREFIX}{name}"),
                format.name().to_string(),
            );
            (
                QUANTIZED_DTYPE,
                vec![rows, format.row_bytes(cols).unwrap_or(0)],
            )
        } else {
            (format.name(), shape.to_vec())
        };
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dtype,
            shape,
            len,
            data,
        });
        Ok(())
    }

    /// The whole file; a declared tensor's bytes are zeros.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (mut out, _) = self.header();
        for tensor in &self.tensors {
            match &tensor.data {
                Some(data) => out.extend_from_slice(data),
                None => out.resize(out.len() + tensor.len, 0),
            }
        }
        out
    }

    /// The length prefix and JSON header, and each tensor's data offset.
    fn header(&self) -> (Vec<u8>, Vec<usize>) {
        let mut header = serde_json::Map::new();
        if !self.metadata.is_empty() {
            let metadata = self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            header.insert(METADATA_KEY.to_string(), Value::Object(metadata));
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            offsets.push(offset);
            let end = offset + tensor.len;
            header.insert(
                tensor.name.clone(),
                serde_json::json!({
                    "dtype": tensor.dtype,
                    "shape": tensor.shape,
                    "data_offsets": [offset, end],
                }),
            );
            offset = end;
        }
        let mut json = Value::Object(header).to_string().into_bytes();
        // The reference writer pads the header with spaces so the data starts 8-byte aligned.
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut out = Vec::with_capacity(8 + json.len());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        (out, offsets)
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Creates the file at `path`: the header and the added tensors'
    /// bytes, the declared ones' room (zeros) for
    /// [`SafetensorsFileWriter::write_at`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn create(&self, path: &Path) -> Result<SafetensorsFileWriter> {
        use std::io::{Seek, SeekFrom, Write};
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let (header, offsets) = self.header();
        let mut file = std::fs::File::create(path).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        let data_start = header.len() as u64;
        let mut places = BTreeMap::new();
        for (tensor, &offset) in self.tensors.iter().zip(&offsets) {
            let start = data_start + offset as u64;
            if let Some(data) = &tensor.data {
                file.seek(SeekFrom::Start(start)).map_err(io)?;
                file.write_all(data).map_err(io)?;
            }
            places.insert(tensor.name.clone(), (start, tensor.len));
        }
        let data_len: usize = self.tensors.iter().map(|t| t.len).sum();
        file.set_len(data_start + data_len as u64).map_err(io)?;
        Ok(SafetensorsFileWriter {
            file,
            path: path.to_path_buf(),
            places,
        })
    }
}

/// A safetensors file being filled in: [`SafetensorsWriter::create`].
#[cfg(not(target_arch = "wasm32"))]
pub struct SafetensorsFileWriter {
    file: std::fs::File,
    path: std::path::PathBuf,
    /// Tensor name → (file offset of its data, its length in bytes).
    places: BTreeMap<String, (u64, usize)>,
}

#[cfg(not(target_arch = "wasm32"))]
impl SafetensorsFileWriter {
    /// Writes `bytes` into tensor `name`'s data from byte `offset` on.
    pub fn write_at(&mut self, name: &str, offset: usize, bytes: &[u8]) -> Result<()> {
        use std::io::{Seek, SeekFrom, Write};
        let &(start, len) = self.places.get(name).ok_or_else(|| {
            Error::InvalidRequest(format!("safetensors tensor '{name}' was not declared"))
        })?;
        if offset.checked_add(bytes.len()).is_none_or(|end| end > len) {
            return Err(Error::InvalidRequest(format!(
                "safetensors tensor '{name}': bytes {offset}..+{} past its {len}",
                bytes.len()
            )));
        }
        let io = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        self.file
            .seek(SeekFrom::Start(start + offset as u64))
            .map_err(io)?;
        self.file.write_all(bytes).map_err(io)
    }
}

/// `(rows, cols)` of a shape, outermost first (a vector is one row).
fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, outer)) => (outer.iter().product(), cols),
        None => (1, 1),
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn a_file_written_piece_by_piece_equals_the_one_built_in_memory() {
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
        let (first, second) = values.split_at(12);
        let bf16 = WeightFormat::BF16;
        let mut whole = SafetensorsWriter::new();
        whole.add_metadata("format", "pt");
        whole
            .add_tensor(
                "a",
                WeightFormat::F32,
                &[2],
                quantize_row(WeightFormat::F32, &[1.0, 2.0]),
            )
            .unwrap();
        whole
            .add_tensor("b", bf16, &[4, 6], quantize_row(bf16, &values))
            .unwrap();
        let mut pieces = SafetensorsWriter::new();
        pieces.add_metadata("format", "pt");
        pieces
            .add_tensor(
                "a",
                WeightFormat::F32,
                &[2],
                quantize_row(WeightFormat::F32, &[1.0, 2.0]),
            )
            .unwrap();
        pieces.declare_tensor("b", bf16, &[4, 6]).unwrap();
        assert!(pieces
            .declare_tensor("q", WeightFormat::Q8_0, &[2, 31])
            .is_err());
        let path = std::env::temp_dir().join(format!(
            "tandem-writer-pieces-{}.safetensors",
            std::process::id()
        ));
        let mut file = pieces.create(&path).unwrap();
        // The second half first: pieces land at their offsets in any order.
        file.write_at("b", 24, &quantize_row(bf16, second)).unwrap();
        file.write_at("b", 0, &quantize_row(bf16, first)).unwrap();
        let past_end = file.write_at("b", 26, &quantize_row(bf16, second));
        assert!(past_end.unwrap_err().to_string().contains("past its 48"));
        assert!(file
            .write_at("c", 0, &[0])
            .unwrap_err()
            .to_string()
            .contains("'c'"));
        drop(file);
        let written = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(written, whole.to_bytes());
    }
}
