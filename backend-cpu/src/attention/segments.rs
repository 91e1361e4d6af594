//! Attention over a long context in key segments, so that a decode step's
//! few `(row, KV group)` pairs still keep every thread busy.
//!
//! Every query's attention is defined segment by segment: the keys at
//! positions `k * SEGMENT .. (k + 1) * SEGMENT` give a partial result (an
//! online softmax from a fresh state: unnormalised sums, maximum and
//! denominator), and the partials are folded in segment order
//! ([`fold_segment`]), then normalised. A tile computes its segments one
//! after the other and folds as it goes. A call with too few `(row, KV
//! group)` pairs to share among the threads ([`SegmentPlan`]) computes each
//! `(row, group, segment)` unit as a task of its own and folds them
//! afterwards. The arithmetic is the same either way, so a row gets the same
//! bits alone as in a batch, whatever the thread count; a context within
//! one segment folds once, a copy, so it gets the bits of one online softmax.

use std::ops::Range;

use tandem_core::backend::AttentionParams;

use super::{first_visible, AttentionInputs, Work};
use crate::math::{exp, MulAdd};
use crate::workers::Workers;

/// Positions per key segment: a multiple of the key tile.
pub(super) const SEGMENT: usize = 256;

/// Tasks per thread of each phase of a segmented call.
const TASKS_PER_THREAD: usize = 4;

/// One KV group of one row over one key segment.
#[derive(Clone, Copy, Debug)]
pub(super) struct Unit {
    pub row: usize,
    pub kv_head: usize,
    pub segment: usize,
}

/// The units of a call that is computed segment by segment.
pub(super) struct SegmentPlan {
    units: Vec<Unit>,
    /// Per `(row, KV group)`, in output order, the range of its units.
    pub groups: Vec<Range<usize>>,
    /// f32s of a unit's slot of partial results: `group * head_dim`
    /// unnormalised sums, then `group` maxima and `group` denominators.
    pub slot_len: usize,
}

impl SegmentPlan {
    /// The plan of a call whose `(row, KV group)` pairs are too few for the
    /// threads (a decode step) and that spans several segments; `None`
    /// when tiles keep the threads busy, or there is one thread.
    pub fn for_call(
        workers: &Workers,
        inputs: &AttentionInputs<'_>,
        p: AttentionParams,
    ) -> Option<Self> {
        let threads = workers.threads();
        if threads < 2 || p.rows * p.kv_heads >= 2 * threads {
            return None;
        }
        let (mut units, mut groups) = (Vec::new(), Vec::new());
        for row in 0..p.rows {
            let pos = inputs.positions[row] as usize;
            let first = first_visible(pos, p.sliding_window);
            for kv_head in 0..p.kv_heads {
                let start = units.len();
                units.extend((first / SEGMENT..=pos / SEGMENT).map(|segment| Unit {
                    row,
                    kv_head,
                    segment,
                }));
                groups.push(start..units.len());
            }
        }
        (units.len() > groups.len()).then(|| SegmentPlan {
            units,
            groups,
            slot_len: p.heads / p.kv_heads * (p.head_dim + 2),
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
