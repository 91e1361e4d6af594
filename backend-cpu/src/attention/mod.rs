//! Paged attention: causal, grouped-query, optional sliding window, online
//! softmax.
//!
//! One task computes consecutive `(row, head)` outputs. For each it walks the
//! row's sequence through its block-table row, one KV block at a time, and
//! keeps the running maximum, the running softmax denominator and the
//! running weighted sum of values (in the output slice itself): each block's
//! scores are computed, the old sums are rescaled by `e^(old_max - new_max)`
//! once per block, then the block's values are added. K and V are read in
//! place through the block table; an F16 cache is widened and a quantized
//! (INT8, INT4) one dequantized one head row at a time.
//! Rows of different sequences, prefill chunks starting mid-sequence and
//! single-token decode rows are all the same case: a row sees positions
//! `0..=positions[t]` (or the last `sliding_window` of them).

use half::f16;
use half::slice::HalfFloatSliceExt;
use tandem_core::backend::AttentionParams;
use tandem_core::kv::quant::{KeyBlockLayout, KvQuantLayout};
use tandem_core::Result;

use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::kv::{KvCache, KvStorage};
#[cfg(target_arch = "x86_64")]
use crate::math::Fused;
use crate::math::{dot, exp, MulAdd, Separate};
use crate::workers::Workers;

/// Fewest multiply-adds worth a task of their own.
const MIN_TASK_WORK: usize = 64 * 1024;

/// The index buffers of one call, as the backend passes them.
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
    let visible_keys = check_inputs(cache, &inputs, p, out.len())?;
    let n = p.rows * p.heads * p.head_dim;
    let work_per_head = (visible_keys / p.rows.max(1)).max(1) * p.head_dim * 2;
    let chunk = workers.chunk_len(
        p.rows * p.heads,
        p.head_dim,
        MIN_TASK_WORK.div_ceil(work_per_head),
    );
    let out = &mut out[..n];
    match cache.storage() {
        KvStorage::F32 { keys, values } => {
            attend_all(workers, isa, &inputs, &keys[..], &values[..], p, chunk, out)
        }
        KvStorage::F16 { keys, values } => {
            attend_all(workers, isa, &inputs, &keys[..], &values[..], p, chunk, out)
        }
        KvStorage::Quant {
            quant,
            key_blocks: Some(blocks),
            keys,
            values,
        } => {
            let keys = KeyBlockRows {
                blocks,
                words: keys,
            };
            let values = QuantRows::new(quant, values);
            attend_all(workers, isa, &inputs, keys, values, p, chunk, out)
        }
        KvStorage::Quant {
            quant,
            key_blocks: None,
            keys,
            values,
        } => {
            let (keys, values) = (QuantRows::new(quant, keys), QuantRows::new(quant, values));
            attend_all(workers, isa, &inputs, keys, values, p, chunk, out)
        }
    }
    Ok(())
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
    let heads_per_chunk = chunk / p.head_dim;
    workers.for_each_chunk(out, chunk, |i, out| {
        let task = Task {
            inputs,
            keys: &keys,
            values: &values,
            p,
            first_head: i * heads_per_chunk,
        };
        match isa.kind() {
            // SAFETY: an `Isa` exists only for instruction sets the CPU has.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni | IsaKind::Avx2 => unsafe { attend_heads_avx2(task, out) },
            IsaKind::Portable => attend_heads::<K, V, Separate>(task, out),
        }
    });
}

/// A run of consecutive `(row, head)` outputs, numbered `row * heads + head`
/// from `first_head`.
struct Task<'a, K, V> {
    inputs: &'a AttentionInputs<'a>,
    keys: &'a K,
    values: &'a V,
    p: AttentionParams,
    first_head: usize,
}

/// The task compiled for AVX2 and FMA: the same code, twice as wide and
/// with fused multiply-adds.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_heads_avx2<K: KvRows, V: KvRows>(task: Task<'_, K, V>, out: &mut [f32]) {
    attend_heads::<K, V, Fused>(task, out)
}

#[inline(always)]
fn attend_heads<K: KvRows, V: KvRows, M: MulAdd>(task: Task<'_, K, V>, out: &mut [f32]) {
    let p = task.p;
    let mut scratch = Scratch::new(p);
    for (k, out) in out.chunks_exact_mut(p.head_dim).enumerate() {
        let index = task.first_head + k;
        let (row, head) = (index / p.heads, index % p.heads);
        attend::<K, V, M>(&task, row, head, &mut scratch, out);
    }
}

