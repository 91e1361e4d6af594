//! The quantized weight formats as the micro-kernels see them.
//!
//! After `ROW_HEAD` bytes, a row is blocks of `BLOCK_BYTES`, each holding
//! `RUNS` runs of 32 elements. Run `b` of a row is one 32-element integer
//! dot product with activation block `b`: the run decodes to 32 small
//! integer codes ([`Codes`] says how they are stored) and a head,
//! `[scale, offset]`, so that element `i` is `scale * code_i + offset`.
//! Formats whose sub-blocks are 16 elements long (Q2_K, Q3_K, Q6_K) have
//! `HALVES`: one `[scale, offset]` per 16-element half of a run, the run's
//! dot product being split in two sums scaled separately, and their offsets
//! taking the activations' sums per half.

use tandem_core::quant::kquant::q3k_scales;
use tandem_core::quant::{WeightFormat, IQ4NL_VALUES, QK};

use super::tiles::MicroKernels;

/// How the 32 codes of a run are stored.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Codes {
    /// 32 signed bytes (Q8_0, INT8).
    Bytes,
    /// 16 bytes of nibbles, unsigned; elements `0..16` are the low nibbles
    /// (Q4_0, Q4_1, INT4).
    Nibbles,
    /// Nibbles with a fifth bit, bit `i` of the `u32` just before them
    /// (Q5_0, Q5_1): unsigned, `0..32`.
    Nibbles5,
    /// Nibbles indexing `IQ4NL_VALUES`: signed.
    NonLinear,
    /// Run `j` of a k-quant super-block, as `tandem_core::quant::kquant`
    /// lays it out: Q2_K's 2-bit and Q4_K's and Q5_K's codes unsigned,
    /// Q3_K's (`q - 4`) and Q6_K's (`q - 32`) signed.
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// Where a block's head comes from.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Head {
    /// `[d, factor * d]` from the f16 `d` at the block's start.
    Scaled(f32),
    /// `[d, m]` from the f16 pair at the block's start.
    Stored,
    /// Decoded by the format's own [`BlockFormat::block_heads`].
    Custom,
}

/// A quantized row format (see the module documentation).
pub(super) trait BlockFormat {
    const ROW_HEAD: usize = 0;
    const BLOCK_BYTES: usize;
    /// 32-element runs per block.
    const RUNS: usize = 1;
    const CODES: Codes;
    /// Byte offset of the first run's codes in a block, for the formats of
    /// 32-element runs (the k-quants' layouts are fixed by [`Codes`]).
    const QUANTS_AT: usize = 0;
    const HEAD: Head = Head::Custom;
    /// Whether values have an offset term (`offset * sum(x)`).
    const OFFSET: bool;
    /// One `[scale, offset]` per 16-element half of a run.
    const HALVES: bool = false;
    /// Floats of head per run.
    const HEAD_FLOATS: usize = if Self::HALVES { 4 } else { 2 };

    /// Bytes of a row of `runs` runs.
    #[inline(always)]
    fn row_bytes(runs: usize) -> usize {
        Self::ROW_HEAD + runs / Self::RUNS * Self::BLOCK_BYTES
    }

    /// Byte offset in its row of the block holding run `b`.
    #[inline(always)]
    fn block_at(b: usize) -> usize {
        Self::ROW_HEAD + b / Self::RUNS * Self::BLOCK_BYTES
    }

    /// The heads of the runs of block `k` of `row`: `RUNS * HEAD_FLOATS`
    /// floats into `heads`.
    ///
    /// # Safety
    /// The CPU supports `K`'s instruction set.
    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        let block = &row[Self::ROW_HEAD + k * Self::BLOCK_BYTES..];
        let d = K::f16_to_f32(f16_bits(block, 0));
        let offset = match Self::HEAD {
            Head::Scaled(factor) => factor * d,
            Head::Stored => K::f16_to_f32(f16_bits(block, 2)),
            Head::Custom => 0.0,
        };
        for head in heads.chunks_exact_mut(2).take(Self::RUNS) {
            (head[0], head[1]) = (d, offset);
        }
    }
}

fn f16_bits(block: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([block[at], block[at + 1]])
}

