//! One layer's paged K/V storage and the kernels that write it:
//! `paged_kv_write` and `copy_kv_blocks`. Quantized caches (INT8, INT4) hold
//! the slots of `tandem_core::kv::quant`, scales and zero points included;
//! INT4 keys are whole blocks quantized per channel.

use half::f16;
use half::slice::HalfFloatSliceExt;
use tandem_core::backend::{KvCacheLayout, KvDtype};
use tandem_core::kv::quant::{KeyBlockLayout, KvQuantLayout};
use tandem_core::Result;

use crate::buffers::{zeroed_vec, ZeroBits};
use crate::check;
use crate::key_bounds::KeyBounds;

/// K and V of one layer, each `[num_blocks, block_size]` slots of the
/// layout's element type.
#[derive(Clone, Debug)]
pub struct KvCache {
    layout: KvCacheLayout,
    storage: KvStorage,
    /// Kept once `track_key_bounds` asked for them (sparse speculation).
    bounds: Option<KeyBounds>,
}

/// K and V storage; one variant per element type: float K and V agree,
/// quantized ones may differ in bits.
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
    /// Values, and INT8 or INT2 keys: `slot_words` words per slot of
    /// their own layout (keys and values may differ in bits). INT4 keys:
    /// `block_words` words per block (`key_blocks`).
    Quant {
        key_quant: KvQuantLayout,
        value_quant: KvQuantLayout,
        key_blocks: Option<KeyBlockLayout>,
        keys: Vec<u32>,
        values: Vec<u32>,
    },
}

