//! The groups of runs the AVX-512 block kernel reads, and their layout.
//!
//! A row's runs are taken four at a time, a quad: the 128 elements of runs
//! `4q` to `4q + 3` form eight segments of 16 elements (the halves of each
//! run, in order), stored as four vectors of 32 i16, `V0` to `V3`. The i32
//! lane `k` of vector `v` holds elements `4v + 2j` and `4v + 2j + 1` of
//! segment `k % 8`, `j = k / 8`. So `vpmaddwd` of the weights' and
//! activations' `V0`s followed by `vpdpwssd` of their `V1` to `V3` leaves
//! in lane `k` the sum of eight products of segment `k % 8`.
//!
//! A row whose run count leaves one or two over ends with a pair instead:
//! the four segments of its two runs (the second zero where there is only
//! one) in two vectors, lane `k` of vector `v` holding elements `8v + 2j`
//! and `8v + 2j + 1` of segment `k % 4`, `j = k / 4`; three over are a quad
//! with a zero run. So no row computes more than one padding run.
//!
//! Activations are rewritten into this layout once per matmul
//! ([`to_group_layout`]), and a row tile's weight codes once
//! ([`repack_codes`]); a single token's kernel unpacks its codes straight
//! into it ([`group_codes`]).

use std::arch::x86_64::*;

use tandem_core::quant::{IQ4NL_VALUES, QK};

use super::super::formats::{BlockFormat, Codes, Head};
use super::super::quantize::BlockQuants;

/// Runs of a quad.
pub(in super::super) const QUAD: usize = 4;
/// Runs of a pair.
pub(super) const PAIR: usize = 2;

/// The blocks a row of `runs` runs takes in the layout: its quads, then a
/// pair or a quad for what is left over.
pub(in super::super) fn stored_runs(runs: usize) -> usize {
    match runs % QUAD {
        0 => runs,
        1 | 2 => runs - runs % QUAD + PAIR,
        _ => runs.next_multiple_of(QUAD),
    }
}

/// The runs of the group that starts at run `first` of a row of `runs`:
/// a pair only at the end of a row that leaves one or two over.
#[inline(always)]
pub(super) fn group_runs(runs: usize, first: usize) -> usize {
    if runs - first <= PAIR {
        PAIR
    } else {
        QUAD
    }
}

/// Element (of the `16 * group` of a group's runs, concatenated) that word
/// `w` of vector `v` holds, in a group of `group` runs.
const fn group_element(group: usize, v: usize, w: usize) -> usize {
    let (lane, within) = (w / 2, w % 2);
    let segments = 2 * group;
    let (segment, j) = (lane % segments, lane / segments);
    16 * segment + 16 / group * v + 2 * j + within
}

/// Per vector of a group of `group` runs, the word each of its words takes
/// from the group's first two runs (or, the same index less 64, from its
/// last two): an index of `vpermt2w` over two blocks.
const fn group_words<const G: usize>() -> [[i16; 32]; G] {
    let mut words = [[0i16; 32]; G];
    let mut v = 0;
    while v < G {
        let mut w = 0;
        while w < 32 {
            words[v][w] = (group_element(G, v, w) % 64) as i16;
            w += 1;
        }
        v += 1;
    }
    words
}

const QUAD_WORDS: [[i16; 32]; QUAD] = group_words::<QUAD>();
const PAIR_WORDS: [[i16; 32]; PAIR] = group_words::<PAIR>();

/// The words of a quad's vectors that come from its last two runs: those
/// of segments 4 to 7.
const LAST_RUNS: __mmask32 = 0xff00_ff00;

/// A group's vectors as byte permutes of its bytes, runs 0 and 1 in a
/// first vector and runs 2 and 3 in a second (indices from 64 pick from
/// the second): per permute, two vectors' worth, interleaved: the even
/// bytes are word by word the first vector, the odd bytes the second, so
/// that shifts widen them ([`widen`]).
const fn group_bytes<const G: usize>() -> [[u8; 64]; 2] {
    let mut bytes = [[0u8; 64]; 2];
    let mut half = 0;
    while half < G / 2 {
        let mut i = 0;
        while i < 64 {
            bytes[half][i] = group_element(G, 2 * half + i % 2, i / 2) as u8;
            i += 1;
        }
        half += 1;
    }
    bytes
}

