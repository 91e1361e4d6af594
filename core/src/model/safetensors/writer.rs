//! The safetensors writer: float tensors under their dtype, quantized
//! matrices as `U8` bytes named in `__metadata__`.

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
    data: Vec<u8>,
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
        let invalid = |reason: String| {
            Err(Error::InvalidRequest(format!(
                "safetensors tensor '{name}': {reason}"
            )))
        };
        if name == METADATA_KEY || self.tensors.iter().any(|t| t.name == name) {
            return invalid("name is reserved or already used".into());
        }
        let (rows, cols) = match shape.split_last() {
            Some((&cols, outer)) => (outer.iter().product(), cols),
            None => (1, 1),
        };
        if format.is_quantized() && shape.len() != 2 {
            return invalid(format!(
                "a {format} tensor is a matrix, but the shape is {shape:?}"
            ));
        }
        if let Some(reason) = crate::model::data_size_mismatch(format, rows, cols, data.len()) {
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
            data,
        });
        Ok(())
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
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
        for tensor in &self.tensors {
            let end = offset + tensor.data.len();
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
        let mut out = Vec::with_capacity(8 + json.len() + offset);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for tensor in &self.tensors {
            out.extend_from_slice(&tensor.data);
        }
        out
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}
