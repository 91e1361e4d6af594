//! GGML's k-quants: super-blocks of [`QK_K`] = 256 elements, split into
//! sub-blocks of 16 or 32 whose scales (and minimums) are themselves
//! quantized against one or two f16 super-block scales. The layouts are
//! GGML's (`ggml-common.h`), bit for bit, so GGUF tensors are used in place.
//! All multi-byte fields are little-endian; byte offsets are within one
//! super-block.
//!
//! **Q4_K** (144 bytes, 4.5 bits per weight): `d: f16` at 0, `dmin: f16` at 2,
//! `scales: [u8; 12]` at 4, `qs: [u8; 128]` at 16. Eight sub-blocks of 32,
//! each with a 6-bit scale `sc(j)` and a 6-bit minimum `mn(j)` packed in
//! `scales` ([`scale_min_k4`]: for `j < 4` the low 6 bits of bytes `j` and
//! `j + 4`; for `j >= 4` the nibbles of byte `j + 4` with the top two bits of
//! bytes `j - 4` and `j` above them). Elements `64k..64k+32` are the low
//! nibbles of `qs[32k..32k+32]` (sub-block `2k`), `64k+32..64k+64` their high
//! nibbles (sub-block `2k+1`). Value: `d * sc(j) * q - dmin * mn(j)`.
//!
//! **Q5_K** (176 bytes, 5.5 bits): `d`, `dmin`, `scales` as Q4_K, then
//! `qh: [u8; 32]` at 16 and `qs: [u8; 128]` at 48. The 4 low bits as Q4_K's
//! nibbles; the fifth bit of element `e = 32j + l` (sub-block `j`) is bit `j`
//! of `qh[l]`. Value: `d * sc(j) * q - dmin * mn(j)`, `q` in `0..32`.
//!
//! **Q6_K** (210 bytes, 6.5625 bits): `ql: [u8; 128]` at 0, `qh: [u8; 64]` at
//! 128, `scales: [i8; 16]` at 192, `d: f16` at 208. Sixteen sub-blocks of 16
//! with signed 8-bit scales. In half `h` (elements `128h..128h+128`), for
//! `l < 32`: element `128h + 32s + l` (`s = 0..4`) has low nibble from
//! `ql[64h + l + 32 * (s & 1)]` (low nibble for `s < 2`, high for `s >= 2`)
//! and two high bits `(qh[32h + l] >> 2s) & 3`. Value:
//! `d * scales[i / 16] * (q - 32)`, `q` in `0..64`.
//!
//! **Q3_K** (110 bytes, 3.4375 bits): `hmask: [u8; 32]` at 0, `qs: [u8; 64]`
//! at 32, `scales: [u8; 12]` at 96, `d: f16` at 108. Sixteen sub-blocks of
//! 16 with 6-bit scales ([`q3k_scales`]: the low nibbles come from bytes
//! `0..8` (sub-blocks `0..8` low nibbles, `8..16` high nibbles), the top two
//! bits from bytes `8..12`, two bits per sub-block). Element `128h + 32s + l`
//! (`s = 0..4`, `l < 32`) has two low bits `(qs[32h + l] >> 2s) & 3` and a
//! high bit `hmask[l] >> (4h + s) & 1`; its sub-block is `8h + 2s + l / 16`.
//! Value: `d * (sc - 32) * (q - 4)` where `q = low | high << 2`
//! (GGML subtracts 4 when the high bit is clear).
//!
//! **Q2_K** (84 bytes, 2.625 bits): `scales: [u8; 16]` at 0 (low nibble the
//! sub-block's scale, high nibble its minimum), `qs: [u8; 64]` at 16,
//! `d: f16` at 80, `dmin: f16` at 82. Element `128h + 32s + l` (`s = 0..4`,
//! `l < 32`) is `(qs[32h + l] >> 2s) & 3`, sub-block `8h + 2s + l / 16`.
//! Value: `d * sc * q - dmin * mn`.
//!
//! Every k-quant decodes, per sub-block of 16, to `scale * q + offset` with
//! small integer `q`; [`decode_block`] gives exactly that form (the codes and
//! per-16 `[scale, offset]`), which the reference [`dequantize_block`], the
//! matmul kernels and the tests share.

use half::f16;

use super::{WeightFormat, QK_K};

pub const Q2_K_BYTES: usize = 84;
pub const Q3_K_BYTES: usize = 110;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