const QUAD_BYTES: [[u8; 64]; 2] = group_bytes::<QUAD>();
const PAIR_BYTES: [[u8; 64]; 2] = group_bytes::<PAIR>();

/// Rewrites rows of `stride` activation blocks (`stride` from
/// [`stored_runs`]), each in element order, in the group layout.
///
/// # Safety
/// The CPU supports AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(in super::super) unsafe fn to_group_layout(blocks: &mut [BlockQuants], stride: usize) {
    for row in blocks.chunks_exact_mut(stride) {
        let mut first = 0;
        while first < stride {
            let at: *mut __m512i = row.as_mut_ptr().add(first).cast();
            let mut runs = [_mm512_setzero_si512(); QUAD];
            if group_runs(stride, first) == QUAD {
                for (i, run) in runs.iter_mut().enumerate() {
                    *run = _mm512_load_si512(at.add(i).cast());
                }
                for (v, words) in QUAD_WORDS.iter().enumerate() {
                    let words = _mm512_loadu_si512(words.as_ptr().cast());
                    let low = _mm512_permutex2var_epi16(runs[0], words, runs[1]);
                    let high = _mm512_permutex2var_epi16(runs[2], words, runs[3]);
                    _mm512_store_si512(
                        at.add(v).cast(),
                        _mm512_mask_blend_epi16(LAST_RUNS, low, high),
                    );
                }
                first += QUAD;
            } else {
                for (i, run) in runs.iter_mut().take(PAIR).enumerate() {
                    *run = _mm512_load_si512(at.add(i).cast());
                }
                for (v, words) in PAIR_WORDS.iter().enumerate() {
                    let words = _mm512_loadu_si512(words.as_ptr().cast());
                    _mm512_store_si512(
                        at.add(v).cast(),
                        _mm512_permutex2var_epi16(runs[0], words, runs[1]),
                    );
                }
                first += PAIR;
            }
        }
    }
}

/// Element `i` of block `b` of `row`, a row of activation blocks in the
/// group layout.
#[cfg(test)]
pub(in super::super) fn element_at(row: &[BlockQuants], b: usize, i: usize) -> i16 {
    let first = b - b % QUAD;
    let group = group_runs(row.len(), first);
    let element = QK * (b - first) + i;
    let (segment, within_segment) = (element / 16, element % 16);
    let per_vector = 16 / group;
    let (v, j, within) = (
        within_segment / per_vector,
        within_segment % per_vector / 2,
        within_segment % 2,
    );
    let lane = 2 * group * j + segment;
    row[first + v].0[2 * lane + within]
}

/// The weight codes of `row` (of format `F`, `runs` runs) in the group
/// layout, into `codes` (`stored_runs(runs)` blocks).
///
/// # Safety
/// `row` holds `runs` runs; the CPU supports AVX2 and AVX-512 F, BW, VL
/// and VBMI.
#[inline(always)]
pub(in super::super) unsafe fn repack_codes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    codes: &mut [BlockQuants],
) {
    assert!(row.len() >= F::row_bytes(runs) && codes.len() >= stored_runs(runs));
    let mut first = 0;
    while first < runs {
        let at: *mut __m512i = codes.as_mut_ptr().add(first).cast();
        let vectors = group_codes::<F>(row, runs, first);
        let group = group_runs(runs, first);
        for (v, vector) in vectors.into_iter().take(group).enumerate() {
            _mm512_store_si512(at.add(v).cast(), vector);
        }
        first += group;
    }
}

