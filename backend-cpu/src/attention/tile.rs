//! The tiled kernel: a task's outputs, one query tile at a time.
//!
//! A query tile is the query heads that share one KV head, in up to
//! [`rows_per_tile`] consecutive rows of one sequence. Its queries are
//! transposed once into `[head_dim]` vectors of sixteen queries, so the
//! scores of one key against sixteen queries are `head_dim` multiply-adds
//! of whole vectors, with no horizontal sum, and the softmax bookkeeping
//! (maxima, denominators, rescaling) runs across queries, lane by lane.
//! Keys come sixteen positions at a time (a key tile, aligned to multiples
//! of sixteen): each key and value row is read, widened or dequantized
//! once per query tile, not once per query head.
//!
//! A tile of few queries (a decode step's: one row, one KV group) would
//! fill a sixteenth of each score vector that way. It puts keys in the
//! lanes instead ([`FEW_QUERIES`]): the key tile is transposed once, and
//! each query's scores and softmax are one vector of the sixteen keys. Per
//! query and key, both ways take the same multiply-adds in the same order,
//! and the same softmax steps, so they give the same bits.
//!
//! A query's arithmetic does not depend on the tile it is in: it visits the
//! key tiles that hold positions it sees, the other positions of those get
//! a weight of exactly zero, and a key tile it sees nothing of leaves its
//! state as it was. So a row gets the same bits alone (decode) as in a
//! prefill chunk or a verification batch, whatever the thread count.
//! Positions in evicted blocks (KV eviction) are seen by no query: a key
//! tile wholly evicted is skipped, a partly evicted one weighs them zero.
//! A tile's keys are visited in segments of [`SEGMENT`] positions, each a
//! softmax of its own folded into the result ([`super::segments`]), so that a
//! decode step can also share one row's keys among threads.

use std::ops::{Range, RangeInclusive};

use tandem_core::backend::AttentionParams;
use tandem_core::kv::EVICTED_BLOCK;

use super::key_tiles::{prefetch_tile, read_kv_tile, whole_tile_at};
use super::lanes::{accumulate, few_scores, scores, two_rows};
use super::ops::TileOps;
use super::segments::{fold_segment, live_segments, normalize, SegmentPlan, Unit, SEGMENT};
use super::{block_table, first_visible, KvRows, Task, Work};
use crate::math::{exp, MulAdd};

/// Positions per key tile, and queries per vector.
pub(super) const LANES: usize = 16;
pub(super) type Lanes = [f32; LANES];
/// Queries a tile aims at: two vectors' worth.
const TILE_QUERIES: usize = 2 * LANES;
/// Tiles of at most this many queries put keys in the lanes.
const FEW_QUERIES: usize = 8;

/// Rows per query tile, so a tile holds about [`TILE_QUERIES`] queries.
pub(super) fn rows_per_tile(p: AttentionParams) -> usize {
    (TILE_QUERIES / (p.heads / p.kv_heads)).max(1)
}

/// `rows` cut into the row ranges of tiles: runs of up to
/// [`rows_per_tile`] consecutive rows of one sequence.
pub(super) fn tile_rows<'a>(
    p: AttentionParams,
    row_seq: &'a [u32],
    rows: Range<usize>,
) -> impl Iterator<Item = Range<usize>> + 'a {
    let per_tile = rows_per_tile(p);
    let mut start = rows.start;
    std::iter::from_fn(move || {
        (start < rows.end).then(|| {
            let mut stop = start + 1;
            while stop < rows.end && stop - start < per_tile && row_seq[stop] == row_seq[start] {
                stop += 1;
            }
            let run = start..stop;
            start = stop;
            run
        })
    })
}

/// Query heads `heads` (all of KV head `kv_head`'s group, or part of it)
/// of `rows`, consecutive rows of one sequence.
struct Tile {
    rows: Range<usize>,
    heads: Range<usize>,
    kv_head: usize,
}

