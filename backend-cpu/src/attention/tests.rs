use tandem_core::backend::{KvCacheLayout, KvDtype};
use tandem_core::kernels::spec;
use tandem_core::kv::plan::MIXED_KV_PAIRS;

use super::*;
use crate::{kv, reference};

/// Uniform random values in `[-bound, bound)`, `len` at a call.
fn random_values(seed: u64, bound: f64) -> impl FnMut(usize) -> Vec<f32> {
    let mut rng = tandem_core::sched::Rng::new(seed);
    move |len| {
        (0..len)
            .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
            .collect()
    }
}

/// A cache of `layout` whose every slot holds K and V from `values`.
fn filled_cache(layout: KvCacheLayout, values: &mut impl FnMut(usize) -> Vec<f32>) -> KvCache {
    let mut cache = KvCache::new(layout).unwrap();
    let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
    let width = layout.kv_heads * layout.head_dim;
    let (k, v) = (values(slots.len() * width), values(slots.len() * width));
    kv::paged_kv_write(&k, &v, &slots, slots.len(), &mut cache).unwrap();
    cache
}

/// Query rows of one sequence (sequence 0) at `positions`.
struct RowsOfOneSequence<'a> {
    q: &'a [f32],
    positions: &'a [u32],
    block_tables: &'a [u32],
}

impl<'a> RowsOfOneSequence<'a> {
    /// The inputs of row `t` alone.
    fn row(&self, t: usize) -> AttentionInputs<'a> {
        let row_len = self.q.len() / self.positions.len();
        AttentionInputs {
            q: &self.q[t * row_len..][..row_len],
            row_seq: &[0],
            positions: &self.positions[t..t + 1],
            block_tables: self.block_tables,
        }
    }

    /// Each row attended alone (parameters `one_row`) has the bits it
    /// has in `batch`.
    fn assert_alone_as_in(
        &self,
        batch: &[f32],
        workers: &Workers,
        isa: Isa,
        cache: &KvCache,
        one_row: AttentionParams,
        what: &str,
    ) {
        let row_len = self.q.len() / self.positions.len();
        for t in 0..self.positions.len() {
            let mut alone = vec![f32::NAN; row_len];
            paged_attention(workers, isa, cache, self.row(t), one_row, &mut alone).unwrap();
            let batch_row = &batch[t * row_len..][..row_len];
            assert!(
                alone
                    .iter()
                    .zip(batch_row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} {what} threads {}: row {t}",
                isa.name(),
                workers.threads()
            );
        }
    }
}

/// Every instruction set's attention against the reference, on two
/// sequences (one decoding, one in a prefill chunk) over 3-token blocks.
#[test]
fn every_instruction_set_matches_the_reference() {
    let mut values = random_values(1, 1.0);
    let p = AttentionParams {
        rows: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 12,
        block_size: 3,
        max_blocks_per_seq: 4,
        scale: 0.3,
        sliding_window: None,
        per_head_tables: false,
    };
    let block_tables = [5, 1, 7, 2, 0, 3, 6, 4];
    let (row_seq, positions) = ([0, 1, 1, 1], [9, 5, 6, 7]);
    let pairs = KvDtype::ALL
        .map(|d| (d, d))
        .into_iter()
        .chain(MIXED_KV_PAIRS);
    for (key_dtype, value_dtype) in pairs {
        let layout = KvCacheLayout {
            num_blocks: 8,
            block_size: 3,
            kv_heads: 2,
            head_dim: 12,
            keys: key_dtype,
            values: value_dtype,
        };
        let cache = filled_cache(layout, &mut values);
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
                paged_attention(&Workers::new(threads), isa, &cache, inputs, p, &mut got).unwrap();
                let tolerance = spec("paged_attention").unwrap().tolerance;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() / (1.0 + w.abs()) <= tolerance,
                        "{} {key_dtype}/{value_dtype} [{i}]: got {g}, want {w}",
                        isa.name()
                    );
                }
            }
        }
    }
}

/// A row's output does not depend on what else is in the call: each
/// row of a 45-token prefill (several query tiles, tasks cutting rows,
/// 5-token blocks) has the bits it has alone (keys in the lanes; with 3
/// threads, its two KV groups cut in three tasks), with and without a
/// sliding window, for a head size that is not a multiple of 16 and
/// for 64, which the score loop compiles as a constant.
#[test]
fn a_row_gets_the_same_bits_alone_and_in_a_batch() {
    let mut values = random_values(7, 2.0);
    let (tokens, heads, kv_heads, block_size) = (45, 6, 2, 5);
    let block_tables: Vec<u32> = (0..9).rev().collect();
    for (dtype, head_dim) in KvDtype::ALL.into_iter().flat_map(|d| [(d, 20), (d, 64)]) {
        let layout = KvCacheLayout {
            num_blocks: 9,
            block_size,
            kv_heads,
            head_dim,
            keys: dtype,
            values: dtype,
        };
        let cache = filled_cache(layout, &mut values);
        let q = values(tokens * heads * head_dim);
        let positions: Vec<u32> = (0..tokens as u32).collect();
        for sliding_window in [None, Some(7)] {
            let p = |rows| AttentionParams {
                rows,
                heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: 9,
                scale: 0.4,
                sliding_window,
                per_head_tables: false,
            };
            for isa in Isa::available() {
                for threads in [1, 2, 3] {
                    let workers = Workers::new(threads);
                    let row_seq = vec![0; tokens];
                    let inputs = AttentionInputs {
                        q: &q,
                        row_seq: &row_seq,
                        positions: &positions,
                        block_tables: &block_tables,
                    };
                    let mut batch = vec![f32::NAN; q.len()];
                    paged_attention(&workers, isa, &cache, inputs, p(tokens), &mut batch).unwrap();
                    let what = format!("{dtype:?} window {sliding_window:?}");
                    let rows = RowsOfOneSequence {
                        q: &q,
                        positions: &positions,
                        block_tables: &block_tables,
                    };
                    rows.assert_alone_as_in(&batch, &workers, isa, &cache, p(1), &what);
                }
            }
        }
    }
}

