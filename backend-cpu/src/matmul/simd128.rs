//! The quantized micro-kernel on wasm SIMD128, which every browser with
//! WebGPU has (the build enables it; there is no run-time detection in
//! wasm).
//!
//! LLVM vectorizes the portable kernel's dot products, but in a browser a
//! one-token matmul spent three quarters of its time there and a quarter
//! building each run's codes through `array::from_fn` calls it did not
//! inline (a Chromium CPU profile of decode). Here a run's codes go
//! straight from the weight bytes into four `i16x8` vectors, and each
//! product with 8 activation quants is one `i32x4.dot_i16x8_s` (exact, as
//! AVX2's `vpmaddwd`). The float arithmetic per run is the portable
//! kernel's (`add_run_sum`, shared), so both give the same bits. Float and
//! W8A8 weights keep the portable kernels.

use std::arch::wasm32::*;

use tandem_core::quant::{IQ4NL_VALUES, QK};

use super::formats::{run_codes, BlockFormat, Codes};
use super::portable::Portable;
use super::quantize::{BlockQuants, QuantRow};
use super::tiles::{add_run_sum, decode_block_heads_scalar, run_tiles, FloatElem, MicroKernels};
use super::{Operands, Task};

/// Tile shape: rows × tokens.
const R: usize = 4;
const T: usize = 4;

pub(super) struct Simd128;

pub(super) fn run(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // SAFETY: the build enables simd128 (this module exists only then).
    unsafe { run_tiles::<Simd128, R, T, R, T, R, T>(operands, cols, task) }
}

impl MicroKernels for Simd128 {
    #[inline(always)]
    unsafe fn f16_to_f32(bits: u16) -> f32 {
        Portable::f16_to_f32(bits)
    }

    #[inline(always)]
    unsafe fn prefetch(_at: *const u8) {}

