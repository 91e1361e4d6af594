//! `paged_attention_scores`: the attention mass each KV block gets, for KV
//! eviction by score (H2O, SnapKV). The softmax of `paged_attention` again,
//! over the keys only, in two passes, and never an attention matrix.
//!
//! 1. Each (query row, KV head) is cut into spans of whole KV blocks, about
//!    [`SPAN`] positions each, scored in parallel (a decode step's one row
//!    shares its keys among the threads, as its attention does). A span's
//!    keys come sixteen at a time, read, widened or dequantized once for the
//!    group's query heads and transposed so that each head's logits against
//!    them are one vector (a decode tile's arithmetic, `lanes::few_scores`).
//!    Per head, the span keeps its largest logit `m` and, per block, the sum
//!    of `exp(logit - m)` over the block's visible keys.
//! 2. Per (row, KV head), each head's spans are rescaled to the row's
//!    largest logit and summed into the softmax denominator, and every
//!    block gets its share of each head's mass.

use tandem_core::backend::AttentionParams;
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::Result;

use super::key_tiles::whole_tile_at;
use super::lanes::few_scores;
#[cfg(target_arch = "x86_64")]
use super::ops::{Avx2Ops, Avx512Ops};
use super::ops::{PortableOps, TileOps};
use super::tile::LANES;
use super::{
    block_table, check_inputs, first_visible, AttentionInputs, KeyBlockRows, KvRows, QuantRows,
};
use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::kv::{KvCache, KvStorage};
#[cfg(target_arch = "x86_64")]
use crate::math::Fused;
use crate::math::{exp, MulAdd, Separate};
use crate::workers::Workers;

/// Positions per span, rounded up to whole KV blocks.
const SPAN: usize = 512;

/// Adds the attention mass of every (row, KV head) to its `scores` row of
/// `max_blocks_per_seq` entries (layout: `Backend::paged_attention_scores`).
pub(crate) fn paged_attention_scores(
    workers: &Workers,
    isa: Isa,
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    scores: &mut [f32],
) -> Result<()> {
    let kernel = "paged_attention_scores";
    if p.per_head_tables {
        return Err(check::error(
            kernel,
            "per-head block tables are not supported: one table per sequence",
        ));
    }
    check_inputs(kernel, cache, inputs, p)?;
    let len = check::product(kernel, &[p.rows, p.kv_heads, p.max_blocks_per_seq])?;
    check::buffer_len(kernel, "scores", scores.len(), len)?;
    let scores = &mut scores[..len];
    match cache.storage() {
        KvStorage::F32 { keys, .. } => score_all(workers, isa, &&keys[..], inputs, p, scores),
        KvStorage::F16 { keys, .. } => score_all(workers, isa, &&keys[..], inputs, p, scores),
        KvStorage::Quant {
            key_blocks: Some(blocks),
            keys,
            ..
        } => {
            let keys = KeyBlockRows {
                blocks,
                words: keys,
            };
            score_all(workers, isa, &keys, inputs, p, scores)
        }
        KvStorage::Quant {
            key_quant, keys, ..
        } => score_all(
            workers,
            isa,
            &QuantRows::new(key_quant, keys),
            inputs,
            p,
            scores,
        ),
    }
    Ok(())
}

/// How a call's rows are cut into spans.
#[derive(Clone, Copy)]
struct Spans {
    /// Positions per span, whole blocks.
    len: usize,
    blocks: usize,
    /// Spans per row: enough for the call's furthest position.
    per_row: usize,
}

impl Spans {
    fn for_call(inputs: &AttentionInputs<'_>, p: AttentionParams) -> Self {
        let len = SPAN.next_multiple_of(p.block_size);
        let furthest = inputs.positions[..p.rows]
            .iter()
            .max()
            .map_or(0, |&x| x as usize);
        Spans {
            len,
            blocks: len / p.block_size,
            per_row: (furthest + 1).div_ceil(len),
        }
    }

    /// Floats a span writes per query head: its largest logit, then a sum
    /// per block.
    fn head_floats(&self) -> usize {
        1 + self.blocks
    }
}

