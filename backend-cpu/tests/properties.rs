//! Property tests: matmul and paged attention on random shapes agree with
//! the reference.

mod common;

use common::{assert_close, RandomWeight, Rng};
use proptest::prelude::*;
use tandem_core::backend::{
    AttentionIndices, AttentionParams, KvCacheLayout, KvDtype, MatmulParams,
};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::kv::EVICTED_BLOCK;
use tandem_core::quant::WeightFormat;
use tandem_core::Backend;
use tandem_cpu::{reference, CpuBackend};

fn format() -> impl Strategy<Value = WeightFormat> {
    prop::sample::select(WeightFormat::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matmul_agrees_with_reference(
        format in format(),
        rows in 1usize..48,
        n in 1usize..40,
        blocks in 1usize..8,
        extra_cols in 0usize..32,
        threads in 1usize..4,
        with_bias: bool,
        seed: u64,
    ) {
        let cols = if format.is_quantized() { blocks * format.block_elems() } else { blocks * 32 - 31 + extra_cols };
        let mut rng = Rng::new(seed);
        let backend = CpuBackend::new(threads);
        let w = RandomWeight::new(&mut rng, format, n, cols, 1.0);
        let x = rng.vec(rows * cols, 1.0);
        let bias = rng.vec(n, 1.0);
        let bias_bytes: Vec<u8> = bias.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bias_weight = backend
            .upload_weight(tandem_core::quant::WeightView { format: WeightFormat::F32, rows: 1, cols: n, data: &bias_bytes })
            .unwrap();
        let mut out = backend.alloc(rows * n).unwrap();
        backend
            .matmul(
                &backend.upload(&x).unwrap(),
                &backend.upload_weight(w.view()).unwrap(),
                with_bias.then_some(&bias_weight),
                MatmulParams { rows },
                &mut out,
            )
            .unwrap();
        let mut want = vec![0.0; rows * n];
        reference::matmul(&x, w.view(), with_bias.then_some(&bias[..]), rows, &mut want);
        assert_close(matmul_kernel_name(format), out.as_slice(), &want);
    }

    #[test]
    fn paged_attention_agrees_with_reference(
        kv_heads in 1usize..4,
        group in 1usize..4,
        head_dim in prop::sample::select(vec![4usize, 8, 20, 64]),
        block_size in 1usize..9,
        seq_lens in prop::collection::vec(1usize..40, 1..4),
        window in prop::option::of(1usize..20),
        f16_cache: bool,
        per_head_tables: bool,
        threads in 1usize..4,
        seed: u64,
    ) {
        let mut rng = Rng::new(seed);
        let backend = CpuBackend::new(threads);
        let dtype = if f16_cache { KvDtype::F16 } else { KvDtype::F32 };
        let max_blocks_per_seq = 40usize.div_ceil(block_size);
        let num_blocks = seq_lens.len() * max_blocks_per_seq;
        let layout = KvCacheLayout { num_blocks, block_size, kv_heads, head_dim, keys: dtype, values: dtype };
        let width = layout.row_width();
        // Each sequence gets its blocks from a shuffled pool.
        let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.below(i + 1));
        }
        let mut cache = backend.alloc_kv_cache(layout).unwrap();
        let (mut row_seq, mut positions, mut block_tables) = (vec![], vec![], vec![]);
        for (seq, &len) in seq_lens.iter().enumerate() {
            let table = &pool[seq * max_blocks_per_seq..(seq + 1) * max_blocks_per_seq];
            block_tables.extend_from_slice(table);
            let slots: Vec<u32> = (0..len)
                .map(|j| table[j / block_size] * block_size as u32 + (j % block_size) as u32)
                .collect();
            let (k, v) = (rng.vec(len * width, 2.0), rng.vec(len * width, 2.0));
            backend
                .paged_kv_write(&backend.upload(&k).unwrap(), &backend.upload(&v).unwrap(), &backend.upload_indices(&slots).unwrap(), len, &mut cache)
                .unwrap();
            // A chunk of this sequence's last positions attends.
            let chunk = 1 + rng.below(len);
            for pos in len - chunk..len {
                row_seq.push(seq as u32);
                positions.push(pos as u32);
            }
        }
        // Per-head tables: each KV head's copy of its sequence's table with
        // holes of its own (sparse attention's), the first block kept.
        if per_head_tables {
            block_tables = block_tables
                .chunks_exact(max_blocks_per_seq)
                .flat_map(|table| (0..kv_heads).map(move |_| table))
                .flat_map(|table| {
                    let mut table = table.to_vec();
                    for entry in &mut table[1..] {
                        if rng.below(3) == 0 {
                            *entry = EVICTED_BLOCK;
                        }
                    }
                    table
                })
                .collect();
        }
        let heads = kv_heads * group;
        let p = AttentionParams {
            rows: row_seq.len(),
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
            per_head_tables,
        };
        let q = rng.vec(p.rows * heads * head_dim, 2.0);
        let (rs, ps, bt) = (
            backend.upload_indices(&row_seq).unwrap(),
            backend.upload_indices(&positions).unwrap(),
            backend.upload_indices(&block_tables).unwrap(),
        );
        let mut out = backend.alloc(q.len()).unwrap();
        let idx = AttentionIndices { row_seq: &rs, positions: &ps, block_tables: &bt };
        backend.paged_attention(&backend.upload(&q).unwrap(), &cache, idx, p, &mut out).unwrap();
        let mut want = vec![0.0; q.len()];
        reference::paged_attention(&q, &cache.keys_f32(), &cache.values_f32(), &row_seq, &positions, &block_tables, p, &mut want);
        assert_close("paged_attention", out.as_slice(), &want);
    }
}
