//! Paged attention: causal, grouped-query, optional sliding window, online
//! softmax.
//!
//! The `(row, head)` outputs are cut into tasks of consecutive outputs, and
//! a task into query tiles ([`tile`]): the heads that share one KV head, for
//! up to a few consecutive rows of one sequence. A tile walks its keys
//! sixteen positions at a time (a key tile), reading each key and value row
//! once for all of its queries, through the block table: an F16 cache is
//! widened and a quantized (INT8, INT4) one dequantized one head row at a
//! time. Rows of different sequences, prefill chunks starting mid-sequence
//! and single-token decode rows are all the same case: a row sees positions
//! `0..=positions[t]` (or the last `sliding_window` of them), less those of
//! evicted blocks (`EVICTED_BLOCK` table entries, KV eviction).

use half::f16;
use tandem_core::backend::AttentionParams;
use tandem_core::kv::quant::{KeyBlockLayout, KvQuantLayout};
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::Result;

use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::kv::{KvCache, KvStorage};
#[cfg(target_arch = "x86_64")]
use crate::math::Fused;
use crate::math::Separate;
use crate::workers::Workers;

mod key_tiles;
mod lanes;
mod ops;
mod scores;
mod segments;
mod select;
mod tile;

pub(crate) use scores::paged_attention_scores;
pub(crate) use select::select_kv_blocks;

#[cfg(target_arch = "x86_64")]
use ops::{Avx2Ops, Avx512Ops};
use ops::{PortableOps, TileOps};

/// Fewest multiply-adds worth a task of their own.
const MIN_TASK_WORK: usize = 64 * 1024;
/// Tasks per thread. The causal mask makes later rows dearer than earlier
/// ones, so many small tasks balance the threads better than a few.
const TASKS_PER_THREAD: usize = 16;

/// The index buffers of one call, as the backend passes them.
#[derive(Clone, Copy)]
pub(crate) struct AttentionInputs<'a> {
    pub q: &'a [f32],
    pub row_seq: &'a [u32],
    pub positions: &'a [u32],
    pub block_tables: &'a [u32],
}

pub(crate) fn paged_attention(
    workers: &Workers,
    isa: Isa,
    cache: &KvCache,
    inputs: AttentionInputs<'_>,
    p: AttentionParams,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "paged_attention";
    let visible_keys = check_inputs(kernel, cache, &inputs, p)?;
    let n = p.rows * p.heads * p.head_dim;
    check::buffer_len(kernel, "out", out.len(), n)?;
    let chunk = task_len(workers, p, visible_keys);
    let out = &mut out[..n];
    match cache.storage() {
        KvStorage::F32 { keys, values } => {
            attend_all(workers, isa, &inputs, &keys[..], &values[..], p, chunk, out)
        }
        KvStorage::F16 { keys, values } => {
            attend_all(workers, isa, &inputs, &keys[..], &values[..], p, chunk, out)
        }
        KvStorage::Quant {
            value_quant,
            key_blocks: Some(blocks),
            keys,
            values,
            ..
        } => {
            let keys = KeyBlockRows {
                blocks,
                words: keys,
            };
            let values = QuantRows::new(value_quant, values);
            attend_all(workers, isa, &inputs, keys, values, p, chunk, out)
        }
        KvStorage::Quant {
            key_quant,
            value_quant,
            key_blocks: None,
            keys,
            values,
        } => {
            let keys = QuantRows::new(key_quant, keys);
            let values = QuantRows::new(value_quant, values);
            attend_all(workers, isa, &inputs, keys, values, p, chunk, out)
        }
    }
    Ok(())
}

/// Output elements per task: about [`TASKS_PER_THREAD`] tasks per thread,
/// each worth at least [`MIN_TASK_WORK`], and a whole number of query
/// tiles when that spans several, else of KV groups. The heads of a group
/// share each key and value row a tile reads: cut into single heads, a
/// decode step's few long rows would read every row once per head. Only
/// when there are fewer groups than threads (one decode row of a model
/// with one KV head) are groups cut, into a share per thread.
fn task_len(workers: &Workers, p: AttentionParams, visible_keys: usize) -> usize {
    let threads = workers.threads();
    let work_per_head = (visible_keys / p.rows.max(1)).max(1) * p.head_dim * 2;
    let heads = (p.rows * p.heads)
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(MIN_TASK_WORK.div_ceil(work_per_head));
    let tile_heads = tile::rows_per_tile(p) * p.heads;
    let heads = if heads >= tile_heads {
        heads.next_multiple_of(tile_heads)
    } else if p.rows * p.kv_heads >= threads {
        heads.next_multiple_of(p.heads / p.kv_heads)
    } else {
        heads.max((p.rows * p.heads).div_ceil(threads))
    };
    heads * p.head_dim
}