/// A long context is attended in key segments ([`super::segments`]): a
/// decode row alone, whose two KV groups are cut into one task per
/// segment on 2 and 3 threads, has the bits it has in a batch of rows
/// computed tile by tile, for every dtype, with and without a sliding
/// window, and stays within the reference's tolerance; also when the
/// table's holes (evicted blocks, sparse attention) span whole segments,
/// which are skipped.
#[test]
fn long_rows_get_the_same_bits_in_segments_and_in_tiles() {
    let mut values = random_values(11, 2.0);
    let (heads, kv_heads, head_dim, block_size, blocks) = (6, 2, 20, 16, 40);
    let whole: Vec<u32> = (0..blocks as u32).rev().collect();
    // Segment 1 (positions 256..512) all holes, and two blocks elsewhere.
    let holed: Vec<u32> = whole
        .iter()
        .enumerate()
        .map(|(e, &b)| match (16..32).contains(&e) || e == 3 || e == 35 {
            true => EVICTED_BLOCK,
            false => b,
        })
        .collect();
    let positions: Vec<u32> = vec![100, 255, 256, 300, 511, 512, 530, 639];
    let rows = positions.len();
    let row_len = heads * head_dim;
    for (dtype, block_tables) in KvDtype::ALL
        .into_iter()
        .flat_map(|d| [(d, &whole), (d, &holed)])
    {
        let layout = KvCacheLayout {
            num_blocks: blocks,
            block_size,
            kv_heads,
            head_dim,
            keys: dtype,
            values: dtype,
        };
        let cache = filled_cache(layout, &mut values);
        let q = values(rows * row_len);
        for sliding_window in [None, Some(300)] {
            let p = |rows| AttentionParams {
                rows,
                heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: blocks,
                scale: 0.3,
                sliding_window,
                per_head_tables: false,
            };
            let mut want = vec![0.0; q.len()];
            reference::paged_attention(
                &q,
                &cache.keys_f32(),
                &cache.values_f32(),
                &vec![0; rows],
                &positions,
                block_tables,
                p(rows),
                &mut want,
            );
            for isa in Isa::available() {
                let batch_inputs = AttentionInputs {
                    q: &q,
                    row_seq: &vec![0; rows],
                    positions: &positions,
                    block_tables,
                };
                let mut batch = vec![f32::NAN; q.len()];
                let workers = Workers::new(1);
                paged_attention(&workers, isa, &cache, batch_inputs, p(rows), &mut batch).unwrap();
                let tolerance = spec("paged_attention").unwrap().tolerance;
                for (i, (g, w)) in batch.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() / (1.0 + w.abs()) <= tolerance,
                        "{} {dtype:?} [{i}]: got {g}, want {w}",
                        isa.name()
                    );
                }
                for threads in [1, 2, 3] {
                    let workers = Workers::new(threads);
                    let rows = RowsOfOneSequence {
                        q: &q,
                        positions: &positions,
                        block_tables,
                    };
                    for (t, &pos) in positions.iter().enumerate() {
                        let segmented =
                            segments::SegmentPlan::for_call(&workers, &rows.row(t), p(1));
                        let pos = pos as usize;
                        let keys = first_visible(pos, sliding_window)..=pos;
                        let live = segments::live_segments(block_tables, p(1), keys);
                        assert_eq!(segmented.is_some(), threads > 1 && live.count() > 1);
                    }
                    let what = format!("{dtype:?} window {sliding_window:?}");
                    rows.assert_alone_as_in(&batch, &workers, isa, &cache, p(1), &what);
                    // The whole batch is one run of rows per KV group,
                    // too few tiles for several threads: its units are
                    // multi-row tiles over one segment each.
                    let batch_p = p(positions.len());
                    let plan = segments::SegmentPlan::for_call(&workers, &batch_inputs, batch_p);
                    assert_eq!(plan.is_some(), threads > 1, "{what}");
                    let mut shared = vec![f32::NAN; q.len()];
                    paged_attention(&workers, isa, &cache, batch_inputs, batch_p, &mut shared)
                        .unwrap();
                    assert!(
                        shared
                            .iter()
                            .zip(&batch)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} {what}: {threads} threads",
                        isa.name()
                    );
                }
            }
        }
    }
}
