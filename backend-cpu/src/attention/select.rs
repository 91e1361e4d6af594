//! Sparse attention's block selection (`select_kv_blocks`): per sequence
//! and KV head, the sequence's table with the blocks that head does not
//! need made holes.
//!
//! A block's bound for a query is `Σ_c max(q_c·min_c, q_c·max_c)` over its
//! key bounds. Splitting each query into its positive and negative parts
//! makes that `q⁺·max + q⁻·min`, which is linear in the query: the bound
//! summed over a KV head's query heads (and a sequence's rows) is one dot
//! product of the summed parts with the block's bounds, `2 · head_dim`
//! multiply-adds per block and KV head.

use tandem_core::backend::{AttentionParams, BlockSelectParams};
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::Result;

use super::{block_table, check_inputs, prefetch, AttentionInputs};
use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::key_bounds::KeyBounds;
use crate::kv::KvCache;
use crate::workers::Workers;

/// Candidate blocks scored per task, at least (a task's dispatch costs
/// about as much as scoring a few dozen blocks).
const MIN_BLOCKS_PER_TASK: usize = 64;

pub(crate) fn select_kv_blocks(
    workers: &Workers,
    isa: Isa,
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    s: BlockSelectParams,
    out: &mut [u32],
) -> Result<()> {
    let kernel = "select_kv_blocks";
    if p.per_head_tables {
        return Err(check::error(
            kernel,
            "its input is one block table per sequence (it writes one per KV head)",
        ));
    }
    check_inputs(kernel, cache, inputs, p)?;
    check::positive(kernel, "top_blocks", s.top_blocks)?;
    let bounds = cache.key_bounds().ok_or_else(|| {
        check::error(
            kernel,
            "the cache keeps no key bounds (call track_key_bounds first)",
        )
    })?;
    let width = p.max_blocks_per_seq;
    let num_seqs = inputs.block_tables.len() / width;
    let seq_width = p.kv_heads * width;
    check::buffer_len(kernel, "out", out.len(), num_seqs * seq_width)?;
    let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); num_seqs];
    for (t, &seq) in inputs.row_seq[..p.rows].iter().enumerate() {
        rows_of[seq as usize].push(t);
    }
    let mut scores = Vec::new();
    for (seq, tables_out) in out[..num_seqs * seq_width]
        .chunks_exact_mut(seq_width)
        .enumerate()
    {
        let table = block_table(inputs.block_tables, seq as u32, 0, p);
        for table_out in tables_out.chunks_exact_mut(width) {
            table_out.copy_from_slice(table);
        }
        let Some(candidates) = candidates(inputs, p, s, &rows_of[seq], table) else {
            continue;
        };
        let parts = query_parts(inputs, p, &rows_of[seq]);
        // Every KV head's bound of every candidate, shared among the threads.
        scores.clear();
        scores.resize(p.kv_heads * candidates.len(), 0.0);
        let tasks = workers.threads() * 4;
        let chunk = scores.len().div_ceil(tasks).max(MIN_BLOCKS_PER_TASK);
        workers.for_each_chunk(&mut scores, chunk, |i, scores| {
            let first = i * chunk;
            let job = BoundsJob {
                bounds,
                table,
                candidates: &candidates,
                parts: &parts,
                d: p.head_dim,
            };
            match isa.kind() {
                // SAFETY: an `Isa` exists only for instruction sets the CPU has.
                #[cfg(target_arch = "x86_64")]
                IsaKind::Avx512Vnni | IsaKind::Avx2 => unsafe { job.score_avx2(first, scores) },
                IsaKind::Portable => job.score(first, scores),
                #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                IsaKind::Simd128 => job.score(first, scores),
            }
        });
        keep_top(&scores, s.top_blocks, &candidates, width, tables_out);
    }
    Ok(())
}

/// The visible entries of a sequence's table (rows `rows`) that are
/// neither sinks, recent nor holes; `None` when they are no more than
/// `top_blocks` and all stay.
fn candidates(
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    s: BlockSelectParams,
    rows: &[usize],
    table: &[u32],
) -> Option<Vec<usize>> {
    let last = rows.iter().map(|&t| inputs.positions[t] as usize).max()?;
    let visible = last / p.block_size + 1;
    let end = visible.saturating_sub(s.recent_blocks);
    let candidates: Vec<usize> = (s.sink_blocks.min(end)..end)
        .filter(|&e| table[e] != EVICTED_BLOCK)
        .collect();
    (candidates.len() > s.top_blocks).then_some(candidates)
}