/// Per-task buffers, sized for the largest tile. Query `i` of a tile is
/// lane `i % 16` of vector `i / 16`.
struct Scratch {
    /// Dimension `d` of query vector `v` at `d * vectors + v`.
    queries: Vec<Lanes>,
    /// The key tile's key and value rows, `[LANES][head_dim]` each.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The key rows transposed, dimension `d` of the sixteen keys at `d`
    /// (tiles of [`FEW_QUERIES`]).
    keys_by_dim: Vec<Lanes>,
    /// The scores of each query of such a tile against the key tile.
    few_scores: [Lanes; FEW_QUERIES],
    /// Key `l`'s scores, then softmax weights, for query vector `v` at
    /// `l * vectors + v`.
    weights: Vec<Lanes>,
    /// Per query vector: first and last visible positions (lanes past the
    /// tile's queries see none), running maximum, softmax denominator, and
    /// the current key tile's rescaling of the earlier sums.
    first: Vec<[i32; LANES]>,
    last: Vec<[i32; LANES]>,
    max: Vec<Lanes>,
    denominator: Vec<Lanes>,
    rescale: Vec<Lanes>,
    /// Per query: one segment's unnormalised sums (`head_dim` each), and
    /// the running `(max, denominator)` of the segments folded so far.
    partial: Vec<f32>,
    runs: Vec<(f32, f32)>,
}

impl Scratch {
    fn new(p: AttentionParams) -> Self {
        let queries = TILE_QUERIES.max(p.heads / p.kv_heads);
        let vectors = queries.div_ceil(LANES);
        Scratch {
            queries: vec![[0.0; LANES]; p.head_dim * vectors],
            keys: vec![0.0; LANES * p.head_dim],
            values: vec![0.0; LANES * p.head_dim],
            keys_by_dim: vec![[0.0; LANES]; p.head_dim],
            few_scores: [[0.0; LANES]; FEW_QUERIES],
            weights: vec![[0.0; LANES]; LANES * vectors],
            first: vec![[0; LANES]; vectors],
            last: vec![[0; LANES]; vectors],
            max: vec![[0.0; LANES]; vectors],
            denominator: vec![[0.0; LANES]; vectors],
            rescale: vec![[0.0; LANES]; vectors],
            partial: vec![0.0; queries * p.head_dim],
            runs: vec![(f32::NEG_INFINITY, 0.0); queries],
        }
    }
}

/// Runs a task's work: its outputs tile by tile, or units of a segmented
/// call ([`super::segments`]) and their folding.
#[inline(always)]
pub(super) fn attend_task<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: Task<'_, K, V>,
    out: &mut [f32],
) {
    match task.work {
        Work::Outputs { first_head } => {
            let mut scratch = Scratch::new(task.p);
            attend_outputs::<K, V, M, T>(&task, first_head, &mut scratch, out)
        }
        Work::Segments { units } => {
            let mut scratch = Scratch::new(task.p);
            let slot_len = out.len() / units.len().max(1);
            for (unit, slot) in units.iter().zip(out.chunks_exact_mut(slot_len)) {
                attend_unit::<K, V, M, T>(&task, unit, &mut scratch, slot);
            }
        }
        Work::Fold {
            first_group,
            plan,
            partials,
        } => fold_groups::<M>(task.p, first_group, plan, partials, out),
    }
}

