//! Every instruction set's micro-kernels against the reference matmul (the
//! integration tests only reach the best one this CPU has).

use tandem_core::kernels::{matmul_kernel_name, spec};
use tandem_core::quant::{quantize_matrix, quantize_row, WeightFormat, WeightView, QK};

use super::formats::BlockFormat;
use super::quantize::{quantize_activations, ActivationForm, BlockQuants, QuantRow};
use super::tiles::{decode_block_heads_scalar, MicroKernels};
use super::*;
use crate::reference;

/// A seeded xorshift generator of values in `[-scale, scale)`.
struct Values(u64);

impl Values {
    fn take(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }
}

/// `n` rows of `cols` values in `format`, stored in `bytes`.
fn matrix_view(format: WeightFormat, n: usize, cols: usize, bytes: &[u8]) -> WeightView<'_> {
    WeightView {
        format,
        rows: n,
        cols,
        data: bytes,
    }
}

fn check(isa: Isa, workers: &Workers, format: WeightFormat, rows: usize, n: usize, cols: usize) {
    let mut values = Values(0x2545_f491_4f6c_dd1d ^ (rows * 1000 + n * 10 + cols) as u64);
    let bytes = quantize_matrix(format, cols, &values.take(n * cols, 1.0));
    let view = matrix_view(format, n, cols, &bytes);
    let weight = Weight::from_view(view).unwrap();
    let x = values.take(rows * cols, 1.0);
    let bias_bytes = quantize_row(WeightFormat::F32, &values.take(n, 1.0));
    let bias_view = WeightView {
        format: WeightFormat::F32,
        rows: 1,
        cols: n,
        data: &bias_bytes,
    };
    let bias = Weight::from_view(bias_view).unwrap();

    let mut got = vec![f32::NAN; rows * n];
    matmul(workers, isa, &x, &weight, Some(&bias), rows, &mut got).unwrap();
    let mut want = vec![0.0; rows * n];
    reference::matmul(&x, view, Some(&bias_view.to_f32()), rows, &mut want);

    let kernel = matmul_kernel_name(format);
    let tolerance = spec(kernel).unwrap().tolerance;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let error = (g - w).abs() / (1.0 + w.abs());
        assert!(
            error <= tolerance,
            "{} {kernel} rows {rows} n {n} cols {cols} [{i}]: got {g}, want {w}",
            isa.name()
        );
    }
}

#[test]
fn every_instruction_set_matches_the_reference() {
    for isa in Isa::available() {
        for threads in [1, 2] {
            let workers = Workers::new(threads);
            for format in WeightFormat::ALL {
                let block = format.block_elems();
                let cols_set: &[usize] = if format.is_quantized() {
                    &[block, 3 * block, 5 * block, 6 * block, 8 * block]
                } else {
                    &[3, 8, 45]
                };
                for &cols in cols_set {
                    // 2, 5 and 37 tokens exercise partial tiles of every `T`,
                    // 37 on one thread also the token split.
                    for rows in [1, 2, 5, 37] {
                        for n in [1, 6, 13] {
                            check(isa, &workers, format, rows, n, cols);
                        }
                    }
                }
            }
        }
    }
}

/// Element `i` of block `b` of a quantized row, in the layout `isa`'s
/// kernels read in `form`.
fn element(isa: Isa, form: ActivationForm, row: &QuantRow<'_>, b: usize, i: usize) -> i16 {
    match (isa.kind(), form) {
        #[cfg(target_arch = "x86_64")]
        (IsaKind::Avx512Vnni, ActivationForm::Planes) => avx512::plane_element(row.quants, b, i),
        #[cfg(target_arch = "x86_64")]
        (IsaKind::Avx512Vnni, _) => avx512::element_at(row.quants, b, i),
        _ => row.quants[b].0[i],
    }
}

