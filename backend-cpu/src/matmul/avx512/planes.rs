//! The AVX-512 byte-plane kernel, for the one-block-per-run formats whose
//! codes are bytes or less: the nibble formats (Q4_0, Q4_1, Q5_0, Q5_1:
//! the Q4_K_M files of Qwen2.5 and Gemma 3 hold most of their layers'
//! weights in Q5_0, SmolLM2's file is Q4_1) and Q8_0 (their output
//! matrices, a third of what a decode step reads).
//!
//! The codes stay bytes: the 16-bit activations are split into byte
//! planes, the low bytes (unsigned) and the high bytes (signed), and
//! `vpdpbusd` sums four products of the codes with each:
//! `a · u = 256 (hi · u) + lo · u`, exact in i32. `vpdpbusd` takes one
//! unsigned and one signed operand: the nibble formats' codes (below 16,
//! or 32 with the fifth bit) are both; Q8_0's signed bytes meet the low
//! plane as they are and the high plane flipped to unsigned, `c + 128`,
//! whose products' excess `128 hi` the lane's high-plane sum takes off.
//! A quad of nibble blocks unpacks from two loads with three byte
//! permutes (nibbles, fifth bits, `d` and `m`) and a few bitwise
//! operations, a quad of Q8_0 blocks from four loads and three permutes,
//! where the i16 kernel ([`super::block_tile_512`]) widens the codes and
//! permutes them into its group layout and a pass of its own decodes the
//! heads. The single-token (decode) kernel, which unpacks every block it
//! reads, does about half the vector work per block.
//!
//! Layout. Runs are taken four at a time, a quad, a row's last quad padded
//! with zero runs. Code vector `c0` holds the low nibbles (Q8_0: the first
//! 16 codes) of the quad's four blocks as they lie in them, byte `16 r + i`
//! element `i` of run `r`; `c1` the high nibbles (the last 16 codes), byte
//! `16 r + i` element `16 + i`. So i32 lane `k` of either sums products of
//! run `k / 4` alone (elements `4 m..4 m + 4` and `16 + 4 m..16 + 4 m + 4`,
//! `m = k % 4`), and one multiply-add by the runs' scales, each repeated
//! over its four lanes, applies them; the offsets (`m`, Q4_1 and Q5_1) are
//! added in lane `4 r`. Activations come in the same order
//! ([`to_planes`]): per quad, the low-byte planes of `c0`'s and `c1`'s
//! elements, their high-byte planes, each lane's activation sum negated,
//! which times the zero point (Q4_0's 8, Q5_0's 16) starts the lane's sum
//! so that it is `sum (u - zero) a` (at most 8 * 16 * 32767 in magnitude),
//! the blocks' scales over their lanes, their scaled sums in lane `4 r`,
//! and each lane's high-plane sum negated (Q8_0's correction).

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::super::formats::{BlockFormat, Codes, Head};
use super::super::quantize::{BlockQuants, QuantRow};
use super::layout::zero_point;
use super::QUAD;

/// Activation blocks per quad in the plane form: four byte planes, the
/// lanes' negated sums, the scales, the scaled sums and the lanes' negated
/// high-plane sums.
pub(in super::super) const PLANES: usize = 8;

/// Whether format `F` takes this kernel: 32-element blocks of nibbles
/// (and fifth bits) behind their f16 `d` (and `m`), at most 24 bytes each
/// so that a quad's lie within two 64-byte loads, and Q8_0's.
pub(in super::super) fn takes_plane_kernel<F: BlockFormat>() -> bool {
    let nibbles = matches!(F::CODES, Codes::Nibbles | Codes::Nibbles5)
        && F::BLOCK_BYTES <= 24
        && matches!(F::HEAD, Head::Scaled(_) | Head::Stored);
    let bytes = F::CODES == Codes::Bytes
        && F::BLOCK_BYTES == BYTES_BLOCK
        && F::QUANTS_AT == 2
        && F::HEAD == Head::Scaled(0.0);
    (nibbles || bytes) && F::RUNS == 1 && F::ROW_HEAD == 0
}