    #[inline(always)]
    unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
        decode_block_heads_scalar::<Self, F>(row, heads)
    }

    #[inline(always)]
    unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
        w: [&[u8]; R],
        _w_codes: [&[BlockQuants]; R],
        w_heads: [&[f32]; R],
        x: [QuantRow<'_>; T],
    ) -> [[f32; T]; R] {
        let mut acc = [[0f32; T]; R];
        for b in 0..x[0].blocks() {
            for r in 0..R {
                let codes = run_vectors::<F>(&w[r][F::block_at(b)..], b % F::RUNS);
                let heads = &w_heads[r][F::HEAD_FLOATS * b..][..F::HEAD_FLOATS];
                for t in 0..T {
                    let xq = &x[t].quants[b].0;
                    let first = i32x4_add(dot8(codes[0], xq, 0), dot8(codes[1], xq, 8));
                    let second = i32x4_add(dot8(codes[2], xq, 16), dot8(codes[3], xq, 24));
                    // One sum per half with `HALVES` (two heads), one for the
                    // whole run otherwise (one head: the zip stops there).
                    let parts = if F::HALVES {
                        [first, second]
                    } else {
                        [i32x4_add(first, second), second]
                    };
                    for (p, (head, sum)) in heads.chunks_exact(2).zip(parts).enumerate() {
                        add_run_sum::<F>(&mut acc[r][t], lanes_sum(sum), head, &x[t], b, p);
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
        Portable::float_tile::<E, R, T>(w, x)
    }

    #[inline(always)]
    unsafe fn i8_tile<const R: usize, const T: usize>(
        w: [&[i8]; R],
        x: [&[i8]; T],
    ) -> [[i32; T]; R] {
        Portable::i8_tile::<R, T>(w, x)
    }
}

/// `codes · x[at..at + 8]` in four i32 lanes of pair sums.
#[inline(always)]
fn dot8(codes: v128, x: &[i16; QK], at: usize) -> v128 {
    i32x4_dot_i16x8(codes, load::<i16>(&x[at..at + 8]))
}

/// The sum of four i32 lanes.
#[inline(always)]
fn lanes_sum(v: v128) -> i32 {
    let v = i32x4_add(v, i32x4_shuffle::<2, 3, 0, 1>(v, v));
    let v = i32x4_add(v, i32x4_shuffle::<1, 0, 3, 2>(v, v));
    i32x4_extract_lane::<0>(v)
}

/// One vector from a slice of exactly 16 bytes.
#[inline(always)]
fn load<E>(s: &[E]) -> v128 {
    assert_eq!(std::mem::size_of_val(s), 16);
    // SAFETY: the slice holds the 16 bytes read; v128.load takes any alignment.
    unsafe { v128_load(s.as_ptr().cast::<v128>()) }
}

/// Codes `[0..8, 8..16, 16..24, 24..32]` of run `j` of `block` as `i16x8`
/// vectors, the values [`run_codes`] gives.
#[inline(always)]
fn run_vectors<F: BlockFormat>(block: &[u8], j: usize) -> [v128; 4] {
    let low_nibbles = |v: v128| v128_and(v, u8x16_splat(0x0f));
    let (h, s) = (j / 4, j % 4);
    match F::CODES {
        Codes::Bytes => {
            let q = &block[F::QUANTS_AT + QK * j..][..QK];
            widen_signed([load(&q[..16]), load(&q[16..])])
        }
        Codes::Nibbles => {
            let q = load(&block[F::QUANTS_AT + QK / 2 * j..][..QK / 2]);
            widen_unsigned([low_nibbles(q), u8x16_shr(q, 4)])
        }
        Codes::Nibbles5 => {
            let q = load(&block[F::QUANTS_AT..][..QK / 2]);
            let qh = &block[F::QUANTS_AT - 4..F::QUANTS_AT];
            let qh = u32x4_splat(u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]));
            // Bit i of `qh` is element i's fifth bit: each element takes
            // its byte of `qh` (bytes 0-1 for elements 0..16, 2-3 for
            // 16..32) and tests its bit there.
            let bit = u8x16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
            let high = |bytes: v128| {
                let set = u8x16_ne(v128_and(i8x16_swizzle(qh, bytes), bit), u8x16_splat(0));
                v128_and(set, u8x16_splat(16))
            };
            widen_unsigned([
                v128_or(
                    low_nibbles(q),
                    high(u8x16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
                ),
                v128_or(
                    u8x16_shr(q, 4),
                    high(u8x16(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)),
                ),
            ])
        }
        Codes::NonLinear => {
            let q = load(&block[F::QUANTS_AT..][..QK / 2]);
            let table = load(&IQ4NL_VALUES[..]);
            widen_signed([
                i8x16_swizzle(table, low_nibbles(q)),
                i8x16_swizzle(table, u8x16_shr(q, 4)),
            ])
        }
        Codes::Q4K | Codes::Q5K => {
            let (qs_at, high) = if F::CODES == Codes::Q5K {
                (48, Some(&block[16..48]))
            } else {
                (16, None)
            };
            let q = &block[qs_at + QK * (j / 2)..][..QK];
            widen_unsigned(std::array::from_fn(|half| {
                let q = load(&q[16 * half..][..16]);
                let nibbles = if j.is_multiple_of(2) {
                    low_nibbles(q)
                } else {
                    u8x16_shr(q, 4)
                };
                match high {
                    Some(qh) => {
                        let bit = v128_and(
                            u8x16_shr(load(&qh[16 * half..][..16]), j as u32),
                            u8x16_splat(1),
                        );
                        v128_or(nibbles, i8x16_shl(bit, 4))
                    }
                    None => nibbles,
                }
            }))
        }
        Codes::Q6K => {
            let ql = &block[64 * h + QK * (s & 1)..][..QK];
            let qh = &block[128 + QK * h..][..QK];
            widen_signed(std::array::from_fn(|half| {
                let l = load(&ql[16 * half..][..16]);
                let low = if s < 2 {
                    low_nibbles(l)
                } else {
                    u8x16_shr(l, 4)
                };
                let high = v128_and(
                    u8x16_shr(load(&qh[16 * half..][..16]), 2 * s as u32),
                    u8x16_splat(3),
                );
                i8x16_sub(v128_or(low, i8x16_shl(high, 4)), i8x16_splat(32))
            }))
        }
        // The 2- and 3-bit k-quants: codes built in scalar code.
        Codes::Q2K | Codes::Q3K => {
            let codes = run_codes::<F>(block, j);
            widen_signed([load(&codes[..16]), load(&codes[16..])])
        }
    }
}

/// Sixteen-byte halves of 32 codes (0..15 and 16..31) as four `i16x8`.
#[inline(always)]
fn widen_unsigned([a, b]: [v128; 2]) -> [v128; 4] {
    [
        u16x8_extend_low_u8x16(a),
        u16x8_extend_high_u8x16(a),
        u16x8_extend_low_u8x16(b),
        u16x8_extend_high_u8x16(b),
    ]
}

/// [`widen_unsigned`] for signed codes.
#[inline(always)]
fn widen_signed([a, b]: [v128; 2]) -> [v128; 4] {
    [
        i16x8_extend_low_i8x16(a),
        i16x8_extend_high_i8x16(a),
        i16x8_extend_low_i8x16(b),
        i16x8_extend_high_i8x16(b),
    ]
}