/// Splits the `(row, head)` outputs into tasks of `chunk` elements.
#[allow(clippy::too_many_arguments)]
fn attend_all<K: KvRows, V: KvRows>(
    workers: &Workers,
    isa: Isa,
    inputs: &AttentionInputs<'_>,
    keys: K,
    values: V,
    p: AttentionParams,
    chunk: usize,
    out: &mut [f32],
) {
    let run = |work: Work<'_>, out: &mut [f32]| {
        let task = Task {
            inputs,
            keys: &keys,
            values: &values,
            p,
            work,
        };
        match isa.kind() {
            // SAFETY: an `Isa` exists only for instruction sets the CPU has.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni => unsafe { attend_task_avx512(task, out) },
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => unsafe { attend_task_avx2(task, out) },
            IsaKind::Portable => tile::attend_task::<K, V, Separate, PortableOps>(task, out),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            IsaKind::Simd128 => tile::attend_task::<K, V, Separate, PortableOps>(task, out),
        }
    };
    if let Some(plan) = segments::SegmentPlan::for_call(workers, inputs, p) {
        return plan.run(workers, p, run, out);
    }
    let heads_per_chunk = chunk / p.head_dim;
    workers.for_each_chunk(out, chunk, |i, out| {
        let first_head = i * heads_per_chunk;
        run(Work::Outputs { first_head }, out)
    });
}

/// What a task computes into its chunk.
#[derive(Clone, Copy)]
enum Work<'a> {
    /// Consecutive `(row, head)` outputs, numbered `row * heads + head`
    /// from `first_head`, each tile over all of its keys.
    Outputs { first_head: usize },
    /// The partial results of these units ([`segments`]), one slot each.
    Segments { units: &'a [segments::Unit] },
    /// The outputs of consecutive KV groups of rows, each folded from
    /// its units' partial results.
    Fold {
        first_group: usize,
        plan: &'a segments::SegmentPlan,
        partials: &'a [f32],
    },
}

/// One task of a call: its inputs and what it computes.
struct Task<'a, K, V> {
    inputs: &'a AttentionInputs<'a>,
    keys: &'a K,
    values: &'a V,
    p: AttentionParams,
    work: Work<'a>,
}

/// The task compiled for AVX2, FMA and F16C: the same code, 8 lanes wide
/// and with fused multiply-adds.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_task_avx2<K: KvRows, V: KvRows>(task: Task<'_, K, V>, out: &mut [f32]) {
    tile::attend_task::<K, V, Fused, Avx2Ops>(task, out)
}

/// The task compiled for AVX-512: a key tile's scores are one vector.
///
/// # Safety
/// The CPU supports AVX2, FMA and AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn attend_task_avx512<K: KvRows, V: KvRows>(task: Task<'_, K, V>, out: &mut [f32]) {
    tile::attend_task::<K, V, Fused, Avx512Ops>(task, out)
}

