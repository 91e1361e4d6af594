//! Paged attention and the KV cache of `CpuBackend` against
//! `tandem_cpu::reference`: sequences over shuffled blocks, every KV dtype
//! and pair of them, one and several threads.

mod common;

use common::{assert_close, backends, Rng};
use tandem_core::backend::{AttentionIndices, AttentionParams, KvCacheLayout, KvDtype};
use tandem_core::Backend;
use tandem_cpu::{reference, CpuBackend};

/// Sequences, block tables and rows of one attention batch.
struct AttentionCase {
    layout: KvCacheLayout,
    max_blocks_per_seq: usize,
    /// Per sequence: its physical blocks and its length in tokens.
    block_tables: Vec<u32>,
    seq_lens: Vec<usize>,
    row_seq: Vec<u32>,
    positions: Vec<u32>,
}

impl AttentionCase {
    /// Three sequences over 4-token blocks in shuffled physical blocks:
    /// A (13 tokens, last block partly filled) decodes at position 12;
    /// B (11 tokens) runs a prefill chunk of positions 3..=10, starting
    /// mid-block; C (6 tokens) decodes at position 5.
    fn mixed(dtype: KvDtype) -> Self {
        let layout = KvCacheLayout {
            num_blocks: 16,
            block_size: 4,
            kv_heads: 3,
            head_dim: 16,
            keys: dtype,
            values: dtype,
        };
        let max_blocks_per_seq = 5;
        #[rustfmt::skip]
        let block_tables = vec![
            7, 2, 11, 4, 0,
            9, 14, 1, 0, 0,
            3, 12, 0, 0, 0,
        ];
        let mut row_seq = vec![0];
        let mut positions = vec![12];
        for pos in 3..=10 {
            row_seq.push(1);
            positions.push(pos);
        }
        row_seq.push(2);
        positions.push(5);
        AttentionCase {
            layout,
            max_blocks_per_seq,
            block_tables,
            seq_lens: vec![13, 11, 6],
            row_seq,
            positions,
        }
    }

    fn slots(&self, seq: usize) -> Vec<u32> {
        let bs = self.layout.block_size;
        (0..self.seq_lens[seq])
            .map(|j| {
                (self.block_tables[seq * self.max_blocks_per_seq + j / bs] as usize * bs + j % bs)
                    as u32
            })
            .collect()
    }

    fn params(&self, heads: usize, sliding_window: Option<usize>) -> AttentionParams {
        AttentionParams {
            rows: self.row_seq.len(),
            heads,
            kv_heads: self.layout.kv_heads,
            head_dim: self.layout.head_dim,
            block_size: self.layout.block_size,
            max_blocks_per_seq: self.max_blocks_per_seq,
            scale: 1.0 / (self.layout.head_dim as f32).sqrt(),
            sliding_window,
            per_head_tables: false,
        }
    }
}

/// Every uniform dtype, and keys and values of different bits.
fn kv_pairs() -> impl Iterator<Item = (KvDtype, KvDtype)> {
    KvDtype::ALL
        .map(|d| (d, d))
        .into_iter()
        .chain(tandem_core::kv::plan::MIXED_KV_PAIRS)
}

/// Fills the cache of `case` through `paged_kv_write`, checking it against
/// the reference write, then returns the filled cache.
fn fill_cache(backend: &CpuBackend, case: &AttentionCase, rng: &mut Rng) -> tandem_cpu::KvCache {
    let mut cache = backend.alloc_kv_cache(case.layout).unwrap();
    let width = case.layout.row_width();
    let mut want_k = vec![0.0; case.layout.num_slots() * width];
    let mut want_v = want_k.clone();
    for seq in 0..case.seq_lens.len() {
        let slots = case.slots(seq);
        let (k, v) = (
            rng.vec(slots.len() * width, 2.0),
            rng.vec(slots.len() * width, 2.0),
        );
        backend
            .paged_kv_write(
                &backend.upload(&k).unwrap(),
                &backend.upload(&v).unwrap(),
                &backend.upload_indices(&slots).unwrap(),
                slots.len(),
                &mut cache,
            )
            .unwrap();
        reference::paged_kv_write(&k, &v, &slots, case.layout, &mut want_k, &mut want_v);
    }
    assert_close("paged_kv_write", &cache.keys_f32(), &want_k);
    assert_close("paged_kv_write", &cache.values_f32(), &want_v);
    cache
}

