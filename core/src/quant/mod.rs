//! Weight storage formats and their layouts.
//!
//! Each format has exactly one layout, shared bit-for-bit by the CPU backend,
//! the WGSL shaders and the CUDA kernels. GGML's formats (F32 to Q4_1) are
//! identical to GGML's, so GGUF tensors are used in place (memory-mapped,
//! never repacked); the others are Tandem's own and travel in safetensors
//! files (`model::safetensors`). A weight matrix of `rows × cols` (`rows`
//! output features, `cols` input features) is stored row-major; each row is
//! an optional row head followed by `cols / block_elems` consecutive blocks.
//! All multi-byte fields are little-endian.
//!
//! | format     | row head    | block elems | block bytes | layout of one block                              | value of element `i`            |
//! |------------|-------------|-------------|-------------|--------------------------------------------------|---------------------------------|
//! | F32        | —           | 1           | 4           | `f32`                                            | as stored                       |
//! | F16        | —           | 1           | 2           | IEEE half                                        | as stored                       |
//! | BF16       | —           | 1           | 2           | bfloat16 (upper half of an f32)                  | as stored                       |
//! | Q8_0       | —           | 32          | 34          | `d: f16`, `qs: [i8; 32]`                         | `d * qs[i]`                     |
//! | Q4_0       | —           | 32          | 18          | `d: f16`, `qs: [u8; 16]`                         | `d * (nib(i) - 8)`              |
//! | Q4_1       | —           | 32          | 20          | `d: f16`, `m: f16`, `qs: [u8; 16]`               | `d * nib(i) + m`                |
//! | Q5_0       | —           | 32          | 22          | `d: f16`, `qh: u32`, `qs: [u8; 16]`              | `d * (q5(i) - 16)`              |
//! | Q5_1       | —           | 32          | 24          | `d: f16`, `m: f16`, `qh: u32`, `qs: [u8; 16]`    | `d * q5(i) + m`                 |
//! | IQ4_NL     | —           | 32          | 18          | `d: f16`, `qs: [u8; 16]`                         | `d * IQ4NL_VALUES[nib(i)]`      |
//! | Q2_K       | —           | 256         | 84          | see [`kquant`]                                   | `d*sc(j)*q2 - dmin*mn(j)`, j = i/16 |
//! | Q3_K       | —           | 256         | 110         | see [`kquant`]                                   | `d*(sc(j)-32)*(q3 - 4)`, j = i/16 |
//! | Q4_K       | —           | 256         | 144         | see [`kquant`]                                   | `d*sc(j)*q4 - dmin*mn(j)`, j = i/32 |
//! | Q5_K       | —           | 256         | 176         | see [`kquant`]                                   | `d*sc(j)*q5 - dmin*mn(j)`, j = i/32 |
//! | Q6_K       | —           | 256         | 210         | see [`kquant`]                                   | `d*sc(j)*(q6 - 32)`, j = i/16   |
//! | INT8       | `s: f32`    | 32          | 32          | `qs: [i8; 32]`                                   | `s * qs[i]`                     |
//! | W8A8       | `s: f32`    | 32          | 32          | `qs: [i8; 32]`                                   | `s * qs[i]`                     |
//! | INT4_G64   | —           | 64          | 36          | `d: f16`, `m: f16`, `qs: [u8; 32]`               | `d * nib(i) + m`                |
//! | INT4_G128  | —           | 128         | 68          | `d: f16`, `m: f16`, `qs: [u8; 64]`               | `d * nib(i) + m`                |
//!
//! `nib(i)` for the 4-bit formats: a block's quants are consecutive 16-byte
//! runs, one per 32 elements; in run `k`, elements `32k..32k+16` are the low
//! nibbles of its 16 bytes and `32k+16..32k+32` the high nibbles. With one run
//! this is GGML's Q4_0/Q4_1 order, so INT4 with groups of 32 *is* Q4_1
//! (`WeightFormat::int4(32)` returns `Q4_1`): the generalisation only lets
//! one `[d, m]` pair cover 64 or 128 elements, and every kernel reads a
//! group as whole Q4_1-ordered runs of 32.
//!
//! Q5_0 and Q5_1 (GGML) are Q4_0 and Q4_1 with a fifth bit per element:
//! `q5(i) = nib(i) | (bit i of qh) << 4`. IQ4_NL (GGML) is Q4_0's layout with
//! the nibble indexing a fixed non-uniform table instead of `nib - 8`. The
//! k-quants (Q2_K to Q6_K, GGML) are super-blocks of 256 elements split into
//! sub-blocks of 16 or 32 with quantized per-sub-block scales; their byte
//! layouts are documented in [`kquant`], next to their decoders.
//!
//! INT8 (weight-only, W8A16) and W8A8 share their bytes: each row starts with
//! its own f32 scale `s` (the per-output-channel scale), then `cols` signed
//! bytes. They differ in what the matmul does with the activations: INT8
//! multiplies them as they are; W8A8 (SmoothQuant) first quantizes each
//! activation row to INT8 with one scale per token ([`quantize_activation_row_i8`])
//! and multiplies INT8 × INT8 with i32 accumulation, scaling the sum by
//! `s * token_scale`. `cols` is a multiple of 32 for both, so rows stay
//! 4-byte aligned and match the activation blocks of the CPU kernels.
//!
//! Blocks of Q8_0 (34 bytes) and Q4_0 (18 bytes) are not 4-byte aligned; GPU
//! kernels read them from a flat `u32` array with byte-offset arithmetic.

