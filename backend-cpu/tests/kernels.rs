//! Every kernel of `CpuBackend` against `tandem_cpu::reference`, with random
//! inputs of awkward sizes, on one and several threads; and the errors that
//! too-short buffers and out-of-range indices must produce.

mod common;

use common::{assert_close, is_block_format, RandomWeight, Rng};
use tandem_core::backend::{
    AttentionIndices, AttentionParams, KvCacheLayout, KvDtype, MatmulParams, RmsNormParams,
    RopeParams, RopeStyle,
};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::WeightFormat;
use tandem_core::{Backend, Error};
use tandem_cpu::{reference, CpuBackend};

/// One thread, and more threads than this machine may have, so both the
/// serial and the split paths run.
fn backends() -> Vec<CpuBackend> {
    vec![CpuBackend::new(1), CpuBackend::new(3)]
}

#[test]
fn embedding_matches_reference_for_every_format() {
    let mut rng = Rng::new(1);
    for backend in backends() {
        for format in WeightFormat::ALL {
            let dim = if is_block_format(format) {
                3 * format.block_elems()
            } else {
                37
            };
            let table = RandomWeight::new(&mut rng, format, 50, dim, 1.0);
            for rows in [1, 3, 17] {
                let tokens: Vec<u32> = (0..rows).map(|_| rng.below(50) as u32).collect();
                let w = backend.upload_weight(table.view()).unwrap();
                let idx = backend.upload_indices(&tokens).unwrap();
                let mut out = backend.alloc(rows * dim).unwrap();
                backend.embedding(&w, &idx, rows, &mut out).unwrap();
                let mut want = vec![0.0; rows * dim];
                reference::embedding(table.view(), &tokens, &mut want);
                assert_close("embedding", out.as_slice(), &want);
            }
        }
    }
}

#[test]
fn rms_norms_match_reference() {
    let mut rng = Rng::new(2);
    for backend in backends() {
        for (rows, dim) in [(1, 35), (3, 576), (17, 7), (40, 600)] {
            let p = RmsNormParams {
                rows,
                dim,
                eps: 1e-5,
            };
            let x = rng.vec(rows * dim, 3.0);
            let delta = rng.vec(rows * dim, 1.0);
            let weight_values = rng.vec(dim, 1.0);
            let weight_bytes: Vec<u8> =
                weight_values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let weight = backend
                .upload_weight(tandem_core::quant::WeightView {
                    format: WeightFormat::F32,
                    rows: 1,
                    cols: dim,
                    data: &weight_bytes,
                })
                .unwrap();

            let xt = backend.upload(&x).unwrap();
            let mut out = backend.alloc(rows * dim).unwrap();
            backend.rms_norm(&xt, &weight, p, &mut out).unwrap();
            let mut want = vec![0.0; rows * dim];
            reference::rms_norm(&x, &weight_values, p, &mut want);
            assert_close("rms_norm", out.as_slice(), &want);

            let mut residual = backend.upload(&x).unwrap();
            let dt = backend.upload(&delta).unwrap();
            backend
                .rms_norm_residual(&mut residual, &dt, &weight, p, &mut out)
                .unwrap();
            let mut want_residual = x.clone();
            reference::rms_norm_residual(&mut want_residual, &delta, &weight_values, p, &mut want);
            assert_close("rms_norm_residual", out.as_slice(), &want);
            assert_close("rms_norm_residual", residual.as_slice(), &want_residual);
        }
    }
}

#[test]
fn rms_norm_accepts_half_precision_weights() {
    let mut rng = Rng::new(3);
    let backend = CpuBackend::new(1);
    let (rows, dim) = (3, 64);
    let weight = RandomWeight::new(&mut rng, WeightFormat::BF16, 1, dim, 1.0);
    let x = rng.vec(rows * dim, 2.0);
    let p = RmsNormParams {
        rows,
        dim,
        eps: 1e-6,
    };
    let mut out = backend.alloc(rows * dim).unwrap();
    let w = backend.upload_weight(weight.view()).unwrap();
    backend
        .rms_norm(&backend.upload(&x).unwrap(), &w, p, &mut out)
        .unwrap();
    let mut want = vec![0.0; rows * dim];
    reference::rms_norm(&x, &weight.view().to_f32(), p, &mut want);
    assert_close("rms_norm", out.as_slice(), &want);
}

