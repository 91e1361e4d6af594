//! The arithmetic of one key tile, sixteen lanes at a time: the queries'
//! scores against its keys and the weighted sums of its values, as
//! independent chains of multiply-adds that the compiler keeps in vector
//! registers.

use super::ops::{mul_add_lanes, TileOps};
use super::tile::{Lanes, LANES};
use crate::math::MulAdd;

/// Queries of a tile of few queries (keys in the lanes) scored side by
/// side: independent chains of multiply-adds sharing each load of the
/// transposed keys.
const FEW_CHAINS: usize = 4;

/// `weights[l * vectors + v] = keys[l] · queries of vector v`, for the
/// sixteen keys of a key tile: two query vectors at a time where there are
/// two, so each broadcast key element serves both, and as many keys side
/// by side as `T` keeps accumulators for (independent chains of
/// multiply-adds that share each load of the transposed queries).
#[inline(always)]
pub(super) fn scores<M: MulAdd, T: TileOps>(
    keys: &[f32],
    queries: &[Lanes],
    hd: usize,
    weights: &mut [Lanes],
) {
    // The common head sizes as constants: each key row is then a fixed
    // offset from one pointer and every element's bounds are known, where
    // a run-time size took a register per row (spilled) and a check per
    // element (five instructions per multiply-add).
    match hd {
        64 => scores_sized::<M, T>(keys, queries, 64, weights),
        128 => scores_sized::<M, T>(keys, queries, 128, weights),
        _ => scores_sized::<M, T>(keys, queries, hd, weights),
    }
}

/// [`scores`] for a head size the caller may have made a constant.
#[inline(always)]
fn scores_sized<M: MulAdd, T: TileOps>(
    keys: &[f32],
    queries: &[Lanes],
    hd: usize,
    weights: &mut [Lanes],
) {
    match T::ACCUMULATORS {
        8.. => scores_by::<M, T, 4, 8>(keys, queries, hd, weights),
        4..=7 => scores_by::<M, T, 2, 4>(keys, queries, hd, weights),
        _ => scores_by::<M, T, 1, 2>(keys, queries, hd, weights),
    }
}

/// [`scores`], `PAIR_KEYS` keys at a time for two query vectors and
/// `ONE_KEYS` for one.
#[inline(always)]
fn scores_by<M: MulAdd, T: TileOps, const PAIR_KEYS: usize, const ONE_KEYS: usize>(
    keys: &[f32],
    queries: &[Lanes],
    hd: usize,
    weights: &mut [Lanes],
) {
    let vectors = queries.len() / hd;
    let mut v = 0;
    while v + 2 <= vectors {
        for first_key in (0..LANES).step_by(PAIR_KEYS) {
            score_keys::<M, T, 2, PAIR_KEYS>(keys, queries, hd, v, first_key, weights);
        }
        v += 2;
    }
    if v < vectors {
        for first_key in (0..LANES).step_by(ONE_KEYS) {
            score_keys::<M, T, 1, ONE_KEYS>(keys, queries, hd, v, first_key, weights);
        }
    }
}