/// The codes of the group that starts at run `first` of `row` (`runs`
/// runs), its vectors first (a pair's last two are zero), the codes of
/// missing runs zero. The one unpacking of both the repacked codes and the
/// kernel's own, so a token's result does not depend on which the kernel
/// read. The runs' bytes go into the layout by byte permutes before they
/// are widened: word permutes cost twice as much. (Unpacking a quad of
/// Q4_1 or Q5_0 blocks four runs at a time, from two loads and one permute
/// of their bytes, measured slower than this, run by run.)
///
/// # Safety
/// `row` holds `runs` runs and `first < runs`; the CPU supports AVX2 and
/// AVX-512 F, BW, VL and VBMI.
#[inline(always)]
pub(super) unsafe fn group_codes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    first: usize,
) -> [__m512i; QUAD] {
    let [low_runs, high_runs] = match quad_bytes::<F>(row, runs, first) {
        Some(quad) => quad,
        None => {
            let low_runs = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(row_run_bytes::<F>(row, first)),
                row_run_bytes_or_zero::<F>(row, runs, first + 1),
            );
            if group_runs(runs, first) == PAIR {
                let pair = _mm512_permutexvar_epi8(
                    _mm512_loadu_si512(PAIR_BYTES[0].as_ptr().cast()),
                    low_runs,
                );
                let [v0, v1] = widen::<F>(pair);
                return [v0, v1, _mm512_setzero_si512(), _mm512_setzero_si512()];
            }
            let high_runs = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(row_run_bytes_or_zero::<F>(row, runs, first + 2)),
                row_run_bytes_or_zero::<F>(row, runs, first + 3),
            );
            [low_runs, high_runs]
        }
    };
    let low = _mm512_permutex2var_epi8(
        low_runs,
        _mm512_loadu_si512(QUAD_BYTES[0].as_ptr().cast()),
        high_runs,
    );
    let high = _mm512_permutex2var_epi8(
        low_runs,
        _mm512_loadu_si512(QUAD_BYTES[1].as_ptr().cast()),
        high_runs,
    );
    let [v0, v1] = widen::<F>(low);
    let [v2, v3] = widen::<F>(high);
    [v0, v1, v2, v3]
}

/// The codes of the whole quad at run `first` of `row` (`runs` runs) as
/// bytes, runs 0 and 1 in the first vector and runs 2 and 3 in the second,
/// for the k-quants whose quad of runs lies in one 64-byte span of codes:
/// Q4_K's nibbles (runs 0 and 2 in the low nibbles, 1 and 3 in the high
/// ones), Q6_K's (runs 0 and 1 low, 2 and 3 high) with their high bits
/// from 32 bytes more. `None` for the other formats, and a quad cut short
/// by the row's end, which [`run_bytes`] unpacks a run at a time. The same
/// bytes as [`run_bytes`] gives, in fewer instructions: a quad of Q6_K
/// runs, for one, in 12 where four runs take 28.
///
/// # Safety
/// `row` holds `runs` runs and `first < runs`; the CPU supports AVX-512
/// F and BW.
#[inline(always)]
unsafe fn quad_bytes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    first: usize,
) -> Option<[__m512i; 2]> {
    if first + QUAD > runs || !first.is_multiple_of(QUAD) {
        return None;
    }
    let block = row.as_ptr().add(F::block_at(first));
    let h = first % F::RUNS / QUAD;
    let low_nibbles = _mm512_set1_epi8(0x0f);
    match F::CODES {
        Codes::Q4K => {
            let packed = _mm512_loadu_si512(block.add(16 + 64 * h).cast());
            let even = _mm512_and_si512(packed, low_nibbles);
            let odd = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles);
            Some([
                _mm512_shuffle_i64x2::<0x44>(even, odd),
                _mm512_shuffle_i64x2::<0xee>(even, odd),
            ])
        }
        Codes::Q6K => {
            let packed = _mm512_loadu_si512(block.add(64 * h).cast());
            let bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * h).cast()));
            // Bits `2s` and `2s + 1` of each byte moved to bits 4 and 5 for
            // run `s`: runs 0 and 1 (the vector's halves) shifted left by 4
            // and 2, runs 2 and 3 right by 0 and 2, within 16-bit words (the
            // bits crossing into the word's other byte are masked off).
            let runs_01 = _mm512_sllv_epi16(
                bits,
                _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2)),
            );
            let runs_23 = _mm512_srlv_epi16(
                bits,
                _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2)),
            );
            let field = _mm512_set1_epi8(0x30);
            let thirty_two = _mm512_set1_epi8(32);
            // `(low & 0x0f) | high`, then the zero point off.
            let low = _mm512_ternarylogic_epi32::<0b1110_1100>(
                packed,
                _mm512_and_si512(runs_01, field),
                low_nibbles,
            );
            let high = _mm512_ternarylogic_epi32::<0b1110_1100>(
                _mm512_srli_epi16::<4>(packed),
                _mm512_and_si512(runs_23, field),
                low_nibbles,
            );
            Some([
                _mm512_sub_epi8(low, thirty_two),
                _mm512_sub_epi8(high, thirty_two),
            ])
        }
        _ => None,
    }
}