/// Bytes of a Q8_0 block: its f16 `d`, then 32 signed bytes.
const BYTES_BLOCK: usize = 34;

/// Where the second pair of loads of a quad of Q8_0 blocks starts: the
/// high halves of its four runs' codes lie in the 128 bytes from there.
const SECOND_LOADS_AT: usize = 8;

/// Whether `F`'s blocks store an offset `m` (Q4_1, Q5_1).
fn stored_offsets<F: BlockFormat>() -> bool {
    F::HEAD == Head::Stored
}

/// Quads of a row of `runs` runs.
fn quads(runs: usize) -> usize {
    runs.div_ceil(QUAD)
}

/// Activation blocks a row of `runs` runs takes in the plane form.
pub(in super::super) fn plane_blocks(runs: usize) -> usize {
    PLANES * quads(runs)
}

/// Blocks of repacked weights per quad: `c0`, `c1` and the scales, and
/// the offsets where `F` stores them.
fn quad_blocks<F: BlockFormat>() -> usize {
    if stored_offsets::<F>() {
        4
    } else {
        3
    }
}

/// Blocks of repacked weights a row of `runs` runs of `F` takes.
pub(in super::super) fn code_blocks<F: BlockFormat>(runs: usize) -> usize {
    quad_blocks::<F>() * quads(runs)
}

/// A 64-byte table whose byte `$j` is `$entry` (a loop: `const` contexts
/// have no iterators).
macro_rules! byte_table {
    ($j:ident => $entry:expr) => {{
        let mut table = [0u8; 64];
        let mut $j = 0;
        while $j < 64 {
            table[$j] = $entry as u8;
            $j += 1;
        }
        table
    }};
}

/// The byte permutes that unpack a quad of `F`'s blocks from two 64-byte
/// loads of their bytes (indices from 64 pick from the second), and
/// Q8_0's last 16 codes of each run from two more, [`SECOND_LOADS_AT`]
/// further (its quad of 136 bytes does not fit two).
struct Tables<F>(PhantomData<F>);

impl<F: BlockFormat> Tables<F> {
    /// Byte `16 r + i`: byte `i` of run `r`'s codes (nibbles, or Q8_0's
    /// low half).
    const CODES: [u8; 64] = byte_table!(j => (j / 16) * F::BLOCK_BYTES + F::QUANTS_AT + j % 16);
    /// Byte `16 r + i`: Q8_0's code `16 + i` of run `r`, from the loads at
    /// [`SECOND_LOADS_AT`]. (Saturating, as `FIFTH_BITS`.)
    const HIGH_BYTES: [u8; 64] = byte_table!(j => ((j / 16) * F::BLOCK_BYTES + F::QUANTS_AT + 16 + j % 16).saturating_sub(SECOND_LOADS_AT));
    /// Quadwords `2 r` and `2 r + 1`: run `r`'s fifth bits (the `u32` just
    /// before its nibbles) in their low half. (Saturating: the table is
    /// built for every format, used for those with fifth bits.)
    const FIFTH_BITS: [u8; 64] = byte_table!(j => if j % 8 < 4 {
        (j / 16) * F::BLOCK_BYTES + F::QUANTS_AT.saturating_sub(4) + j % 4
    } else {
        0
    });
    /// Words `0..16`: `d` of run `k / 4` for word `k`; words `16..32`: `m`,
    /// the f16 after it.
    const HEADS: [u8; 64] =
        byte_table!(j => (j / 2 % 16 / 4) * F::BLOCK_BYTES + 2 * (j / 32) + j % 2);
}

/// Per mask bit `16 r + i`, the bit of run `r`'s fifth bits (in quadwords
/// `2 r` and `2 r + 1`) that `c0`'s byte takes: bit `i`.
const C0_BITS: [u8; 64] = byte_table!(j => j % 16);
/// The same for `c1`'s bytes: bit `16 + i`.
const C1_BITS: [u8; 64] = byte_table!(j => 16 + j % 16);