/// Cuts outputs `first_head..` into tiles: each row covered only in part
/// gives tiles of that row alone, runs of whole rows give tiles of up to
/// [`rows_per_tile`] rows of one sequence per KV head.
#[inline(always)]
fn attend_outputs<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: &Task<'_, K, V>,
    first: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let p = task.p;
    let group = p.heads / p.kv_heads;
    let end = first + out.len() / p.head_dim;
    let heads_of = |row: usize| {
        let base = row * p.heads;
        first.max(base) - base..end.min(base + p.heads) - base
    };
    let row_seq = task.inputs.row_seq;
    let mut row = first / p.heads;
    while row * p.heads < end {
        let heads = heads_of(row);
        if heads.len() < p.heads {
            for kv_head in heads.start / group..heads.end.div_ceil(group) {
                let heads = heads.start.max(kv_head * group)..heads.end.min((kv_head + 1) * group);
                let tile = Tile {
                    rows: row..row + 1,
                    heads,
                    kv_head,
                };
                attend_tile::<K, V, M, T>(task, &tile, scratch, first, out);
            }
            row += 1;
            continue;
        }
        let mut run_end = row + 1;
        while run_end * p.heads < end && heads_of(run_end).len() == p.heads {
            run_end += 1;
        }
        for kv_head in 0..p.kv_heads {
            for rows in tile_rows(p, row_seq, row..run_end) {
                let tile = Tile {
                    rows,
                    heads: kv_head * group..(kv_head + 1) * group,
                    kv_head,
                };
                attend_tile::<K, V, M, T>(task, &tile, scratch, first, out);
            }
        }
        row = run_end;
    }
}

/// A tile's queries, set up in the scratch for all of its segments.
struct TileQueries<'a> {
    n: usize,
    vectors: usize,
    /// Few enough to put keys in the lanes: their rows, found once.
    few: Option<[&'a [f32]; FEW_QUERIES]>,
    /// The positions any of them sees.
    lo: usize,
    hi: usize,
}

impl Tile {
    fn queries(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.rows
            .clone()
            .flat_map(|row| self.heads.clone().map(move |head| (row, head)))
    }
}

/// Transposes the tile's queries into the scratch's vectors, with their
/// visible positions.
#[inline(always)]
fn set_up_queries<'a, K, V>(
    task: &Task<'a, K, V>,
    tile: &Tile,
    s: &mut Scratch,
) -> TileQueries<'a> {
    let (p, inputs) = (task.p, task.inputs);
    let hd = p.head_dim;
    let n = tile.rows.len() * tile.heads.len();
    let vectors = n.div_ceil(LANES);
    let mut few = (n <= FEW_QUERIES).then_some([&[][..]; FEW_QUERIES]);
    s.queries[..hd * vectors].fill([0.0; LANES]);
    s.first[..vectors].fill([i32::MAX; LANES]);
    s.last[..vectors].fill([-1; LANES]);
    let (mut lo, mut hi) = (usize::MAX, 0);
    for (i, (row, head)) in tile.queries().enumerate() {
        let (v, lane) = (i / LANES, i % LANES);
        let q = &inputs.q[(row * p.heads + head) * hd..][..hd];
        for (d, &x) in q.iter().enumerate() {
            s.queries[d * vectors + v][lane] = x;
        }
        if let Some(few) = &mut few {
            few[i] = q;
        }
        let pos = inputs.positions[row] as usize;
        let first = first_visible(pos, p.sliding_window);
        (s.first[v][lane], s.last[v][lane]) = (first as i32, pos as i32);
        (lo, hi) = (lo.min(first), hi.max(pos));
    }
    TileQueries {
        n,
        vectors,
        few,
        lo,
        hi,
    }
}

/// The attention outputs of one tile's queries, segment by segment
/// ([`super::segments`]), into their places in `out`, which holds outputs
/// `first_head..`. No closure runs this: a closure's body is compiled
/// without its caller's target features, which only inlining would lend it.
#[inline(always)]
fn attend_tile<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: &Task<'_, K, V>,
    tile: &Tile,
    s: &mut Scratch,
    first_head: usize,
    out: &mut [f32],
) {
    let (p, hd) = (task.p, task.p.head_dim);
    let out_at = |(row, head): (usize, usize)| (row * p.heads + head - first_head) * hd;
    let q = set_up_queries(task, tile, s);
    for query in tile.queries() {
        out[out_at(query)..][..hd].fill(0.0);
    }
    s.runs[..q.n].fill((f32::NEG_INFINITY, 0.0));
    let mut partial = std::mem::take(&mut s.partial);
    let table = block_table(
        task.inputs.block_tables,
        task.inputs.row_seq[tile.rows.start],
        tile.kv_head,
        p,
    );
    for segment in live_segments(table, p, q.lo..=q.hi) {
        let keys = q.lo.max(segment * SEGMENT)..=q.hi.min((segment + 1) * SEGMENT - 1);
        attend_segment::<K, V, M, T>(task, tile, s, &q, keys, &mut partial);
        for (i, query) in tile.queries().enumerate() {
            let (v, lane) = (i / LANES, i % LANES);
            let result = (s.max[v][lane], s.denominator[v][lane]);
            let out = &mut out[out_at(query)..][..hd];
            fold_segment::<M>(&mut s.runs[i], out, result, &partial[i * hd..][..hd]);
        }
    }
    s.partial = partial;
    for (i, query) in tile.queries().enumerate() {
        normalize(&mut out[out_at(query)..][..hd], s.runs[i].1);
    }
}