/// 64 code bytes as two vectors of i16, the even bytes' and the odd
/// bytes', their zero point taken off first. Shifts within each word, not
/// the byte-to-word conversions: those cross 128-bit lanes, and every
/// such shuffle on a CPU of one 512-bit shuffle unit (Zen 4) waits for
/// the others and for the permutes into the layout.
///
/// # Safety
/// The CPU supports AVX-512 F and BW.
#[inline(always)]
unsafe fn widen<F: BlockFormat>(bytes: __m512i) -> [__m512i; 2] {
    let bytes = match zero_point::<F>() {
        Some(zero) => _mm512_sub_epi8(bytes, _mm512_set1_epi8(zero)),
        None => bytes,
    };
    if signed_codes::<F>() {
        [
            _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(bytes)),
            _mm512_srai_epi16::<8>(bytes),
        ]
    } else {
        [
            _mm512_and_si512(bytes, _mm512_set1_epi16(0xff)),
            _mm512_srli_epi16::<8>(bytes),
        ]
    }
}

/// [`row_run_bytes`], or zeros for a run past the row's last.
///
/// # Safety
/// As [`row_run_bytes`] where `b < runs`.
#[inline(always)]
unsafe fn row_run_bytes_or_zero<F: BlockFormat>(row: &[u8], runs: usize, b: usize) -> __m256i {
    if b < runs {
        row_run_bytes::<F>(row, b)
    } else {
        _mm256_setzero_si256()
    }
}

/// The 32 codes of run `b` of `row` as bytes. (Not a closure: closures do
/// not inherit the caller's target features, and the intrinsics would not
/// inline into one.)
///
/// # Safety
/// `row` holds run `b`; the CPU supports AVX2 and AVX-512 F, BW and VL.
#[inline(always)]
unsafe fn row_run_bytes<F: BlockFormat>(row: &[u8], b: usize) -> __m256i {
    run_bytes::<F>(row.as_ptr().add(F::block_at(b)), b % F::RUNS)
}

/// Whether `F`'s codes are signed bytes ([`Codes`]), or become signed
/// when their zero point is taken off.
fn signed_codes<F: BlockFormat>() -> bool {
    zero_point::<F>().is_some()
        || matches!(
            F::CODES,
            Codes::Bytes | Codes::NonLinear | Codes::Q3K | Codes::Q6K
        )
}

/// The code that stands for zero in the formats whose offset is a fixed
/// multiple of their scale (Q4_0's 8, Q5_0's 16: `[d, -8 d]` heads). This
/// kernel takes it off the codes as it unpacks them, so their runs need
/// no offset term: one pass less per tile, and the dot product exact in
/// integers.
pub(super) fn zero_point<F: BlockFormat>() -> Option<i8> {
    match F::HEAD {
        Head::Scaled(factor) if factor != 0.0 => Some(-factor as i8),
        _ => None,
    }
}

