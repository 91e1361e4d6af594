//! Every kernel of `CpuBackend` but paged attention against
//! `tandem_cpu::reference`, with random inputs of awkward sizes, on one and
//! several threads.

mod common;

use common::{assert_close, backends, is_block_format, RandomWeight, Rng};
use tandem_core::backend::{MatmulParams, RmsNormParams, RopeParams, RopeStyle};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::WeightFormat;
use tandem_core::Backend;
use tandem_cpu::{reference, CpuBackend};

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

#[test]
fn info_names_the_backend_and_its_threads() {
    let info = CpuBackend::new(2).info();
    assert_eq!(info.name, "cpu");
    assert!(info.device.starts_with("2 threads"), "{}", info.device);
    assert!(CpuBackend::default().threads() >= 1);
}