#[test]
fn paged_attention_matches_reference_across_sequences_blocks_and_gqa() {
    let mut rng = Rng::new(9);
    for backend in backends() {
        for (keys, values) in kv_pairs() {
            let mut case = AttentionCase::mixed(keys);
            case.layout.values = values;
            let cache = fill_cache(&backend, &case, &mut rng);
            for (heads, window) in [(9, None), (3, None), (9, Some(5)), (6, Some(1))] {
                let p = case.params(heads, window);
                let q = rng.vec(p.rows * heads * p.head_dim, 2.0);
                let mut out = backend.alloc(q.len()).unwrap();
                let (row_seq, positions, tables) = (
                    backend.upload_indices(&case.row_seq).unwrap(),
                    backend.upload_indices(&case.positions).unwrap(),
                    backend.upload_indices(&case.block_tables).unwrap(),
                );
                let idx = AttentionIndices {
                    row_seq: &row_seq,
                    positions: &positions,
                    block_tables: &tables,
                };
                backend
                    .paged_attention(&backend.upload(&q).unwrap(), &cache, idx, p, &mut out)
                    .unwrap();
                let mut want = vec![0.0; q.len()];
                reference::paged_attention(
                    &q,
                    &cache.keys_f32(),
                    &cache.values_f32(),
                    &case.row_seq,
                    &case.positions,
                    &case.block_tables,
                    p,
                    &mut want,
                );
                assert_close("paged_attention", out.as_slice(), &want);
            }
        }
    }
}

#[test]
fn paged_attention_is_stable_with_large_scores() {
    // Scores of several hundred: a softmax without the running maximum overflows.
    let mut rng = Rng::new(10);
    let backend = CpuBackend::new(1);
    let case = AttentionCase::mixed(KvDtype::F32);
    let cache = fill_cache(&backend, &case, &mut rng);
    let mut p = case.params(9, None);
    p.scale = 40.0;
    let q = rng.vec(p.rows * 9 * p.head_dim, 2.0);
    let mut out = backend.alloc(q.len()).unwrap();
    let (row_seq, positions, tables) = (
        backend.upload_indices(&case.row_seq).unwrap(),
        backend.upload_indices(&case.positions).unwrap(),
        backend.upload_indices(&case.block_tables).unwrap(),
    );
    let idx = AttentionIndices {
        row_seq: &row_seq,
        positions: &positions,
        block_tables: &tables,
    };
    backend
        .paged_attention(&backend.upload(&q).unwrap(), &cache, idx, p, &mut out)
        .unwrap();
    assert!(out.as_slice().iter().all(|v| v.is_finite()));
    let mut want = vec![0.0; q.len()];
    reference::paged_attention(
        &q,
        &cache.keys_f32(),
        &cache.values_f32(),
        &case.row_seq,
        &case.positions,
        &case.block_tables,
        p,
        &mut want,
    );
    assert_close("paged_attention", out.as_slice(), &want);
}

#[test]
fn copy_kv_blocks_copies_whole_blocks_in_order() {
    let mut rng = Rng::new(11);
    let backend = CpuBackend::new(1);
    for (keys, values) in kv_pairs() {
        let mut case = AttentionCase::mixed(keys);
        case.layout.values = values;
        let mut cache = fill_cache(&backend, &case, &mut rng);
        let (mut want_k, mut want_v) = (cache.keys_f32(), cache.values_f32());
        let pairs = [(7, 5), (5, 6), (2, 2)];
        backend.copy_kv_blocks(&mut cache, &pairs).unwrap();
        let block_elems = case.layout.block_size * case.layout.row_width();
        reference::copy_kv_blocks(&mut want_k, &mut want_v, block_elems, &pairs);
        assert_eq!(cache.keys_f32(), want_k);
        assert_eq!(cache.values_f32(), want_v);
    }
}

#[test]
fn float_keys_with_quantized_values_are_refused() {
    let backend = CpuBackend::new(1);
    let mut case = AttentionCase::mixed(KvDtype::F16);
    case.layout.values = KvDtype::Int8;
    let err = backend.alloc_kv_cache(case.layout).unwrap_err().to_string();
    assert!(err.contains("KV keys f16 with values int8"), "{err}");
}
