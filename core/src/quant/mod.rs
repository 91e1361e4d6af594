//! Weight storage formats and their block layouts.
//!
//! Each format has exactly one layout, shared bit-for-bit by the CPU backend,
//! the WGSL shaders and the CUDA kernels, and identical to GGML's so GGUF
//! tensors are used in place (memory-mapped, never repacked). A weight matrix
//! of `rows × cols` (`rows` output features, `cols` input features) is stored
//! row-major; each row is `cols / block_elems` consecutive blocks. All
//! multi-byte fields are little-endian.
//!
//! | format | block elems | block bytes | layout of one block                                   | value of element `i`            |
//! |--------|-------------|-------------|-------------------------------------------------------|---------------------------------|
//! | F32    | 1           | 4           | `f32`                                                 | as stored                       |
//! | F16    | 1           | 2           | IEEE half                                             | as stored                       |
//! | BF16   | 1           | 2           | bfloat16 (upper half of an f32)                       | as stored                       |
//! | Q8_0   | 32          | 34          | `d: f16`, `qs: [i8; 32]`                              | `d * qs[i]`                     |
//! | Q4_0   | 32          | 18          | `d: f16`, `qs: [u8; 16]`                              | `d * (nib(i) - 8)`              |
//! | Q4_1   | 32          | 20          | `d: f16`, `m: f16`, `qs: [u8; 16]`                    | `d * nib(i) + m`                |
//!
//! `nib(i)` for the 4-bit formats: elements `0..16` are the low nibbles of
//! `qs[0..16]`, elements `16..32` the high nibbles of the same bytes. Blocks of
//! Q8_0 (34 bytes) and Q4_0 (18 bytes) are not 4-byte aligned; GPU kernels read
//! them from a flat `u32` array with byte-offset arithmetic.

use half::{bf16, f16};

/// How a weight tensor is stored. The discriminants are GGML's type ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

pub const QK: usize = 32;

impl WeightFormat {
    pub const ALL: [WeightFormat; 6] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
    ];

    /// GGML's type id for this format.
    pub fn ggml_type(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16 => 1,
            WeightFormat::Q4_0 => 2,
            WeightFormat::Q4_1 => 3,
            WeightFormat::Q8_0 => 8,
            WeightFormat::BF16 => 30,
        }
    }

    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_type() == id)
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "F32",
            WeightFormat::F16 => "F16",
            WeightFormat::BF16 => "BF16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_0 => "Q4_0",
            WeightFormat::Q4_1 => "Q4_1",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => 1,
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1 => QK,
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
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes taken by `elems` elements, or `None` when `elems` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !elems.is_multiple_of(be) {
            return None;
        }
        (elems / be).checked_mul(self.block_bytes() as u64)
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

impl<'a> WeightView<'a> {
    pub fn row_bytes(&self) -> usize {
        self.cols / self.format.block_elems() * self.format.block_bytes()
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

/// Decodes `out.len()` elements stored in `format` from `src`.
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
                for i in 0..16 {
                    o[i] = d * ((b[2 + i] & 0x0f) as f32 - 8.0);
                    o[i + 16] = d * ((b[2 + i] >> 4) as f32 - 8.0);
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (o, b) in out.chunks_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for i in 0..16 {
                    o[i] = d * (b[4 + i] & 0x0f) as f32 + m;
                    o[i + 16] = d * (b[4 + i] >> 4) as f32 + m;
                }
            }
        }
    }
}

/// Encodes `src` (a whole number of blocks) into `format`, round to nearest,
/// the way GGML's reference quantizers do.
pub fn quantize_row(format: WeightFormat, src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / format.block_elems() * format.block_bytes());
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
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(blk[i]) | (q(blk[i + 16]) << 4)));
            }
        }
        WeightFormat::Q4_1 => {
            for blk in src.chunks(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(blk[i]) | (q(blk[i + 16]) << 4)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_error_is_bounded_by_the_step() {
        let src: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for format in WeightFormat::ALL {
            let bytes = quantize_row(format, &src);
            assert_eq!(bytes.len() as u64, format.bytes_for(96).unwrap());
            let mut back = vec![0.0; 96];
            dequantize_row(format, &bytes, &mut back);
            for (blk, bblk) in src.chunks(32).zip(back.chunks(32)) {
                let range = blk.iter().fold(0f32, |a, v| a.max(v.abs())) * 2.0;
                // Q4_0 maps the block's largest magnitude to -8 exactly, so the
                // opposite extreme can be clamped at +7: a whole step of error.
                let max_err = match format {
                    WeightFormat::Q4_0 => range / 16.0,
                    WeightFormat::Q4_1 => range / 15.0 * 0.51,
                    WeightFormat::Q8_0 => range / 254.0 * 0.51,
                    WeightFormat::F16 | WeightFormat::BF16 => range / 256.0 * 0.51,
                    WeightFormat::F32 => 0.0,
                };
                for (a, b) in blk.iter().zip(bblk) {
                    assert!((a - b).abs() <= max_err + 1e-3, "{format}: {a} vs {b}");
                }
            }
        }
    }
}
