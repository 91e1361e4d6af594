//! The errors `CpuBackend` gives for too-short buffers, out-of-range
//! indices, malformed weights and caches: named, never a panic.

mod common;

use common::{RandomWeight, Rng};
use tandem_core::backend::{
    AttentionIndices, AttentionParams, KvCacheLayout, KvDtype, MatmulParams, RmsNormParams,
    RopeParams, RopeStyle,
};
use tandem_core::quant::WeightFormat;
use tandem_core::{Backend, Error};
use tandem_cpu::CpuBackend;

/// Asserts `result` is a backend error whose message mentions `needle`.
fn assert_backend_error<T: std::fmt::Debug>(result: tandem_core::Result<T>, needle: &str) {
    match result {
        Err(Error::Backend { backend, message }) => {
            assert_eq!(backend, "cpu");
            assert!(
                message.contains(needle),
                "message {message:?} does not mention {needle:?}"
            );
        }
        other => panic!("expected a backend error mentioning {needle:?}, got {other:?}"),
    }
}

#[test]
fn too_short_buffers_and_bad_indices_are_errors() {
    let b = CpuBackend::new(2);
    let mut rng = Rng::new(12);
    let t = |len: usize| b.alloc(len).unwrap();
    let ids = |v: &[u32]| b.upload_indices(v).unwrap();
    let w = b
        .upload_weight(RandomWeight::new(&mut rng, WeightFormat::Q4_1, 8, 64, 1.0).view())
        .unwrap();
    let short_bias = b
        .upload_weight(RandomWeight::new(&mut rng, WeightFormat::F32, 1, 4, 1.0).view())
        .unwrap();
    let norm_w = b
        .upload_weight(RandomWeight::new(&mut rng, WeightFormat::F32, 1, 16, 1.0).view())
        .unwrap();

    assert_backend_error(b.download(&t(3), 4), "tensor");
    assert_backend_error(b.embedding(&w, &ids(&[1, 2]), 3, &mut t(192)), "tokens");
    assert_backend_error(
        b.embedding(&w, &ids(&[1, 8]), 2, &mut t(128)),
        "tokens[1] = 8",
    );
    assert_backend_error(b.embedding(&w, &ids(&[1, 2]), 2, &mut t(127)), "out");

    let p = RmsNormParams {
        rows: 2,
        dim: 16,
        eps: 1e-5,
    };
    assert_backend_error(b.rms_norm(&t(31), &norm_w, p, &mut t(32)), "x holds 31");
    assert_backend_error(
        b.rms_norm(&t(40), &norm_w, RmsNormParams { dim: 17, ..p }, &mut t(40)),
        "weight",
    );
    assert_backend_error(
        b.rms_norm_residual(&mut t(32), &t(16), &norm_w, p, &mut t(32)),
        "delta",
    );

    assert_backend_error(
        b.matmul(&t(63), &w, None, MatmulParams { rows: 1 }, &mut t(8)),
        "x holds 63",
    );
    assert_backend_error(
        b.matmul(&t(128), &w, None, MatmulParams { rows: 2 }, &mut t(15)),
        "out",
    );
    assert_backend_error(
        b.matmul(
            &t(64),
            &w,
            Some(&short_bias),
            MatmulParams { rows: 1 },
            &mut t(8),
        ),
        "bias",
    );

    let rope = RopeParams {
        rows: 2,
        heads: 2,
        head_dim: 8,
        rotary_dim: 8,
        style: RopeStyle::NeoX,
    };
    assert_backend_error(b.rope(&mut t(31), &ids(&[0, 1]), &t(4), rope), "x holds 31");
    assert_backend_error(b.rope(&mut t(32), &ids(&[0]), &t(4), rope), "positions");
    assert_backend_error(b.rope(&mut t(32), &ids(&[0, 1]), &t(3), rope), "inv_freq");
    assert_backend_error(
        b.rope(
            &mut t(32),
            &ids(&[0, 1]),
            &t(8),
            RopeParams {
                rotary_dim: 10,
                ..rope
            },
        ),
        "rotary_dim",
    );

    let layout = KvCacheLayout {
        num_blocks: 2,
        block_size: 4,
        kv_heads: 1,
        head_dim: 8,
        keys: KvDtype::F16,
        values: KvDtype::F16,
    };
    let mut cache = b.alloc_kv_cache(layout).unwrap();
    assert_backend_error(
        b.paged_kv_write(&t(16), &t(15), &ids(&[0, 1]), 2, &mut cache),
        "v holds 15",
    );
    assert_backend_error(
        b.paged_kv_write(&t(16), &t(16), &ids(&[0, 8]), 2, &mut cache),
        "slots[1] = 8",
    );
    assert_backend_error(b.copy_kv_blocks(&mut cache, &[(0, 1), (1, 2)]), "(1, 2)");

    // INT4 keys: the rows of one block must be consecutive, at consecutive offsets.
    let mut int4 = b
        .alloc_kv_cache(KvCacheLayout {
            keys: KvDtype::Int4,
            values: KvDtype::Int4,
            ..layout
        })
        .unwrap();
    assert_backend_error(
        b.paged_kv_write(&t(24), &t(24), &ids(&[0, 2, 3]), 3, &mut int4),
        "offsets 0 and 2 of KV block 0",
    );
    assert_backend_error(
        b.paged_kv_write(&t(24), &t(24), &ids(&[0, 4, 1]), 3, &mut int4),
        "KV block 0 is written by rows that are not consecutive",
    );
    b.paged_kv_write(&t(24), &t(24), &ids(&[1, 2, 4]), 3, &mut int4)
        .unwrap();

    let attention = AttentionParams {
        rows: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        max_blocks_per_seq: 2,
        scale: 0.3,
        sliding_window: None,
        per_head_tables: false,
    };
    let run = |q: usize, row_seq: &[u32], positions: &[u32], tables: &[u32], p: AttentionParams| {
        let (row_seq, positions, tables) = (ids(row_seq), ids(positions), ids(tables));
        let idx = AttentionIndices {
            row_seq: &row_seq,
            positions: &positions,
            block_tables: &tables,
        };
        b.paged_attention(&t(q), &cache, idx, p, &mut t(32))
    };
    assert!(run(32, &[0, 0], &[6, 7], &[1, 0], attention).is_ok());
    assert_backend_error(run(31, &[0, 0], &[6, 7], &[1, 0], attention), "q holds 31");
    assert_backend_error(
        run(32, &[0, 1], &[6, 7], &[1, 0], attention),
        "row_seq[1] = 1",
    );
    assert_backend_error(run(32, &[0, 0], &[6, 8], &[1, 0], attention), "position 8");
    assert_backend_error(
        run(32, &[0, 0], &[6, 7], &[1, 2], attention),
        "block_tables",
    );
    assert_backend_error(
        run(
            32,
            &[0, 0],
            &[6, 7],
            &[1, 0],
            AttentionParams {
                heads: 3,
                kv_heads: 2,
                ..attention
            },
        ),
        "multiple",
    );
    assert_backend_error(
        run(
            32,
            &[0, 0],
            &[6, 7],
            &[1, 0],
            AttentionParams {
                head_dim: 4,
                ..attention
            },
        ),
        "cache has",
    );
    assert_backend_error(
        run(
            32,
            &[0, 0],
            &[6, 7],
            &[1, 0],
            AttentionParams {
                sliding_window: Some(0),
                ..attention
            },
        ),
        "sliding_window",
    );
    let (row_seq, positions, tables) = (ids(&[0, 0]), ids(&[6, 7]), ids(&[1, 0]));
    let idx = AttentionIndices {
        row_seq: &row_seq,
        positions: &positions,
        block_tables: &tables,
    };
    let per_head = AttentionParams {
        per_head_tables: true,
        ..attention
    };
    assert_backend_error(
        b.paged_attention_scores(&t(32), &cache, idx, per_head, &mut t(4)),
        "per-head block tables",
    );

    assert_backend_error(b.swiglu(&t(10), &t(9), 10, &mut t(10)), "up holds 9");
    assert_backend_error(
        b.gather_rows(&t(20), &ids(&[0, 4]), 2, 5, &mut t(10)),
        "rows[1] = 4",
    );
    assert_backend_error(b.gather_rows(&t(20), &ids(&[0, 1]), 2, 5, &mut t(9)), "out");
    assert_backend_error(b.argmax(&t(20), 3, 7, &mut ids(&[0, 0, 0])), "x holds 20");
    assert_backend_error(b.argmax(&t(21), 3, 7, &mut ids(&[0, 0])), "out");
}