/// The two passes, the first's results in `partials` (per span, per head
/// of its group, [`Spans::head_floats`] floats).
fn score_all<K: KvRows>(
    workers: &Workers,
    isa: Isa,
    keys: &K,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    scores: &mut [f32],
) {
    let spans = Spans::for_call(inputs, p);
    let group = p.heads / p.kv_heads;
    let span_floats = group * spans.head_floats();
    let mut partials = vec![0f32; p.rows * p.kv_heads * spans.per_row * span_floats];
    workers.for_each_chunk(&mut partials, span_floats, |unit, out| {
        let span = Span::new(unit, spans, p);
        match isa.kind() {
            // SAFETY: an `Isa` exists only for instruction sets the CPU has.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni => unsafe { score_span_avx512(keys, inputs, p, span, out) },
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => unsafe { score_span_avx2(keys, inputs, p, span, out) },
            IsaKind::Portable => score_span::<K, Separate, PortableOps>(keys, inputs, p, span, out),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            IsaKind::Simd128 => score_span::<K, Separate, PortableOps>(keys, inputs, p, span, out),
        }
    });
    let row_floats = spans.per_row * span_floats;
    workers.for_each_chunk(scores, p.max_blocks_per_seq, |task, row| {
        add_masses(
            &partials[task * row_floats..][..row_floats],
            spans,
            group,
            row,
        );
    });
}

/// One unit of the first pass: span `index` of KV head `kv_head`'s
/// queries in row `row`.
#[derive(Clone, Copy)]
struct Span {
    row: usize,
    kv_head: usize,
    index: usize,
    spans: Spans,
}

impl Span {
    fn new(unit: usize, spans: Spans, p: AttentionParams) -> Self {
        let (row_head, index) = (unit / spans.per_row, unit % spans.per_row);
        Span {
            row: row_head / p.kv_heads,
            kv_head: row_head % p.kv_heads,
            index,
            spans,
        }
    }
}

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_span_avx2<K: KvRows>(
    keys: &K,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    span: Span,
    out: &mut [f32],
) {
    score_span::<K, Fused, Avx2Ops>(keys, inputs, p, span, out)
}

/// # Safety
/// The CPU supports AVX2, FMA, F16C and AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn score_span_avx512<K: KvRows>(
    keys: &K,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    span: Span,
    out: &mut [f32],
) {
    score_span::<K, Fused, Avx512Ops>(keys, inputs, p, span, out)
}