/// The forms `isa`'s kernels take activations in.
fn forms(isa: Isa) -> Vec<ActivationForm> {
    let mut forms = vec![
        ActivationForm::Blocks { half_sums: false },
        ActivationForm::Blocks { half_sums: true },
    ];
    #[cfg(target_arch = "x86_64")]
    if isa.kind() == IsaKind::Avx512Vnni {
        forms.push(ActivationForm::Planes);
    }
    forms
}

/// The group layout holds every element of a row once, where `element_at`
/// says, for rows of every length up to three quads (pairs and padded
/// quads at their ends).
#[cfg(target_arch = "x86_64")]
#[test]
fn the_group_layout_is_a_permutation() {
    if !Isa::available()
        .iter()
        .any(|isa| isa.kind() == IsaKind::Avx512Vnni)
    {
        return;
    }
    for runs in 1..=12 {
        let stride = avx512::stored_runs(runs);
        assert!(
            stride >= runs && stride - runs <= 1,
            "{runs} runs stored in {stride}"
        );
        let mut row: Vec<BlockQuants> = (0..stride)
            .map(|b| BlockQuants(std::array::from_fn(|i| (b * QK + i) as i16)))
            .collect();
        // SAFETY: checked above that the CPU has AVX-512.
        unsafe { avx512::to_group_layout(&mut row, stride) };
        let mut seen = vec![false; stride * QK];
        for b in 0..stride {
            for i in 0..QK {
                let v = avx512::element_at(&row, b, i);
                assert_eq!(
                    v as usize,
                    b * QK + i,
                    "{runs} runs, block {b}, element {i}"
                );
                seen[v as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{runs} runs");
    }
}

/// A token's outputs are the same bits whether it is multiplied alone, which
/// unpacks the weight codes straight into registers, or within a batch,
/// which repacks them first (and, on AVX-512, whatever the tile it lands
/// in): greedy decoding and speculative verification rely on it.
#[test]
fn a_token_gets_the_same_bits_alone_and_in_a_batch() {
    for isa in Isa::available() {
        let workers = Workers::new(2);
        for format in WeightFormat::ALL {
            if !format.is_quantized() {
                continue;
            }
            let block = format.block_elems();
            for cols in [block, 3 * block, 6 * block] {
                let (rows, n) = (9, 7);
                let mut values = Values(0x5eed ^ (cols * 31 + n) as u64);
                let bytes = quantize_matrix(format, cols, &values.take(n * cols, 1.0));
                let weight = Weight::from_view(matrix_view(format, n, cols, &bytes)).unwrap();
                let x = values.take(rows * cols, 1.0);
                let mut batch = vec![0f32; rows * n];
                matmul(&workers, isa, &x, &weight, None, rows, &mut batch).unwrap();
                for t in 0..rows {
                    let mut alone = vec![0f32; n];
                    let x = &x[t * cols..][..cols];
                    matmul(&workers, isa, x, &weight, None, 1, &mut alone).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&alone),
                        bits(&batch[t * n..][..n]),
                        "{} {format} cols {cols} token {t}",
                        isa.name()
                    );
                }
            }
        }
    }
}

/// Weights of every format sharing one input in one `matmuls` call give
/// each the bits of its own `matmul`, though the activations are quantized
/// once per form; weights of other widths are refused.
#[test]
fn matmuls_over_one_input_give_the_bits_of_separate_matmuls() {
    let cols = 512;
    let (rows, n) = (11, 5);
    let mut values = Values(0xfeed);
    let x = values.take(rows * cols, 1.0);
    let matrices: Vec<(WeightFormat, Vec<u8>)> = WeightFormat::ALL
        .into_iter()
        .filter(|f| cols.is_multiple_of(f.block_elems()))
        .map(|f| (f, quantize_matrix(f, cols, &values.take(n * cols, 1.0))))
        .collect();
    let weights: Vec<Weight> = matrices
        .iter()
        .map(|(f, bytes)| Weight::from_view(matrix_view(*f, n, cols, bytes)).unwrap())
        .collect();
    for isa in Isa::available() {
        let workers = Workers::new(2);
        let mut outs = vec![vec![f32::NAN; rows * n]; weights.len()];
        let mut targets: Vec<Target<'_>> = weights
            .iter()
            .zip(&mut outs)
            .map(|(w, out)| (w, None, out.as_mut_slice()))
            .collect();
        matmuls(&workers, isa, &x, rows, &mut targets).unwrap();
        for ((w, got), (format, _)) in weights.iter().zip(&outs).zip(&matrices) {
            let mut alone = vec![f32::NAN; rows * n];
            matmul(&workers, isa, &x, w, None, rows, &mut alone).unwrap();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(&alone), "{} {format}", isa.name());
        }
    }
    let narrow_bytes = quantize_matrix(WeightFormat::Q8_0, 64, &values.take(n * 64, 1.0));
    let narrow = Weight::from_view(matrix_view(WeightFormat::Q8_0, n, 64, &narrow_bytes)).unwrap();
    let (mut a, mut b) = (vec![0.0; rows * n], vec![0.0; rows * n]);
    let err = matmuls(
        &Workers::new(1),
        Isa::detect(),
        &x,
        rows,
        &mut [(&weights[0], None, &mut a), (&narrow, None, &mut b)],
    )
    .unwrap_err();
    assert!(err.to_string().contains("512 and 64 columns"), "{err}");
}

