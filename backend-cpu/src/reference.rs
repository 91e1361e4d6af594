//! Obvious scalar versions of every kernel: the ground truth.
//!
//! Each function is the textbook formula in the most direct loop, with f64
//! accumulators where a sum is long, and no threads, tiling or quantized
//! activations. The unit tests compare the fast kernels of [`crate::CpuBackend`]
//! with these, and the cross-backend suite compares every other backend with
//! them, within the manifest's tolerance (`tandem_core::kernels::spec`).
//!
//! They work on plain slices so any backend's downloaded results can be
//! checked. They are test oracles: they trust their inputs and panic (index
//! out of bounds) where the backend would return an error. KV caches are
//! given as f32 slices of `[num_slots, kv_heads * head_dim]` (an F16 or
//! quantized cache converted first).

use half::f16;
use tandem_core::backend::{
    AttentionParams, BlockSelectParams, KvCacheLayout, KvDtype, RmsNormParams, RopeParams,
    RopeStyle,
};
use tandem_core::kv::quant::{KeyBlockLayout, KvQuantLayout};
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::quant::{dequantize_row, quantize_activation_row_i8, WeightFormat, WeightView};

/// `out[t] = table[tokens[t]]`, decoding only the rows looked up.
pub fn embedding(table: WeightView<'_>, tokens: &[u32], out: &mut [f32]) {
    let dim = table.cols;
    for (t, &token) in tokens.iter().enumerate() {
        dequantize_row(
            table.format,
            table.row(token as usize),
            &mut out[t * dim..(t + 1) * dim],
        );
    }
}

/// `out = x / sqrt(mean(x²) + eps) * weight`, per row.
pub fn rms_norm(x: &[f32], weight: &[f32], p: RmsNormParams, out: &mut [f32]) {
    for r in 0..p.rows {
        let row = &x[r * p.dim..(r + 1) * p.dim];
        let mean_square = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / p.dim as f64;
        let inv_rms = 1.0 / (mean_square + p.eps as f64).sqrt();
        for c in 0..p.dim {
            out[r * p.dim + c] = (row[c] as f64 * inv_rms * weight[c] as f64) as f32;
        }
    }
}

/// `residual += delta; out = rms_norm(residual)`.
pub fn rms_norm_residual(
    residual: &mut [f32],
    delta: &[f32],
    weight: &[f32],
    p: RmsNormParams,
    out: &mut [f32],
) {
    let n = p.rows * p.dim;
    for i in 0..n {
        residual[i] += delta[i];
    }
    rms_norm(residual, weight, p, out);
}

/// `out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r])`, with `w` fully
/// dequantized and the activations left in f32 — except for W8A8 weights,
/// whose definition quantizes each activation row to INT8 first
/// ([`quantize_activation_row_i8`]): the sum is then over the decoded
/// `scale * quant` activations.
pub fn matmul(x: &[f32], w: WeightView<'_>, bias: Option<&[f32]>, rows: usize, out: &mut [f32]) {
    let weights = w.to_f32();
    let (n, cols) = (w.rows, w.cols);
    let mut int8_x = Vec::new();
    let x = if w.format == WeightFormat::W8A8 {
        let mut quants = vec![0i8; cols];
        for row in x[..rows * cols].chunks(cols.max(1)) {
            let scale = quantize_activation_row_i8(row, &mut quants);
            int8_x.extend(quants.iter().map(|&q| scale * q as f32));
        }
        &int8_x
    } else {
        x
    };
    for t in 0..rows {
        for r in 0..n {
            let mut sum = 0f64;
            for c in 0..cols {
                sum += x[t * cols + c] as f64 * weights[r * cols + c] as f64;
            }
            if let Some(bias) = bias {
                sum += bias[r] as f64;
            }
            out[t * n + r] = sum as f32;
        }
    }
}

