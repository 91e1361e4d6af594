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

use std::ops::Range;

use tandem_core::backend::AttentionParams;

use tandem_core::kv::EVICTED_BLOCK;

use super::ops::TileOps;
use super::{block_table, first_visible, KvRows, Task};
use crate::math::{exp, MulAdd};

/// Positions per key tile, and queries per vector.
pub(super) const LANES: usize = 16;
pub(super) type Lanes = [f32; LANES];
/// Queries a tile aims at: two vectors' worth.
const TILE_QUERIES: usize = 2 * LANES;
/// Keys whose scores are summed side by side: independent chains of
/// multiply-adds that share each load of the transposed queries.
const KEYS_AT_ONCE: usize = 8;
/// Tiles of at most this many queries put keys in the lanes.
const FEW_QUERIES: usize = 8;
/// Queries of such a tile scored side by side: independent chains of
/// multiply-adds sharing each load of the transposed keys.
const FEW_CHAINS: usize = 4;

/// Rows per query tile, so a tile holds about [`TILE_QUERIES`] queries.
pub(super) fn rows_per_tile(p: AttentionParams) -> usize {
    (TILE_QUERIES / (p.heads / p.kv_heads)).max(1)
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
        }
    }
}

/// Cuts the task into tiles: each row the task covers only in part gives
/// tiles of that row alone, runs of whole rows give tiles of up to
/// [`rows_per_tile`] rows of one sequence per KV head.
#[inline(always)]
pub(super) fn attend_task<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: Task<'_, K, V>,
    out: &mut [f32],
) {
    let p = task.p;
    let group = p.heads / p.kv_heads;
    let mut scratch = Scratch::new(p);
    let first = task.first_head;
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
                attend_tile::<K, V, M, T>(&task, &tile, &mut scratch, out);
            }
            row += 1;
            continue;
        }
        let mut run_end = row + 1;
        while run_end * p.heads < end && heads_of(run_end).len() == p.heads {
            run_end += 1;
        }
        for kv_head in 0..p.kv_heads {
            let mut start = row;
            while start < run_end {
                let mut stop = start + 1;
                while stop < run_end
                    && stop - start < rows_per_tile(p)
                    && row_seq[stop] == row_seq[start]
                {
                    stop += 1;
                }
                let tile = Tile {
                    rows: start..stop,
                    heads: kv_head * group..(kv_head + 1) * group,
                    kv_head,
                };
                attend_tile::<K, V, M, T>(&task, &tile, &mut scratch, out);
                start = stop;
            }
        }
        row = run_end;
    }
}

