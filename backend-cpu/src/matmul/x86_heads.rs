//! The x86-64 kernels' decoding of block heads: each block's scale (and
//! minimum) as f32, with vectors for the formats that keep one f16 `d` per
//! block and for the k-quants' packed sub-block scales.

use std::arch::x86_64::*;

use super::formats::{BlockFormat, Codes, Head};
use super::tiles::{decode_block_heads_scalar, prefetch_ahead};
use super::x86::Avx2;

/// Decodes the run heads of a row. Formats with one f16 `d` (and `m`) at
/// the start of each block of one run go four blocks at a time: each
/// block's first two halves (`[d, m]` in Q4_1) are a dword of one vector,
/// and one F16C conversion and one 256-bit store make the four blocks'
/// heads. At one token these heads cost as much as the block's products
/// did, one block at a time. The k-quants
/// unpack a super-block's sub-block scales (and minimums) as bytes in one
/// vector, convert them together and multiply them by `d` (and `-dmin`),
/// the same products as their scalar [`BlockFormat::block_heads`]. The
/// others decode per block in scalar code.
///
/// # Safety
/// The CPU supports AVX2 and F16C.
#[inline(always)]
pub(super) unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
    let k_quant = matches!(
        F::CODES,
        Codes::Q2K | Codes::Q3K | Codes::Q4K | Codes::Q5K | Codes::Q6K
    );
    let one_run = F::RUNS == 1 && !F::HALVES && F::HEAD != Head::Custom;
    if F::ROW_HEAD != 0 || !(one_run || k_quant) {
        return decode_block_heads_scalar::<Avx2, F>(row, heads);
    }
    // The 8-byte load must stay inside the block.
    const { assert!(F::BLOCK_BYTES >= 8) };
    let per_block = F::RUNS * F::HEAD_FLOATS;
    let blocks = (heads.len() / per_block).min(row.len() / F::BLOCK_BYTES);
    let mut first = 0;
    if one_run {
        while first + FOUR <= blocks {
            // SAFETY: blocks `first..first + 4` and their heads are in
            // bounds by the choice of `blocks`.
            four_one_run_heads::<F>(row, first, heads.as_mut_ptr().add(2 * first));
            first += FOUR;
        }
    }
    for b in first..blocks {
        prefetch_ahead::<Avx2, F>(row, b, 1);
        // SAFETY: bytes `b * BLOCK_BYTES..` of a whole block and floats
        // `b * per_block..` of its heads are in bounds by the choice of
        // `blocks`.
        let block = row.as_ptr().add(b * F::BLOCK_BYTES);
        let out = heads.as_mut_ptr().add(b * per_block);
        if k_quant {
            k_quant_heads::<F>(block, out);
            continue;
        }
        let halves = _mm_cvtph_ps(_mm_loadl_epi64(block.cast()));
        let head = match F::HEAD {
            // [d, factor * d]
            Head::Scaled(factor) => _mm_mul_ps(
                _mm_shuffle_ps::<0b00_00_00_00>(halves, halves),
                _mm_setr_ps(1.0, factor, 0.0, 0.0),
            ),
            Head::Stored | Head::Custom => halves,
        };
        _mm_storel_epi64(out.cast(), _mm_castps_si128(head));
    }
}

/// Blocks whose heads [`four_one_run_heads`] decodes together.
const FOUR: usize = 4;

/// The heads `[d, offset]` of blocks `first..first + 4` of `row`, a format
/// of one run per block whose f16 `d` (and `m`) lead the block, into
/// `heads` (8 floats); the same values as [`BlockFormat::block_heads`].
/// Prefetches the bytes ahead of the four ([`prefetch_ahead`]).
///
/// # Safety
/// The four blocks are in `row` and 8 floats are writable at `heads`; the
/// CPU supports AVX2 and F16C.
#[inline(always)]
unsafe fn four_one_run_heads<F: BlockFormat>(row: &[u8], first: usize, heads: *mut f32) {
    prefetch_ahead::<Avx2, F>(row, first, FOUR);
    let start = row.as_ptr().add(first * F::BLOCK_BYTES);
    let word = |b: usize| start.add(b * F::BLOCK_BYTES).cast::<i32>().read_unaligned();
    let halves = _mm256_cvtph_ps(_mm_setr_epi32(word(0), word(1), word(2), word(3)));
    let pairs = match F::HEAD {
        // [d, factor * d] from [d, _].
        Head::Scaled(factor) => _mm256_mul_ps(
            _mm256_moveldup_ps(halves),
            _mm256_setr_ps(1.0, factor, 1.0, factor, 1.0, factor, 1.0, factor),
        ),
        Head::Stored => halves,
        Head::Custom => unreachable!("not a one-run format"),
    };
    _mm256_storeu_ps(heads, pairs);
}