/// A quad's weights as the kernel reads them.
#[derive(Clone, Copy)]
struct Quad {
    c0: __m512i,
    c1: __m512i,
    /// Each run's `d` over its four lanes.
    scales: __m512,
    /// Each run's `m` over its four lanes, with stored offsets (zeros
    /// otherwise).
    offsets: __m512,
}

/// The unpacking of `F`'s blocks, its tables loaded once per tile.
struct Unpack<F> {
    codes: __m512i,
    high_bytes: __m512i,
    fifth_bits: __m512i,
    heads: __m512i,
    c0_bits: __m512i,
    c1_bits: __m512i,
    format: PhantomData<F>,
}

impl<F: BlockFormat> Unpack<F> {
    /// # Safety
    /// The CPU supports AVX-512 F.
    #[inline(always)]
    unsafe fn new() -> Self {
        Unpack {
            codes: _mm512_loadu_si512(Tables::<F>::CODES.as_ptr().cast()),
            high_bytes: _mm512_loadu_si512(Tables::<F>::HIGH_BYTES.as_ptr().cast()),
            fifth_bits: _mm512_loadu_si512(Tables::<F>::FIFTH_BITS.as_ptr().cast()),
            heads: _mm512_loadu_si512(Tables::<F>::HEADS.as_ptr().cast()),
            c0_bits: _mm512_loadu_si512(C0_BITS.as_ptr().cast()),
            c1_bits: _mm512_loadu_si512(C1_BITS.as_ptr().cast()),
            format: PhantomData,
        }
    }

    /// The quad that starts at run `first` of `row` (`runs` runs), the
    /// codes and heads of missing runs zero. The only unpacking: repacked
    /// weights are its output stored, so a token's result does not depend
    /// on which the kernel read.
    ///
    /// # Safety
    /// `row` holds `runs` runs and `first < runs`; the CPU supports AVX-512
    /// F, BW, VBMI and BITALG and F16C.
    #[inline(always)]
    unsafe fn quad(&self, row: &[u8], runs: usize, first: usize) -> Quad {
        let at = row.as_ptr().add(F::block_at(first));
        // Masked loads: no byte past the quad's blocks is read, so none
        // past the row (the second reads none where they end in the first).
        let len = F::BLOCK_BYTES * (runs - first).min(QUAD);
        let low = _mm512_maskz_loadu_epi8(bytes(len), at.cast());
        let high =
            _mm512_maskz_loadu_epi8(bytes(len.saturating_sub(64)), at.wrapping_add(64).cast());
        let heads = _mm512_permutex2var_epi8(low, self.heads, high);
        let scales = _mm512_cvtph_ps(_mm512_castsi512_si256(heads));
        let offsets = if stored_offsets::<F>() {
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(heads))
        } else {
            _mm512_setzero_ps()
        };
        let packed = _mm512_permutex2var_epi8(low, self.codes, high);
        if F::CODES == Codes::Bytes {
            // Signed codes: the kernel flips them for the high plane.
            let rest = len.saturating_sub(SECOND_LOADS_AT);
            let at = at.wrapping_add(SECOND_LOADS_AT);
            let low = _mm512_maskz_loadu_epi8(bytes(rest), at.cast());
            let high =
                _mm512_maskz_loadu_epi8(bytes(rest.saturating_sub(64)), at.wrapping_add(64).cast());
            return Quad {
                c0: packed,
                c1: _mm512_permutex2var_epi8(low, self.high_bytes, high),
                scales,
                offsets,
            };
        }
        let nibble = _mm512_set1_epi8(0x0f);
        let high_nibbles = _mm512_srli_epi16::<4>(packed);
        if F::CODES == Codes::Nibbles {
            return Quad {
                c0: _mm512_and_si512(packed, nibble),
                c1: _mm512_and_si512(high_nibbles, nibble),
                scales,
                offsets,
            };
        }
        // The fifth bits as 16 in the bytes whose bit is set, merged with
        // the nibbles in one `vpternlogd`: `(nibbles & 0x0f) | fifth`. (A
        // masked add of 16 is taken apart by LLVM into an or and a blend.)
        let fifth = _mm512_permutex2var_epi8(low, self.fifth_bits, high);
        let sixteen = _mm512_set1_epi8(16);
        let c0_fifth = _mm512_bitshuffle_epi64_mask(fifth, self.c0_bits);
        let c1_fifth = _mm512_bitshuffle_epi64_mask(fifth, self.c1_bits);
        Quad {
            c0: _mm512_ternarylogic_epi32::<0b1110_1100>(
                packed,
                _mm512_maskz_mov_epi8(c0_fifth, sixteen),
                nibble,
            ),
            c1: _mm512_ternarylogic_epi32::<0b1110_1100>(
                high_nibbles,
                _mm512_maskz_mov_epi8(c1_fifth, sixteen),
                nibble,
            ),
            scales,
            offsets,
        }
    }
}