/// The block formats with integer kernels, one type each below.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BlockKind {
    Q8_0,
    Q4_0,
    Q4_1,
    Int8,
    Int4G64,
    Int4G128,
    Q5_0,
    Q5_1,
    Iq4Nl,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockKind {
    /// The kind of `format`, `None` for the float formats and W8A8.
    pub(super) fn of(format: WeightFormat) -> Option<Self> {
        use tandem_core::quant::Int4Group;
        Some(match format {
            WeightFormat::Q8_0 => BlockKind::Q8_0,
            WeightFormat::Q4_0 => BlockKind::Q4_0,
            WeightFormat::Q4_1 => BlockKind::Q4_1,
            WeightFormat::Int8PerChannel => BlockKind::Int8,
            WeightFormat::Int4 {
                group: Int4Group::G64,
            } => BlockKind::Int4G64,
            WeightFormat::Int4 {
                group: Int4Group::G128,
            } => BlockKind::Int4G128,
            WeightFormat::Q5_0 => BlockKind::Q5_0,
            WeightFormat::Q5_1 => BlockKind::Q5_1,
            WeightFormat::IQ4_NL => BlockKind::Iq4Nl,
            WeightFormat::Q2_K => BlockKind::Q2K,
            WeightFormat::Q3_K => BlockKind::Q3K,
            WeightFormat::Q4_K => BlockKind::Q4K,
            WeightFormat::Q5_K => BlockKind::Q5K,
            WeightFormat::Q6_K => BlockKind::Q6K,
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::W8A8 => {
                return None
            }
        })
    }

    /// Whether the kernels take the activations' sums per 16-element half.
    pub(super) fn needs_half_sums(self) -> bool {
        self == BlockKind::Q2K
    }
}

/// Runs `$body` with the type alias `$f` naming the [`BlockFormat`] of
/// `$kind`, so that one generic call covers every block format.
macro_rules! with_block_format {
    ($kind:expr, $f:ident => $body:expr) => {{
        use $crate::matmul::formats as fmt;
        match $kind {
            fmt::BlockKind::Q8_0 => {
                type $f = fmt::Q8_0;
                $body
            }
            fmt::BlockKind::Q4_0 => {
                type $f = fmt::Q4_0;
                $body
            }
            fmt::BlockKind::Q4_1 => {
                type $f = fmt::Q4_1;
                $body
            }
            fmt::BlockKind::Int8 => {
                type $f = fmt::Int8Rows;
                $body
            }
            fmt::BlockKind::Int4G64 => {
                type $f = fmt::Int4<64>;
                $body
            }
            fmt::BlockKind::Int4G128 => {
                type $f = fmt::Int4<128>;
                $body
            }
            fmt::BlockKind::Q5_0 => {
                type $f = fmt::Q5_0;
                $body
            }
            fmt::BlockKind::Q5_1 => {
                type $f = fmt::Q5_1;
                $body
            }
            fmt::BlockKind::Iq4Nl => {
                type $f = fmt::Iq4Nl;
                $body
            }
            fmt::BlockKind::Q2K => {
                type $f = fmt::Q2K;
                $body
            }
            fmt::BlockKind::Q3K => {
                type $f = fmt::Q3K;
                $body
            }
            fmt::BlockKind::Q4K => {
                type $f = fmt::Q4K;
                $body
            }
            fmt::BlockKind::Q5K => {
                type $f = fmt::Q5K;
                $body
            }
            fmt::BlockKind::Q6K => {
                type $f = fmt::Q6K;
                $body
            }
        }
    }};
}
pub(super) use with_block_format;

pub(super) struct Q8_0;
pub(super) struct Q4_0;
pub(super) struct Q4_1;
/// INT8 weight-only rows: the row's f32 scale heads every run.
pub(super) struct Int8Rows;
/// INT4 with groups of `GROUP` elements: Q4_1 blocks sharing one `[d, m]`.
pub(super) struct Int4<const GROUP: usize>;
pub(super) struct Q5_0;
pub(super) struct Q5_1;
pub(super) struct Iq4Nl;
pub(super) struct Q2K;
pub(super) struct Q3K;
pub(super) struct Q4K;
pub(super) struct Q5K;
pub(super) struct Q6K;

impl BlockFormat for Q8_0 {
    const BLOCK_BYTES: usize = 34;
    const CODES: Codes = Codes::Bytes;
    const QUANTS_AT: usize = 2;
    const HEAD: Head = Head::Scaled(0.0);
    const OFFSET: bool = false;
}