/// One unit of a segmented call: its KV group's queries over its segment,
/// the partial results into `slot` (sums, maxima, denominators).
#[inline(always)]
fn attend_unit<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: &Task<'_, K, V>,
    unit: &Unit,
    s: &mut Scratch,
    slot: &mut [f32],
) {
    let (group, hd) = (task.p.heads / task.p.kv_heads, task.p.head_dim);
    let tile = Tile {
        rows: unit.rows.clone(),
        heads: unit.kv_head * group..(unit.kv_head + 1) * group,
        kv_head: unit.kv_head,
    };
    let q = set_up_queries(task, &tile, s);
    let first = unit.segment * SEGMENT;
    let keys = q.lo.max(first)..=q.hi.min(first + SEGMENT - 1);
    let room = slot.len() / (hd + 2);
    let (sums, results) = slot.split_at_mut(room * hd);
    attend_segment::<K, V, M, T>(task, &tile, s, &q, keys, sums);
    let (maxima, denominators) = results.split_at_mut(room);
    for i in 0..q.n {
        let (v, lane) = (i / LANES, i % LANES);
        (maxima[i], denominators[i]) = (s.max[v][lane], s.denominator[v][lane]);
    }
}

/// The outputs of `(row, KV group)` pairs `first_group..` of a segmented
/// call, each folded from its units' slots in segment order.
#[inline(always)]
fn fold_groups<M: MulAdd>(
    p: AttentionParams,
    first_group: usize,
    plan: &SegmentPlan,
    partials: &[f32],
    out: &mut [f32],
) {
    let (group, hd, room) = (p.heads / p.kv_heads, p.head_dim, plan.queries);
    let groups = &plan.groups[first_group..];
    for ((units, row), out) in groups.iter().zip(out.chunks_exact_mut(group * hd)) {
        out.fill(0.0);
        for (i, out) in out.chunks_exact_mut(hd).enumerate() {
            // The query's place among its units' queries.
            let at = row * group + i;
            let mut run = (f32::NEG_INFINITY, 0.0);
            for unit in units.clone() {
                let slot = &partials[unit * plan.slot_len..][..plan.slot_len];
                let (sums, results) = slot.split_at(room * hd);
                let result = (results[at], results[room + at]);
                fold_segment::<M>(&mut run, out, result, &sums[at * hd..][..hd]);
            }
            normalize(out, run.1);
        }
    }
}