/// Checks every size and index of the call; returns the number of (row, key)
/// pairs the call attends over.
fn check_inputs(
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    out_len: usize,
) -> Result<usize> {
    let kernel = "paged_attention";
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
    check::buffer_len(kernel, "out", out_len, n)?;
    check::buffer_len(kernel, "row_seq", inputs.row_seq.len(), p.rows)?;
    check::buffer_len(kernel, "positions", inputs.positions.len(), p.rows)?;
    let num_seqs = inputs.block_tables.len() / p.max_blocks_per_seq;
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
        let table = block_table(inputs.block_tables, inputs.row_seq[t], p);
        let blocks = &table[first / p.block_size..=last_block];
        check::indices_below(kernel, "block_tables", blocks, layout.num_blocks)?;
        visible_keys += pos + 1 - first;
    }
    Ok(visible_keys)
}

/// First position a query at `pos` sees.
fn first_visible(pos: usize, sliding_window: Option<usize>) -> usize {
    sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

fn block_table(block_tables: &[u32], seq: u32, p: AttentionParams) -> &[u32] {
    &block_tables[seq as usize * p.max_blocks_per_seq..][..p.max_blocks_per_seq]
}

/// Per-task buffers: one block's scores (then softmax weights), and four
/// key or value rows widened to f32 (used only by F16 and quantized caches).
struct Scratch {
    weights: Vec<f32>,
    rows: [Vec<f32>; 4],
}

impl Scratch {
    fn new(p: AttentionParams) -> Self {
        Scratch {
            weights: vec![0.0; p.block_size],
            rows: std::array::from_fn(|_| vec![0.0; p.head_dim]),
        }
    }
}

/// A K or V storage read one head row at a time as f32.
trait KvRows: Sync + Send {
    /// Elements `at..at + scratch.len()`, borrowed when already f32,
    /// otherwise widened into `scratch`.
    fn read<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32];
}

impl KvRows for &[f32] {
    fn read<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        &self[at..at + scratch.len()]
    }
}

impl KvRows for &[f16] {
    fn read<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        self[at..at + scratch.len()].convert_to_f32_slice(scratch);
        scratch
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
    fn read<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        let q = self.quant;
        let width = q.kv_heads * q.head_dim;
        let (slot, head) = (at / width, at % width / q.head_dim);
        let words = q.slot_words();
        q.dequantize_head(&self.words[slot * words..][..words], head, scratch);
        scratch
    }
}

/// INT4 keys, quantized per channel over each block; element offsets as
/// for [`QuantRows`].
struct KeyBlockRows<'a> {
    blocks: &'a KeyBlockLayout,
    words: &'a [u32],
}

impl KvRows for KeyBlockRows<'_> {
    fn read<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        let b = self.blocks;
        let width = b.channels();
        let (slot, head) = (at / width, at % width / b.head_dim);
        let words = b.block_words();
        let block = &self.words[slot / b.block_size * words..][..words];
        b.dequantize_head(block, slot % b.block_size, head, scratch);
        scratch
    }
}