/// Scores of keys `first_key..first_key + K` for query vectors
/// `v..v + V`: `K * V` independent chains of multiply-adds.
#[inline(always)]
fn score_keys<M: MulAdd, T: TileOps, const V: usize, const K: usize>(
    keys: &[f32],
    queries: &[Lanes],
    hd: usize,
    v: usize,
    first_key: usize,
    weights: &mut [Lanes],
) {
    let vectors = queries.len() / hd;
    // One slice for the K rows, read at `k * hd + d`: with a constant `hd`
    // one pointer and fixed offsets.
    let rows = &keys[first_key * hd..][..K * hd];
    let mut sums = [[[0f32; LANES]; V]; K];
    for d in 0..hd {
        let q = &queries[d * vectors + v..][..V];
        for (k, sum) in sums.iter_mut().enumerate() {
            let key = rows[k * hd + d];
            for (sum, q) in sum.iter_mut().zip(q) {
                *sum = T::mul_add_key::<M>(key, q, sum);
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

/// `scores[i]`: query `queries[i]` against the key tile `keys` (keys in
/// the lanes), per query and key the multiply-adds of [`score_keys`] in
/// its order, [`FEW_CHAINS`] queries at a time.
#[inline(always)]
pub(super) fn few_scores<M: MulAdd>(keys: &[Lanes], queries: &[&[f32]], scores: &mut [Lanes]) {
    for (queries, scores) in queries
        .chunks(FEW_CHAINS)
        .zip(scores.chunks_mut(FEW_CHAINS))
    {
        // A short chunk scores its last query again rather than branch.
        let hd = keys.len();
        let mut q = [&[][..]; FEW_CHAINS];
        for (c, q) in q.iter_mut().enumerate() {
            *q = &queries[c.min(queries.len() - 1)][..hd];
        }
        let mut sums = [[0f32; LANES]; FEW_CHAINS];
        for (d, keys) in keys.iter().enumerate() {
            for (sum, q) in sums.iter_mut().zip(q) {
                *sum = mul_add_lanes::<M>(q[d], keys, sum);
            }
        }
        scores.copy_from_slice(&sums[..scores.len()]);
    }
}

/// Rows `a` and `b` (`a != b`, `hd` long) of `out`, both mutable.
#[inline(always)]
pub(super) fn two_rows(out: &mut [f32], a: usize, b: usize, hd: usize) -> (&mut [f32], &mut [f32]) {
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
pub(super) fn accumulate<M: MulAdd, T: TileOps, const Q: usize>(
    outs: [&mut [f32]; Q],
    rescale: [f32; Q],
    weights: [&Lanes; Q],
    values: &[f32],
) {
    // As many vectors of each output at once as `T` keeps accumulators for.
    match T::ACCUMULATORS / Q {
        4.. => accumulate_by::<M, T, Q, 4>(outs, rescale, weights, values),
        2..=3 => accumulate_by::<M, T, Q, 2>(outs, rescale, weights, values),
        _ => accumulate_by::<M, T, Q, 1>(outs, rescale, weights, values),
    }
}

/// [`accumulate`], `C` vectors of each output at a time.
#[inline(always)]
fn accumulate_by<M: MulAdd, T: TileOps, const Q: usize, const C: usize>(
    mut outs: [&mut [f32]; Q],
    rescale: [f32; Q],
    weights: [&Lanes; Q],
    values: &[f32],
) {
    let hd = outs[0].len();
    let mut c = 0;
    while c + C * LANES <= hd {
        accumulate_vectors::<M, T, Q, C>(&mut outs, rescale, weights, values, c);
        c += C * LANES;
    }
    while c + LANES <= hd {
        accumulate_vectors::<M, T, Q, 1>(&mut outs, rescale, weights, values, c);
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
fn accumulate_vectors<M: MulAdd, T: TileOps, const Q: usize, const C: usize>(
    outs: &mut [&mut [f32]; Q],
    rescale: [f32; Q],
    weights: [&Lanes; Q],
    values: &[f32],
    c: usize,
) {
    let hd = outs[0].len();
    // Loops, not `array::from_fn`: its closure was left a call, compiled
    // without the caller's vector instructions.
    let mut acc = [[[0f32; LANES]; C]; Q];
    for (q, acc) in acc.iter_mut().enumerate() {
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = scaled_lanes(&outs[q][c + k * LANES..], rescale[q]);
        }
    }
    for l in 0..LANES {
        let row = &values[l * hd + c..][..C * LANES];
        for q in 0..Q {
            let w = weights[q][l];
            for k in 0..C {
                let part: &Lanes = row[k * LANES..][..LANES].try_into().unwrap();
                acc[q][k] = T::mul_add_key::<M>(w, part, &acc[q][k]);
            }
        }
    }
    for q in 0..Q {
        for k in 0..C {
            outs[q][c + k * LANES..][..LANES].copy_from_slice(&acc[q][k]);
        }
    }
}