/// The tile's queries over positions `keys` (within one segment) from a
/// fresh softmax state: the unnormalised sums into `partial` (query `i` at
/// `i * head_dim`), the maxima and denominators left in the scratch.
#[inline(always)]
fn attend_segment<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: &Task<'_, K, V>,
    tile: &Tile,
    s: &mut Scratch,
    q: &TileQueries<'_>,
    keys: RangeInclusive<usize>,
    partial: &mut [f32],
) {
    let (p, inputs) = (task.p, task.inputs);
    let hd = p.head_dim;
    let (n, vectors) = (q.n, q.vectors);
    let (lo, hi) = (*keys.start(), *keys.end());
    s.max[..vectors].fill([f32::NEG_INFINITY; LANES]);
    s.denominator[..vectors].fill([0.0; LANES]);
    partial[..n * hd].fill(0.0);
    let table = block_table(
        inputs.block_tables,
        inputs.row_seq[tile.rows.start],
        tile.kv_head,
        p,
    );
    let kv_width = p.kv_heads * hd;
    let mut start = lo / LANES * LANES;
    while start <= hi {
        // The key and value rows, and which positions are live (seen by
        // some query and not evicted): one division per key tile, not two
        // per position (a decode step's tiles are few queries each).
        let (block, within) = (start / p.block_size, start % p.block_size);
        if table[block] == EVICTED_BLOCK && within + LANES <= p.block_size {
            // A hole (sparse attention's tables are mostly holes).
            start += LANES;
            continue;
        }
        prefetch_tile(task, tile.kv_head, table, start + LANES, hi);
        let whole = lo <= start && start + LANES - 1 <= hi;
        let live = if let Some(first) = whole
            .then(|| whole_tile_at(table, p, start, tile.kv_head))
            .flatten()
        {
            // The common tile, wholly seen and inside one block: its rows
            // are consecutive slots.
            let (keys, values) = (&mut s.keys[..LANES * hd], &mut s.values[..LANES * hd]);
            task.keys.read_rows::<T>(first, kv_width, keys, hd);
            task.values.read_rows::<T>(first, kv_width, values, hd);
            [true; LANES]
        } else {
            let rows = (&mut s.keys[..], &mut s.values[..]);
            let live = read_kv_tile::<K, V, T>(task, tile.kv_head, rows, start, lo..=hi, table);
            if !live.contains(&true) {
                start += LANES;
                continue;
            }
            live
        };
        if let Some(few) = &q.few {
            T::transpose(&s.keys, hd, &mut s.keys_by_dim);
            few_scores::<M>(&s.keys_by_dim, &few[..n], &mut s.few_scores[..n]);
        } else {
            scores::<M, T>(&s.keys, &s.queries[..hd * vectors], hd, &mut s.weights);
            for v in 0..vectors {
                softmax_step(s, v, vectors, start as i32, p.scale, &live);
            }
        }
        // The queries that see some of the key tile, two at a time.
        let tile_end = (start + LANES - 1) as i32;
        let mut pending = None;
        for i in 0..n {
            let (v, lane) = (i / LANES, i % LANES);
            if s.last[v][lane] < start as i32 || s.first[v][lane] > tile_end {
                continue;
            }
            let (weights, rescale) = if q.few.is_some() {
                let scores = s.few_scores[i];
                few_query_step(s, scores, (v, lane), start as i32, p.scale, &live)
            } else {
                let mut weights = [0f32; LANES];
                for (l, w) in weights.iter_mut().enumerate() {
                    *w = s.weights[l * vectors + v][lane];
                }
                (weights, s.rescale[v][lane])
            };
            let this = (i * hd, rescale, weights);
            let Some(other) = pending.take() else {
                pending = Some(this);
                continue;
            };
            let (a, b) = two_rows(partial, other.0, this.0, hd);
            accumulate::<M, T, 2>([a, b], [other.1, this.1], [&other.2, &this.2], &s.values);
        }
        if let Some((at, rescale, weights)) = pending {
            accumulate::<M, T, 1>([&mut partial[at..][..hd]], [rescale], [&weights], &s.values);
        }
        start += LANES;
    }
}