/// The mask of the first `n` bytes of a vector.
#[inline(always)]
fn bytes(n: usize) -> __mmask64 {
    if n >= 64 {
        !0
    } else {
        (1u64 << n) - 1
    }
}

/// The weights of `row` (of format `F`, `runs` runs) as the kernel reads
/// them, into `codes` ([`code_blocks`] blocks): per quad `c0`, `c1`, the
/// scales and, where `F` stores them, the offsets.
///
/// # Safety
/// `row` holds `runs` runs; the CPU supports AVX-512 F, BW, VBMI and
/// BITALG and F16C.
#[inline(always)]
pub(in super::super) unsafe fn repack_plane_codes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    codes: &mut [BlockQuants],
) {
    assert!(row.len() >= F::row_bytes(runs) && codes.len() >= code_blocks::<F>(runs));
    let unpack = Unpack::<F>::new();
    for q in 0..quads(runs) {
        let at: *mut __m512i = codes.as_mut_ptr().add(quad_blocks::<F>() * q).cast();
        let quad = unpack.quad(row, runs, QUAD * q);
        _mm512_store_si512(at.cast(), quad.c0);
        _mm512_store_si512(at.add(1).cast(), quad.c1);
        _mm512_store_ps(at.add(2).cast(), quad.scales);
        if stored_offsets::<F>() {
            _mm512_store_ps(at.add(3).cast(), quad.offsets);
        }
    }
}

/// Quad `q` of `codes` as [`repack_plane_codes`] stored it.
///
/// # Safety
/// `codes` holds quad `q`; the CPU supports AVX-512 F.
#[inline(always)]
unsafe fn repacked_quad<F: BlockFormat>(codes: &[BlockQuants], q: usize) -> Quad {
    let at: *const __m512i = codes.as_ptr().add(quad_blocks::<F>() * q).cast();
    Quad {
        c0: _mm512_load_si512(at.cast()),
        c1: _mm512_load_si512(at.add(1).cast()),
        scales: _mm512_load_ps(at.add(2).cast()),
        offsets: if stored_offsets::<F>() {
            _mm512_load_ps(at.add(3).cast())
        } else {
            _mm512_setzero_ps()
        },
    }
}