pub mod kquant;
mod pack;

use half::{bf16, f16};

pub use pack::{pack_int4_groups, pack_int8_per_channel, quantize_activation_row_i8};

use crate::{Error, Result};

/// How a weight tensor is stored. The GGML formats keep GGML's names.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    /// INT8 per output channel, weight-only (W8A16).
    Int8PerChannel,
    /// INT8 per output channel; the matmul quantizes activations per token
    /// to INT8 and multiplies in integers (SmoothQuant's W8A8).
    W8A8,
    /// INT4 asymmetric groups of 64 or 128 (groups of 32 are [`WeightFormat::Q4_1`]).
    Int4 {
        group: Int4Group,
    },
    Q5_0,
    Q5_1,
    IQ4_NL,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// The group sizes of [`WeightFormat::Int4`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int4Group {
    G64,
    G128,
}

impl Int4Group {
    pub fn elems(self) -> usize {
        match self {
            Int4Group::G64 => 64,
            Int4Group::G128 => 128,
        }
    }
}

/// GGML's block size: elements per block of Q8_0, Q4_0 and Q4_1, and the
/// granularity (run of 4-bit quants, activation block) every quantized
/// format is built from.
pub const QK: usize = 32;

/// Group sizes [`WeightFormat::int4`] and [`pack_int4_groups`] accept.
pub const INT4_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// Elements per k-quant super-block (GGML's `QK_K`): a k-quant row's
/// `cols` is a multiple of it.
pub const QK_K: usize = 256;