/// The attention outputs of one tile's queries, into their places in the
/// task's `out`.
#[inline(always)]
fn attend_tile<K: KvRows, V: KvRows, M: MulAdd, T: TileOps>(
    task: &Task<'_, K, V>,
    tile: &Tile,
    s: &mut Scratch,
    out: &mut [f32],
) {
    let (p, inputs) = (task.p, task.inputs);
    let hd = p.head_dim;
    let queries = || {
        tile.rows
            .clone()
            .flat_map(|row| tile.heads.clone().map(move |head| (row, head)))
    };
    let out_at = |(row, head): (usize, usize)| (row * p.heads + head - task.first_head) * hd;
    let n = tile.rows.len() * tile.heads.len();
    let vectors = n.div_ceil(LANES);
    let few = n <= FEW_QUERIES;
    // A tile of few queries scores them from their rows, found once here.
    let mut few_queries: [&[f32]; FEW_QUERIES] = [&[]; FEW_QUERIES];

    s.queries[..hd * vectors].fill([0.0; LANES]);
    s.first[..vectors].fill([i32::MAX; LANES]);
    s.last[..vectors].fill([-1; LANES]);
    s.max[..vectors].fill([f32::NEG_INFINITY; LANES]);
    s.denominator[..vectors].fill([0.0; LANES]);
    let (mut lo, mut hi) = (usize::MAX, 0);
    for (i, (row, head)) in queries().enumerate() {
        let (v, lane) = (i / LANES, i % LANES);
        let q = &inputs.q[(row * p.heads + head) * hd..][..hd];
        for (d, &x) in q.iter().enumerate() {
            s.queries[d * vectors + v][lane] = x;
        }
        if few {
            few_queries[i] = q;
        }
        let pos = inputs.positions[row] as usize;
        let first = first_visible(pos, p.sliding_window);
        (s.first[v][lane], s.last[v][lane]) = (first as i32, pos as i32);
        (lo, hi) = (lo.min(first), hi.max(pos));
        out[out_at((row, head))..][..hd].fill(0.0);
    }

    let table = block_table(inputs.block_tables, inputs.row_seq[tile.rows.start], p);
    let kv_width = p.kv_heads * hd;
    let mut start = lo / LANES * LANES;
    while start <= hi {
        // Each position's element offset, and whether it is live (seen by
        // some query and not evicted): one division per key tile, not two
        // per position (a decode step's tiles are few queries each).
        let mut offsets = [0usize; LANES];
        let mut live = [false; LANES];
        let (mut block, mut within) = (start / p.block_size, start % p.block_size);
        for l in 0..LANES {
            if (lo..=hi).contains(&(start + l)) && table[block] != EVICTED_BLOCK {
                live[l] = true;
                let slot = table[block] as usize * p.block_size + within;
                offsets[l] = slot * kv_width + tile.kv_head * hd;
            }
            within += 1;
            if within == p.block_size {
                (block, within) = (block + 1, 0);
            }
        }
        if !live.contains(&true) {
            start += LANES;
            continue;
        }
        // Positions outside `lo..=hi` may not be written (or no longer be
        // this sequence's), evicted ones are nowhere: zeros stand in for them.
        for (l, &live) in live.iter().enumerate() {
            let (k, v) = (&mut s.keys[l * hd..][..hd], &mut s.values[l * hd..][..hd]);
            if live {
                task.keys.read_into::<T>(offsets[l], k);
                task.values.read_into::<T>(offsets[l], v);
            } else {
                k.fill(0.0);
                v.fill(0.0);
            }
        }
        if few {
            T::transpose(&s.keys, hd, &mut s.keys_by_dim);
            few_scores::<M>(&s.keys_by_dim, &few_queries[..n], &mut s.few_scores[..n]);
        } else {
            scores::<M>(&s.keys, &s.queries[..hd * vectors], hd, &mut s.weights);
            for v in 0..vectors {
                softmax_step(s, v, vectors, start as i32, p.scale, &live);
            }
        }
        // The queries that see some of the key tile, two at a time.
        let tile_end = (start + LANES - 1) as i32;
        let mut pending = None;
        for (i, query) in queries().enumerate() {
            let (v, lane) = (i / LANES, i % LANES);
            if s.last[v][lane] < start as i32 || s.first[v][lane] > tile_end {
                continue;
            }
            let (weights, rescale) = if few {
                let scores = s.few_scores[i];
                few_query_step(s, scores, (v, lane), start as i32, p.scale, &live)
            } else {
                let mut weights = [0f32; LANES];
                for (l, w) in weights.iter_mut().enumerate() {
                    *w = s.weights[l * vectors + v][lane];
                }
                (weights, s.rescale[v][lane])
            };
            let this = (out_at(query), rescale, weights);
            let Some(other) = pending.take() else {
                pending = Some(this);
                continue;
            };
            let (a, b) = two_rows(out, other.0, this.0, hd);
            accumulate::<M, 2>([a, b], [other.1, this.1], [&other.2, &this.2], &s.values);
        }
        if let Some((at, rescale, weights)) = pending {
            accumulate::<M, 1>([&mut out[at..][..hd]], [rescale], [&weights], &s.values);
        }
        start += LANES;
    }
    for (i, query) in queries().enumerate() {
        // A query whose every visible position was evicted attends to nothing.
        let denominator = s.denominator[i / LANES][i % LANES];
        let inv = if denominator > 0.0 {
            1.0 / denominator
        } else {
            0.0
        };
        out[out_at(query)..][..hd]
            .iter_mut()
            .for_each(|o| *o *= inv);
    }
}

