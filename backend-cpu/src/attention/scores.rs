//! `paged_attention_scores`: the attention mass each KV block gets, for KV
//! eviction by score (H2O, SnapKV). The softmax of `paged_attention` again,
//! over the keys only: one task per (query row, KV head) computes the
//! logits of the group's heads over the row's visible keys, then adds each
//! head's normalised weights into the key's table entry. Only the task's
//! logits row is held, never an attention matrix. A task is compiled per
//! instruction set, as the attention's are: each key is widened or
//! dequantized once for the group's heads, and the dot products are
//! `math::dot`'s, which vectorize.

use tandem_core::backend::AttentionParams;
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::Result;

#[cfg(target_arch = "x86_64")]
use super::ops::{Avx2Ops, Avx512Ops};
use super::ops::{PortableOps, TileOps};
use super::{check_inputs, AttentionInputs};
use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::kv::{KvCache, KvStorage};
#[cfg(target_arch = "x86_64")]
use crate::math::Fused;
use crate::math::{dot, MulAdd, Separate};
use crate::workers::Workers;

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
    check_inputs(kernel, cache, inputs, p)?;
    let len = check::product(kernel, &[p.rows, p.kv_heads, p.max_blocks_per_seq])?;
    check::buffer_len(kernel, "scores", scores.len(), len)?;
    let width = p.max_blocks_per_seq;
    let tasks = p.rows * p.kv_heads;
    workers.for_each_chunk(&mut scores[..tasks * width], width, |task, row| {
        let (t, g) = (task / p.kv_heads, task % p.kv_heads);
        match isa.kind() {
            // SAFETY: an `Isa` exists only for instruction sets the CPU has.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni => unsafe { score_task_avx512(cache, inputs, p, t, g, row) },
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => unsafe { score_task_avx2(cache, inputs, p, t, g, row) },
            IsaKind::Portable => score_task::<Separate, PortableOps>(cache, inputs, p, t, g, row),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            IsaKind::Simd128 => score_task::<Separate, PortableOps>(cache, inputs, p, t, g, row),
        }
    });
    Ok(())
}

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_task_avx2(
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    t: usize,
    g: usize,
    out: &mut [f32],
) {
    score_task::<Fused, Avx2Ops>(cache, inputs, p, t, g, out)
}

/// # Safety
/// The CPU supports AVX2, FMA, F16C and AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn score_task_avx512(
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    t: usize,
    g: usize,
    out: &mut [f32],
) {
    score_task::<Fused, Avx512Ops>(cache, inputs, p, t, g, out)
}

#[inline(always)]
fn score_task<M: MulAdd, O: TileOps>(
    cache: &KvCache,
    inputs: &AttentionInputs<'_>,
    p: AttentionParams,
    t: usize,
    g: usize,
    out: &mut [f32],
) {
    let (bs, hd) = (p.block_size, p.head_dim);
    let group = p.heads / p.kv_heads;
    let pos = inputs.positions[t] as usize;
    let table = &inputs.block_tables[inputs.row_seq[t] as usize * p.max_blocks_per_seq..]
        [..p.max_blocks_per_seq];
    let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let visible: Vec<usize> = (first..=pos)
        .filter(|&j| table[j / bs] != EVICTED_BLOCK)
        .collect();
    let queries = &inputs.q[(t * p.heads + g * group) * hd..][..group * hd];
    // Per head, its logits over the visible keys, then their exponentials.
    let mut weights = vec![0f32; group * visible.len()];
    let mut key = vec![0f32; hd];
    for (i, &j) in visible.iter().enumerate() {
        let slot = table[j / bs] as usize * bs + j % bs;
        let key = read_key::<O>(cache, slot, g, &mut key);
        for (h, q) in queries.chunks_exact(hd).enumerate() {
            weights[h * visible.len() + i] = dot::<M>(q, key) * p.scale;
        }
    }
    for head in weights.chunks_mut(visible.len().max(1)) {
        let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for w in head.iter_mut() {
            *w = (*w - max).exp();
            total += *w;
        }
        for (&j, w) in visible.iter().zip(head.iter()) {
            out[j / bs] += w / total;
        }
    }
}

/// Head `g` of the key in `slot`, as f32: borrowed from an F32 cache,
/// otherwise widened or dequantized into `scratch`.
#[inline(always)]
fn read_key<'a, O: TileOps>(
    cache: &'a KvCache,
    slot: usize,
    g: usize,
    scratch: &'a mut [f32],
) -> &'a [f32] {
    let layout = cache.layout();
    let (hd, width) = (layout.head_dim, layout.row_width());
    match cache.storage() {
        KvStorage::F32 { keys, .. } => return &keys[slot * width + g * hd..][..hd],
        KvStorage::F16 { keys, .. } => O::widen(&keys[slot * width + g * hd..][..hd], scratch),
        KvStorage::Quant {
            key_blocks: Some(blocks),
            keys,
            ..
        } => {
            let words = blocks.block_words();
            let block = &keys[slot / layout.block_size * words..][..words];
            blocks.dequantize_head(block, slot % layout.block_size, g, scratch);
        }
        KvStorage::Quant {
            key_quant, keys, ..
        } => {
            let words = key_quant.slot_words();
            key_quant.dequantize_head(&keys[slot * words..][..words], g, scratch);
        }
    }
    scratch
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

    /// Every dtype, holes, a window, grouped heads: the reference over the
    /// cache as it dequantizes, and each row's heads add up to their count.
    #[test]
    fn scores_match_the_reference_and_sum_to_the_heads() {
        for (isa, dtype) in Isa::available()
            .into_iter()
            .flat_map(|isa| KvDtype::ALL.map(|dtype| (isa, dtype)))
        {
            for window in [None, Some(7)] {
                let layout = KvCacheLayout {
                    num_blocks: 12,
                    block_size: 3,
                    kv_heads: 2,
                    head_dim: 40,
                    keys: dtype,
                    values: dtype,
                };
                let p = AttentionParams {
                    rows: 3,
                    heads: 6,
                    kv_heads: 2,
                    head_dim: 40,
                    block_size: 3,
                    max_blocks_per_seq: 7,
                    scale: 0.3,
                    sliding_window: window,
                };
                let mut cache = KvCache::new(layout).unwrap();
                let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
                let (k, v) = (values(slots.len() * 80, 1), values(slots.len() * 80, 2));
                kv::paged_kv_write(&k, &v, &slots, slots.len(), &mut cache).unwrap();
                let tables = [5, EVICTED_BLOCK, 2, 9, EVICTED_BLOCK, 0, 4];
                let inputs = AttentionInputs {
                    q: &values(3 * 6 * 40, 3),
                    row_seq: &[0, 0, 0],
                    positions: &[20, 9, 1],
                    block_tables: &tables,
                };
                let mut got = values(3 * 2 * 7, 4);
                let mut want = got.clone();
                let backend = CpuBackend::new(2);
                paged_attention_scores(&backend.workers, isa, &cache, &inputs, p, &mut got)
                    .unwrap();
                reference::paged_attention_scores(
                    inputs.q,
                    &cache.keys_f32(),
                    inputs.row_seq,
                    inputs.positions,
                    inputs.block_tables,
                    p,
                    &mut want,
                );
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-5,
                        "{} {dtype:?} {window:?}: {got:?} vs {want:?}",
                        isa.name()
                    );
                }
                let base = values(3 * 2 * 7, 4);
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
}
