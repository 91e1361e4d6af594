//! Attention over a long context in key segments, so that a call of few
//! tiles (a decode step's one row per KV group, or a verification step's
//! few rows of one sequence) still keeps every thread busy.
//!
//! Every query's attention is defined segment by segment: the keys at
//! positions `k * SEGMENT .. (k + 1) * SEGMENT` give a partial result (an
//! online softmax from a fresh state: unnormalised sums, maximum and
//! denominator), and the partials are folded in segment order
//! ([`fold_segment`]), then normalised. A tile computes its segments one
//! after the other and folds as it goes. A call with too few tiles to
//! share among the threads ([`SegmentPlan`]) computes each `(tile,
//! segment)` unit as a task of its own and folds them afterwards: the
//! tile's rows read each key and value row once, where splitting a
//! verification step's rows among the threads had each thread read them
//! all again (five rows cost five decode steps). The arithmetic is the same
//! either way, so a row gets the same bits alone as in a batch, whatever
//! the thread count; a context within one segment folds once, a copy, so
//! it gets the bits of one online softmax.
//!
//! A segment whose blocks are all evicted (sparse attention's tables are
//! mostly holes) is skipped, never computed: its fold would change nothing.

use std::ops::{Range, RangeInclusive};

use tandem_core::backend::AttentionParams;
use tandem_core::kv::EVICTED_BLOCK;

use super::tile::{rows_per_tile, tile_rows};
use super::{block_table, first_visible, AttentionInputs, Work};
use crate::math::{exp, MulAdd};
use crate::workers::Workers;

/// Positions per key segment: a multiple of the key tile.
pub(super) const SEGMENT: usize = 256;

/// Tasks per thread of each phase of a segmented call.
const TASKS_PER_THREAD: usize = 4;

/// One KV group of a few consecutive rows of one sequence (a tile's
/// rows) over one key segment.
#[derive(Clone, Debug)]
pub(super) struct Unit {
    pub rows: Range<usize>,
    pub kv_head: usize,
    pub segment: usize,
}

/// The units of a call that is computed segment by segment.
pub(super) struct SegmentPlan {
    units: Vec<Unit>,
    /// Per `(row, KV group)`, in output order: the range of its units, and
    /// the row's place among their rows.
    pub groups: Vec<(Range<usize>, usize)>,
    /// Queries a unit's slot has room for: [`rows_per_tile`] rows of a
    /// group's heads.
    pub queries: usize,
    /// f32s of a unit's slot of partial results: `queries * head_dim`
    /// unnormalised sums, then `queries` maxima and `queries` denominators.
    pub slot_len: usize,
}

impl SegmentPlan {
    /// The plan of a call whose tiles (runs of up to [`rows_per_tile`]
    /// rows of one sequence, per KV group) are too few for the threads (a
    /// decode step, or a verification step's few rows) and that spans
    /// several segments; `None` when tiles keep the threads busy, or there
    /// is one thread.
    pub fn for_call(
        workers: &Workers,
        inputs: &AttentionInputs<'_>,
        p: AttentionParams,
    ) -> Option<Self> {
        let threads = workers.threads();
        if threads < 2 {
            return None;
        }
        let runs: Vec<_> = tile_rows(p, inputs.row_seq, 0..p.rows).collect();
        let tiles = runs.len() * p.kv_heads;
        // As many tiles as a segmented call has tasks share out well enough.
        if tiles >= TASKS_PER_THREAD * threads {
            return None;
        }
        let (mut units, mut groups) = (Vec::new(), Vec::new());
        for rows in runs {
            // The segments holding positions any row of the run sees.
            let positions = &inputs.positions[rows.clone()];
            let pos = positions.iter().max().map_or(0, |&pos| pos as usize);
            let first = positions
                .iter()
                .map(|&pos| first_visible(pos as usize, p.sliding_window))
                .min()
                .unwrap_or(0);
            // Per KV head: with per-head tables each reads its own blocks.
            let mut per_head = Vec::with_capacity(p.kv_heads);
            for kv_head in 0..p.kv_heads {
                let seq = inputs.row_seq[rows.start];
                let table = block_table(inputs.block_tables, seq, kv_head, p);
                let at = units.len();
                units.extend(live_segments(table, p, first..=pos).map(|segment| Unit {
                    rows: rows.clone(),
                    kv_head,
                    segment,
                }));
                per_head.push(at..units.len());
            }
            for row in rows.clone() {
                for units in &per_head {
                    groups.push((units.clone(), row - rows.start));
                }
            }
        }
        let queries = rows_per_tile(p) * (p.heads / p.kv_heads);
        (units.len() > tiles).then(|| SegmentPlan {
            units,
            groups,
            queries,
            slot_len: queries * (p.head_dim + 2),
        })
    }