/// Runs `CpuBackend::matmul` and the reference on the same random operands.
fn check_matmul(
    backend: &CpuBackend,
    rng: &mut Rng,
    format: WeightFormat,
    rows: usize,
    n: usize,
    cols: usize,
    with_bias: bool,
) {
    // Weights and activations of order 1: the error of quantizing the
    // activations to 16 bits, about |w| * sqrt(cols) * max|x| / 65534, stays
    // far inside the tolerance.
    let w = RandomWeight::new(rng, format, n, cols, 1.0);
    let x = rng.vec(rows * cols, 1.0);
    let bias = RandomWeight::new(rng, WeightFormat::F32, 1, n, 1.0);
    let wt = backend.upload_weight(w.view()).unwrap();
    let bt = backend.upload_weight(bias.view()).unwrap();
    let mut out = backend.alloc(rows * n).unwrap();
    backend
        .matmul(
            &backend.upload(&x).unwrap(),
            &wt,
            with_bias.then_some(&bt),
            MatmulParams { rows },
            &mut out,
        )
        .unwrap();
    let mut want = vec![0.0; rows * n];
    let bias_values = bias.view().to_f32();
    reference::matmul(
        &x,
        w.view(),
        with_bias.then_some(&bias_values[..]),
        rows,
        &mut want,
    );
    assert_close(matmul_kernel_name(format), out.as_slice(), &want);
}