/// Checks every size and index of a call of `kernel` (paged attention or
/// its score variant) but its output; returns the number of (row, key)
/// pairs the call attends over.
pub(crate) fn check_inputs(
    kernel: &str,
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
) -> Result<usize> {
    for (name, v) in [
        ("heads", p.heads),
        ("kv_heads", p.kv_heads),
        ("head_dim", p.head_dim),
        ("block_size", p.block_size),
        ("max_blocks_per_seq", p.max_blocks_per_seq),
    ] {
        check::positive(kernel, name, v)?;
    }
    if !p.heads.is_multiple_of(p.kv_heads) {
        return Err(check::error(
            kernel,
            format!(
                "heads {} is not a multiple of kv_heads {}",
                p.heads, p.kv_heads
            ),
        ));
    }
    if p.sliding_window == Some(0) {
        return Err(check::error(kernel, "sliding_window must be positive"));
    }
    let layout = cache.layout();
    if (layout.kv_heads, layout.head_dim, layout.block_size)
        != (p.kv_heads, p.head_dim, p.block_size)
    {
        return Err(check::error(
            kernel,
            format!(
                "parameters say kv_heads {}, head_dim {}, block_size {} but the cache has {}, {}, {}",
                p.kv_heads, p.head_dim, p.block_size, layout.kv_heads, layout.head_dim, layout.block_size
            ),
        ));
    }
    let n = check::product(kernel, &[p.rows, p.heads, p.head_dim])?;
    check::buffer_len(kernel, "q", inputs.q.len(), n)?;
    check::buffer_len(kernel, "row_seq", inputs.row_seq.len(), p.rows)?;
    check::buffer_len(kernel, "positions", inputs.positions.len(), p.rows)?;
    let num_seqs = inputs.block_tables.len() / (p.max_blocks_per_seq * p.tables_per_seq());
    check::indices_below(kernel, "row_seq", &inputs.row_seq[..p.rows], num_seqs)?;
    let mut visible_keys = 0;
    for t in 0..p.rows {
        let pos = inputs.positions[t] as usize;
        let last_block = pos / p.block_size;
        if last_block >= p.max_blocks_per_seq {
            return Err(check::error(
                kernel,
                format!(
                    "row {t} at position {pos} needs block {last_block} but block tables have {} columns",
                    p.max_blocks_per_seq
                ),
            ));
        }
        let first = first_visible(pos, p.sliding_window);
        for kv_head in 0..p.tables_per_seq() {
            let table = block_table(inputs.block_tables, inputs.row_seq[t], kv_head, p);
            let blocks = &table[first / p.block_size..=last_block];
            if let Some(&b) = blocks
                .iter()
                .find(|&&b| b != EVICTED_BLOCK && b as usize >= layout.num_blocks)
            {
                return Err(check::error(
                    kernel,
                    format!(
                        "block_tables: row {t}'s table holds block {b}, out of range (must be < {} or EVICTED_BLOCK)",
                        layout.num_blocks
                    ),
                ));
            }
        }
        visible_keys += pos + 1 - first;
    }
    Ok(visible_keys)
}