/// A zeroed vector, or an error (not an abort) when memory runs out.
fn zeroed<T: ZeroBits>(len: usize) -> Result<Vec<T>> {
    zeroed_vec(len).ok_or_else(|| {
        check::error(
            "alloc_kv_cache",
            format!("cannot allocate {len} KV elements"),
        )
    })
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
        layout.check()?;
        let quant = |dtype| KvQuantLayout::new(dtype, layout.kv_heads, layout.head_dim);
        let storage = if let (Some(key_quant), Some(value_quant)) =
            (quant(layout.keys), quant(layout.values))
        {
            let words = check::product(kernel, &[layout.num_slots(), value_quant.slot_words()])?;
            let key_blocks = layout.key_blocks();
            let key_words = match key_blocks {
                Some(blocks) => check::product(kernel, &[layout.num_blocks, blocks.block_words()])?,
                None => check::product(kernel, &[layout.num_slots(), key_quant.slot_words()])?,
            };
            KvStorage::Quant {
                key_quant,
                value_quant,
                key_blocks,
                keys: zeroed(key_words)?,
                values: zeroed(words)?,
            }
        } else if layout.keys == KvDtype::F16 {
            KvStorage::F16 {
                keys: zeroed(len)?,
                values: zeroed(len)?,
            }
        } else {
            KvStorage::F32 {
                keys: zeroed(len)?,
                values: zeroed(len)?,
            }
        };
        Ok(KvCache {
            layout,
            storage,
            bounds: None,
        })
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
            KvStorage::Quant {
                key_blocks: Some(blocks),
                keys,
                ..
            } => dequantize_key_blocks(blocks, keys),
            KvStorage::Quant {
                key_quant, keys, ..
            } => dequantize_all(key_quant, keys),
        }
    }

    /// All values as f32, laid out like [`KvCache::keys_f32`].
    pub fn values_f32(&self) -> Vec<f32> {
        match &self.storage {
            KvStorage::F32 { values, .. } => values.clone(),
            KvStorage::F16 { values, .. } => values.to_f32_vec(),
            KvStorage::Quant {
                value_quant,
                values,
                ..
            } => dequantize_all(value_quant, values),
        }
    }

    pub(crate) fn storage(&self) -> &KvStorage {
        &self.storage
    }

    /// Starts keeping key bounds (`Backend::track_key_bounds`).
    pub(crate) fn track_key_bounds(&mut self) {
        if self.bounds.is_none() {
            let l = self.layout;
            self.bounds = Some(KeyBounds::new(
                l.num_blocks,
                l.block_size,
                l.kv_heads,
                l.head_dim,
            ));
        }
    }

    pub(crate) fn key_bounds(&self) -> Option<&KeyBounds> {
        self.bounds.as_ref()
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
    if let Some(bounds) = &mut cache.bounds {
        bounds.write_rows(slots, &k[..n]);
    }
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
            key_quant,
            value_quant,
            key_blocks,
            keys,
            values,
        } => {
            let runs = match key_blocks {
                Some(blocks) => key_runs(blocks.block_size, slots)?,
                None => Vec::new(),
            };
            let (key_words, value_words) = (key_quant.slot_words(), value_quant.slot_words());
            for ((&slot, k), v) in rows {
                if key_blocks.is_none() {
                    let at = slot as usize * key_words;
                    key_quant.quantize_row(k, &mut keys[at..at + key_words]);
                }
                let at = slot as usize * value_words;
                value_quant.quantize_row(v, &mut values[at..at + value_words]);
            }
            if let Some(blocks) = key_blocks {
                write_key_runs(blocks, &runs, k, keys);
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
    let block_size = cache.layout.block_size;
    let (key_units, value_units) = match &cache.storage {
        KvStorage::Quant {
            key_quant,
            value_quant,
            key_blocks,
            ..
        } => (
            key_blocks.map_or(block_size * key_quant.slot_words(), |b| b.block_words()),
            block_size * value_quant.slot_words(),
        ),
        KvStorage::F32 { .. } | KvStorage::F16 { .. } => {
            let units = block_size * cache.layout.row_width();
            (units, units)
        }
    };
    fn copy<T: Copy>(store: &mut [T], block_units: usize, (src, dst): (u32, u32)) {
        let (src, dst) = (src as usize * block_units, dst as usize * block_units);
        store.copy_within(src..src + block_units, dst);
    }
    for &pair in pairs {
        if let Some(bounds) = &mut cache.bounds {
            bounds.copy(pair);
        }
        match &mut cache.storage {
            KvStorage::F32 { keys, values } => {
                copy(keys, key_units, pair);
                copy(values, value_units, pair);
            }
            KvStorage::F16 { keys, values } => {
                copy(keys, key_units, pair);
                copy(values, value_units, pair);
            }
            KvStorage::Quant { keys, values, .. } => {
                copy(keys, key_units, pair);
                copy(values, value_units, pair);
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

/// Rows `rows` of a `paged_kv_write` call, written to offsets `first..` of
/// INT4 key block `block`.
struct KeyRun {
    block: usize,
    first: usize,
    rows: std::ops::Range<usize>,
}

/// Cuts the rows of a call into runs of consecutive rows whose slots lie in
/// one block, at consecutive offsets (as a sequence appends its tokens). A
/// block written by two runs of one call, or a run with a gap, is refused:
/// the GPU kernels give one worker per run, which must see the block's
/// earlier tokens as they were before the call.
fn key_runs(block_size: usize, slots: &[u32]) -> Result<Vec<KeyRun>> {
    let kernel = "paged_kv_write";
    let mut runs: Vec<KeyRun> = Vec::new();
    for (t, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        if let Some(run) = runs.last_mut().filter(|run| run.block == block) {
            let want = run.first + run.rows.len();
            if offset != want {
                return Err(check::error(
                    kernel,
                    format!(
                        "rows {} and {t} write offsets {} and {offset} of KV block {block}: \
                         an INT4 key block takes consecutive offsets",
                        t - 1,
                        want - 1
                    ),
                ));
            }
            run.rows.end = t + 1;
            continue;
        }
        if runs.iter().any(|run| run.block == block) {
            return Err(check::error(
                kernel,
                format!("KV block {block} is written by rows that are not consecutive"),
            ));
        }
        runs.push(KeyRun {
            block,
            first: offset,
            rows: t..t + 1,
        });
    }
    Ok(runs)
}

/// Writes INT4 keys, run by run ([`KeyBlockLayout::write_run`]).
fn write_key_runs(blocks: &KeyBlockLayout, runs: &[KeyRun], k: &[f32], keys: &mut [u32]) {
    let (words, channels) = (blocks.block_words(), blocks.channels());
    for run in runs {
        blocks.write_run(
            &mut keys[run.block * words..][..words],
            run.first,
            &k[run.rows.start * channels..run.rows.end * channels],
        );
    }
}

/// Every slot of an INT4 key store, dequantized (slot `block * block_size
/// + offset`, including offsets past a block's valid tokens).
fn dequantize_key_blocks(blocks: &KeyBlockLayout, words: &[u32]) -> Vec<f32> {
    let width = blocks.channels();
    let mut out = Vec::new();
    let mut row = vec![0.0; width];
    for block in words.chunks_exact(blocks.block_words()) {
        for offset in 0..blocks.block_size {
            blocks.dequantize_token(block, offset, &mut row);
            out.extend_from_slice(&row);
        }
    }
    out
}