/// Per KV head, the positive and then the negative parts of its query
/// heads' queries over `rows`, summed: `[kv_heads][2][head_dim]`.
fn query_parts(inputs: &AttentionInputs<'_>, p: AttentionParams, rows: &[usize]) -> Vec<f32> {
    let d = p.head_dim;
    let group = p.heads / p.kv_heads;
    let mut parts = vec![0f32; p.kv_heads * 2 * d];
    for (g, parts) in parts.chunks_exact_mut(2 * d).enumerate() {
        let (pos, neg) = parts.split_at_mut(d);
        for &t in rows {
            for h in g * group..(g + 1) * group {
                let q = &inputs.q[(t * p.heads + h) * d..][..d];
                for ((a, b), &x) in pos.iter_mut().zip(neg.iter_mut()).zip(q) {
                    *a += x.max(0.0);
                    *b += x.min(0.0);
                }
            }
        }
    }
    parts
}

/// How many candidates ahead scoring prefetches their bounds: each takes
/// a few dozen cycles to score, a load from memory hundreds.
const PREFETCH_AHEAD: usize = 8;

/// What a task needs to score candidates: element `g * candidates.len() +
/// i` of the scores is KV head `g`'s bound of candidate `i`.
struct BoundsJob<'a> {
    bounds: &'a KeyBounds,
    table: &'a [u32],
    candidates: &'a [usize],
    parts: &'a [f32],
    d: usize,
}

impl BoundsJob<'_> {
    /// Scores elements `first..first + out.len()`.
    #[inline(always)]
    fn score(&self, first: usize, out: &mut [f32]) {
        let (d, n) = (self.d, self.candidates.len());
        let elements = self.parts.len() / (2 * d) * n;
        for (at, score) in (first..).zip(out) {
            // A candidate's bounds are a scattered 2 · head_dim floats.
            let ahead = at + PREFETCH_AHEAD;
            if ahead < elements {
                let block = self.table[self.candidates[ahead % n]] as usize;
                let (min, _) = self.bounds.of(block, ahead / n);
                prefetch(min.as_ptr().cast(), 2 * d * size_of::<f32>());
            }
            let (g, i) = (at / n, at % n);
            let (pos, neg) = self.parts[g * 2 * d..][..2 * d].split_at(d);
            let (min, max) = self.bounds.of(self.table[self.candidates[i]] as usize, g);
            *score = bound(pos, max) + bound(neg, min);
        }
    }

    /// [`BoundsJob::score`] compiled for AVX2: the same sums in the same
    /// order, eight lanes to a vector (no fused multiply-adds), so the same
    /// bits.
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_avx2(&self, first: usize, out: &mut [f32]) {
        self.score(first, out)
    }
}

/// In each KV head's table (`tables`, `width` entries each, one after the
/// other), makes holes of the candidates that are not among that head's
/// `top` highest scores (ties to the earlier candidate).
fn keep_top(scores: &[f32], top: usize, candidates: &[usize], width: usize, tables: &mut [u32]) {
    let n = candidates.len();
    let mut scored: Vec<(f32, usize)> = Vec::with_capacity(n);
    for (scores, table) in scores.chunks_exact(n).zip(tables.chunks_exact_mut(width)) {
        scored.clear();
        scored.extend(scores.iter().copied().zip(0..));
        let highest_first =
            |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        scored.select_nth_unstable_by(top - 1, highest_first);
        for &(_, i) in &scored[top..] {
            table[candidates[i]] = EVICTED_BLOCK;
        }
    }
}