/// First position a query at `pos` sees.
fn first_visible(pos: usize, sliding_window: Option<usize>) -> usize {
    sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// The table KV head `kv_head` of sequence `seq` reads (the sequence's
/// own, unless the tables are per head).
fn block_table(block_tables: &[u32], seq: u32, kv_head: usize, p: AttentionParams) -> &[u32] {
    let table = p.table_of(seq as usize, kv_head);
    &block_tables[table * p.max_blocks_per_seq..][..p.max_blocks_per_seq]
}

/// A K or V storage read one head row at a time as f32.
trait KvRows: Sync + Send {
    /// Elements `at..at + row.len()` into `row`, widened (the way `O`
    /// widens) or dequantized.
    fn read_into<O: TileOps>(&self, at: usize, row: &mut [f32]);

    /// The head rows at `first + i * stride` into `rows`, one after the
    /// other, each as [`read_into`](Self::read_into) gives it.
    #[inline(always)]
    fn read_rows<O: TileOps>(&self, first: usize, stride: usize, rows: &mut [f32], row_len: usize) {
        read_each_row::<O>(self, first, stride, rows, row_len)
    }

    /// Starts loading what [`read_into`](Self::read_into) reads for the
    /// `rows` head rows of `row_len` elements at `first + i * stride`.
    fn prefetch_rows(&self, first: usize, stride: usize, rows: usize, row_len: usize);
}

/// [`KvRows::read_rows`] one row at a time.
#[inline(always)]
fn read_each_row<O: TileOps>(
    store: &(impl KvRows + ?Sized),
    first: usize,
    stride: usize,
    rows: &mut [f32],
    row_len: usize,
) {
    for (i, row) in rows.chunks_exact_mut(row_len).enumerate() {
        store.read_into::<O>(first + i * stride, row);
    }
}

/// Starts loading `bytes` bytes at `at` into the second-level cache. A key
/// tile is one KV block (or part of one), and the blocks of a sequence lie
/// anywhere: the hardware prefetcher, which follows a stream within a
/// page, cannot guess the next one, and a decode step over a long context
/// waited on memory for most of its time. Into the first-level cache, the
/// prefetches of a tile waited on its few outstanding misses instead and
/// gained little (`decode_model` in `benches/attention.rs`).
#[inline(always)]
fn prefetch(at: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        const LINE: usize = 64;
        let first_line = at as usize / LINE * LINE;
        for line in (first_line..at as usize + bytes).step_by(LINE) {
            // SAFETY: a prefetch is a hint, which never faults, whatever
            // the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line as *const i8) }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, bytes);
}

/// [`KvRows::prefetch_rows`] of a store of plain elements.
#[inline(always)]
fn prefetch_elements<T>(elements: &[T], first: usize, stride: usize, rows: usize, row_len: usize) {
    let base = elements.as_ptr();
    for i in 0..rows {
        let at = base.wrapping_add(first + i * stride).cast::<u8>();
        prefetch(at, row_len * size_of::<T>());
    }
}

impl KvRows for &[f32] {
    #[inline(always)]
    fn read_into<O: TileOps>(&self, at: usize, row: &mut [f32]) {
        row.copy_from_slice(&self[at..at + row.len()]);
    }

    #[inline(always)]
    fn prefetch_rows(&self, first: usize, stride: usize, rows: usize, row_len: usize) {
        prefetch_elements(self, first, stride, rows, row_len)
    }
}

impl KvRows for &[f16] {
    #[inline(always)]
    fn read_into<O: TileOps>(&self, at: usize, row: &mut [f32]) {
        O::widen(&self[at..at + row.len()], row);
    }

    #[inline(always)]
    fn prefetch_rows(&self, first: usize, stride: usize, rows: usize, row_len: usize) {
        prefetch_elements(self, first, stride, rows, row_len)
    }
}

/// A quantized K or V store. Element offsets `at` are those of the float
/// layout (`slot * kv_heads * head_dim + head * head_dim`), so the attention
/// loop is the same for every dtype.
struct QuantRows<'a> {
    quant: &'a KvQuantLayout,
    words: &'a [u32],
}

impl<'a> QuantRows<'a> {
    fn new(quant: &'a KvQuantLayout, words: &'a [u32]) -> Self {
        QuantRows { quant, words }
    }
}

impl KvRows for QuantRows<'_> {
    #[inline(always)]
    fn read_into<O: TileOps>(&self, at: usize, row: &mut [f32]) {
        let q = self.quant;
        let width = q.kv_heads * q.head_dim;
        let (slot, head) = (at / width, at % width / q.head_dim);
        let words = q.slot_words();
        q.dequantize_head(&self.words[slot * words..][..words], head, row);
    }

    #[inline(always)]
    fn prefetch_rows(&self, first: usize, stride: usize, rows: usize, _row_len: usize) {
        // A slot's words (every head's) are few: all of them.
        let width = self.quant.kv_heads * self.quant.head_dim;
        let words = self.quant.slot_words();
        let slot_stride = stride / width * words;
        prefetch_elements(self.words, first / width * words, slot_stride, rows, words)
    }
}

/// INT4 keys, quantized per channel over each block; element offsets as
/// for [`QuantRows`].
struct KeyBlockRows<'a> {
    blocks: &'a KeyBlockLayout,
    words: &'a [u32],
}

impl KvRows for KeyBlockRows<'_> {
    #[inline(always)]
    fn read_into<O: TileOps>(&self, at: usize, row: &mut [f32]) {
        let b = self.blocks;
        let width = b.channels();
        let (slot, head) = (at / width, at % width / b.head_dim);
        let words = b.block_words();
        let block = &self.words[slot / b.block_size * words..][..words];
        b.dequantize_head(block, slot % b.block_size, head, row);
    }

    /// Rows of consecutive tokens of one block (a key tile's) share their
    /// channels' parameters, decoded once for all of them.
    #[inline(always)]
    fn read_rows<O: TileOps>(&self, first: usize, stride: usize, rows: &mut [f32], row_len: usize) {
        let b = self.blocks;
        let width = b.channels();
        let (slot, head) = (first / width, first % width / b.head_dim);
        let (offset, tokens) = (slot % b.block_size, rows.len() / row_len);
        if stride != width || row_len != b.head_dim || offset + tokens > b.block_size {
            return read_each_row::<O>(self, first, stride, rows, row_len);
        }
        let words = b.block_words();
        let block = &self.words[slot / b.block_size * words..][..words];
        b.dequantize_head_tokens(block, offset..offset + tokens, head, rows);
    }

    #[inline(always)]
    fn prefetch_rows(&self, first: usize, _stride: usize, _rows: usize, _row_len: usize) {
        // A key tile lies within one block: its words (every head's).
        let b = self.blocks;
        let words = b.block_words();
        let block = first / b.channels() / b.block_size;
        prefetch_elements(self.words, block * words, 0, 1, words)
    }
}

#[cfg(test)]
mod tests;