/// Sub-blocks of 16 per super-block: the granularity of [`Decoded`].
pub const SUB16: usize = QK_K / 16;

/// One super-block decoded into integer codes and per-16 affine parameters:
/// element `i` is `scale[i / 16] * q[i] + offset[i / 16]`.
pub struct Decoded {
    pub q: [i8; QK_K],
    pub scale: [f32; SUB16],
    pub offset: [f32; SUB16],
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block `j` (of 8).
pub fn scale_min_k4(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Q3_K's sixteen 6-bit scales (`0..64`, to be offset by -32).
pub fn q3k_scales(scales: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            scales[j] & 0x0f
        } else {
            scales[j - 8] >> 4
        };
        let high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = low | (high << 4);
    }
    out
}

/// Decodes one super-block of `format` (a k-quant) from `b`.
pub fn decode_block(format: WeightFormat, b: &[u8]) -> Decoded {
    let mut d = Decoded {
        q: [0; QK_K],
        scale: [0.0; SUB16],
        offset: [0.0; SUB16],
    };
    match format {
        WeightFormat::Q4_K | WeightFormat::Q5_K => {
            let (dd, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if format == WeightFormat::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, scales);
                for half in 0..2 {
                    d.scale[2 * j + half] = dd * sc as f32;
                    d.offset[2 * j + half] = -dmin * mn as f32;
                }
                let run = &qs[32 * (j / 2)..][..32];
                for l in 0..32 {
                    let nib = if j % 2 == 0 {
                        run[l] & 0x0f
                    } else {
                        run[l] >> 4
                    };
                    let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                    d.q[32 * j + l] = (nib | high) as i8;
                }
            }
        }
        WeightFormat::Q6_K => {
            let (ql, qh, scales, dd) = (&b[0..128], &b[128..192], &b[192..208], f16_at(b, 208));
            for (j, &sc) in scales.iter().enumerate() {
                d.scale[j] = dd * (sc as i8) as f32;
                d.offset[j] = 0.0;
            }
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        let low = ql[64 * h + l + 32 * (s & 1)];
                        let low = if s < 2 { low & 0x0f } else { low >> 4 };
                        let high = (qh[32 * h + l] >> (2 * s)) & 3;
                        d.q[128 * h + 32 * s + l] = (low | (high << 4)) as i8 - 32;
                    }
                }
            }
        }
        WeightFormat::Q3_K => {
            let (hmask, qs, dd) = (&b[0..32], &b[32..96], f16_at(b, 108));
            for (j, sc) in q3k_scales(&b[96..108]).into_iter().enumerate() {
                d.scale[j] = dd * (sc as i32 - 32) as f32;
                d.offset[j] = 0.0;
            }
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        let low = (qs[32 * h + l] >> (2 * s)) & 3;
                        let high = (hmask[l] >> (4 * h + s)) & 1;
                        d.q[128 * h + 32 * s + l] = (low | (high << 2)) as i8 - 4;
                    }
                }
            }
        }
        WeightFormat::Q2_K => {
            let (scales, qs, dd, dmin) = (&b[0..16], &b[16..80], f16_at(b, 80), f16_at(b, 82));
            for (j, &sc) in scales.iter().enumerate() {
                d.scale[j] = dd * (sc & 0x0f) as f32;
                d.offset[j] = -dmin * (sc >> 4) as f32;
            }
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        d.q[128 * h + 32 * s + l] = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
                    }
                }
            }
        }
        other => unreachable!("{other} is not a k-quant"),
    }
    d
}

/// Decodes the first `out.len()` (at most 256) elements of one super-block.
pub fn dequantize_block(format: WeightFormat, b: &[u8], out: &mut [f32]) {
    let d = decode_block(format, b);
    for (i, o) in out.iter_mut().enumerate() {
        *o = d.scale[i / 16] * d.q[i] as f32 + d.offset[i / 16];
    }
}

/// Rounds `v` to the nearest integer in `0..=max`.
fn code(v: f32, max: i32) -> u8 {
    (v.round() as i32).clamp(0, max) as u8
}

/// Affine sub-block parameters `(scale, min)` with `min <= 0`, so that
/// `scale * q + min` for `q` in `0..=levels` covers the values.
fn affine(values: &[f32], levels: f32) -> (f32, f32) {
    let min = values.iter().copied().fold(0f32, f32::min);
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    ((max - min) / levels, min)
}