/// IQ4_NL's 16 levels (GGML's `kvalues_iq4nl`), indexed by the nibble.
pub const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl WeightFormat {
    pub const ALL: [WeightFormat; 18] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Int8PerChannel,
        WeightFormat::W8A8,
        WeightFormat::Int4 {
            group: Int4Group::G64,
        },
        WeightFormat::Int4 {
            group: Int4Group::G128,
        },
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::IQ4_NL,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ];

    /// The formats a GGUF file can hold.
    pub const GGML: [WeightFormat; 14] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::IQ4_NL,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ];

    /// GGML's k-quants: super-blocks of [`QK_K`] elements.
    pub fn is_k_quant(self) -> bool {
        self.block_elems() == QK_K
    }

    /// The INT4 format with groups of `group` elements (32 is Q4_1, whose
    /// layout is the same), or an error naming the sizes there are.
    pub fn int4(group: usize) -> Result<Self> {
        match group {
            32 => Ok(WeightFormat::Q4_1),
            64 => Ok(WeightFormat::Int4 {
                group: Int4Group::G64,
            }),
            128 => Ok(WeightFormat::Int4 {
                group: Int4Group::G128,
            }),
            _ => Err(Error::InvalidRequest(format!(
                "INT4 group size {group} is not supported (one of {INT4_GROUP_SIZES:?})"
            ))),
        }
    }

    /// GGML's type id for this format, `None` for Tandem's own formats.
    pub fn ggml_type(self) -> Option<u32> {
        match self {
            WeightFormat::F32 => Some(0),
            WeightFormat::F16 => Some(1),
            WeightFormat::Q4_0 => Some(2),
            WeightFormat::Q4_1 => Some(3),
            WeightFormat::Q8_0 => Some(8),
            WeightFormat::BF16 => Some(30),
            WeightFormat::Q5_0 => Some(6),
            WeightFormat::Q5_1 => Some(7),
            WeightFormat::Q2_K => Some(10),
            WeightFormat::Q3_K => Some(11),
            WeightFormat::Q4_K => Some(12),
            WeightFormat::Q5_K => Some(13),
            WeightFormat::Q6_K => Some(14),
            WeightFormat::IQ4_NL => Some(20),
            WeightFormat::Int8PerChannel | WeightFormat::W8A8 | WeightFormat::Int4 { .. } => None,
        }
    }

    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Self::GGML.into_iter().find(|f| f.ggml_type() == Some(id))
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "F32",
            WeightFormat::F16 => "F16",
            WeightFormat::BF16 => "BF16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_0 => "Q4_0",
            WeightFormat::Q4_1 => "Q4_1",
            WeightFormat::Int8PerChannel => "INT8",
            WeightFormat::W8A8 => "W8A8",
            WeightFormat::Int4 {
                group: Int4Group::G64,
            } => "INT4_G64",
            WeightFormat::Int4 {
                group: Int4Group::G128,
            } => "INT4_G128",
            WeightFormat::Q5_0 => "Q5_0",
            WeightFormat::Q5_1 => "Q5_1",
            WeightFormat::IQ4_NL => "IQ4_NL",
            WeightFormat::Q2_K => "Q2_K",
            WeightFormat::Q3_K => "Q3_K",
            WeightFormat::Q4_K => "Q4_K",
            WeightFormat::Q5_K => "Q5_K",
            WeightFormat::Q6_K => "Q6_K",
        }
    }

    /// The format whose [`name`](Self::name) is `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Elements per block: `cols` must be a multiple of it.
    pub fn block_elems(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => 1,
            WeightFormat::Q8_0
            | WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Int8PerChannel
            | WeightFormat::W8A8
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::IQ4_NL => QK,
            WeightFormat::Int4 { group } => group.elems(),
            WeightFormat::Q2_K
            | WeightFormat::Q3_K
            | WeightFormat::Q4_K
            | WeightFormat::Q5_K
            | WeightFormat::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::BF16 => 2,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Int8PerChannel | WeightFormat::W8A8 => QK,
            WeightFormat::Int4 { group } => 4 + group.elems() / 2,
            WeightFormat::Q5_0 => 22,
            WeightFormat::Q5_1 => 24,
            WeightFormat::IQ4_NL => 18,
            WeightFormat::Q2_K => kquant::Q2_K_BYTES,
            WeightFormat::Q3_K => kquant::Q3_K_BYTES,
            WeightFormat::Q4_K => kquant::Q4_K_BYTES,
            WeightFormat::Q5_K => kquant::Q5_K_BYTES,
            WeightFormat::Q6_K => kquant::Q6_K_BYTES,
        }
    }

    /// Bytes at the start of every row before its blocks (the per-row scale).
    pub fn row_head_bytes(self) -> usize {
        match self {
            WeightFormat::Int8PerChannel | WeightFormat::W8A8 => 4,
            _ => 0,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `cols` elements, or `None` when `cols` is not a
    /// whole number of blocks or the size overflows.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_elems()) {
            return None;
        }
        (cols / self.block_elems())
            .checked_mul(self.block_bytes())?
            .checked_add(self.row_head_bytes())
    }

    /// Bytes taken by a `rows × cols` matrix (a vector is one row), or `None`
    /// when `cols` is not a whole number of blocks or the size overflows.
    pub fn bytes_for(self, rows: u64, cols: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !cols.is_multiple_of(be) {
            return None;
        }
        (cols / be)
            .checked_mul(self.block_bytes() as u64)?
            .checked_add(self.row_head_bytes() as u64)?
            .checked_mul(rows)
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A borrowed weight matrix: `rows × cols` elements in `format`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// The bytes of matrices of one format and width stacked by rows (Q, K and
/// V; gate and up): every format stores rows whole and in order, so this is
/// their bytes one after another. `None` when formats or widths differ.
pub fn concat_rows(views: &[WeightView<'_>]) -> Option<Vec<u8>> {
    let first = views.first()?;
    if views
        .iter()
        .any(|v| v.format != first.format || v.cols != first.cols)
    {
        return None;
    }
    Some(views.iter().flat_map(|v| v.data.iter().copied()).collect())
}

impl<'a> WeightView<'a> {
    pub fn row_bytes(&self) -> usize {
        self.format.row_head_bytes()
            + self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// All elements as f32 (used by tests and by host-side transforms, never
    /// by the forward pass).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, dst) in out.chunks_mut(self.cols.max(1)).enumerate().take(self.rows) {
            dequantize_row(self.format, self.row(r), dst);
        }
        out
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes the 4-bit quants of one block (`out.len()` of them, a multiple of
/// 32) as `d * nib + m`: Q4_1's order, one 16-byte run per 32 elements.
fn dequantize_nibbles(qs: &[u8], d: f32, m: f32, out: &mut [f32]) {
    for (o, run) in out.chunks_mut(QK).zip(qs.chunks_exact(QK / 2)) {
        for i in 0..QK / 2 {
            o[i] = d * (run[i] & 0x0f) as f32 + m;
            o[i + QK / 2] = d * (run[i] >> 4) as f32 + m;
        }
    }
}

/// Decodes 5-bit quants: `qs` as Q4_1's nibbles, bit `i` of `qh` the fifth
/// bit of element `i`; element `i` is `d * q5 + m`.
fn dequantize_q5(qs: &[u8], qh: u32, d: f32, m: f32, out: &mut [f32]) {
    for i in 0..QK / 2 {
        let low = (qs[i] & 0x0f) as u32 | ((qh >> i) & 1) << 4;
        let high = (qs[i] >> 4) as u32 | ((qh >> (i + QK / 2)) & 1) << 4;
        out[i] = d * low as f32 + m;
        out[i + QK / 2] = d * high as f32 + m;
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decodes the first `out.len()` elements of the row in `src` (for the
/// per-row formats `src` starts with the row head).
pub fn dequantize_row(format: WeightFormat, src: &[u8], out: &mut [f32]) {
    match format {
        WeightFormat::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        WeightFormat::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        WeightFormat::Q8_0 => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (i, v) in o.iter_mut().enumerate() {
                    *v = d * (b[2 + i] as i8) as f32;
                }
            }
        }
        WeightFormat::Q4_0 => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                dequantize_nibbles(&b[2..], d, -8.0 * d, o);
            }
        }
        WeightFormat::Q4_1 | WeightFormat::Int4 { .. } => {
            let (elems, bytes) = (format.block_elems(), format.block_bytes());
            for (o, b) in out.chunks_mut(elems).zip(src.chunks_exact(bytes)) {
                dequantize_nibbles(&b[4..], f16_at(b, 0), f16_at(b, 2), o);
            }
        }
        WeightFormat::Int8PerChannel | WeightFormat::W8A8 => {
            let s = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            for (o, &q) in out.iter_mut().zip(&src[4..]) {
                *o = s * (q as i8) as f32;
            }
        }
        WeightFormat::Q5_0 => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(22)) {
                let d = f16_at(b, 0);
                let mut full = [0f32; QK];
                dequantize_q5(&b[6..], u32_at(b, 2), d, -16.0 * d, &mut full);
                o.copy_from_slice(&full[..o.len()]);
            }
        }
        WeightFormat::Q5_1 => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(24)) {
                let mut full = [0f32; QK];
                dequantize_q5(&b[8..], u32_at(b, 4), f16_at(b, 0), f16_at(b, 2), &mut full);
                o.copy_from_slice(&full[..o.len()]);
            }
        }
        WeightFormat::IQ4_NL => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for (i, v) in o.iter_mut().enumerate() {
                    let byte = b[2 + i % (QK / 2)];
                    let nib = if i < QK / 2 { byte & 0x0f } else { byte >> 4 };
                    *v = d * IQ4NL_VALUES[nib as usize] as f32;
                }
            }
        }
        WeightFormat::Q2_K
        | WeightFormat::Q3_K
        | WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K => {
            for (o, b) in out
                .chunks_mut(QK_K)
                .zip(src.chunks_exact(format.block_bytes()))
            {
                kquant::dequantize_block(format, b, o);
            }
        }
    }
}