    /// Computes every unit's partial results, then folds each group's into
    /// its outputs, each phase shared among the threads (`run` dispatches
    /// a task to the instruction set's kernel).
    pub fn run(
        &self,
        workers: &Workers,
        p: AttentionParams,
        run: impl Fn(Work<'_>, &mut [f32]) + Sync,
        out: &mut [f32],
    ) {
        let tasks = workers.threads() * TASKS_PER_THREAD;
        let mut partials = vec![0f32; self.units.len() * self.slot_len];
        let units_per_task = self.units.len().div_ceil(tasks);
        workers.for_each_chunk(&mut partials, units_per_task * self.slot_len, |i, slots| {
            let units = &self.units[i * units_per_task..][..slots.len() / self.slot_len];
            run(Work::Segments { units }, slots)
        });
        let group_len = p.heads / p.kv_heads * p.head_dim;
        let groups_per_task = self.groups.len().div_ceil(tasks);
        workers.for_each_chunk(out, groups_per_task * group_len, |i, out| {
            let work = Work::Fold {
                first_group: i * groups_per_task,
                plan: self,
                partials: &partials,
            };
            run(work, out)
        });
    }
}

/// The segments holding some of `keys` whose blocks in `table` are not
/// all evicted, in order.
pub(super) fn live_segments(
    table: &[u32],
    p: AttentionParams,
    keys: RangeInclusive<usize>,
) -> impl Iterator<Item = usize> + '_ {
    let (lo, hi) = (*keys.start(), *keys.end());
    (lo / SEGMENT..=hi / SEGMENT).filter(move |&segment| {
        let first = lo.max(segment * SEGMENT) / p.block_size;
        let last = hi.min((segment + 1) * SEGMENT - 1) / p.block_size;
        table[first..=last].iter().any(|&b| b != EVICTED_BLOCK)
    })
}

/// Folds a query's partial result over one segment (`partial` sums, its
/// `(max, denominator)`) into its running result (`out` and `run`, which
/// start as zeros and `(-inf, 0)`). A segment the query saw nothing of
/// changes nothing; the first one it saw is copied exactly (its factor is
/// `exp(0) = 1`, the zeros' is at most a denormal).
#[inline(always)]
pub(super) fn fold_segment<M: MulAdd>(
    run: &mut (f32, f32),
    out: &mut [f32],
    (max, denominator): (f32, f32),
    partial: &[f32],
) {
    if max == f32::NEG_INFINITY {
        return;
    }
    let new_max = run.0.max(max);
    let (old, new) = (exp(run.0 - new_max), exp(max - new_max));
    run.1 = M::mul_add(denominator, new, run.1 * old);
    for (o, &x) in out.iter_mut().zip(partial) {
        *o = M::mul_add(x, new, *o * old);
    }
    run.0 = new_max;
}

/// Divides a query's folded sums by its denominator. A query whose every
/// visible position was evicted attends to nothing.
#[inline(always)]
pub(super) fn normalize(out: &mut [f32], denominator: f32) {
    let inv = if denominator > 0.0 {
        1.0 / denominator
    } else {
        0.0
    };
    out.iter_mut().for_each(|o| *o *= inv);
}