/// The 32 codes of run `j` of the block at `block` as bytes, in element
/// order ([`Codes`] says which are signed, [`signed_codes`] too). The fifth bits of Q5_0, Q5_1 and Q5_K and
/// the third of Q3_K become a byte mask, the bytes where it is set (or
/// clear) taking the bit's value; a masked bit field and the bits above it
/// merge in one `vpternlogd`.
///
/// # Safety
/// A whole block of format `F` is readable at `block`; the CPU supports
/// AVX2 and AVX-512 F, BW and VL.
#[inline(always)]
unsafe fn run_bytes<F: BlockFormat>(block: *const u8, j: usize) -> __m256i {
    let (h, s) = (j / 4, j % 4);
    let bytes = |at: usize| _mm256_loadu_si256(block.add(at).cast());
    // Bytes shifted right by `n` bits (the bits moving in from the next byte
    // are masked off by every caller).
    let shift = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    let mask = |v: __m256i, m: i8| _mm256_and_si256(v, _mm256_set1_epi8(m));
    let splat = _mm256_set1_epi8;
    // `(low & 0x0f) | high` per byte.
    let merge = |low: __m256i, high: __m256i| {
        _mm256_ternarylogic_epi32::<0b1110_1100>(low, high, splat(0x0f))
    };
    // 16 in the bytes of `bits` whose bit `bit` is set, 0 elsewhere.
    let fifth = |bits: __mmask32| _mm256_maskz_mov_epi8(bits, splat(16));
    match F::CODES {
        Codes::Bytes => bytes(F::QUANTS_AT + QK * j),
        Codes::Nibbles => mask(nibble_halves(block.add(F::QUANTS_AT + QK / 2 * j)), 0x0f),
        Codes::Nibbles5 => {
            let low = nibble_halves(block.add(F::QUANTS_AT));
            let qh = block.add(F::QUANTS_AT - 4).cast::<u32>().read_unaligned();
            merge(low, fifth(_cvtu32_mask32(qh)))
        }
        Codes::NonLinear => {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()));
            let q = mask(nibble_halves(block.add(F::QUANTS_AT)), 0x0f);
            _mm256_shuffle_epi8(table, q)
        }
        Codes::Q4K => mask(shift(bytes(16 + QK * (j / 2)), 4 * (j % 2)), 0x0f),
        Codes::Q5K => {
            let low = shift(bytes(48 + QK * (j / 2)), 4 * (j % 2));
            let bits = _mm256_test_epi8_mask(bytes(16), splat((1u8 << j) as i8));
            merge(low, fifth(bits))
        }
        Codes::Q6K => {
            let low = shift(bytes(64 * h + QK * (s & 1)), 4 * (s / 2));
            // Rotating each 32-bit lane left by `4 - 2s` moves bits `2s` and
            // `2s + 1` of every byte to bits 4 and 5 of the same byte.
            let rotation = _mm256_set1_epi32((4 - 2 * s as i32).rem_euclid(32));
            let high = mask(_mm256_rolv_epi32(bytes(128 + QK * h), rotation), 0x30);
            _mm256_sub_epi8(merge(low, high), splat(32))
        }
        Codes::Q3K => {
            let low = mask(shift(bytes(32 + QK * h), 2 * s), 3);
            // `(low | 4 * bit) - 4`: `low - 4` where the bit is clear.
            let clear = _mm256_testn_epi8_mask(bytes(0), splat((1u8 << (4 * h + s)) as i8));
            _mm256_mask_sub_epi8(low, clear, low, splat(4))
        }
        Codes::Q2K => mask(shift(bytes(16 + QK * h), 2 * s), 3),
    }
}

/// 16 bytes of nibbles at `packed` spread over 32 bytes, the low nibbles
/// in bytes `0..16` and the high ones in `16..32`, each in the low four
/// bits of its byte (the high four are left to mask).
///
/// # Safety
/// 16 bytes are readable at `packed`; the CPU supports AVX2, AVX-512BW and
/// AVX-512VL.
#[inline(always)]
unsafe fn nibble_halves(packed: *const u8) -> __m256i {
    let both = _mm256_broadcastsi128_si256(_mm_loadu_si128(packed.cast()));
    // The upper copy's 16-bit lanes (8..16) shifted down by a nibble.
    _mm256_mask_srli_epi16::<4>(both, 0xff00, both)
}