#[test]
fn malformed_weights_and_caches_are_errors() {
    let b = CpuBackend::new(1);
    let bytes = vec![0u8; 40];
    let view = |format, rows, cols, data: &[u8]| {
        b.upload_weight(tandem_core::quant::WeightView {
            format,
            rows,
            cols,
            data,
        })
    };
    assert!(view(WeightFormat::Q4_1, 2, 32, &bytes).is_ok());
    assert_backend_error(
        view(WeightFormat::Q4_1, 2, 32, &bytes[..39]),
        "needs 40 bytes",
    );
    assert_backend_error(view(WeightFormat::Q4_1, 1, 48, &bytes), "whole Q4_1 blocks");
    // k-quant rows are whole super-blocks of 256.
    let q6k = vec![0u8; 2 * 210];
    assert!(view(WeightFormat::Q6_K, 2, 256, &q6k).is_ok());
    assert_backend_error(
        view(WeightFormat::Q6_K, 2, 256, &q6k[..419]),
        "Q6_K weight of 2×256 needs 420 bytes, got 419",
    );
    assert_backend_error(
        view(WeightFormat::Q4_K, 3, 320, &q6k),
        "3 rows of 320 columns are not whole Q4_K blocks of 256 elements",
    );
    assert_backend_error(
        view(WeightFormat::Q5_0, 1, 48, &q6k),
        "not whole Q5_0 blocks of 32",
    );
    let layout = KvCacheLayout {
        num_blocks: usize::MAX / 2,
        block_size: 4,
        kv_heads: 1,
        head_dim: 8,
        keys: KvDtype::F32,
        values: KvDtype::F32,
    };
    assert_backend_error(b.alloc_kv_cache(layout), "overflows");
    assert_backend_error(
        b.alloc_kv_cache(KvCacheLayout {
            block_size: 0,
            num_blocks: 4,
            ..layout
        }),
        "block_size",
    );
}
