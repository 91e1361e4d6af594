//! Micro-kernels in plain Rust, for every target: written with fixed-size
//! lane arrays so the compiler vectorizes them for whatever the build
//! enables (SSE2 on baseline x86-64, NEON, wasm simd128).

use half::f16;
use tandem_core::quant::QK;

use super::quantize::QuantRow;
use super::{
    decode_block_heads_scalar, float_task, quant_task, w8a8_task, BlockFormat, FloatElem, Int4,
    Int8Rows, MicroKernels, Offset, Operands, Task, Q4_0, Q4_1, Q8_0,
};

/// Tile shape: rows × tokens.
const R: usize = 4;
const T: usize = 4;

pub(super) struct Portable;

/// The 32 quants of a run as integers: the 8-bit formats' signed bytes, or
/// the 4-bit formats' unsigned nibbles (low nibbles first).
#[inline(always)]
fn run_quants<F: BlockFormat>(quants: &[u8]) -> [i8; QK] {
    match F::OFFSET {
        Offset::None => std::array::from_fn(|i| quants[i] as i8),
        _ => std::array::from_fn(|i| {
            let byte = quants[i % (QK / 2)];
            (if i < QK / 2 { byte & 0x0f } else { byte >> 4 }) as i8
        }),
    }
}

pub(super) fn run(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // SAFETY: the portable kernels use no instruction beyond the build target's.
    unsafe {
        match operands {
            Operands::F32 { w, x } => float_task::<Portable, _, R, T>(w, x, cols, task),
            Operands::F16 { w, x } => float_task::<Portable, _, R, T>(w, x, cols, task),
            Operands::BF16 { w, x } => float_task::<Portable, _, R, T>(w, x, cols, task),
            Operands::Q8_0 { w, x } => quant_task::<Portable, Q8_0, R, T>(w, x, cols, task),
            Operands::Q4_0 { w, x } => quant_task::<Portable, Q4_0, R, T>(w, x, cols, task),
            Operands::Q4_1 { w, x } => quant_task::<Portable, Q4_1, R, T>(w, x, cols, task),
            Operands::Int8PerChannel { w, x } => {
                quant_task::<Portable, Int8Rows, R, T>(w, x, cols, task)
            }
            Operands::Int4G64 { w, x } => quant_task::<Portable, Int4<64>, R, T>(w, x, cols, task),
            Operands::Int4G128 { w, x } => {
                quant_task::<Portable, Int4<128>, R, T>(w, x, cols, task)
            }
            Operands::W8A8 { w, x } => w8a8_task::<Portable, R, T>(w, x, cols, task),
        }
    }
}

impl MicroKernels for Portable {
    #[inline(always)]
    unsafe fn f16_to_f32(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }

    #[inline(always)]
    unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
        decode_block_heads_scalar::<Self, F>(row, heads)
    }

    #[inline(always)]
    unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
        w: [&[u8]; R],
        w_heads: [&[f32]; R],
        x: [QuantRow<'_>; T],
    ) -> [[f32; T]; R] {
        let mut acc = [[0f32; T]; R];
        for b in 0..x[0].blocks() {
            for r in 0..R {
                let weights = run_quants::<F>(&w[r][F::run_quants_at(b)..][..F::RUN_BYTES]);
                let [w_scale, w_offset] = [w_heads[r][2 * b], w_heads[r][2 * b + 1]];
                for t in 0..T {
                    let xq = &x[t].quants[b].0;
                    let mut sum = 0i32;
                    for i in 0..QK {
                        sum += weights[i] as i32 * xq[i] as i32;
                    }
                    let [x_scale, x_sum] = [x[t].stats[2 * b], x[t].stats[2 * b + 1]];
                    acc[r][t] += sum as f32 * (w_scale * x_scale);
                    if F::OFFSET != Offset::None {
                        acc[r][t] += w_offset * x_sum;
                    }
                }
            }
        }
        acc
    }

    #[inline(always)]
    unsafe fn float_tile<E: FloatElem, const R: usize, const T: usize>(
        w: [&[E]; R],
        x: [&[f32]; T],
    ) -> [[f32; T]; R] {
        const LANES: usize = 8;
        let cols = x[0].len();
        let full = cols - cols % LANES;
        let mut lanes = [[[0f32; LANES]; T]; R];
        for c in (0..full).step_by(LANES) {
            for r in 0..R {
                let wv: [f32; LANES] = std::array::from_fn(|i| w[r][c + i].to_f32());
                for t in 0..T {
                    let xv = &x[t][c..c + LANES];
                    for i in 0..LANES {
                        lanes[r][t][i] += wv[i] * xv[i];
                    }
                }
            }
        }
        let mut acc = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let tail: f32 = (full..cols).map(|c| w[r][c].to_f32() * x[t][c]).sum();
                acc[r][t] = lanes[r][t].iter().sum::<f32>() + tail;
            }
        }
        acc
    }

    #[inline(always)]
    unsafe fn i8_tile<const R: usize, const T: usize>(
        w: [&[i8]; R],
        x: [&[i8]; T],
    ) -> [[i32; T]; R] {
        const LANES: usize = 16;
        let cols = x[0].len();
        let mut lanes = [[[0i32; LANES]; T]; R];
        for c in (0..cols).step_by(LANES) {
            for r in 0..R {
                let wv: [i32; LANES] = std::array::from_fn(|i| w[r][c + i] as i32);
                for t in 0..T {
                    let xv = &x[t][c..c + LANES];
                    for i in 0..LANES {
                        lanes[r][t][i] += wv[i] * xv[i] as i32;
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|t| lanes[r][t].iter().sum()))
    }
}