/// Encodes the 4-bit quants `q` (a multiple of 32, each `0..=15`) in Q4_1's
/// order, one 16-byte run per 32 elements.
fn pack_nibbles(q: &[u8], out: &mut Vec<u8>) {
    for run in q.chunks_exact(QK) {
        out.extend((0..QK / 2).map(|i| run[i] | (run[i + QK / 2] << 4)));
    }
}

/// Encodes one group as `[d, m, nibbles]` with `d = (max - min) / 15`,
/// round to nearest: Q4_1's reference quantizer for any group size.
fn quantize_min_max_group(values: &[f32], out: &mut Vec<u8>) {
    let min = values.iter().copied().fold(f32::INFINITY, f32::min);
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(min).to_le_bytes());
    let q: Vec<u8> = values
        .iter()
        .map(|&v| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8)
        .collect();
    pack_nibbles(&q, out);
}

/// Encodes `src` into `format`, round to nearest, the way GGML's reference
/// quantizers do. For the block formats `src` is any whole number of blocks
/// (one row or a whole matrix); for the per-row formats (INT8, W8A8) it is
/// exactly one row, whose scale is `max|v| / 127` — use [`quantize_matrix`]
/// for a matrix.
pub fn quantize_row(format: WeightFormat, src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        format.row_head_bytes() + src.len() / format.block_elems() * format.block_bytes(),
    );
    match format {
        WeightFormat::F32 => src.iter().for_each(|v| out.extend(v.to_le_bytes())),
        WeightFormat::F16 => src
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        WeightFormat::BF16 => src
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        WeightFormat::Q8_0 => {
            for blk in src.chunks(QK) {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        WeightFormat::Q4_0 => {
            for blk in src.chunks(QK) {
                // GGML keeps the sign of the largest-magnitude value so that it maps to -8 exactly.
                let max = blk
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| ((v * id + 8.5) as i32).clamp(0, 15) as u8)
                    .collect();
                pack_nibbles(&q, &mut out);
            }
        }
        WeightFormat::Q4_1 | WeightFormat::Int4 { .. } => {
            for group in src.chunks(format.block_elems()) {
                quantize_min_max_group(group, &mut out);
            }
        }
        WeightFormat::Int8PerChannel | WeightFormat::W8A8 => {
            let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
            let s = amax / 127.0;
            let id = if s != 0.0 { 1.0 / s } else { 0.0 };
            out.extend(s.to_le_bytes());
            out.extend(src.iter().map(|v| (v * id).round() as i8 as u8));
        }
        WeightFormat::Q5_0 => {
            for blk in src.chunks(QK) {
                // As Q4_0: the largest magnitude maps to -16 exactly.
                let max = blk
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| ((v * id + 16.5) as i32).clamp(0, 31) as u8)
                    .collect();
                out.extend(f16::from_f32(d).to_le_bytes());
                pack_q5(&q, &mut out);
            }
        }
        WeightFormat::Q5_1 => {
            for blk in src.chunks(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 31.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| (((v - min) * id + 0.5) as i32).clamp(0, 31) as u8)
                    .collect();
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                pack_q5(&q, &mut out);
            }
        }
        WeightFormat::IQ4_NL => {
            for blk in src.chunks(QK) {
                // The largest magnitude maps to the table's end on its side.
                let max = blk
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = f16::from_f32(max / IQ4NL_VALUES[0] as f32);
                let id = if d.to_f32() != 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| {
                        let target = v * id;
                        (0..16u8)
                            .min_by(|&a, &b| {
                                let da = (IQ4NL_VALUES[a as usize] as f32 - target).abs();
                                let db = (IQ4NL_VALUES[b as usize] as f32 - target).abs();
                                da.total_cmp(&db)
                            })
                            .unwrap_or(0)
                    })
                    .collect();
                out.extend(d.to_le_bytes());
                pack_nibbles(&q, &mut out);
            }
        }
        WeightFormat::Q2_K
        | WeightFormat::Q3_K
        | WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K => {
            for blk in src.chunks(QK_K) {
                kquant::quantize_block(format, blk, &mut out);
            }
        }
    }
    out
}