impl BlockFormat for Q4_0 {
    const BLOCK_BYTES: usize = 18;
    const CODES: Codes = Codes::Nibbles;
    const QUANTS_AT: usize = 2;
    // `d * (nib - 8)`: the nibbles are taken unsigned.
    const HEAD: Head = Head::Scaled(-8.0);
    const OFFSET: bool = true;
}

impl BlockFormat for Q4_1 {
    const BLOCK_BYTES: usize = 20;
    const CODES: Codes = Codes::Nibbles;
    const QUANTS_AT: usize = 4;
    const HEAD: Head = Head::Stored;
    const OFFSET: bool = true;
}

impl BlockFormat for Int8Rows {
    const ROW_HEAD: usize = 4;
    const BLOCK_BYTES: usize = QK;
    const CODES: Codes = Codes::Bytes;
    const OFFSET: bool = false;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], _k: usize, heads: &mut [f32]) {
        (heads[0], heads[1]) = (f32::from_le_bytes([row[0], row[1], row[2], row[3]]), 0.0);
    }
}

impl<const GROUP: usize> BlockFormat for Int4<GROUP> {
    const BLOCK_BYTES: usize = 4 + GROUP / 2;
    const RUNS: usize = GROUP / QK;
    const CODES: Codes = Codes::Nibbles;
    const QUANTS_AT: usize = 4;
    const HEAD: Head = Head::Stored;
    const OFFSET: bool = true;
}

impl BlockFormat for Q5_0 {
    const BLOCK_BYTES: usize = 22;
    const CODES: Codes = Codes::Nibbles5;
    const QUANTS_AT: usize = 6;
    // `d * (q5 - 16)`, the codes taken unsigned.
    const HEAD: Head = Head::Scaled(-16.0);
    const OFFSET: bool = true;
}

impl BlockFormat for Q5_1 {
    const BLOCK_BYTES: usize = 24;
    const CODES: Codes = Codes::Nibbles5;
    const QUANTS_AT: usize = 8;
    const HEAD: Head = Head::Stored;
    const OFFSET: bool = true;
}

impl BlockFormat for Iq4Nl {
    const BLOCK_BYTES: usize = 18;
    const CODES: Codes = Codes::NonLinear;
    const QUANTS_AT: usize = 2;
    const HEAD: Head = Head::Scaled(0.0);
    const OFFSET: bool = false;
}

/// Q4_K's and Q5_K's heads: per sub-block of 32, `[d * sc, -dmin * mn]`.
/// The eight 6-bit scales and minimums are unpacked four at a time from
/// the three words of `scales`, as `scale_min_k4` reads them one by one.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn k4_heads<K: MicroKernels>(block: &[u8], heads: &mut [f32]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let (d, dmin) = (
        K::f16_to_f32(f16_bits(block, 0)),
        K::f16_to_f32(f16_bits(block, 2)),
    );
    let word = |i: usize| {
        let at = 4 + 4 * i;
        u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
    };
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let bytes = |low: u32, high: u32| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&low.to_le_bytes());
        out[4..].copy_from_slice(&high.to_le_bytes());
        out
    };
    let sc = bytes(w0 & LOW6, (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4));
    let mn = bytes(w1 & LOW6, ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4));
    for (head, (&sc, &mn)) in heads.chunks_exact_mut(2).zip(sc.iter().zip(&mn)) {
        (head[0], head[1]) = (d * sc as f32, -dmin * mn as f32);
    }
}

impl BlockFormat for Q4K {
    const BLOCK_BYTES: usize = 144;
    const RUNS: usize = 8;
    const CODES: Codes = Codes::Q4K;
    const OFFSET: bool = true;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        k4_heads::<K>(&row[k * Self::BLOCK_BYTES..], heads)
    }
}

impl BlockFormat for Q5K {
    const BLOCK_BYTES: usize = 176;
    const RUNS: usize = 8;
    const CODES: Codes = Codes::Q5K;
    const OFFSET: bool = true;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        k4_heads::<K>(&row[k * Self::BLOCK_BYTES..], heads)
    }
}

impl BlockFormat for Q6K {
    const BLOCK_BYTES: usize = 210;
    const RUNS: usize = 8;
    const CODES: Codes = Codes::Q6K;
    const OFFSET: bool = false;
    const HALVES: bool = true;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        let block = &row[k * Self::BLOCK_BYTES..][..Self::BLOCK_BYTES];
        let d = K::f16_to_f32(f16_bits(block, 208));
        for (head, &sc) in heads.chunks_exact_mut(2).zip(&block[192..208]) {
            (head[0], head[1]) = (d * (sc as i8) as f32, 0.0);
        }
    }
}