/// `weights[l * vectors + v] = keys[l] · queries of vector v`, for the
/// sixteen keys of a key tile: two query vectors at a time where there are
/// two, so each broadcast key element serves both.
#[inline(always)]
fn scores<M: MulAdd>(keys: &[f32], queries: &[Lanes], hd: usize, weights: &mut [Lanes]) {
    let vectors = queries.len() / hd;
    let mut v = 0;
    while v + 2 <= vectors {
        for first_key in (0..LANES).step_by(KEYS_AT_ONCE / 2) {
            score_keys::<M, 2, { KEYS_AT_ONCE / 2 }>(keys, queries, hd, v, first_key, weights);
        }
        v += 2;
    }
    if v < vectors {
        for first_key in (0..LANES).step_by(KEYS_AT_ONCE) {
            score_keys::<M, 1, KEYS_AT_ONCE>(keys, queries, hd, v, first_key, weights);
        }
    }
}

/// Scores of keys `first_key..first_key + K` for query vectors
/// `v..v + V`: `K * V` independent chains of multiply-adds.
#[inline(always)]
fn score_keys<M: MulAdd, const V: usize, const K: usize>(
    keys: &[f32],
    queries: &[Lanes],
    hd: usize,
    v: usize,
    first_key: usize,
    weights: &mut [Lanes],
) {
    let vectors = queries.len() / hd;
    let rows: [&[f32]; K] = std::array::from_fn(|k| &keys[(first_key + k) * hd..][..hd]);
    let mut sums = [[[0f32; LANES]; V]; K];
    for d in 0..hd {
        let q: [Lanes; V] = std::array::from_fn(|i| queries[d * vectors + v + i]);
        for (sum, row) in sums.iter_mut().zip(rows) {
            let key = row[d];
            for (sum, q) in sum.iter_mut().zip(&q) {
                *sum = mul_add_lanes::<M>(key, q, sum);
            }
        }
    }
    for (k, sum) in sums.into_iter().enumerate() {
        for (i, sum) in sum.into_iter().enumerate() {
            weights[(first_key + k) * vectors + v + i] = sum;
        }
    }
}

/// The first sixteen elements of `x`, times `scale`.
#[inline(always)]
fn scaled_lanes(x: &[f32], scale: f32) -> Lanes {
    let mut lanes = [0f32; LANES];
    lanes.copy_from_slice(&x[..LANES]);
    for lane in &mut lanes {
        *lane *= scale;
    }
    lanes
}

/// `key * q + sum`, lane by lane.
#[inline(always)]
fn mul_add_lanes<M: MulAdd>(key: f32, q: &Lanes, sum: &Lanes) -> Lanes {
    std::array::from_fn(|lane| M::mul_add(key, q[lane], sum[lane]))
}

