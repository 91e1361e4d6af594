//! Decoding: one row of any format back to f32 (the reference the kernels
//! are checked against, and how F16/BF16 and quantized tensors are widened
//! where a backend needs floats).

use half::{bf16, f16};

use super::kquant;
use super::{WeightFormat, IQ4NL_VALUES, QK, QK_K};

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