#[test]
fn matmul_matches_reference_for_every_format_and_awkward_shape() {
    let mut rng = Rng::new(4);
    for backend in [CpuBackend::new(1), CpuBackend::new(2), CpuBackend::new(3)] {
        for format in WeightFormat::ALL {
            let block = format.block_elems();
            let cols_set: &[usize] = if is_block_format(format) {
                &[block, 3 * block, 9 * block]
            } else {
                &[1, 7, 33, 100]
            };
            for &cols in cols_set {
                // 40 rows on 2 threads takes the token-split path.
                for rows in [1, 3, 17, 40] {
                    for n in [1, 5, 67] {
                        check_matmul(&backend, &mut rng, format, rows, n, cols, n != 5);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_handles_model_sized_shapes() {
    let mut rng = Rng::new(5);
    let backend = CpuBackend::new(2);
    for format in [
        WeightFormat::Q4_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Int8PerChannel,
        WeightFormat::W8A8,
        WeightFormat::int4(64).unwrap(),
    ] {
        check_matmul(&backend, &mut rng, format, 1, 1536, 576, false);
        check_matmul(&backend, &mut rng, format, 2, 576, 1536, false);
        check_matmul(&backend, &mut rng, format, 70, 200, 576, true);
    }
    let g128 = WeightFormat::int4(128).unwrap();
    check_matmul(&backend, &mut rng, g128, 1, 1536, 640, false);
    check_matmul(&backend, &mut rng, g128, 70, 200, 1536, true);
}

/// Activation rows with a few huge channels (what SmoothQuant exists for):
/// W8A8's per-token INT8 activations lose the small channels, and the fast
/// kernel must lose exactly what the reference loses.
#[test]
fn w8a8_matches_reference_with_outlier_activations() {
    let mut rng = Rng::new(8);
    let backend = CpuBackend::new(2);
    let (n, cols) = (13, 256);
    let w = RandomWeight::new(&mut rng, WeightFormat::W8A8, n, cols, 1.0);
    let wt = backend.upload_weight(w.view()).unwrap();
    for rows in [1, 17] {
        let mut x = rng.vec(rows * cols, 1.0);
        for t in 0..rows {
            x[t * cols + 7] = 60.0;
            x[t * cols + 200] = -45.0 * (t + 1) as f32;
        }
        let mut out = backend.alloc(rows * n).unwrap();
        backend
            .matmul(
                &backend.upload(&x).unwrap(),
                &wt,
                None,
                MatmulParams { rows },
                &mut out,
            )
            .unwrap();
        let mut want = vec![0.0; rows * n];
        reference::matmul(&x, w.view(), None, rows, &mut want);
        assert_close("matmul_w8a8", out.as_slice(), &want);
        // The quantization is real: the f32 product differs.
        let mut exact = vec![0.0; rows * n];
        let as_f32 = w.view().to_f32();
        for (t, row) in exact.chunks_mut(n).enumerate() {
            for (r, v) in row.iter_mut().enumerate() {
                *v = (0..cols)
                    .map(|c| x[t * cols + c] * as_f32[r * cols + c])
                    .sum();
            }
        }
        let moved = exact.iter().zip(&want).any(|(e, w)| (e - w).abs() > 1e-3);
        assert!(
            moved,
            "INT8 activations should not reproduce the f32 product"
        );
    }
}

/// GGML's formats beyond Q4_1, at the sizes a model's shapes reduce to:
/// one, a few and an odd number of super-blocks (k-quants) or blocks.
#[test]
fn matmul_matches_reference_for_the_ggml_formats_at_awkward_sizes() {
    let mut rng = Rng::new(9);
    for backend in [CpuBackend::new(1), CpuBackend::new(2)] {
        for format in NEW_GGML_FORMATS {
            let cols_set: &[usize] = if format.is_k_quant() {
                &[256, 512, 768, 2304]
            } else {
                &[32, 96, 160]
            };
            for &cols in cols_set {
                for rows in [1, 3, 17] {
                    for n in [1, 7, 33] {
                        check_matmul(&backend, &mut rng, format, rows, n, cols, n == 7);
                    }
                }
            }
        }
    }
}

/// The formats GGUF files of real models mix with Q8_0 and Q4_1.
const NEW_GGML_FORMATS: [WeightFormat; 8] = [
    WeightFormat::Q5_0,
    WeightFormat::Q5_1,
    WeightFormat::IQ4_NL,
    WeightFormat::Q2_K,
    WeightFormat::Q3_K,
    WeightFormat::Q4_K,
    WeightFormat::Q5_K,
    WeightFormat::Q6_K,
];

#[test]
fn matmul_results_do_not_depend_on_the_thread_count() {
    let mut rng = Rng::new(6);
    for format in [WeightFormat::Q4_1].into_iter().chain(NEW_GGML_FORMATS) {
        let w = RandomWeight::new(&mut rng, format, 131, 512, 0.05);
        // One token splits output rows across threads, 45 split tokens.
        for rows in [1, 45] {
            let x = rng.vec(rows * 512, 1.0);
            let results: Vec<Vec<f32>> = [1, 2, 3]
                .map(|threads| {
                    let backend = CpuBackend::new(threads);
                    let mut out = backend.alloc(rows * 131).unwrap();
                    let wt = backend.upload_weight(w.view()).unwrap();
                    backend
                        .matmul(
                            &backend.upload(&x).unwrap(),
                            &wt,
                            None,
                            MatmulParams { rows },
                            &mut out,
                        )
                        .unwrap();
                    out.into_vec()
                })
                .into();
            assert_eq!(results[0], results[1], "{format} rows {rows}");
            assert_eq!(results[0], results[2], "{format} rows {rows}");
        }
    }
}

#[test]
fn rope_matches_reference_for_both_styles_and_partial_rotation() {
    let mut rng = Rng::new(7);
    for backend in backends() {
        for style in [RopeStyle::Interleaved, RopeStyle::NeoX] {
            for (rows, heads, head_dim, rotary_dim) in [
                (1, 9, 64, 64),
                (3, 2, 10, 6),
                (17, 3, 16, 16),
                (40, 1, 8, 0),
            ] {
                let p = RopeParams {
                    rows,
                    heads,
                    head_dim,
                    rotary_dim,
                    style,
                };
                let x = rng.vec(rows * heads * head_dim, 2.0);
                let positions: Vec<u32> = (0..rows).map(|_| rng.below(5000) as u32).collect();
                let inv_freq: Vec<f32> = (0..rotary_dim / 2)
                    .map(|i| 10000f32.powf(-2.0 * i as f32 / rotary_dim as f32))
                    .collect();
                let mut xt = backend.upload(&x).unwrap();
                backend
                    .rope(
                        &mut xt,
                        &backend.upload_indices(&positions).unwrap(),
                        &backend.upload(&inv_freq).unwrap(),
                        p,
                    )
                    .unwrap();
                let mut want = x.clone();
                reference::rope(&mut want, &positions, &inv_freq, p);
                assert_close("rope", xt.as_slice(), &want);
            }
        }
    }
}

#[test]
fn swiglu_gather_and_argmax_match_reference() {
    let mut rng = Rng::new(8);
    for backend in backends() {
        for len in [1, 7, 1536, 40_000] {
            let gate = rng.vec(len, 12.0);
            let up = rng.vec(len, 3.0);
            let mut out = backend.alloc(len).unwrap();
            backend
                .swiglu(
                    &backend.upload(&gate).unwrap(),
                    &backend.upload(&up).unwrap(),
                    len,
                    &mut out,
                )
                .unwrap();
            let mut want = vec![0.0; len];
            reference::swiglu(&gate, &up, &mut want);
            assert_close("swiglu", out.as_slice(), &want);

            let mut out = backend.alloc(len).unwrap();
            backend
                .geglu(
                    &backend.upload(&gate).unwrap(),
                    &backend.upload(&up).unwrap(),
                    len,
                    &mut out,
                )
                .unwrap();
            reference::geglu(&gate, &up, &mut want);
            assert_close("geglu", out.as_slice(), &want);

            let mut x = backend.upload(&gate).unwrap();
            backend.scale(&mut x, len - len / 3, 0.3).unwrap();
            want.copy_from_slice(&gate);
            reference::scale(&mut want[..len - len / 3], 0.3);
            assert_close("scale", x.as_slice(), &want);
        }

        let (rows, width) = (17, 33);
        let x = rng.vec(rows * width, 1.0);
        let picks = [16u32, 0, 3, 3, 9];
        let mut out = backend.alloc(picks.len() * width).unwrap();
        backend
            .gather_rows(
                &backend.upload(&x).unwrap(),
                &backend.upload_indices(&picks).unwrap(),
                picks.len(),
                width,
                &mut out,
            )
            .unwrap();
        let mut want = vec![0.0; picks.len() * width];
        reference::gather_rows(&x, &picks, width, &mut want);
        assert_eq!(out.as_slice(), &want[..]);

        for (rows, width) in [(1, 49_152), (3, 17), (17, 1000)] {
            let mut x: Vec<f32> = rng.vec(rows * width, 1.0);
            // Ties: the row maximum appears twice; NaNs lead row 0.
            for r in 0..rows {
                let row = &mut x[r * width..(r + 1) * width];
                let (a, b) = (rng.below(width), rng.below(width));
                row[a] = 5.0;
                row[b] = 5.0;
            }
            x[0] = f32::NAN;
            let mut out = backend.upload_indices(&vec![0; rows]).unwrap();
            backend
                .argmax(&backend.upload(&x).unwrap(), rows, width, &mut out)
                .unwrap();
            let mut want = vec![0; rows];
            reference::argmax(&x, rows, width, &mut want);
            assert_eq!(out.as_slice(), &want[..]);
        }
    }
}

#[test]
fn argmax_ignores_nans_and_picks_the_first_maximum() {
    let backend = CpuBackend::new(1);
    let x = [
        f32::NAN,
        1.0,
        3.0,
        f32::NAN,
        3.0,
        f32::NAN,
        f32::NAN,
        f32::NAN,
        f32::NAN,
    ];
    let mut out = backend.upload_indices(&[9, 9, 9]).unwrap();
    backend
        .argmax(&backend.upload(&x).unwrap(), 3, 3, &mut out)
        .unwrap();
    assert_eq!(out.as_slice(), &[2, 1, 0]);
}

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

#[test]
fn info_names_the_backend_and_its_threads() {
    let info = CpuBackend::new(2).info();
    assert_eq!(info.name, "cpu");
    assert!(info.device.starts_with("2 threads"), "{}", info.device);
    assert!(CpuBackend::default().threads() >= 1);
}

#[test]
fn float_keys_with_quantized_values_are_refused() {
    let backend = CpuBackend::new(1);
    let mut case = AttentionCase::mixed(KvDtype::F16);
    case.layout.values = KvDtype::Int8;
    let err = backend.alloc_kv_cache(case.layout).unwrap_err().to_string();
    assert!(err.contains("KV keys f16 with values int8"), "{err}");
}
