//! One layer's paged K/V storage and the kernels that write it:
//! `paged_kv_write` and `copy_kv_blocks`. Quantized caches (INT8, INT4) hold
//! the slots of `tandem_core::kv::quant`, scales and zero points included.

use half::f16;
use half::slice::HalfFloatSliceExt;
use tandem_core::backend::{KvCacheLayout, KvDtype};
use tandem_core::kv::quant::KvQuantLayout;
use tandem_core::Result;

use crate::check;

/// K and V of one layer, each `[num_blocks, block_size]` slots of the
/// layout's element type.
#[derive(Clone, Debug)]
pub struct KvCache {
    layout: KvCacheLayout,
    storage: KvStorage,
}

/// K and V storage; one variant per element type, so K and V always agree.
#[derive(Clone, Debug)]
pub(crate) enum KvStorage {
    F32 {
        keys: Vec<f32>,
        values: Vec<f32>,
    },
    F16 {
        keys: Vec<f16>,
        values: Vec<f16>,
    },
    /// `slot_words` words per slot.
    Quant {
        quant: KvQuantLayout,
        keys: Vec<u32>,
        values: Vec<u32>,
    },
}

/// A zeroed vector, or an error (not an abort) when memory runs out.
fn zeroed<T: Clone>(len: usize, zero: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        check::error(
            "alloc_kv_cache",
            format!("cannot allocate {len} KV elements"),
        )
    })?;
    v.resize(len, zero);
    Ok(v)
}

impl KvCache {
    pub(crate) fn new(layout: KvCacheLayout) -> Result<Self> {
        let kernel = "alloc_kv_cache";
        check::positive(kernel, "block_size", layout.block_size)?;
        check::positive(kernel, "kv_heads", layout.kv_heads)?;
        check::positive(kernel, "head_dim", layout.head_dim)?;
        let len = check::product(
            kernel,
            &[
                layout.num_blocks,
                layout.block_size,
                layout.kv_heads,
                layout.head_dim,
            ],
        )?;
        let storage = if let Some(quant) = layout.quant() {
            let words = check::product(kernel, &[layout.num_slots(), quant.slot_words()])?;
            KvStorage::Quant {
                quant,
                keys: zeroed(words, 0)?,
                values: zeroed(words, 0)?,
            }
        } else if layout.dtype == KvDtype::F16 {
            KvStorage::F16 {
                keys: zeroed(len, f16::ZERO)?,
                values: zeroed(len, f16::ZERO)?,
            }
        } else {
            KvStorage::F32 {
                keys: zeroed(len, 0.0)?,
                values: zeroed(len, 0.0)?,
            }
        };
        Ok(KvCache { layout, storage })
    }

    pub fn layout(&self) -> KvCacheLayout {
        self.layout
    }

    /// All keys as f32 `[num_slots, kv_heads * head_dim]` (for tests and the
    /// reference kernels).
    pub fn keys_f32(&self) -> Vec<f32> {
        match &self.storage {
            KvStorage::F32 { keys, .. } => keys.clone(),
            KvStorage::F16 { keys, .. } => keys.to_f32_vec(),
            KvStorage::Quant { quant, keys, .. } => dequantize_all(quant, keys),
        }
    }

    /// All values as f32, laid out like [`KvCache::keys_f32`].
    pub fn values_f32(&self) -> Vec<f32> {
        match &self.storage {
            KvStorage::F32 { values, .. } => values.clone(),
            KvStorage::F16 { values, .. } => values.to_f32_vec(),
            KvStorage::Quant { quant, values, .. } => dequantize_all(quant, values),
        }
    }

    pub(crate) fn storage(&self) -> &KvStorage {
        &self.storage
    }
}

/// Writes row `t` of `k` and `v` (`[rows, kv_heads * head_dim]`) to slot `slots[t]`.
pub(crate) fn paged_kv_write(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    rows: usize,
    cache: &mut KvCache,
) -> Result<()> {
    let kernel = "paged_kv_write";
    let width = cache.layout.row_width();
    let n = check::product(kernel, &[rows, width])?;
    check::buffer_len(kernel, "k", k.len(), n)?;
    check::buffer_len(kernel, "v", v.len(), n)?;
    check::buffer_len(kernel, "slots", slots.len(), rows)?;
    let slots = &slots[..rows];
    check::indices_below(kernel, "slots", slots, cache.layout.num_slots())?;
    let rows = slots
        .iter()
        .zip(k.chunks_exact(width))
        .zip(v.chunks_exact(width));
    match &mut cache.storage {
        KvStorage::F32 { keys, values } => {
            for ((&slot, k), v) in rows {
                let at = slot as usize * width;
                keys[at..at + width].copy_from_slice(k);
                values[at..at + width].copy_from_slice(v);
            }
        }
        KvStorage::F16 { keys, values } => {
            for ((&slot, k), v) in rows {
                let at = slot as usize * width;
                keys[at..at + width].convert_from_f32_slice(k);
                values[at..at + width].convert_from_f32_slice(v);
            }
        }
        KvStorage::Quant {
            quant,
            keys,
            values,
        } => {
            let words = quant.slot_words();
            for ((&slot, k), v) in rows {
                let at = slot as usize * words;
                quant.quantize_row(k, &mut keys[at..at + words]);
                quant.quantize_row(v, &mut values[at..at + words]);
            }
        }
    }
    Ok(())
}

/// Copies whole blocks `src -> dst`, pair by pair in order.
pub(crate) fn copy_kv_blocks(cache: &mut KvCache, pairs: &[(u32, u32)]) -> Result<()> {
    let kernel = "copy_kv_blocks";
    let num_blocks = cache.layout.num_blocks;
    if let Some(&(src, dst)) = pairs
        .iter()
        .find(|&&(s, d)| s as usize >= num_blocks || d as usize >= num_blocks)
    {
        return Err(check::error(
            kernel,
            format!("pair ({src}, {dst}) names a block outside 0..{num_blocks}"),
        ));
    }
    let slot_units = match &cache.storage {
        KvStorage::Quant { quant, .. } => quant.slot_words(),
        KvStorage::F32 { .. } | KvStorage::F16 { .. } => cache.layout.row_width(),
    };
    let block_elems = cache.layout.block_size * slot_units;
    for &(src, dst) in pairs {
        let (src, dst) = (src as usize * block_elems, dst as usize * block_elems);
        match &mut cache.storage {
            KvStorage::F32 { keys, values } => {
                keys.copy_within(src..src + block_elems, dst);
                values.copy_within(src..src + block_elems, dst);
            }
            KvStorage::F16 { keys, values } => {
                keys.copy_within(src..src + block_elems, dst);
                values.copy_within(src..src + block_elems, dst);
            }
            KvStorage::Quant { keys, values, .. } => {
                keys.copy_within(src..src + block_elems, dst);
                values.copy_within(src..src + block_elems, dst);
            }
        }
    }
    Ok(())
}

/// Every slot of a quantized K or V store, dequantized.
fn dequantize_all(quant: &KvQuantLayout, words: &[u32]) -> Vec<f32> {
    let width = quant.kv_heads * quant.head_dim;
    let slots = words.len() / quant.slot_words();
    let mut out = vec![0.0; slots * width];
    for (slot, out) in words
        .chunks_exact(quant.slot_words())
        .zip(out.chunks_exact_mut(width))
    {
        quant.dequantize_row(slot, out);
    }
    out
}
