//! The device buffers the backend hands out: activations, indices,
//! weights and paged KV caches.

use super::*;

/// f32 activations on the device.
pub struct CudaTensor {
    pub(super) buf: CudaSlice<f32>,
}

impl CudaTensor {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// u32 indices on the device.
pub struct CudaIndices {
    pub(super) buf: CudaSlice<u32>,
}

impl CudaIndices {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// A weight matrix in its storage format, bytes exactly as in the model file.
pub struct CudaWeight {
    pub(super) format: WeightFormat,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) buf: CudaSlice<u8>,
}

impl CudaWeight {
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    pub(super) fn row_bytes(&self) -> usize {
        self.format.row_head_bytes()
            + self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    pub(super) fn elems(&self) -> usize {
        self.rows * self.cols
    }
}

/// One layer's paged K and V, `[num_slots, kv_heads * head_dim]` each (INT4
/// keys: `num_blocks` per-channel blocks).
pub struct CudaKvCache {
    pub(super) layout: KvCacheLayout,
    pub(super) k: CudaSlice<u8>,
    pub(super) v: CudaSlice<u8>,
    /// Per-block key bounds (`kernels/kv_key_bounds.cu`), once tracked.
    pub(super) bounds: Option<CudaSlice<f32>>,
}

impl CudaKvCache {
    pub fn layout(&self) -> KvCacheLayout {
        self.layout
    }
}

impl CudaBackend {
    /// `upload_weight`: the bytes as they are, once they fill whole blocks
    /// of the weight's format.
    pub(super) fn store_weight(&self, w: WeightView<'_>) -> Result<CudaWeight> {
        self.refuse_while_capturing("upload_weight")?;
        if !w.cols.is_multiple_of(w.format.block_elems()) {
            return Err(backend_error(format!(
                "a {} weight needs columns in multiples of {}, got {}",
                w.format,
                w.format.block_elems(),
                w.cols
            )));
        }
        let expected = w.format.bytes_for(w.rows as u64, w.cols as u64);
        if expected != Some(w.data.len() as u64) {
            return Err(backend_error(format!(
                "weight of {}x{} {} needs whole blocks per row and {:?} bytes, got {}",
                w.rows,
                w.cols,
                w.format,
                expected,
                w.data.len()
            )));
        }
        let mut buf = self.alloc_raw::<u8>(w.data.len())?;
        if !w.data.is_empty() {
            let mut view = buf.slice_mut(..w.data.len());
            self.stream
                .memcpy_htod(w.data, &mut view)
                .map_err(|e| backend_error(format!("copy weight to device: {e}")))?;
        }
        Ok(CudaWeight {
            format: w.format,
            rows: w.rows,
            cols: w.cols,
            buf,
        })
    }

    /// `copy_kv_blocks`: whole blocks of K, V and the key bounds where
    /// tracked, device to device on the stream.
    pub(super) fn copy_cache_blocks(
        &self,
        cache: &mut CudaKvCache,
        pairs: &[(u32, u32)],
    ) -> Result<()> {
        let layout = cache.layout;
        // Quantized blocks carry their scales, so whole blocks copy everything.
        let (key_bytes, value_bytes) = (layout.key_block_bytes(), layout.value_block_bytes());
        for &(src, dst) in pairs {
            if src as usize >= layout.num_blocks || dst as usize >= layout.num_blocks {
                return Err(backend_error(format!(
                    "copy_kv_blocks: block pair ({src}, {dst}) outside {} blocks",
                    layout.num_blocks
                )));
            }
        }
        let bounds_bytes = 4 * 2 * layout.row_width();
        let mut stores = vec![
            (cache.k.device_ptr(&self.stream), key_bytes),
            (cache.v.device_ptr(&self.stream), value_bytes),
        ];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds.device_ptr(&self.stream), bounds_bytes));
        }
        for ((base, _sync), block_bytes) in &stores {
            let (base, block_bytes) = (*base, *block_bytes);
            for &(src, dst) in pairs {
                // SAFETY: both ranges lie inside `buf` (checked above) and the
                // copy is ordered on the backend's stream.
                unsafe {
                    driver_result::memcpy_dtod_async(
                        base + (dst as usize * block_bytes) as u64,
                        base + (src as usize * block_bytes) as u64,
                        block_bytes,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| backend_error(format!("copy_kv_blocks: {e}")))?;
            }
        }
        Ok(())
    }
}

pub(super) fn download<T: DeviceRepr + Default + Clone>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    len: usize,
) -> Result<Vec<T>> {
    check_len("download: source", buf.len(), len)?;
    let mut host = vec![T::default(); len];
    if len > 0 {
        stream
            .memcpy_dtoh(&buf.slice(..len), &mut host)
            .map_err(|e| backend_error(format!("copy to host: {e}")))?;
    }
    stream
        .synchronize()
        .map_err(|e| backend_error(format!("synchronize: {e}")))?;
    Ok(host)
}
