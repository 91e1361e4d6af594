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

mod dequantize;
pub mod kquant;
mod pack;
mod quantize;

pub use dequantize::dequantize_row;
pub use pack::{pack_int4_groups, pack_int8_per_channel, quantize_activation_row_i8};
pub use quantize::{quantize_matrix, quantize_row};

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

#[cfg(test)]
mod tests;