/// Rewrites each row of `quads` quads of activation blocks (in element
/// order, `QUAD * quads` blocks, a row's missing runs zero) with their
/// `[scale, sum]` stats into the plane form, `PLANES * quads` blocks per
/// row of `planes`.
///
/// # Safety
/// The CPU supports AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(in super::super) unsafe fn to_planes(
    blocks: &[BlockQuants],
    stats: &[f32],
    planes: &mut [BlockQuants],
    quads: usize,
) {
    let rows = planes.len() / (PLANES * quads);
    assert!(blocks.len() >= rows * QUAD * quads && stats.len() >= rows * 2 * QUAD * quads);
    let ones = _mm512_set1_epi8(1);
    for ((quad, stats), out) in blocks
        .chunks_exact(QUAD)
        .zip(stats.chunks_exact(2 * QUAD))
        .zip(planes.chunks_exact_mut(PLANES))
    {
        let at: *const __m512i = quad.as_ptr().cast();
        let mut low = [_mm256_setzero_si256(); QUAD];
        let mut high = [_mm256_setzero_si256(); QUAD];
        for r in 0..QUAD {
            let run = _mm512_load_si512(at.add(r).cast());
            low[r] = _mm512_cvtepi16_epi8(run);
            high[r] = _mm512_cvtepi16_epi8(_mm512_srai_epi16::<8>(run));
        }
        // 128-bit lanes `[r0 0..16, r0 16..32, r1 0..16, r1 16..32]` and the
        // same of runs 2 and 3; the first halves are lanes 0 and 2 of each
        // (`0x88`), the second halves lanes 1 and 3 (`0xdd`).
        let [low01, low23] = pairs(low);
        let [high01, high23] = pairs(high);
        let vectors = [
            _mm512_shuffle_i64x2::<0x88>(low01, low23),
            _mm512_shuffle_i64x2::<0xdd>(low01, low23),
            _mm512_shuffle_i64x2::<0x88>(high01, high23),
            _mm512_shuffle_i64x2::<0xdd>(high01, high23),
        ];
        // Each lane's sum, `256 * sum(high) + sum(low)`, as the kernel
        // sums its products.
        let zero = _mm512_setzero_si512();
        let low_sum = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(zero, vectors[0], ones),
            vectors[1],
            ones,
        );
        let high_sum = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(zero, ones, vectors[2]),
            ones,
            vectors[3],
        );
        let sums = _mm512_add_epi32(_mm512_slli_epi32::<8>(high_sum), low_sum);
        let out: *mut __m512i = out.as_mut_ptr().cast();
        for (v, vector) in vectors.into_iter().enumerate() {
            _mm512_store_si512(out.add(v).cast(), vector);
        }
        _mm512_store_si512(out.add(4).cast(), _mm512_sub_epi32(zero, sums));
        let (mut scales, mut scaled_sums) = ([0f32; 16], [0f32; 16]);
        for k in 0..16 {
            scales[k] = stats[2 * (k / 4)];
        }
        for r in 0..QUAD {
            scaled_sums[4 * r] = stats[2 * r + 1];
        }
        _mm512_store_ps(out.add(5).cast(), _mm512_loadu_ps(scales.as_ptr()));
        _mm512_store_ps(out.add(6).cast(), _mm512_loadu_ps(scaled_sums.as_ptr()));
        _mm512_store_si512(out.add(7).cast(), _mm512_sub_epi32(zero, high_sum));
    }
}

/// `[v0, v1]` and `[v2, v3]`, 512 bits each.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[inline(always)]
unsafe fn pairs(v: [__m256i; QUAD]) -> [__m512i; 2] {
    [
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v[0]), v[1]),
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v[2]), v[3]),
    ]
}

/// Element `i` of run `b` of `row`, a row of activation blocks in the plane
/// form.
#[cfg(test)]
pub(in super::super) fn plane_element(row: &[BlockQuants], b: usize, i: usize) -> i16 {
    let (q, r) = (b / QUAD, b % QUAD);
    let byte = |plane: usize| {
        let block = &row[PLANES * q + plane].0;
        let at = 16 * r + i % 16;
        block[at / 2].to_le_bytes()[at % 2]
    };
    let half = i / 16;
    i16::from_le_bytes([byte(half), byte(2 + half)])
}

/// Lane `k` of quad `q` of `row` in the plane form: the negated activation
/// sum, the scale, the scaled sum, the negated high-byte sum.
#[cfg(test)]
pub(in super::super) fn plane_lane(
    row: &[BlockQuants],
    q: usize,
    k: usize,
) -> (i32, f32, f32, i32) {
    let word = |plane: usize| {
        let block = &row[PLANES * q + plane].0;
        let [a, b] = block[2 * k].to_le_bytes();
        let [c, d] = block[2 * k + 1].to_le_bytes();
        [a, b, c, d]
    };
    (
        i32::from_le_bytes(word(4)),
        f32::from_le_bytes(word(5)),
        f32::from_le_bytes(word(6)),
        i32::from_le_bytes(word(7)),
    )
}