/// One key tile's step of the online softmax for query vector `v`: scores
/// scaled and masked, the new running maximum, the rescaling of the earlier
/// sums, the weights and the denominator. A lane that sees none of the
/// tile's positions keeps its maximum and gets a rescaling of exactly 1.
/// Keys not `live` (evicted) are seen by no lane.
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
    let seen = |l: usize, lane: usize| {
        let j = start + l as i32;
        live[l] && first[lane] <= j && j <= last[lane]
    };
    let mut tile_max = [f32::NEG_INFINITY; LANES];
    for l in 0..LANES {
        let w = &mut s.weights[l * vectors + v];
        for lane in 0..LANES {
            w[lane] = if seen(l, lane) {
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
        rescale[lane] = if tile_max[lane] == f32::NEG_INFINITY {
            1.0
        } else {
            exp(max[lane] - new_max[lane])
        };
    }
    let mut sum = [0f32; LANES];
    for l in 0..LANES {
        let w = &mut s.weights[l * vectors + v];
        for lane in 0..LANES {
            w[lane] = if seen(l, lane) {
                exp(w[lane] - new_max[lane])
            } else {
                0.0
            };
            sum[lane] += w[lane];
        }
    }
    let denominator = &mut s.denominator[v];
    for lane in 0..LANES {
        denominator[lane] = denominator[lane] * rescale[lane] + sum[lane];
    }
    *max = new_max;
}

/// `scores[i]`: query `queries[i]` against the key tile `keys` (keys in
/// the lanes), per query and key the multiply-adds of [`score_keys`] in
/// its order, [`FEW_CHAINS`] queries at a time.
#[inline(always)]
fn few_scores<M: MulAdd>(keys: &[Lanes], queries: &[&[f32]], scores: &mut [Lanes]) {
    for (queries, scores) in queries
        .chunks(FEW_CHAINS)
        .zip(scores.chunks_mut(FEW_CHAINS))
    {
        // A short chunk scores its last query again rather than branch.
        let q: [&[f32]; FEW_CHAINS] = std::array::from_fn(|c| queries[c.min(queries.len() - 1)]);
        let mut sums = [[0f32; LANES]; FEW_CHAINS];
        for (d, keys) in keys.iter().enumerate() {
            for (sum, q) in sums.iter_mut().zip(q) {
                *sum = mul_add_lanes::<M>(q[d], keys, sum);
            }
        }
        scores.copy_from_slice(&sums[..scores.len()]);
    }
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
    let seen: [bool; LANES] = std::array::from_fn(|l| {
        let j = start + l as i32;
        live[l] && first <= j && j <= last
    });
    // Whole-vector steps (exponentials included), then the masks.
    let scaled: Lanes = std::array::from_fn(|l| {
        if seen[l] {
            scores[l] * scale
        } else {
            f32::NEG_INFINITY
        }
    });
    let tile_max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = s.max[v][lane];
    let new_max = max.max(tile_max);
    let rescale = if tile_max == f32::NEG_INFINITY {
        1.0
    } else {
        exp(max - new_max)
    };
    let exps: Lanes = std::array::from_fn(|l| exp(scaled[l] - new_max));
    let weights: Lanes = std::array::from_fn(|l| if seen[l] { exps[l] } else { 0.0 });
    // In key order, as `softmax_step` adds them.
    let sum = weights.iter().fold(0.0, |sum, &w| sum + w);
    let denominator = &mut s.denominator[v][lane];
    *denominator = *denominator * rescale + sum;
    s.max[v][lane] = new_max;
    (weights, rescale)
}

/// Rows `a` and `b` (`a != b`, `hd` long) of `out`, both mutable.
fn two_rows(out: &mut [f32], a: usize, b: usize, hd: usize) -> (&mut [f32], &mut [f32]) {
    if a < b {
        let (low, high) = out.split_at_mut(b);
        (&mut low[a..][..hd], &mut high[..hd])
    } else {
        let (low, high) = out.split_at_mut(a);
        (&mut high[..hd], &mut low[b..][..hd])
    }
}

/// `out = out * rescale + sum_l weights[l] * values[l]` for `Q` queries
/// at once (their outputs side by side share each load of a value row),
/// each element's sum taken in key order.
#[inline(always)]
fn accumulate<M: MulAdd, const Q: usize>(
    mut outs: [&mut [f32]; Q],
    rescale: [f32; Q],
    weights: [&Lanes; Q],
    values: &[f32],
) {
    let hd = outs[0].len();
    let mut c = 0;
    while c + 4 * LANES <= hd {
        accumulate_vectors::<M, Q, 4>(&mut outs, rescale, weights, values, c);
        c += 4 * LANES;
    }
    while c + LANES <= hd {
        accumulate_vectors::<M, Q, 1>(&mut outs, rescale, weights, values, c);
        c += LANES;
    }
    for d in c..hd {
        for q in 0..Q {
            let mut acc = outs[q][d] * rescale[q];
            for (l, &w) in weights[q].iter().enumerate() {
                acc = M::mul_add(w, values[l * hd + d], acc);
            }
            outs[q][d] = acc;
        }
    }
}

/// [`accumulate`] on elements `c..c + C * 16`: `Q * C` independent chains
/// of multiply-adds, held in registers across the sixteen keys.
#[inline(always)]
fn accumulate_vectors<M: MulAdd, const Q: usize, const C: usize>(
    outs: &mut [&mut [f32]; Q],
    rescale: [f32; Q],
    weights: [&Lanes; Q],
    values: &[f32],
    c: usize,
) {
    let hd = outs[0].len();
    let mut acc: [[Lanes; C]; Q] = std::array::from_fn(|q| {
        std::array::from_fn(|k| scaled_lanes(&outs[q][c + k * LANES..], rescale[q]))
    });
    for l in 0..LANES {
        let row = &values[l * hd + c..][..C * LANES];
        for q in 0..Q {
            let w = weights[q][l];
            for k in 0..C {
                for i in 0..LANES {
                    acc[q][k][i] = M::mul_add(w, row[k * LANES + i], acc[q][k][i]);
                }
            }
        }
    }
    for q in 0..Q {
        for k in 0..C {
            outs[q][c + k * LANES..][..LANES].copy_from_slice(&acc[q][k]);
        }
    }
}