/// Encodes 5-bit quants `q` (32 of them, each `0..=31`): the fifth bits as
/// the `qh` word, then the low four bits in Q4_1's order.
fn pack_q5(q: &[u8], out: &mut Vec<u8>) {
    let qh = q
        .iter()
        .enumerate()
        .fold(0u32, |acc, (i, &v)| acc | (((v >> 4) & 1) as u32) << i);
    out.extend(qh.to_le_bytes());
    let low: Vec<u8> = q.iter().map(|v| v & 0x0f).collect();
    pack_nibbles(&low, out);
}

/// Encodes a row-major matrix of rows of `cols` values, row by row.
pub fn quantize_matrix(format: WeightFormat, cols: usize, src: &[f32]) -> Vec<u8> {
    src.chunks(cols.max(1))
        .flat_map(|row| quantize_row(format, row))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_error_is_bounded_by_the_step() {
        let src: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let range = src.iter().fold(0f32, |a, v| a.max(v.abs())) * 2.0;
        for format in WeightFormat::ALL {
            let bytes = quantize_row(format, &src);
            assert_eq!(bytes.len() as u64, format.bytes_for(1, 256).unwrap());
            let mut back = vec![0.0; 256];
            dequantize_row(format, &bytes, &mut back);
            // Every block's range is at most the whole row's.
            let max_err = match format {
                // Q4_0 maps the block's largest magnitude to -8 exactly, so the
                // opposite extreme can be clamped at +7: a whole step of error.
                WeightFormat::Q4_0 => range / 16.0,
                WeightFormat::Q4_1 | WeightFormat::Int4 { .. } => range / 15.0 * 0.51,
                WeightFormat::Q8_0 | WeightFormat::Int8PerChannel | WeightFormat::W8A8 => {
                    range / 254.0 * 0.51
                }
                WeightFormat::F16 | WeightFormat::BF16 => range / 256.0 * 0.51,
                WeightFormat::F32 => 0.0,
                // As Q4_0 with 32 levels: a whole step at the clamped end.
                WeightFormat::Q5_0 => range / 32.0,
                WeightFormat::Q5_1 => range / 31.0 * 0.51,
                // The largest magnitude maps to -127 exactly; the table ends
                // at 113 on the other side, 14 of its units short.
                WeightFormat::IQ4_NL => range / 2.0 * 14.0 / 127.0,
                // Per sub-block bounds are checked in `kquant`; over a row,
                // a coarse bound: the largest step of each format.
                WeightFormat::Q2_K => range / 3.0 * 1.6,
                WeightFormat::Q3_K => range / 7.0 * 1.6,
                WeightFormat::Q4_K => range / 15.0 * 1.6,
                WeightFormat::Q5_K => range / 31.0 * 1.6,
                WeightFormat::Q6_K => range / 63.0 * 1.6,
            };
            for (a, b) in src.iter().zip(&back) {
                assert!((a - b).abs() <= max_err + 1e-3, "{format}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn int4_with_groups_of_32_is_q4_1() {
        let src: Vec<f32> = (0..128)
            .map(|i| ((i * 13 % 29) as f32 - 9.0) / 3.0)
            .collect();
        let q4_1 = WeightFormat::int4(32).unwrap();
        assert_eq!(q4_1, WeightFormat::Q4_1);
        // One group of 64 decodes like two Q4_1 blocks sharing their `[d, m]`.
        let g64 = WeightFormat::int4(64).unwrap();
        let bytes = quantize_row(g64, &src);
        let mut as_g64 = vec![0.0; 128];
        dequantize_row(g64, &bytes, &mut as_g64);
        let mut as_q4_1 = vec![0.0; 128];
        for (group, out) in bytes.chunks(36).zip(as_q4_1.chunks_mut(64)) {
            let (head, runs) = group.split_at(4);
            let blocks: Vec<u8> = runs.chunks(16).flat_map(|r| [head, r].concat()).collect();
            dequantize_row(WeightFormat::Q4_1, &blocks, out);
        }
        assert_eq!(as_g64, as_q4_1);
        for bad in [0, 16, 48, 256] {
            assert!(WeightFormat::int4(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_count_the_row_head() {
        let int8 = WeightFormat::Int8PerChannel;
        assert_eq!(int8.row_bytes(64), Some(68));
        assert_eq!(int8.bytes_for(3, 64), Some(204));
        assert_eq!(int8.row_bytes(48), None);
        let g128 = WeightFormat::int4(128).unwrap();
        assert_eq!(g128.row_bytes(256), Some(136));
        assert_eq!(g128.bytes_for(5, 192), None);
        assert_eq!(WeightFormat::Q8_0.bytes_for(2, 64), Some(136));
        assert_eq!(WeightFormat::F32.bytes_for(u64::MAX, 2), None);
        for format in WeightFormat::ALL {
            assert_eq!(WeightFormat::from_name(format.name()), Some(format));
        }
        assert_eq!(
            WeightFormat::GGML.map(|f| f.ggml_type().is_some()),
            [true; 14]
        );
        for format in WeightFormat::GGML {
            assert_eq!(
                WeightFormat::from_ggml_type(format.ggml_type().unwrap()),
                Some(format)
            );
        }
        assert_eq!(WeightFormat::Q4_K.row_bytes(512), Some(288));
        assert_eq!(WeightFormat::Q6_K.row_bytes(320), None);
    }

    #[test]
    fn quantize_matrix_scales_each_row() {
        let src: Vec<f32> = (0..96).map(|i| if i < 32 { 0.01 } else { 100.0 }).collect();
        let bytes = quantize_matrix(WeightFormat::Int8PerChannel, 32, &src);
        let view = WeightView {
            format: WeightFormat::Int8PerChannel,
            rows: 3,
            cols: 32,
            data: &bytes,
        };
        assert_eq!(view.to_f32()[0], 0.01);
        assert_eq!(view.to_f32()[95], 100.0);
    }
}