impl BlockFormat for Q3K {
    const BLOCK_BYTES: usize = 110;
    const RUNS: usize = 8;
    const CODES: Codes = Codes::Q3K;
    const OFFSET: bool = false;
    const HALVES: bool = true;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        let block = &row[k * Self::BLOCK_BYTES..][..Self::BLOCK_BYTES];
        let d = K::f16_to_f32(f16_bits(block, 108));
        for (head, sc) in heads.chunks_exact_mut(2).zip(q3k_scales(&block[96..108])) {
            (head[0], head[1]) = (d * (sc as i32 - 32) as f32, 0.0);
        }
    }
}

impl BlockFormat for Q2K {
    const BLOCK_BYTES: usize = 84;
    const RUNS: usize = 8;
    const CODES: Codes = Codes::Q2K;
    const OFFSET: bool = true;
    const HALVES: bool = true;

    #[inline(always)]
    unsafe fn block_heads<K: MicroKernels>(row: &[u8], k: usize, heads: &mut [f32]) {
        let block = &row[k * Self::BLOCK_BYTES..][..Self::BLOCK_BYTES];
        let (d, dmin) = (
            K::f16_to_f32(f16_bits(block, 80)),
            K::f16_to_f32(f16_bits(block, 82)),
        );
        for (head, &sc) in heads.chunks_exact_mut(2).zip(&block[..16]) {
            (head[0], head[1]) = (d * (sc & 0x0f) as f32, -dmin * (sc >> 4) as f32);
        }
    }
}

/// The 32 codes of run `j` of `block` as integers, in scalar code (the
/// portable kernels; the x86 kernels decode the same with vectors).
#[inline(always)]
pub(super) fn run_codes<F: BlockFormat>(block: &[u8], j: usize) -> [i8; QK] {
    let nibble = |q: &[u8], i: usize| {
        let byte = q[i % (QK / 2)];
        if i < QK / 2 {
            byte & 0x0f
        } else {
            byte >> 4
        }
    };
    let (h, s) = (j / 4, j % 4);
    match F::CODES {
        Codes::Bytes => std::array::from_fn(|i| block[F::QUANTS_AT + QK * j + i] as i8),
        Codes::Nibbles => {
            let q = &block[F::QUANTS_AT + QK / 2 * j..];
            std::array::from_fn(|i| nibble(q, i) as i8)
        }
        Codes::Nibbles5 => {
            let q = &block[F::QUANTS_AT..];
            let at = F::QUANTS_AT - 4;
            let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            std::array::from_fn(|i| (nibble(q, i) | (((qh >> i) & 1) as u8) << 4) as i8)
        }
        Codes::NonLinear => {
            let q = &block[F::QUANTS_AT..];
            std::array::from_fn(|i| IQ4NL_VALUES[nibble(q, i) as usize])
        }
        Codes::Q4K | Codes::Q5K => {
            let (qs_at, qh) = if F::CODES == Codes::Q5K {
                (48, Some(&block[16..48]))
            } else {
                (16, None)
            };
            let q = &block[qs_at + QK * (j / 2)..][..QK];
            std::array::from_fn(|l| {
                let nib = if j.is_multiple_of(2) {
                    q[l] & 0x0f
                } else {
                    q[l] >> 4
                };
                let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                (nib | high) as i8
            })
        }
        Codes::Q6K => {
            let ql = &block[64 * h + QK * (s & 1)..][..QK];
            let qh = &block[128 + QK * h..][..QK];
            std::array::from_fn(|l| {
                let low = if s < 2 { ql[l] & 0x0f } else { ql[l] >> 4 };
                let high = (qh[l] >> (2 * s)) & 3;
                (low | (high << 4)) as i8 - 32
            })
        }
        Codes::Q3K => {
            let qs = &block[32 + QK * h..][..QK];
            std::array::from_fn(|l| {
                let low = (qs[l] >> (2 * s)) & 3;
                let high = (block[l] >> (4 * h + s)) & 1;
                (low | (high << 2)) as i8 - 4
            })
        }
        Codes::Q2K => {
            let qs = &block[16 + QK * h..][..QK];
            std::array::from_fn(|l| ((qs[l] >> (2 * s)) & 3) as i8)
        }
    }
}