/// The first pass over one span: per query head of the group, `out` gets
/// the largest logit of the span's visible keys (`-inf` if none), then per
/// block the sum of `exp(logit - largest)` over its visible keys.
#[inline(always)]
fn score_span<K: KvRows, M: MulAdd, O: TileOps>(
    keys: &K,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    span: Span,
    out: &mut [f32],
) {
    let (bs, hd) = (p.block_size, p.head_dim);
    let group = p.heads / p.kv_heads;
    let spans = span.spans;
    for head in out.chunks_exact_mut(spans.head_floats()) {
        head[0] = f32::NEG_INFINITY;
        head[1..].fill(0.0);
    }
    let pos = inputs.positions[span.row] as usize;
    let first = first_visible(pos, p.sliding_window);
    let start = span.index * spans.len;
    let end = (start + spans.len).min(pos + 1);
    if end <= start.max(first) {
        return;
    }
    let table = block_table(inputs.block_tables, inputs.row_seq[span.row], 0, p);
    let visible = |j: usize| j >= first && j <= pos && table[j / bs] != EVICTED_BLOCK;
    let queries: Vec<&[f32]> = (0..group)
        .map(|i| &inputs.q[(span.row * p.heads + span.kv_head * group + i) * hd..][..hd])
        .collect();
    let width = p.kv_heads * hd;
    let mut tile_keys = vec![0f32; LANES * hd];
    let mut by_dim = vec![[0f32; LANES]; hd];
    let mut tile_scores = vec![[0f32; LANES]; group];
    // Per head, the span's logits (`-inf` where a key is not visible).
    let mut logits = vec![f32::NEG_INFINITY; group * (end - start)];
    for tile in (start..end).step_by(LANES) {
        let next = tile + LANES;
        if next + LANES <= end {
            if let Some(first) = whole_tile_at(table, p, next, span.kv_head) {
                keys.prefetch_rows(first, width, LANES, hd);
            }
        }
        let lanes = LANES.min(end - tile);
        // A tile wholly visible inside one block reads its rows at once.
        let whole = (lanes == LANES && (tile..next).all(visible))
            .then(|| whole_tile_at(table, p, tile, span.kv_head))
            .flatten();
        if let Some(first) = whole {
            keys.read_rows::<O>(first, width, &mut tile_keys, hd);
        } else {
            for (l, key) in tile_keys.chunks_exact_mut(hd).enumerate() {
                let j = tile + l;
                if l < lanes && visible(j) {
                    let slot = table[j / bs] as usize * bs + j % bs;
                    keys.read_into::<O>(slot * width + span.kv_head * hd, key);
                } else {
                    key.fill(0.0);
                }
            }
        }
        O::transpose(&tile_keys, hd, &mut by_dim);
        few_scores::<M>(&by_dim, &queries, &mut tile_scores);
        for (head, scores) in logits.chunks_exact_mut(end - start).zip(&tile_scores) {
            for (l, logit) in head[tile - start..][..lanes].iter_mut().enumerate() {
                if visible(tile + l) {
                    *logit = scores[l] * p.scale;
                }
            }
        }
    }
    for (head, out) in logits
        .chunks_exact_mut(end - start)
        .zip(out.chunks_exact_mut(spans.head_floats()))
    {
        let largest = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if largest == f32::NEG_INFINITY {
            continue;
        }
        out[0] = largest;
        // One pass of exponentials that the compiler vectorizes, then the
        // blocks' sums (a sum in order does not vectorize).
        for x in head.iter_mut() {
            let weight = exp(*x - largest);
            *x = if *x == f32::NEG_INFINITY { 0.0 } else { weight };
        }
        for (block, sum) in head.chunks(bs).zip(&mut out[1..]) {
            *sum = block.iter().sum();
        }
    }
}