/// The byte-plane kernel: [`super::block_tile_512`]'s contract,
/// with activations in the plane form, weights from the rows (whose heads
/// it decodes itself: `w_heads` are not read) or repacked by
/// [`repack_plane_codes`].
///
/// # Safety
/// The CPU supports AVX2, FMA, F16C and AVX-512 F, BW, VL, VNNI, VBMI and
/// BITALG.
#[inline(always)]
pub(super) unsafe fn plane_tile_512<F: BlockFormat, const R: usize, const T: usize>(
    w: [&[u8]; R],
    w_codes: [&[BlockQuants]; R],
    x: [QuantRow<'_>; T],
) -> [[f32; T]; R] {
    let runs = x[0].blocks();
    let repacked = !w_codes[0].is_empty();
    if repacked {
        assert!(w_codes.iter().all(|c| c.len() >= code_blocks::<F>(runs)));
    } else {
        assert!(w.iter().all(|w| w.len() >= F::row_bytes(runs)));
    }
    assert!(x.iter().all(|x| x.quants.len() >= plane_blocks(runs)));
    // The zero point's shift, Q4_0's 3 or Q5_0's 4.
    let zero_shift = zero_point::<F>().map(|zero| (zero as u32).trailing_zeros());
    debug_assert!(zero_point::<F>().is_none_or(|zero| (zero as u32).is_power_of_two()));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let unpack = Unpack::<F>::new();
    for q in 0..quads(runs) {
        // SAFETY (all loads below): the lengths are asserted above, and
        // blocks are 64-byte aligned. No closures here: they would not
        // inherit the target features, and the intrinsics would not inline
        // into them.
        let mut weights = [Quad {
            c0: _mm512_setzero_si512(),
            c1: _mm512_setzero_si512(),
            scales: _mm512_setzero_ps(),
            offsets: _mm512_setzero_ps(),
        }; R];
        // The codes the high plane meets: Q8_0's flipped to unsigned, once
        // per row for the tile's tokens.
        let mut unsigned = [[_mm512_setzero_si512(); 2]; R];
        for r in 0..R {
            weights[r] = if repacked {
                repacked_quad::<F>(w_codes[r], q)
            } else {
                unpack.quad(w[r], runs, QUAD * q)
            };
            let Quad { c0, c1, .. } = weights[r];
            unsigned[r] = if F::CODES == Codes::Bytes {
                let flip = _mm512_set1_epi8(i8::MIN);
                [_mm512_xor_si512(c0, flip), _mm512_xor_si512(c1, flip)]
            } else {
                [c0, c1]
            };
        }
        for t in 0..T {
            let at: *const __m512i = x[t].quants.as_ptr().add(PLANES * q).cast();
            let [low0, low1, high0, high1] = [
                _mm512_load_si512(at.cast()),
                _mm512_load_si512(at.add(1).cast()),
                _mm512_load_si512(at.add(2).cast()),
                _mm512_load_si512(at.add(3).cast()),
            ];
            let start = match zero_shift {
                Some(shift) => _mm512_sll_epi32(
                    _mm512_load_si512(at.add(4).cast()),
                    _mm_cvtsi32_si128(shift as i32),
                ),
                None => _mm512_setzero_si512(),
            };
            // Q8_0's high-plane products take its codes flipped to
            // unsigned, `c + 128`: `-128` times the lane's high-plane sum
            // starts them.
            let high_start = if F::CODES == Codes::Bytes {
                _mm512_slli_epi32::<7>(_mm512_load_si512(at.add(7).cast()))
            } else {
                _mm512_setzero_si512()
            };
            let x_scales = _mm512_load_ps(at.add(5).cast());
            let x_sums = if stored_offsets::<F>() {
                _mm512_load_ps(at.add(6).cast())
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                let Quad {
                    c0,
                    c1,
                    scales,
                    offsets,
                } = weights[r];
                let [u0, u1] = unsigned[r];
                let high =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(high_start, u0, high0), u1, high1);
                let low = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, low0, c0), low1, c1);
                let sums = _mm512_add_epi32(_mm512_slli_epi32::<8>(high), low);
                let scales = _mm512_mul_ps(scales, x_scales);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scales, acc[r][t]);
                if stored_offsets::<F>() {
                    acc[r][t] = _mm512_fmadd_ps(offsets, x_sums, acc[r][t]);
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    out
}