/// One super-block of `src` (256 values) in `format`, appended to `out`:
/// round to nearest at every level (sub-block parameters from the
/// sub-block's range, then the super-block scales from the largest of
/// them), the simple form of GGML's reference quantizers.
pub fn quantize_block(format: WeightFormat, src: &[f32], out: &mut Vec<u8>) {
    debug_assert_eq!(src.len(), QK_K);
    match format {
        WeightFormat::Q4_K | WeightFormat::Q5_K => {
            let levels = if format == WeightFormat::Q4_K { 15 } else { 31 };
            let params: Vec<(f32, f32)> =
                src.chunks(32).map(|s| affine(s, levels as f32)).collect();
            let max_scale = params.iter().fold(0f32, |a, p| a.max(p.0));
            let max_min = params.iter().fold(0f32, |a, p| a.max(-p.1));
            let d = f16::from_f32(max_scale / 63.0);
            let dmin = f16::from_f32(max_min / 63.0);
            let inv = |x: f16| {
                if x.to_f32() > 0.0 {
                    1.0 / x.to_f32()
                } else {
                    0.0
                }
            };
            let sc: Vec<u8> = params.iter().map(|p| code(p.0 * inv(d), 63)).collect();
            let mn: Vec<u8> = params.iter().map(|p| code(-p.1 * inv(dmin), 63)).collect();
            let mut scales = [0u8; 12];
            for j in 0..8 {
                if j < 4 {
                    scales[j] = sc[j];
                    scales[j + 4] = mn[j];
                } else {
                    scales[j + 4] = (sc[j] & 0x0f) | ((mn[j] & 0x0f) << 4);
                    scales[j - 4] |= (sc[j] >> 4) << 6;
                    scales[j] |= (mn[j] >> 4) << 6;
                }
            }
            let mut q = [0u8; QK_K];
            for j in 0..8 {
                let scale = d.to_f32() * sc[j] as f32;
                let min = dmin.to_f32() * mn[j] as f32;
                let id = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                for l in 0..32 {
                    q[32 * j + l] = code((src[32 * j + l] + min) * id, levels);
                }
            }
            out.extend(d.to_le_bytes());
            out.extend(dmin.to_le_bytes());
            out.extend(scales);
            if format == WeightFormat::Q5_K {
                out.extend(
                    (0..32).map(|l| {
                        (0..8).fold(0u8, |acc, j| acc | (((q[32 * j + l] >> 4) & 1) << j))
                    }),
                );
            }
            for k in 0..4 {
                out.extend(
                    (0..32).map(|l| (q[64 * k + l] & 0x0f) | ((q[64 * k + 32 + l] & 0x0f) << 4)),
                );
            }
        }
        WeightFormat::Q6_K | WeightFormat::Q3_K => {
            // Symmetric: q in -32..32 (Q6_K) or -4..4 (Q3_K), signed sub-block scales.
            let (half_range, scale_max) = if format == WeightFormat::Q6_K {
                (32.0, 127.0)
            } else {
                (4.0, 31.0)
            };
            let scales: Vec<f32> = src
                .chunks(16)
                .map(|s| {
                    let m = s
                        .iter()
                        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                    m / -half_range
                })
                .collect();
            let amax = scales
                .iter()
                .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            let d = f16::from_f32(amax.abs() / scale_max);
            let id = if d.to_f32() > 0.0 {
                1.0 / d.to_f32()
            } else {
                0.0
            };
            let sc: Vec<i32> = scales
                .iter()
                .map(|s| ((s * id).round() as i32).clamp(-(scale_max as i32) - 1, scale_max as i32))
                .collect();
            let mut q = [0u8; QK_K];
            for j in 0..16 {
                let scale = d.to_f32() * sc[j] as f32;
                let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                let top = 2 * half_range as i32 - 1;
                for l in 0..16 {
                    q[16 * j + l] = code(src[16 * j + l] * inv + half_range, top);
                }
            }
            if format == WeightFormat::Q6_K {
                let mut ql = [0u8; 128];
                let mut qh = [0u8; 64];
                for h in 0..2 {
                    for s in 0..4 {
                        for l in 0..32 {
                            let v = q[128 * h + 32 * s + l];
                            let at = 64 * h + l + 32 * (s & 1);
                            ql[at] |= if s < 2 { v & 0x0f } else { (v & 0x0f) << 4 };
                            qh[32 * h + l] |= (v >> 4) << (2 * s);
                        }
                    }
                }
                out.extend(ql);
                out.extend(qh);
                out.extend(sc.iter().map(|&s| s as i8 as u8));
                out.extend(d.to_le_bytes());
            } else {
                let mut hmask = [0u8; 32];
                let mut qs = [0u8; 64];
                for h in 0..2 {
                    for s in 0..4 {
                        for l in 0..32 {
                            let v = q[128 * h + 32 * s + l];
                            qs[32 * h + l] |= (v & 3) << (2 * s);
                            hmask[l] |= ((v >> 2) & 1) << (4 * h + s);
                        }
                    }
                }
                let sc6: Vec<u8> = sc.iter().map(|&s| (s + 32).clamp(0, 63) as u8).collect();
                let mut scales = [0u8; 12];
                for (j, &s) in sc6.iter().enumerate() {
                    if j < 8 {
                        scales[j] |= s & 0x0f;
                    } else {
                        scales[j - 8] |= (s & 0x0f) << 4;
                    }
                    scales[8 + j % 4] |= (s >> 4) << (2 * (j / 4));
                }
                out.extend(hmask);
                out.extend(qs);
                out.extend(scales);
                out.extend(d.to_le_bytes());
            }
        }
        WeightFormat::Q2_K => {
            let params: Vec<(f32, f32)> = src.chunks(16).map(|s| affine(s, 3.0)).collect();
            let max_scale = params.iter().fold(0f32, |a, p| a.max(p.0));
            let max_min = params.iter().fold(0f32, |a, p| a.max(-p.1));
            let d = f16::from_f32(max_scale / 15.0);
            let dmin = f16::from_f32(max_min / 15.0);
            let inv = |x: f16| {
                if x.to_f32() > 0.0 {
                    1.0 / x.to_f32()
                } else {
                    0.0
                }
            };
            let sc: Vec<u8> = params.iter().map(|p| code(p.0 * inv(d), 15)).collect();
            let mn: Vec<u8> = params.iter().map(|p| code(-p.1 * inv(dmin), 15)).collect();
            let mut qs = [0u8; 64];
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        let e = 128 * h + 32 * s + l;
                        let j = e / 16;
                        let scale = d.to_f32() * sc[j] as f32;
                        let id = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                        let v = code((src[e] + dmin.to_f32() * mn[j] as f32) * id, 3);
                        qs[32 * h + l] |= v << (2 * s);
                    }
                }
            }
            out.extend(sc.iter().zip(&mn).map(|(s, m)| s | (m << 4)));
            out.extend(qs);
            out.extend(d.to_le_bytes());
            out.extend(dmin.to_le_bytes());
        }
        other => unreachable!("{other} is not a k-quant"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GGML's `dequantize_row_q4_K` transcribed loop for loop, as an
    /// independent check of [`decode_block`]'s reading of the layout.
    fn ggml_q4_k(b: &[u8]) -> Vec<f32> {
        let (d, min) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, mut q) = (&b[4..16], &b[16..]);
        let mut y = Vec::new();
        let mut is = 0;
        for _ in (0..QK_K).step_by(64) {
            let (sc, m) = scale_min_k4(is, scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = scale_min_k4(is + 1, scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            y.extend(q[..32].iter().map(|&v| d1 * (v & 0xf) as f32 - m1));
            y.extend(q[..32].iter().map(|&v| d2 * (v >> 4) as f32 - m2));
            q = &q[32..];
            is += 2;
        }
        y
    }

    /// GGML's `dequantize_row_q6_K`, transcribed.
    fn ggml_q6_k(b: &[u8]) -> Vec<f32> {
        let d = f16_at(b, 208);
        let mut y = vec![0f32; QK_K];
        let (mut ql, mut qh, mut sc) = (&b[0..128], &b[128..192], &b[192..208]);
        for n in (0..QK_K).step_by(128) {
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                let s = |k: usize| sc[is + k] as i8 as f32;
                y[n + l] = d * s(0) * q1 as f32;
                y[n + l + 32] = d * s(2) * q2 as f32;
                y[n + l + 64] = d * s(4) * q3 as f32;
                y[n + l + 96] = d * s(6) * q4 as f32;
            }
            ql = &ql[64..];
            qh = &qh[32..];
            sc = &sc[8..];
        }
        y
    }

    /// GGML's `dequantize_row_q3_K`, transcribed (its scale unpacking with
    /// the `kmask` words included).
    fn ggml_q3_k(b: &[u8]) -> Vec<f32> {
        let d_all = f16_at(b, 108);
        let (hm, mut q) = (&b[0..32], &b[32..96]);
        let word = |i: usize| u32::from_le_bytes(b[96 + 4 * i..100 + 4 * i].try_into().unwrap());
        let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
        let mut aux = [word(0), word(1), word(2), 0];
        let tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
        aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
        aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
        aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
        let scales: Vec<i8> = aux
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .map(|v| v as i8)
            .collect();
        let mut y = Vec::new();
        let (mut is, mut m) = (0, 1u8);
        for _ in (0..QK_K).step_by(128) {
            let mut shift = 0;
            for _ in 0..4 {
                for part in 0..2 {
                    let dl = d_all * (scales[is] as i32 - 32) as f32;
                    is += 1;
                    for l in 16 * part..16 * part + 16 {
                        let low = ((q[l] >> shift) & 3) as i32;
                        let sub = if hm[l] & m != 0 { 0 } else { 4 };
                        y.push(dl * (low - sub) as f32);
                    }
                }
                shift += 2;
                m <<= 1;
            }
            q = &q[32..];
        }
        y
    }

    fn values(seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2654435761).max(1);
        (0..QK_K)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                // Sub-blocks of different ranges, so the scales differ.
                let range = 0.1 + (i / 16) as f32 * 0.3;
                ((state % 2001) as f32 / 1000.0 - 1.0) * range
            })
            .collect()
    }

    #[test]
    fn decoders_agree_with_ggml_loops() {
        for seed in 1..6 {
            let src = values(seed);
            for (format, ggml) in [
                (WeightFormat::Q4_K, ggml_q4_k as fn(&[u8]) -> Vec<f32>),
                (WeightFormat::Q6_K, ggml_q6_k),
                (WeightFormat::Q3_K, ggml_q3_k),
            ] {
                let mut bytes = Vec::new();
                quantize_block(format, &src, &mut bytes);
                let mut ours = vec![0f32; QK_K];
                dequantize_block(format, &bytes, &mut ours);
                assert_eq!(ours, ggml(&bytes), "{format}");
            }
        }
    }

    #[test]
    fn round_trip_error_is_within_a_step_of_each_sub_block() {
        for format in [
            WeightFormat::Q2_K,
            WeightFormat::Q3_K,
            WeightFormat::Q4_K,
            WeightFormat::Q5_K,
            WeightFormat::Q6_K,
        ] {
            let levels: f32 = match format {
                WeightFormat::Q2_K => 3.0,
                WeightFormat::Q3_K => 7.0,
                WeightFormat::Q4_K => 15.0,
                WeightFormat::Q5_K => 31.0,
                _ => 63.0,
            };
            for seed in 1..4 {
                let src = values(seed);
                let mut bytes = Vec::new();
                quantize_block(format, &src, &mut bytes);
                assert_eq!(bytes.len(), format.block_bytes(), "{format}");
                let mut back = vec![0f32; QK_K];
                dequantize_block(format, &bytes, &mut back);
                for (j, (s, b)) in src.chunks(16).zip(back.chunks(16)).enumerate() {
                    // The sub-block's own step, widened for the rounding of
                    // its scale and minimum to the super-block's grid.
                    let range = s.iter().fold(0f32, |a, v| a.max(v.abs())) * 2.0;
                    let step = range / levels;
                    let bound = step * 1.5 + range * 0.05;
                    for (a, b) in s.iter().zip(b) {
                        assert!((a - b).abs() <= bound, "{format} sub-block {j}: {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn q3k_scales_match_the_kmask_unpacking() {
        let bytes: Vec<u8> = (0..12u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(11))
            .collect();
        let mut block = vec![0u8; Q3_K_BYTES];
        block[96..108].copy_from_slice(&bytes);
        block[108..110].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        // Every code is 1 (low bits 01, high bit set), so element `i` is `d * (sc - 32)`.
        block[0..32].fill(0xff);
        block[32..96].fill(0x55);
        let mut y = vec![0f32; QK_K];
        dequantize_block(WeightFormat::Q3_K, &block, &mut y);
        assert_eq!(y, ggml_q3_k(&block));
    }
}