/// The second pass for one (row, KV head): adds each block's share of
/// every head's softmax mass to `row` (`max_blocks_per_seq` entries), from
/// the row's spans in `partials`.
fn add_masses(partials: &[f32], spans: Spans, group: usize, row: &mut [f32]) {
    let head_floats = spans.head_floats();
    let span_floats = group * head_floats;
    for head in 0..group {
        let of_span = |s: usize| &partials[s * span_floats + head * head_floats..][..head_floats];
        let largest = (0..spans.per_row)
            .map(|s| of_span(s)[0])
            .fold(f32::NEG_INFINITY, f32::max);
        if largest == f32::NEG_INFINITY {
            continue;
        }
        // Each span's sums rescaled to the row's largest logit.
        let rescale = |s: usize| match of_span(s)[0] {
            m if m == f32::NEG_INFINITY => 0.0,
            m => (m - largest).exp(),
        };
        let total: f32 = (0..spans.per_row)
            .map(|s| rescale(s) * of_span(s)[1..].iter().sum::<f32>())
            .sum();
        for s in 0..spans.per_row {
            let factor = rescale(s) / total;
            let first_block = s * spans.blocks;
            for (b, &sum) in of_span(s)[1..].iter().enumerate() {
                if sum > 0.0 {
                    row[first_block + b] += sum * factor;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;
    use crate::{kv, CpuBackend};
    use tandem_core::backend::{KvCacheLayout, KvDtype};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    /// One sequence's rows over a cache of `num_blocks` blocks of
    /// `block_size`, 2 KV heads of 3 query heads each: the scores added to
    /// a random `scores` buffer, the reference's, and that buffer.
    struct Case<'a> {
        block_size: usize,
        num_blocks: usize,
        table: &'a [u32],
        positions: &'a [u32],
        window: Option<usize>,
    }

    impl Case<'_> {
        fn run(&self, isa: Isa, dtype: KvDtype) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let (rows, hd) = (self.positions.len(), 40);
            let layout = KvCacheLayout {
                num_blocks: self.num_blocks,
                block_size: self.block_size,
                kv_heads: 2,
                head_dim: hd,
                keys: dtype,
                values: dtype,
            };
            let p = AttentionParams {
                rows,
                heads: 6,
                kv_heads: 2,
                head_dim: hd,
                block_size: self.block_size,
                max_blocks_per_seq: self.table.len(),
                scale: 0.3,
                sliding_window: self.window,
                per_head_tables: false,
            };
            let mut cache = KvCache::new(layout).unwrap();
            let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
            let (k, v) = (values(slots.len() * 80, 1), values(slots.len() * 80, 2));
            kv::paged_kv_write(&k, &v, &slots, slots.len(), &mut cache).unwrap();
            let inputs = AttentionInputs {
                q: &values(rows * 6 * hd, 3),
                row_seq: &vec![0; rows],
                positions: self.positions,
                block_tables: self.table,
            };
            let base = values(rows * 2 * self.table.len(), 4);
            let (mut got, mut want) = (base.clone(), base.clone());
            let backend = CpuBackend::new(2);
            paged_attention_scores(&backend.workers, isa, &cache, &inputs, p, &mut got).unwrap();
            reference::paged_attention_scores(
                inputs.q,
                &cache.keys_f32(),
                inputs.row_seq,
                inputs.positions,
                inputs.block_tables,
                p,
                &mut want,
            );
            (got, want, base)
        }
    }

    /// Every dtype, holes, a window, grouped heads: the reference over the
    /// cache as it dequantizes, and each row's heads add up to their count.
    #[test]
    fn scores_match_the_reference_and_sum_to_the_heads() {
        for (isa, dtype) in Isa::available()
            .into_iter()
            .flat_map(|isa| KvDtype::ALL.map(|dtype| (isa, dtype)))
        {
            for window in [None, Some(7)] {
                let case = Case {
                    block_size: 3,
                    num_blocks: 12,
                    table: &[5, EVICTED_BLOCK, 2, 9, EVICTED_BLOCK, 0, 4],
                    positions: &[20, 9, 1],
                    window,
                };
                let (got, want, base) = case.run(isa, dtype);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-5,
                        "{} {dtype:?} {window:?}: {got:?} vs {want:?}",
                        isa.name()
                    );
                }
                let added: f32 = got.iter().zip(&base).map(|(g, b)| g - b).sum();
                assert!((added - 18.0).abs() < 1e-4, "3 rows of 6 heads, {added}");
                for row in 0..6 {
                    for b in [1, 4] {
                        assert_eq!(got[row * 7 + b], base[row * 7 + b], "a hole got mass");
                    }
                }
            }
        }
    }

    /// Rows longer than a span, with holes in several spans and a window
    /// that starts inside one: the spans fold into the reference's softmax.
    #[test]
    fn long_rows_fold_their_spans_into_one_softmax() {
        let (block_size, blocks) = (16, 90);
        let table: Vec<u32> = (0..blocks as u32)
            .map(|b| match b % 29 {
                7 => EVICTED_BLOCK,
                _ => (b * 37) % blocks as u32,
            })
            .collect();
        assert!(blocks * block_size > 2 * SPAN);
        for isa in Isa::available() {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int4] {
                for window in [None, Some(700)] {
                    let case = Case {
                        block_size,
                        num_blocks: blocks,
                        table: &table,
                        positions: &[1439, 1100, 511, 512, 3],
                        window,
                    };
                    let (got, want, base) = case.run(isa, dtype);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() < 1e-5,
                            "{} {dtype:?} {window:?} entry {i}: {g} vs {w}",
                            isa.name()
                        );
                    }
                    let added: f32 = got.iter().zip(&base).map(|(g, b)| g - b).sum();
                    assert!((added - 30.0).abs() < 1e-3, "5 rows of 6 heads, {added}");
                }
            }
        }
    }
}
