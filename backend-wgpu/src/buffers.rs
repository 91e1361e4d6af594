//! The device buffers the backend hands out: activations, indices,
//! weights (split by rows into chunks) and paged KV caches, with their
//! allocation, uploads and block copies, which only move bytes.

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

impl WgpuBackend {
    /// `Backend::alloc`: a pooled tensor, cleared on the device.
    pub(crate) fn alloc_zeroed(&self, len: usize) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * len as u64)?;
        self.gpu.clear(&buf, 4 * len as u64);
        Ok(WgpuTensor { buf, len })
    }

    /// `Backend::upload`.
    pub(crate) fn upload_f32(&self, data: &[f32]) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytes_of_f32(data));
        Ok(WgpuTensor {
            buf,
            len: data.len(),
        })
    }

    /// `Backend::upload_indices`.
    pub(crate) fn upload_u32(&self, data: &[u32]) -> Result<WgpuIndices> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytemuck::cast_slice(data));
        Ok(WgpuIndices {
            buf,
            len: data.len(),
        })
    }

    /// `Backend::write_indices`.
    pub(crate) fn write_u32(&self, dst: &mut WgpuIndices, data: &[u32]) -> Result<()> {
        check_len("write_indices", dst.len, data.len())?;
        // Queue writes land before the next submit: recorded kernels that
        // read the old values go first.
        self.gpu.submit()?;
        self.gpu.write(&dst.buf, bytemuck::cast_slice(data));
        Ok(())
    }

    /// `Backend::upload_weight`: a vector as f32, a matrix in its storage
    /// format, split into chunks by rows.
    pub(crate) fn upload_chunked(&self, w: WeightView<'_>) -> Result<WgpuWeight> {
        let format = w.format;
        if !w.cols.is_multiple_of(format.block_elems()) {
            return Err(backend_error(format!(
                "a {format} weight needs columns in multiples of {}, got {}",
                format.block_elems(),
                w.cols
            )));
        }
        let row_bytes = w.row_bytes();
        if w.data.len() < w.rows * row_bytes {
            return Err(backend_error(format!(
                "a {}x{} {format} weight needs {} bytes, got {}",
                w.rows,
                w.cols,
                w.rows * row_bytes,
                w.data.len()
            )));
        }
        if w.rows == 1 || w.cols == 1 {
            return self.upload_vector(w.rows, w.cols, &w.to_f32());
        }
        let rows_per_chunk = (self.max_chunk_bytes / row_bytes.max(1) as u64) as usize;
        if rows_per_chunk == 0 {
            return Err(backend_error(format!(
                "one row of a {format} weight ({row_bytes} bytes) exceeds the storage binding limit"
            )));
        }
        let mut chunks = Vec::new();
        for row_start in (0..w.rows).step_by(rows_per_chunk) {
            let rows = rows_per_chunk.min(w.rows - row_start);
            let bytes = &w.data[row_start * row_bytes..(row_start + rows) * row_bytes];
            let buf = self.gpu.dedicated(bytes.len() as u64, "weight")?;
            self.gpu.write(&buf, bytes);
            chunks.push(WeightChunk {
                row_start,
                rows,
                buf,
            });
        }
        Ok(WgpuWeight {
            format,
            rows: w.rows,
            cols: w.cols,
            chunks,
        })
    }

    /// `Backend::alloc_kv_cache`.
    pub(crate) fn new_kv_cache(&self, layout: KvCacheLayout) -> Result<WgpuKvCache> {
        layout.check()?;
        let slot_units = match layout.value_quant() {
            Some(quant) => quant.slot_words(),
            None if layout.values == KvDtype::F16 => layout.row_width().div_ceil(2),
            None => layout.row_width(),
        };
        let key_slot_words = layout.key_quant().map_or(slot_units, |k| k.slot_words());
        let key_block_units = layout
            .key_blocks()
            .map_or(layout.block_size * key_slot_words, |b| b.block_words());
        let bytes = 4 * (layout.num_slots() * slot_units) as u64;
        let key_bytes = 4 * (layout.num_blocks * key_block_units) as u64;
        Ok(WgpuKvCache {
            layout,
            k: self.gpu.dedicated(key_bytes, "K cache")?,
            v: self.gpu.dedicated(bytes, "V cache")?,
            slot_units,
            key_slot_words,
            key_block_units,
            bounds: None,
        })
    }

    /// `Backend::copy_kv_blocks`: keys, values and any key bounds, block by block.
    pub(crate) fn copy_blocks(&self, cache: &mut WgpuKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        let blocks = cache.layout.num_blocks;
        let block_bytes = 4 * (cache.layout.block_size * cache.slot_units) as u64;
        let key_block_bytes = 4 * cache.key_block_units as u64;
        if let Some(&(src, dst)) = pairs
            .iter()
            .find(|&&(src, dst)| src as usize >= blocks || dst as usize >= blocks)
        {
            return Err(backend_error(format!(
                "copy_kv_blocks: block pair ({src}, {dst}) outside a cache of {blocks} blocks"
            )));
        }
        if pairs.is_empty() || block_bytes == 0 {
            return Ok(());
        }
        // WebGPU forbids copies within one buffer: each block goes through a
        // scratch buffer, pair after pair, so chained pairs copy in order.
        let bounds_bytes = 4 * (2 * cache.layout.row_width()) as u64;
        let scratch = self
            .gpu
            .pooled(block_bytes.max(key_block_bytes).max(bounds_bytes))?;
        let mut stores = vec![(&cache.k, key_block_bytes), (&cache.v, block_bytes)];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds, bounds_bytes));
        }
        for &(src, dst) in pairs {
            for &(buf, bytes) in &stores {
                self.gpu.copy(buf, src as u64 * bytes, &scratch, 0, bytes);
                self.gpu.copy(&scratch, 0, buf, dst as u64 * bytes, bytes);
            }
        }
        Ok(())
    }

    /// `Backend::track_key_bounds`: the bounds buffer, allocated once.
    pub(crate) fn alloc_key_bounds(&self, cache: &mut WgpuKvCache) -> Result<()> {
        if cache.bounds.is_none() {
            let l = &cache.layout;
            let bytes = 4 * (l.num_blocks * 2 * l.row_width()) as u64;
            cache.bounds = Some(self.gpu.dedicated(bytes, "key bounds")?);
        }
        Ok(())
    }
}