/// Every form holds each activation rounded to the nearest step of its
/// block's scale, with the block's `[scale, sum]`; the planes also each
/// lane's negated sum and negated high-byte sum (a row of five blocks: a
/// quad and a padded one).
#[test]
fn quantized_activations_round_to_the_nearest_step() {
    let workers = Workers::new(1);
    for cols in [64, 160] {
        let blocks = cols / QK;
        let x = Values(7).take(3 * cols, 4.0);
        for isa in Isa::available() {
            for form in forms(isa) {
                let q = quantize_activations(&workers, isa, &x, 3, cols, form);
                for t in 0..3 {
                    let row = q.row(t);
                    let quants: Vec<Vec<i16>> = (0..blocks)
                        .map(|b| (0..QK).map(|i| element(isa, form, &row, b, i)).collect())
                        .collect();
                    for (b, quants) in quants.iter().enumerate() {
                        let block = &x[t * cols + b * QK..][..QK];
                        let max_abs = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let scale = row.stats[2 * b];
                        assert_eq!(scale, max_abs / 32767.0);
                        for (v, &q) in block.iter().zip(quants) {
                            assert!((v - scale * q as f32).abs() <= scale * 0.5 + 1e-6);
                        }
                        let sum: i32 = quants.iter().map(|&q| q as i32).sum();
                        assert_eq!(row.stats[2 * b + 1], scale * sum as f32);
                    }
                    #[cfg(target_arch = "x86_64")]
                    if form == ActivationForm::Planes {
                        for k in 0..16 * blocks.div_ceil(4) {
                            let (b, m) = (k / 4, k % 4);
                            // The lane's sum of `f(q)` over its eight elements.
                            let lane_sum = |f: fn(i16) -> i32| {
                                quants.get(b).map_or(0, |q| {
                                    (0..4).map(|i| f(q[4 * m + i]) + f(q[16 + 4 * m + i])).sum()
                                })
                            };
                            let stats = |i: usize| row.stats.get(2 * b + i).copied().unwrap_or(0.0);
                            let scaled_sum = if m == 0 { stats(1) } else { 0.0 };
                            assert_eq!(
                                avx512::plane_lane(row.quants, b / 4, k % 16),
                                (
                                    -lane_sum(|q| q as i32),
                                    stats(0),
                                    scaled_sum,
                                    -lane_sum(|q| (q >> 8) as i32)
                                ),
                                "lane {k}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn an_all_zero_block_quantizes_to_zeros() {
    let form = ActivationForm::Blocks { half_sums: true };
    let q = quantize_activations(&Workers::new(1), Isa::detect(), &[0.0; 32], 1, 32, form);
    assert_eq!(q.row(0).stats[..2], [0.0, 0.0]);
    assert_eq!(q.row(0).quants[0].0, [0; 32]);
}

/// The word-wise unpacking of Q4_K's heads against GGML's byte-wise
/// `scale_min_k4`, over scale bytes with every bit pattern in play.
#[test]
fn q4_k_heads_unpack_like_scale_min_k4() {
    use tandem_core::quant::kquant::scale_min_k4;
    let mut values = Values(11);
    for _ in 0..64 {
        let mut block = vec![0u8; formats::Q4K::BLOCK_BYTES];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        block[2..4].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
        for (b, v) in block[4..16].iter_mut().zip(values.take(12, 1.0)) {
            *b = ((v + 1.0) * 127.9) as u8;
        }
        let mut heads = [0f32; 16];
        // SAFETY: the portable kernels run on every CPU.
        unsafe {
            <formats::Q4K as BlockFormat>::block_heads::<portable::Portable>(&block, 0, &mut heads)
        };
        for j in 0..8 {
            let (sc, mn) = scale_min_k4(j, &block[4..16]);
            assert_eq!(
                [heads[2 * j], heads[2 * j + 1]],
                [0.5 * sc as f32, -0.25 * mn as f32]
            );
        }
    }
}

/// The x86 kernels' vector decoding of block heads (the k-quants' one
/// super-block at a time, the one-run formats' four blocks at a time)
/// against the scalar one, bit for bit, over blocks of random bytes.
#[cfg(target_arch = "x86_64")]
#[test]
fn x86_block_heads_match_the_scalar_ones() {
    /// `F`'s heads over seven random blocks (a four and three more) whose
    /// f16 `d` (and `dmin`) sit at `d_at`.
    fn check<F: BlockFormat>(d_at: &[usize]) {
        const BLOCKS: usize = 7;
        let mut values = Values(5 + F::BLOCK_BYTES as u64);
        let mut row: Vec<u8> = values
            .take(BLOCKS * F::BLOCK_BYTES, 1.0)
            .iter()
            .map(|v| ((v + 1.0) * 127.9) as u8)
            .collect();
        for (b, block) in row.chunks_exact_mut(F::BLOCK_BYTES).enumerate() {
            for (&at, d) in d_at.iter().zip(values.take(d_at.len(), 2.0)) {
                let d = half::f16::from_f32(d * (b + 1) as f32);
                block[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        let len = BLOCKS * F::RUNS * F::HEAD_FLOATS;
        let (mut fast, mut scalar) = (vec![f32::NAN; len], vec![f32::NAN; len]);
        // SAFETY: checked below that the CPU has AVX2 and F16C; the portable
        // kernels run on every CPU.
        unsafe {
            <x86::Avx2 as MicroKernels>::decode_block_heads::<F>(&row, &mut fast);
            decode_block_heads_scalar::<portable::Portable, F>(&row, &mut scalar);
        }
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&scalar));
    }
    if !Isa::available()
        .iter()
        .any(|isa| isa.kind() == IsaKind::Avx2)
    {
        return;
    }
    check::<formats::Q2K>(&[80, 82]);
    check::<formats::Q3K>(&[108]);
    check::<formats::Q4K>(&[0, 2]);
    check::<formats::Q5K>(&[0, 2]);
    check::<formats::Q6K>(&[208]);
    check::<formats::Q8_0>(&[0]);
    check::<formats::Q4_0>(&[0]);
    check::<formats::Q4_1>(&[0, 2]);
    check::<formats::Q5_0>(&[0]);
    check::<formats::Q5_1>(&[0, 2]);
    check::<formats::Iq4Nl>(&[0]);
}
