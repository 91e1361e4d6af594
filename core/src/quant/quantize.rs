//! Encoding: f32 rows into any format, round to nearest, as GGML's
//! reference quantizers do (tests, `tandem quantize`, and the activations
//! of the W8A8 path).

use half::{bf16, f16};

use super::kquant;
use super::{WeightFormat, IQ4NL_VALUES, QK, QK_K};

/// Encodes the 4-bit quants `q` (a multiple of 32, each `0..=15`) in Q4_1's
/// order, one 16-byte run per 32 elements.
pub(super) fn pack_nibbles(q: &[u8], out: &mut Vec<u8>) {
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