/// One key tile's step of the online softmax for query vector `v`: scores
/// scaled and masked, the new running maximum, the rescaling of the earlier
/// sums, the weights and the denominator. A lane that sees none of the
/// tile's positions keeps its maximum and gets a rescaling of exactly 1.
/// Keys not `live` (evicted) are seen by no lane. Every step runs on whole
/// vectors, the exponentials of unseen lanes included, and the masks pick
/// afterwards: an exponential under a branch stayed scalar code, a fifth of
/// a prefill's attention time at depth.
#[inline(always)]
fn softmax_step(
    s: &mut Scratch,
    v: usize,
    vectors: usize,
    start: i32,
    scale: f32,
    live: &[bool; LANES],
) {
    let (first, last) = (s.first[v], s.last[v]);
    let mut seen = [[false; LANES]; LANES];
    let mut tile_max = [f32::NEG_INFINITY; LANES];
    for l in 0..LANES {
        let j = start + l as i32;
        let w = &mut s.weights[l * vectors + v];
        for lane in 0..LANES {
            seen[l][lane] = live[l] & (first[lane] <= j) & (j <= last[lane]);
            w[lane] = if seen[l][lane] {
                w[lane] * scale
            } else {
                f32::NEG_INFINITY
            };
            tile_max[lane] = tile_max[lane].max(w[lane]);
        }
    }
    let (max, rescale) = (&mut s.max[v], &mut s.rescale[v]);
    let mut new_max = [0.0; LANES];
    for lane in 0..LANES {
        new_max[lane] = max[lane].max(tile_max[lane]);
        let factor = exp(max[lane] - new_max[lane]);
        rescale[lane] = if tile_max[lane] == f32::NEG_INFINITY {
            1.0
        } else {
            factor
        };
    }
    let mut sum = [0f32; LANES];
    for (l, seen) in seen.iter().enumerate() {
        let w = &mut s.weights[l * vectors + v];
        for lane in 0..LANES {
            let e = exp(w[lane] - new_max[lane]);
            w[lane] = if seen[lane] { e } else { 0.0 };
            sum[lane] += w[lane];
        }
    }
    let denominator = &mut s.denominator[v];
    for lane in 0..LANES {
        denominator[lane] = denominator[lane] * rescale[lane] + sum[lane];
    }
    *max = new_max;
}

/// One key tile's softmax step for a single query of a tile of
/// [`FEW_QUERIES`], keys in the lanes: the arithmetic of [`softmax_step`]
/// for that query's `scores`, lane `l` for key `l`. Returns the query's
/// weights and the rescaling of its earlier sums, and updates its running
/// maximum and denominator (at `(v, lane)` in the scratch).
#[inline(always)]
fn few_query_step(
    s: &mut Scratch,
    scores: Lanes,
    (v, lane): (usize, usize),
    start: i32,
    scale: f32,
    live: &[bool; LANES],
) -> (Lanes, f32) {
    let (first, last) = (s.first[v][lane], s.last[v][lane]);
    // Whole-vector steps (exponentials included), then the masks; loops,
    // not `array::from_fn`, whose closures stayed calls compiled without
    // the caller's vector instructions.
    let mut seen = [false; LANES];
    let mut scaled = [0f32; LANES];
    for l in 0..LANES {
        let j = start + l as i32;
        seen[l] = live[l] & (first <= j) & (j <= last);
        scaled[l] = if seen[l] {
            scores[l] * scale
        } else {
            f32::NEG_INFINITY
        };
    }
    let mut maxima = [f32::NEG_INFINITY; LANES / 2];
    for l in 0..LANES {
        maxima[l % (LANES / 2)] = maxima[l % (LANES / 2)].max(scaled[l]);
    }
    let tile_max = maxima.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = s.max[v][lane];
    let new_max = max.max(tile_max);
    let rescale = if tile_max == f32::NEG_INFINITY {
        1.0
    } else {
        exp(max - new_max)
    };
    let mut weights = [0f32; LANES];
    for l in 0..LANES {
        let e = exp(scaled[l] - new_max);
        weights[l] = if seen[l] { e } else { 0.0 };
    }
    // In key order, as `softmax_step` adds them.
    let sum = weights.iter().fold(0.0, |sum, &w| sum + w);
    let denominator = &mut s.denominator[v][lane];
    *denominator = *denominator * rescale + sum;
    s.max[v][lane] = new_max;
    (weights, rescale)
}