/// Rotates pair `i` of every head of row `t` by `positions[t] * inv_freq[i]`.
pub fn rope(x: &mut [f32], positions: &[u32], inv_freq: &[f32], p: RopeParams) {
    let half = p.rotary_dim / 2;
    for t in 0..p.rows {
        for h in 0..p.heads {
            let head = &mut x[(t * p.heads + h) * p.head_dim..][..p.head_dim];
            for (i, &freq) in inv_freq[..half].iter().enumerate() {
                let angle = positions[t] as f32 * freq;
                let (sin, cos) = angle.sin_cos();
                let (a, b) = match p.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::NeoX => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

/// Writes row `t` of `k` and `v` to slot `slots[t]` of the caches, rounded
/// to the cache's element type (quantized caches: through the quantize and
/// dequantize of `tandem_core::kv::quant`; INT4 keys per block).
pub fn paged_kv_write(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    layout: KvCacheLayout,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) {
    let row_width = layout.row_width();
    let round = |dtype, row: &[f32], out: &mut [f32]| match (
        dtype,
        KvQuantLayout::new(dtype, layout.kv_heads, layout.head_dim),
    ) {
        (_, Some(quant)) => {
            let mut slot = vec![0; quant.slot_words()];
            quant.quantize_row(row, &mut slot);
            quant.dequantize_row(&slot, out);
        }
        (KvDtype::F16, None) => {
            for (o, &x) in out.iter_mut().zip(row) {
                *o = f16::from_f32(x).to_f32();
            }
        }
        _ => out.copy_from_slice(row),
    };
    for (t, &slot) in slots.iter().enumerate() {
        let dst = slot as usize * row_width..(slot as usize + 1) * row_width;
        let src = t * row_width..(t + 1) * row_width;
        if layout.key_blocks().is_none() {
            round(layout.keys, &k[src.clone()], &mut k_cache[dst.clone()]);
        }
        round(layout.values, &v[src], &mut v_cache[dst]);
    }
    if let Some(blocks) = layout.key_blocks() {
        write_key_blocks(&blocks, k, slots, k_cache);
    }
}

/// INT4 keys: each run of consecutive rows in one block is added to the
/// block's valid tokens (its offsets before the run), the block is quantized
/// per channel over them, and all its offsets are stored dequantized (those
/// past the run read as each channel's minimum, code 0).
fn write_key_blocks(blocks: &KeyBlockLayout, k: &[f32], slots: &[u32], k_cache: &mut [f32]) {
    let (block_size, width) = (blocks.block_size, blocks.channels());
    let mut t = 0;
    while t < slots.len() {
        let block = slots[t] as usize / block_size;
        let first = slots[t] as usize % block_size;
        let run = slots[t..]
            .iter()
            .take_while(|&&s| s as usize / block_size == block)
            .count();
        let cached = &mut k_cache[block * block_size * width..][..block_size * width];
        let mut tokens = cached[..first * width].to_vec();
        tokens.extend_from_slice(&k[t * width..(t + run) * width]);
        let mut words = vec![0; blocks.block_words()];
        blocks.quantize_block(&tokens, &mut words);
        for (offset, out) in cached.chunks_exact_mut(width).enumerate() {
            blocks.dequantize_token(&words, offset, out);
        }
        t += run;
    }
}

/// Copies KV block `src` over block `dst` for each pair, in order;
/// `block_elems` is `block_size * kv_heads * head_dim`.
pub fn copy_kv_blocks(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    block_elems: usize,
    pairs: &[(u32, u32)],
) {
    for &(src, dst) in pairs {
        let (src, dst) = (src as usize * block_elems, dst as usize * block_elems);
        k_cache.copy_within(src..src + block_elems, dst);
        v_cache.copy_within(src..src + block_elems, dst);
    }
}

/// Causal attention of each query row over the cached keys at positions
/// `0..=positions[t]` of its sequence (only the last `sliding_window` of them
/// when set), read through the sequence's block-table row (or its KV head's,
/// with per-head tables); query head `h` uses KV head `h / (heads /
/// kv_heads)`. Plain two-pass softmax.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    row_seq: &[u32],
    positions: &[u32],
    block_tables: &[u32],
    p: AttentionParams,
    out: &mut [f32],
) {
    let kv_width = p.kv_heads * p.head_dim;
    let indices = (row_seq, positions, block_tables);
    for t in 0..p.rows {
        for h in 0..p.heads {
            let weights = attention_weights(q, k_cache, indices, p, t, h);
            let kv_offset = h / (p.heads / p.kv_heads) * p.head_dim;
            let out_head = &mut out[(t * p.heads + h) * p.head_dim..][..p.head_dim];
            for (d, o) in out_head.iter_mut().enumerate() {
                let value = |slot: usize| v_cache[slot * kv_width + kv_offset + d] as f64;
                *o = weights
                    .iter()
                    .map(|&(_, slot, w)| w * value(slot))
                    .sum::<f64>() as f32;
            }
        }
    }
}

/// The attention mass per KV block of [`paged_attention`]'s softmax: adds
/// to `scores[(t * kv_heads + g) * max_blocks_per_seq + b]` the weights row
/// `t`'s heads of group `g` give the keys of table entry `b`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_scores(
    q: &[f32],
    k_cache: &[f32],
    row_seq: &[u32],
    positions: &[u32],
    block_tables: &[u32],
    p: AttentionParams,
    scores: &mut [f32],
) {
    let indices = (row_seq, positions, block_tables);
    for t in 0..p.rows {
        for h in 0..p.heads {
            let g = h / (p.heads / p.kv_heads);
            let row = &mut scores[(t * p.kv_heads + g) * p.max_blocks_per_seq..];
            for (j, _, w) in attention_weights(q, k_cache, indices, p, t, h) {
                row[j / p.block_size] += w as f32;
            }
        }
    }
}

/// Sparse attention's block selection, the obvious way: each block's key
/// bounds are the minimum and maximum of its first `filled[block]` slots
/// of `k_cache`, a table entry's bound for KV head `g` is
/// `Σ_c max(q_c · min_c, q_c · max_c)` summed over the sequence's rows and
/// the group's heads (float64), and KV head `g`'s table keeps its
/// `top_blocks` highest candidates (ties to the earlier entry) with the
/// sinks and the recent window. `out` (`[seqs, kv_heads,
/// max_blocks_per_seq]`) as `Backend::select_kv_blocks` writes it.
#[allow(clippy::too_many_arguments)]
pub fn select_kv_blocks(
    q: &[f32],
    k_cache: &[f32],
    filled: &[usize],
    row_seq: &[u32],
    positions: &[u32],
    block_tables: &[u32],
    p: AttentionParams,
    s: BlockSelectParams,
    out: &mut [u32],
) {
    let (w, d) = (p.max_blocks_per_seq, p.head_dim);
    let kv_width = p.kv_heads * d;
    for (seq, table) in block_tables.chunks_exact(w).enumerate() {
        let out = &mut out[seq * p.kv_heads * w..][..p.kv_heads * w];
        for head_table in out.chunks_exact_mut(w) {
            head_table.copy_from_slice(table);
        }
        let rows: Vec<usize> = (0..p.rows)
            .filter(|&t| row_seq[t] as usize == seq)
            .collect();
        let Some(last) = rows.iter().map(|&t| positions[t] as usize).max() else {
            continue;
        };
        let visible = last / p.block_size + 1;
        let end = visible.saturating_sub(s.recent_blocks);
        let candidates: Vec<usize> = (s.sink_blocks.min(end)..end)
            .filter(|&e| table[e] != EVICTED_BLOCK)
            .collect();
        if candidates.len() <= s.top_blocks {
            continue;
        }
        for (g, head_table) in out.chunks_exact_mut(w).enumerate() {
            let mut bounds: Vec<(f64, usize)> = candidates
                .iter()
                .map(|&e| {
                    let block = table[e] as usize;
                    let key = |i: usize, c: usize| {
                        k_cache[(block * p.block_size + i) * kv_width + g * d + c] as f64
                    };
                    let mut bound = 0.0;
                    for &t in &rows {
                        for h in (0..p.heads).filter(|h| h / (p.heads / p.kv_heads) == g) {
                            for c in 0..d {
                                let x = q[(t * p.heads + h) * d + c] as f64;
                                let keys = (0..filled[block]).map(|i| key(i, c));
                                let lo = keys.clone().fold(f64::INFINITY, f64::min);
                                let hi = keys.fold(f64::NEG_INFINITY, f64::max);
                                bound += (x * lo).max(x * hi);
                            }
                        }
                    }
                    (bound, e)
                })
                .collect();
            bounds.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, e) in &bounds[s.top_blocks..] {
                head_table[e] = EVICTED_BLOCK;
            }
        }
    }
}

/// Row `t`'s query head `h`: `(position, slot, softmax weight)` of every key
/// it sees (none when all of them were evicted), in float64.
fn attention_weights(
    q: &[f32],
    k_cache: &[f32],
    (row_seq, positions, block_tables): (&[u32], &[u32], &[u32]),
    p: AttentionParams,
    t: usize,
    h: usize,
) -> Vec<(usize, usize, f64)> {
    let kv_width = p.kv_heads * p.head_dim;
    let kv_offset = h / (p.heads / p.kv_heads) * p.head_dim;
    let pos = positions[t] as usize;
    let table = p.table_of(row_seq[t] as usize, h / (p.heads / p.kv_heads));
    let table = &block_tables[table * p.max_blocks_per_seq..][..p.max_blocks_per_seq];
    let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let q_head = &q[(t * p.heads + h) * p.head_dim..][..p.head_dim];
    let logits: Vec<(usize, usize, f64)> = (first..=pos)
        .filter(|&j| table[j / p.block_size] != EVICTED_BLOCK)
        .map(|j| {
            let slot = table[j / p.block_size] as usize * p.block_size + j % p.block_size;
            let key = &k_cache[slot * kv_width + kv_offset..][..p.head_dim];
            let dot: f64 = q_head
                .iter()
                .zip(key)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            (j, slot, dot * p.scale as f64)
        })
        .collect();
    let max = logits.iter().map(|l| l.2).fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = logits.iter().map(|l| (l.2 - max).exp()).sum();
    logits
        .into_iter()
        .map(|(j, slot, l)| (j, slot, (l - max).exp() / total))
        .collect()
}

/// `out = silu(gate) * up` with `silu(g) = g / (1 + e^-g)`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

/// `out = gelu(gate) * up` with GELU's tanh approximation,
/// `gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let scale = (2.0 / std::f32::consts::PI).sqrt();
    for i in 0..out.len() {
        let g = gate[i];
        let u = scale * (g + 0.044715 * g * g * g);
        out[i] = 0.5 * g * (1.0 + u.tanh()) * up[i];
    }
}

/// `x *= factor`, elementwise.
pub fn scale(x: &mut [f32], factor: f32) {
    x.iter_mut().for_each(|v| *v *= factor);
}

/// `out[i] = x[rows[i]]` for rows of `width` elements.
pub fn gather_rows(x: &[f32], rows: &[u32], width: usize, out: &mut [f32]) {
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
    }
}

/// Index of the largest value of each row, the lowest among equal maxima
/// (NaNs are never the maximum).
pub fn argmax(x: &[f32], rows: usize, width: usize, out: &mut [u32]) {
    for r in 0..rows {
        let row = &x[r * width..(r + 1) * width];
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] || row[best].is_nan() && !v.is_nan() {
                best = i;
            }
        }
        out[r] = best as u32;
    }
}
