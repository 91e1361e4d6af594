//! Weights read where they lie in a model file: one tensor, or several
//! stacked as one fused weight, against copies of the same bytes.

mod common;

use std::sync::Arc;

use common::{RandomWeight, Rng};
use tandem_core::backend::{MatmulParams, WeightStorage};
use tandem_core::model::Bytes;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

/// `x · wᵀ` for `rows` tokens, as bits.
fn product(backend: &CpuBackend, x: &[f32], w: &tandem_cpu::Weight, rows: usize) -> Vec<u32> {
    let x = backend.upload(x).unwrap();
    let mut out = backend.alloc(rows * w.rows()).unwrap();
    backend
        .matmul(&x, w, None, MatmulParams { rows }, &mut out)
        .unwrap();
    out.into_vec().iter().map(|v| v.to_bits()).collect()
}

/// Weights that lie in a model file are read there (block formats) or
/// copied (float formats), and multiply the same either way; a view that
/// is not in the file, or whose bytes do not match its shape, is refused
/// or copied, never read out of bounds.
#[test]
fn weights_read_in_the_model_file_multiply_as_copies_do() {
    let mut rng = Rng::new(11);
    let backend = CpuBackend::new(2);
    for format in WeightFormat::ALL {
        let cols = 2 * format.block_elems().max(32);
        let w = RandomWeight::new(&mut rng, format, 19, cols, 0.1);
        // The weight at an odd offset of a bigger file, as in a GGUF.
        let mut file_bytes = vec![7u8; 13];
        file_bytes.extend_from_slice(&w.bytes);
        file_bytes.extend_from_slice(&[9u8; 5]);
        let file = Arc::new(Bytes::Owned(file_bytes));
        let in_file = WeightView {
            data: &file[13..13 + w.bytes.len()],
            ..w.view()
        };
        let (mapped, storage) = backend.upload_file_weight(in_file, &file).unwrap();
        let float = matches!(
            format,
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16
        );
        let want_storage = if float {
            WeightStorage::Copied
        } else {
            WeightStorage::InFile
        };
        assert_eq!(storage, want_storage, "{format}");
        let copied = backend.upload_weight(w.view()).unwrap();
        for rows in [1, 5] {
            let x = rng.vec(rows * cols, 1.0);
            assert_eq!(
                product(&backend, &x, &mapped, rows),
                product(&backend, &x, &copied, rows),
                "{format} rows {rows}"
            );
        }
        // Not in this file: copied.
        let (_, storage) = backend.upload_file_weight(w.view(), &file).unwrap();
        assert_eq!(storage, WeightStorage::Copied, "{format}");
        // A shape the bytes do not fill: refused.
        let short = WeightView {
            rows: 20,
            ..in_file
        };
        assert!(
            backend.upload_file_weight(short, &file).is_err(),
            "{format}"
        );
    }
}

/// Matrices stacked where they lie in a model file (a fused Q, K and V,
/// or gate and up) multiply as their concatenated copy does, bit for bit:
/// one token (rows split among the threads), a few, and a prompt's worth
/// (tokens split), with row tiles and tasks that straddle the matrices.
/// Matrices of mixed formats or widths, more than three, or not all in the
/// file are left to the loader to copy.
#[test]
fn matrices_stacked_in_the_model_file_multiply_as_their_concatenation() {
    let mut rng = Rng::new(23);
    let backend = CpuBackend::new(2);
    for format in WeightFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
        let cols = 2 * format.block_elems().max(32);
        for heights in [&[13, 5, 7][..], &[4, 9], &[1]] {
            let parts: Vec<RandomWeight> = heights
                .iter()
                .map(|&h| RandomWeight::new(&mut rng, format, h, cols, 0.1))
                .collect();
            // Each at an odd offset, with bytes of other tensors between.
            let mut file_bytes = Vec::new();
            let mut offsets = Vec::new();
            for part in &parts {
                file_bytes.extend_from_slice(&[7u8; 13]);
                offsets.push(file_bytes.len());
                file_bytes.extend_from_slice(&part.bytes);
            }
            let file = Arc::new(Bytes::Owned(file_bytes));
            let views: Vec<WeightView<'_>> = parts
                .iter()
                .zip(&offsets)
                .map(|(part, &at)| WeightView {
                    data: &file[at..at + part.bytes.len()],
                    ..part.view()
                })
                .collect();
            let stacked = backend
                .upload_file_stack(&views, &file)
                .unwrap()
                .unwrap_or_else(|| panic!("{format} {heights:?}: not stacked"));
            let bytes: Vec<u8> = parts.iter().flat_map(|p| p.bytes.clone()).collect();
            let n = heights.iter().sum();
            let copied = backend
                .upload_weight(WeightView {
                    format,
                    rows: n,
                    cols,
                    data: &bytes,
                })
                .unwrap();
            assert_eq!(stacked.rows(), n);
            for rows in [1, 3, 40] {
                let x = rng.vec(rows * cols, 1.0);
                assert_eq!(
                    product(&backend, &x, &stacked, rows),
                    product(&backend, &x, &copied, rows),
                    "{format} {heights:?} rows {rows}"
                );
            }
            // One of them not in this file: left to the loader.
            let mut elsewhere = views.clone();
            elsewhere[0] = parts[0].view();
            assert!(backend
                .upload_file_stack(&elsewhere, &file)
                .unwrap()
                .is_none());
        }
    }
    let mut stack_of = |formats: &[WeightFormat], cols: &[usize]| {
        let parts: Vec<RandomWeight> = formats
            .iter()
            .zip(cols)
            .map(|(&f, &c)| RandomWeight::new(&mut rng, f, 3, c, 0.1))
            .collect();
        let file = Arc::new(Bytes::Owned(
            parts.iter().flat_map(|p| p.bytes.clone()).collect(),
        ));
        let mut at = 0;
        let views: Vec<WeightView<'_>> = parts
            .iter()
            .map(|part| {
                at += part.bytes.len();
                WeightView {
                    data: &file[at - part.bytes.len()..at],
                    ..part.view()
                }
            })
            .collect();
        backend.upload_file_stack(&views, &file).unwrap().is_some()
    };
    use WeightFormat::{F16, Q4_1, Q8_0};
    assert!(stack_of(&[Q4_1, Q4_1], &[64, 64]));
    assert!(!stack_of(&[Q4_1, Q8_0], &[64, 64]), "mixed formats");
    assert!(!stack_of(&[Q4_1, Q4_1], &[64, 96]), "mixed widths");
    assert!(!stack_of(&[Q4_1; 4], &[64; 4]), "four matrices");
    assert!(!stack_of(&[F16, F16], &[64, 64]), "float matrices");
}
