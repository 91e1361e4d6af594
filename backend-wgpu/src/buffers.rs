//! The device buffers the backend hands out: activations, indices,
//! weights (split by rows into chunks) and paged KV caches.

use super::*;

/// f32 activations on the device.
pub struct WgpuTensor {
    pub(crate) buf: GpuBuffer,
    pub(crate) len: usize,
}

/// u32 indices on the device.
pub struct WgpuIndices {
    pub(crate) buf: GpuBuffer,
    pub(crate) len: usize,
}

/// A weight matrix in its storage format, as one buffer per range of rows.
pub struct WgpuWeight {
    pub(crate) format: WeightFormat,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) chunks: Vec<WeightChunk>,
}

pub(crate) struct WeightChunk {
    pub(crate) row_start: usize,
    pub(crate) rows: usize,
    pub(crate) buf: GpuBuffer,
}

impl WgpuWeight {
    /// The f32 vector of a norm weight or bias (stored as one f32 buffer).
    pub(crate) fn vector(&self, len: usize, what: &str) -> Result<&GpuBuffer> {
        match self.chunks.as_slice() {
            [chunk] if self.format == WeightFormat::F32 && self.rows * self.cols >= len => {
                Ok(&chunk.buf)
            }
            _ => Err(backend_error(format!(
                "{what}: expected a vector of {len} values, got a {}x{} {} matrix",
                self.rows, self.cols, self.format
            ))),
        }
    }
}

/// Bits per code of quantized keys, in slots or per-channel blocks.
pub(crate) fn key_bits(layout: &KvCacheLayout) -> usize {
    match (layout.key_quant(), layout.key_blocks()) {
        (Some(slots), _) => slots.bits,
        (None, Some(blocks)) => blocks.bits,
        (None, None) => 0,
    }
}

/// One layer's paged K and V storage (layouts: `shaders/paged_kv_write.wgsl`).
pub struct WgpuKvCache {
    pub(crate) layout: KvCacheLayout,
    pub(crate) k: GpuBuffer,
    pub(crate) v: GpuBuffer,
    /// Storage units (f32 values, or u32 words holding two halves or
    /// quantized codes and scales) per value slot.
    pub(crate) slot_units: usize,
    /// Words per key slot of quantized keys in slots (INT8, INT2).
    pub(crate) key_slot_words: usize,
    /// Storage units of one block of keys: `block_size * slot_units`, or
    /// the per-channel INT4 key block.
    pub(crate) key_block_units: usize,
    /// Per-block key bounds (`shaders/kv_key_bounds.wgsl`), once tracked.
    pub(crate) bounds: Option<GpuBuffer>,
}