/// `Σ a_c · b_c` in eight lanes, which the compiler keeps in vectors.
#[inline(always)]
fn bound(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (a, b) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += a[l] * b[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{kv, reference, CpuBackend};
    use tandem_core::backend::{KvCacheLayout, KvDtype};
    use tandem_core::sched::Rng;

    fn values(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
    }

    /// The kernel on `backend`'s threads and instruction set.
    fn select_on(
        backend: &CpuBackend,
        cache: &kv::KvCache,
        inputs: &AttentionInputs<'_>,
        p: AttentionParams,
        s: BlockSelectParams,
        out: &mut [u32],
    ) -> Result<()> {
        select_kv_blocks(&backend.workers, backend.isa, cache, inputs, p, s, out)
    }

    fn params(rows: usize, width: usize) -> AttentionParams {
        AttentionParams {
            rows,
            heads: 6,
            kv_heads: 2,
            head_dim: 40,
            block_size: 5,
            max_blocks_per_seq: width,
            scale: 0.3,
            sliding_window: None,
            per_head_tables: false,
        }
    }

    /// Two sequences (one with two rows, one with a hole), a third without
    /// rows, every dtype, several budgets: the reference's choice over the
    /// keys as written, block by block in order, one block rewritten after a
    /// restart, another copied.
    #[test]
    fn selection_matches_the_reference() {
        let mut rng = Rng::new(7);
        let backend = CpuBackend::new(2);
        for dtype in KvDtype::ALL {
            let layout = KvCacheLayout {
                num_blocks: 40,
                block_size: 5,
                kv_heads: 2,
                head_dim: 40,
                keys: dtype,
                values: dtype,
            };
            let mut cache = kv::KvCache::new(layout).unwrap();
            cache.track_key_bounds();
            let width = layout.row_width();
            let mut keys = vec![0f32; layout.num_slots() * width];
            let mut filled = vec![0usize; 40];
            // Blocks 0..36 filled slot by slot; block 36 half.
            for block in 0..37 {
                let n = if block == 36 { 3 } else { 5 };
                let slots: Vec<u32> = (0..n).map(|i| (block * 5 + i) as u32).collect();
                let k = values(&mut rng, n * width);
                kv::paged_kv_write(&k, &k, &slots, n, &mut cache).unwrap();
                keys[block * 5 * width..][..n * width].copy_from_slice(&k);
                filled[block] = n;
            }
            // Block 7 reused: its bounds restart at slot 0.
            let k = values(&mut rng, 2 * width);
            kv::paged_kv_write(&k, &k, &[35, 36], 2, &mut cache).unwrap();
            keys[35 * width..][..2 * width].copy_from_slice(&k);
            filled[7] = 2;
            kv::copy_kv_blocks(&mut cache, &[(3, 38)]).unwrap();
            keys.copy_within(3 * 5 * width..4 * 5 * width, 38 * 5 * width);
            filled[38] = 5;
            let w = 20;
            let mut tables = vec![0u32; 3 * w];
            let seq0: Vec<u32> = (0..19).chain([38]).collect();
            tables[..20].copy_from_slice(&seq0);
            let seq1 = [
                19,
                20,
                21,
                EVICTED_BLOCK,
                23,
                24,
                25,
                26,
                27,
                28,
                29,
                30,
                7,
                36,
            ];
            tables[w..w + seq1.len()].copy_from_slice(&seq1);
            tables[2 * w..3 * w].copy_from_slice(&seq0);
            let p = params(3, w);
            let q = values(&mut rng, 3 * 6 * 40);
            let inputs = AttentionInputs {
                q: &q,
                row_seq: &[0, 1, 0],
                positions: &[99, 67, 80],
                block_tables: &tables,
            };
            for (top, sinks, recent) in [(1, 1, 4), (3, 0, 2), (5, 2, 1), (30, 1, 4)] {
                let s = BlockSelectParams {
                    top_blocks: top,
                    sink_blocks: sinks,
                    recent_blocks: recent,
                };
                // A table per sequence and KV head.
                let mut got = vec![0u32; 3 * 2 * w];
                select_on(&backend, &cache, &inputs, p, s, &mut got).unwrap();
                let mut want = vec![0u32; 3 * 2 * w];
                reference::select_kv_blocks(
                    &q,
                    &keys,
                    &filled,
                    inputs.row_seq,
                    inputs.positions,
                    &tables,
                    p,
                    s,
                    &mut want,
                );
                assert_eq!(got, want, "{dtype:?} {s:?}");
                for head in got[..2 * w].chunks_exact(w) {
                    let kept = head.iter().filter(|&&b| b != EVICTED_BLOCK).count();
                    assert!(kept <= sinks + recent + top, "{dtype:?} {s:?}: {kept}");
                    if top < 5 {
                        assert!(kept < 20, "{dtype:?} {s:?}: nothing dropped");
                    }
                }
                if top < 5 {
                    assert_ne!(
                        got[..w],
                        got[w..2 * w],
                        "{dtype:?} {s:?}: the heads chose alike"
                    );
                }
                for head in got[4 * w..].chunks_exact(w) {
                    assert_eq!(head, &tables[2 * w..], "a sequence without rows");
                }
            }
        }
    }

    /// Enough blocks that the scores are cut among several tasks, a head
    /// size with a tail past the eight lanes: every instruction set on 1-3
    /// threads chooses what the reference chooses.
    #[test]
    fn blocks_scored_in_many_tasks_are_chosen_as_the_reference_does() {
        let mut rng = Rng::new(13);
        let (blocks, block_size, kv_heads, head_dim) = (300, 4, 2, 28);
        let layout = KvCacheLayout {
            num_blocks: blocks,
            block_size,
            kv_heads,
            head_dim,
            keys: KvDtype::F16,
            values: KvDtype::F16,
        };
        let mut cache = kv::KvCache::new(layout).unwrap();
        cache.track_key_bounds();
        let width = layout.row_width();
        let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
        let k = values(&mut rng, slots.len() * width);
        kv::paged_kv_write(&k, &k, &slots, slots.len(), &mut cache).unwrap();
        let keys = cache.keys_f32();
        let tables: Vec<u32> = (0..blocks as u32).rev().collect();
        let p = AttentionParams {
            rows: 1,
            heads: 6,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: blocks,
            scale: 0.2,
            sliding_window: None,
            per_head_tables: false,
        };
        let q = values(&mut rng, 6 * head_dim);
        let inputs = AttentionInputs {
            q: &q,
            row_seq: &[0],
            positions: &[(blocks * block_size - 2) as u32],
            block_tables: &tables,
        };
        let s = BlockSelectParams {
            top_blocks: 7,
            sink_blocks: 1,
            recent_blocks: 3,
        };
        let mut want = vec![0u32; kv_heads * blocks];
        reference::select_kv_blocks(
            &q,
            &keys,
            &vec![block_size; blocks],
            inputs.row_seq,
            inputs.positions,
            &tables,
            p,
            s,
            &mut want,
        );
        for isa in Isa::available() {
            for threads in [1, 2, 3] {
                let workers = Workers::new(threads);
                let mut got = vec![0u32; kv_heads * blocks];
                select_kv_blocks(&workers, isa, &cache, &inputs, p, s, &mut got).unwrap();
                assert_eq!(got, want, "{} on {threads} threads", isa.name());
            }
        }
    }

    /// A key that matches the query far better than all others puts its
    /// block first, wherever it is.
    #[test]
    fn the_block_holding_a_matching_key_is_selected() {
        let mut rng = Rng::new(3);
        let backend = CpuBackend::new(1);
        let layout = KvCacheLayout {
            num_blocks: 30,
            block_size: 5,
            kv_heads: 2,
            head_dim: 40,
            keys: KvDtype::F16,
            values: KvDtype::F16,
        };
        let width = layout.row_width();
        let q = values(&mut rng, 6 * 40);
        for hidden in [1, 12, 24] {
            let mut cache = kv::KvCache::new(layout).unwrap();
            cache.track_key_bounds();
            let slots: Vec<u32> = (0..150).collect();
            let mut k: Vec<f32> = values(&mut rng, 150 * width)
                .iter()
                .map(|x| x * 0.1)
                .collect();
            // Key 2 of block `hidden`, head 1: the queries of group 1, scaled up.
            for c in 0..40 {
                k[(hidden * 5 + 2) * width + 40 + c] = 4.0 * (q[3 * 40 + c] + q[4 * 40 + c]);
            }
            kv::paged_kv_write(&k, &k, &slots, 150, &mut cache).unwrap();
            let tables: Vec<u32> = (0..30).collect();
            let inputs = AttentionInputs {
                q: &q,
                row_seq: &[0],
                positions: &[149],
                block_tables: &tables,
            };
            let s = BlockSelectParams {
                top_blocks: 1,
                sink_blocks: 1,
                recent_blocks: 2,
            };
            let mut got = vec![0u32; 2 * 30];
            let p = params(1, 30);
            select_on(&backend, &cache, &inputs, p, s, &mut got).unwrap();
            // Head 1's table, which alone holds the key.
            let kept: Vec<usize> = (0..30).filter(|&e| got[30 + e] != EVICTED_BLOCK).collect();
            assert_eq!(kept.len(), 1 + 2 + 1, "{kept:?}");
            assert!(kept.contains(&hidden), "{hidden}: {kept:?}");
        }
    }

    /// A cache without key bounds, and per-head tables as the input.
    #[test]
    fn a_cache_without_bounds_is_refused() {
        let layout = KvCacheLayout {
            num_blocks: 2,
            block_size: 5,
            kv_heads: 2,
            head_dim: 40,
            keys: KvDtype::F32,
            values: KvDtype::F32,
        };
        let cache = kv::KvCache::new(layout).unwrap();
        let inputs = AttentionInputs {
            q: &[0.0; 240],
            row_seq: &[0],
            positions: &[3],
            block_tables: &[0, 1],
        };
        let s = BlockSelectParams {
            top_blocks: 1,
            sink_blocks: 0,
            recent_blocks: 0,
        };
        let backend = CpuBackend::new(1);
        let e = select_on(&backend, &cache, &inputs, params(1, 2), s, &mut [0; 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("key bounds"), "{e}");
        let per_head = AttentionParams {
            per_head_tables: true,
            ..params(1, 2)
        };
        let e = select_on(&backend, &cache, &inputs, per_head, s, &mut [0; 4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("one block table per sequence"), "{e}");
    }
}