/// Attention output of query head `head` of row `row`, into `out`.
#[inline(always)]
fn attend<K: KvRows, V: KvRows, M: MulAdd>(
    task: &Task<'_, K, V>,
    row: usize,
    head: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (p, inputs) = (task.p, task.inputs);
    let hd = p.head_dim;
    let kv_width = p.kv_heads * hd;
    let kv_offset = head / (p.heads / p.kv_heads) * hd;
    let q = &inputs.q[(row * p.heads + head) * hd..][..hd];
    let pos = inputs.positions[row] as usize;
    let table = block_table(inputs.block_tables, inputs.row_seq[row], p);

    let mut running_max = f32::NEG_INFINITY;
    let mut denominator = 0f32;
    out.fill(0.0);
    let mut start = first_visible(pos, p.sliding_window);
    while start <= pos {
        let block = start / p.block_size;
        let end = ((block + 1) * p.block_size).min(pos + 1);
        let first_slot = table[block] as usize * p.block_size;
        let block_start = block * p.block_size;
        // Position `j` of this block lives in slot `first_slot + j - block_start`.
        let at = |j: usize| (first_slot + j - block_start) * kv_width + kv_offset;

        let weights = &mut scratch.weights[..end - start];
        for (score, j) in weights.iter_mut().zip(start..end) {
            *score = dot::<M>(q, task.keys.read(at(j), &mut scratch.rows[0])) * p.scale;
        }
        let block_max = weights.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let new_max = running_max.max(block_max);
        let rescale = exp(running_max - new_max);
        // Scores become softmax weights in a loop of their own, so the
        // exponentials vectorize.
        for w in weights.iter_mut() {
            *w = exp(*w - new_max);
        }
        denominator = denominator * rescale + weights.iter().sum::<f32>();
        out.iter_mut().for_each(|o| *o *= rescale);
        // Four value rows per pass over `out`: a quarter of the loads and
        // stores of the accumulator.
        let quads = weights.len() / 4 * 4;
        for (k, w) in weights[..quads].chunks_exact(4).enumerate() {
            let j = start + 4 * k;
            let [s0, s1, s2, s3] = &mut scratch.rows;
            let (v0, v1) = (task.values.read(at(j), s0), task.values.read(at(j + 1), s1));
            let (v2, v3) = (
                task.values.read(at(j + 2), s2),
                task.values.read(at(j + 3), s3),
            );
            let (v0, v1, v2, v3) = (&v0[..hd], &v1[..hd], &v2[..hd], &v3[..hd]);
            for d in 0..hd {
                let sum = M::mul_add(w[0], v0[d], out[d]);
                let sum = M::mul_add(w[1], v1[d], sum);
                let sum = M::mul_add(w[2], v2[d], sum);
                out[d] = M::mul_add(w[3], v3[d], sum);
            }
        }
        for (&weight, j) in weights[quads..].iter().zip(start + quads..end) {
            let value = task.values.read(at(j), &mut scratch.rows[0]);
            for (o, &v) in out.iter_mut().zip(value) {
                *o = M::mul_add(weight, v, *o);
            }
        }
        running_max = new_max;
        start = end;
    }
    let inv = 1.0 / denominator;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(test)]
mod tests {
    use tandem_core::backend::{KvCacheLayout, KvDtype};
    use tandem_core::kernels::spec;

    use super::*;
    use crate::{kv, reference};

    /// Every instruction set's attention against the reference, on two
    /// sequences (one decoding, one in a prefill chunk) over 3-token blocks.
    #[test]
    fn every_instruction_set_matches_the_reference() {
        let mut rng = tandem_core::sched::Rng::new(1);
        let mut values = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
                .collect()
        };
        let p = AttentionParams {
            rows: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 12,
            block_size: 3,
            max_blocks_per_seq: 4,
            scale: 0.3,
            sliding_window: None,
        };
        let block_tables = [5, 1, 7, 2, 0, 3, 6, 4];
        let (row_seq, positions) = ([0, 1, 1, 1], [9, 5, 6, 7]);
        for dtype in KvDtype::ALL {
            let layout = KvCacheLayout {
                num_blocks: 8,
                block_size: 3,
                kv_heads: 2,
                head_dim: 12,
                dtype,
            };
            let mut cache = KvCache::new(layout).unwrap();
            let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
            let (k, v) = (values(slots.len() * 24), values(slots.len() * 24));
            kv::paged_kv_write(&k, &v, &slots, slots.len(), &mut cache).unwrap();
            let q = values(p.rows * p.heads * p.head_dim);
            let mut want = vec![0.0; q.len()];
            reference::paged_attention(
                &q,
                &cache.keys_f32(),
                &cache.values_f32(),
                &row_seq,
                &positions,
                &block_tables,
                p,
                &mut want,
            );
            for isa in Isa::available() {
                for threads in [1, 2] {
                    let inputs = AttentionInputs {
                        q: &q,
                        row_seq: &row_seq,
                        positions: &positions,
                        block_tables: &block_tables,
                    };
                    let mut got = vec![f32::NAN; q.len()];
                    paged_attention(&Workers::new(threads), isa, &cache, inputs, p, &mut got)
                        .unwrap();
                    let tolerance = spec("paged_attention").unwrap().tolerance;
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() / (1.0 + w.abs()) <= tolerance,
                            "{} [{i}]: got {g}, want {w}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}
