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