/// The heads of one k-quant super-block at `block` into `heads`
/// (`RUNS * HEAD_FLOATS` floats), as [`BlockFormat::block_heads`] decodes
/// them (`tandem_core::quant::kquant` has the layouts).
///
/// # Safety
/// A whole block of format `F` is readable at `block` and its heads are
/// writable at `heads`; the CPU supports AVX2 and F16C.
#[inline(always)]
unsafe fn k_quant_heads<F: BlockFormat>(block: *const u8, heads: *mut f32) {
    let word = |at: usize| block.add(at).cast::<u32>().read_unaligned();
    // `[d, -dmin]` from the f16 pair at `at`, repeated.
    let d_dmin = |at: usize| {
        let pair = _mm_cvtph_ps(_mm_cvtsi32_si128(word(at) as i32));
        let pair = _mm_mul_ps(pair, _mm_setr_ps(1.0, -1.0, 0.0, 0.0));
        _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(pair)))
    };
    // `d` from the f16 at `at`, repeated.
    let d = |at: usize| {
        let bits = block.add(at).cast::<u16>().read_unaligned();
        _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))))
    };
    match F::CODES {
        Codes::Q4K | Codes::Q5K => {
            // `k4_heads`' words, the scales then the minimums of sub-blocks
            // 0..4 and 4..8, interleaved per sub-block.
            const LOW6: u32 = 0x3f3f_3f3f;
            const LOW4: u32 = 0x0f0f_0f0f;
            const TOP2: u32 = 0x0303_0303;
            let (w0, w1, w2) = (word(4), word(8), word(12));
            let bytes = _mm_setr_epi32(
                (w0 & LOW6) as i32,
                (w1 & LOW6) as i32,
                ((w2 & LOW4) | (((w0 >> 6) & TOP2) << 4)) as i32,
                (((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4)) as i32,
            );
            let pairs = _mm_shuffle_epi8(
                bytes,
                _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15),
            );
            store_byte_heads::<false, false>(pairs, d_dmin(0), heads);
        }
        Codes::Q2K => {
            // Per sub-block of 16, the scale in the low nibble and the
            // minimum in the high one.
            let packed = _mm_loadu_si128(block.cast());
            let low_nibbles = _mm_set1_epi8(0x0f);
            let scales = _mm_and_si128(packed, low_nibbles);
            let mins = _mm_and_si128(_mm_srli_epi16::<4>(packed), low_nibbles);
            let d_dmin = d_dmin(80);
            store_byte_heads::<false, false>(_mm_unpacklo_epi8(scales, mins), d_dmin, heads);
            let high = heads.add(16);
            store_byte_heads::<false, false>(_mm_unpackhi_epi8(scales, mins), d_dmin, high);
        }
        Codes::Q6K => {
            let scales = _mm_loadu_si128(block.add(192).cast());
            store_byte_heads::<true, true>(scales, d(208), heads);
        }
        Codes::Q3K => {
            // `q3k_scales` word by word: the low four bits of scales 0..8
            // and 8..16, then the top two of each.
            const LOW4: u32 = 0x0f0f_0f0f;
            const LOW2: u32 = 0x0303_0303;
            let (a, b, c) = (word(96), word(100), word(104));
            let scales = _mm_setr_epi32(
                ((a & LOW4) | ((c & LOW2) << 4)) as i32,
                ((b & LOW4) | (((c >> 2) & LOW2) << 4)) as i32,
                (((a >> 4) & LOW4) | (((c >> 4) & LOW2) << 4)) as i32,
                (((b >> 4) & LOW4) | (((c >> 6) & LOW2) << 4)) as i32,
            );
            let scales = _mm_sub_epi8(scales, _mm_set1_epi8(32));
            store_byte_heads::<true, true>(scales, d(108), heads);
        }
        _ => unreachable!("not a k-quant"),
    }
}

/// Sixteen bytes of sub-block scales (or interleaved scales and minimums)
/// converted to f32 and multiplied lane by lane by `factors` (repeated per
/// eight), stored at `heads`; with `ZERO_OFFSETS` each product is followed
/// by a 0 offset. `SIGNED` takes the bytes as `i8`.
///
/// # Safety
/// 16 floats (32 with `ZERO_OFFSETS`) are writable at `heads`; the CPU
/// supports AVX2.
#[inline(always)]
unsafe fn store_byte_heads<const SIGNED: bool, const ZERO_OFFSETS: bool>(
    bytes: __m128i,
    factors: __m256,
    heads: *mut f32,
) {
    for (i, eight) in [bytes, _mm_unpackhi_epi64(bytes, bytes)]
        .into_iter()
        .enumerate()
    {
        let ints = if SIGNED {
            _mm256_cvtepi8_epi32(eight)
        } else {
            _mm256_cvtepu8_epi32(eight)
        };
        let values = _mm256_mul_ps(_mm256_cvtepi32_ps(ints), factors);
        if ZERO_OFFSETS {
            // Each f32 zero-extended to 64 bits: the value, then 0.0.
            let values = _mm256_castps_si256(values);
            let low = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(values));
            let high = _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(values));
            _mm256_storeu_si256(heads.add(16 * i).cast(), low);
            _mm256_storeu_si256(heads.add(16 * i + 8).cast(), high);
        } else {
            _mm256_storeu_ps(heads.add(8 * i), values);
        }
    }
}
