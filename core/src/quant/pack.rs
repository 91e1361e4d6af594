//! Packing integer quants computed elsewhere (RTN, GPTQ, AWQ, SmoothQuant)
//! into the byte layouts of the module table, and the per-token activation
//! quantization that W8A8 matmuls share on every backend.

use half::f16;

use super::quantize::pack_nibbles;
use super::{WeightFormat, QK};
use crate::{Error, Result};

fn invalid<T>(what: &str, reason: String) -> Result<T> {
    Err(Error::InvalidRequest(format!("{what}: {reason}")))
}

fn check_len(what: &str, name: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return invalid(
            what,
            format!("{name} holds {len} values, expected {expected}"),
        );
    }
    Ok(())
}

/// Packs `rows × cols` signed quants `q` (row-major) with one scale per row
/// into the INT8 layout, which W8A8 shares: element `(r, c)` is
/// `scales[r] * q[r * cols + c]`. `cols` must be a multiple of 32.
pub fn pack_int8_per_channel(
    rows: usize,
    cols: usize,
    q: &[i8],
    scales: &[f32],
) -> Result<Vec<u8>> {
    const WHAT: &str = "pack_int8_per_channel";
    if !cols.is_multiple_of(QK) {
        return invalid(WHAT, format!("{cols} columns is not a multiple of {QK}"));
    }
    let elems = rows
        .checked_mul(cols)
        .ok_or_else(|| Error::InvalidRequest(format!("{WHAT}: {rows}×{cols} overflows")))?;
    check_len(WHAT, "q", q.len(), elems)?;
    check_len(WHAT, "scales", scales.len(), rows)?;
    if let Some(r) = scales.iter().position(|s| !s.is_finite()) {
        return invalid(WHAT, format!("scale of row {r} is {}", scales[r]));
    }
    let row_bytes = WeightFormat::Int8PerChannel.row_bytes(cols).unwrap_or(0);
    let mut out = Vec::with_capacity(rows * row_bytes);
    for (r, scale) in scales.iter().enumerate() {
        out.extend(scale.to_le_bytes());
        out.extend(q[r * cols..(r + 1) * cols].iter().map(|&v| v as u8));
    }
    Ok(out)
}

/// Packs `rows × cols` 4-bit quants `q` (row-major, each `0..=15`) with a
/// scale and a minimum per group of `group` consecutive elements of a row
/// (`scales` and `mins` are `[rows, cols / group]`): element `(r, c)` is
/// `scale * q + min` of its group. `group` is 32 (the bytes are then Q4_1),
/// 64 or 128; the format to label the bytes with is
/// [`WeightFormat::int4`]`(group)`. Scales and minimums are stored as f16:
/// algorithms that want the stored values exact round them first
/// (`half::f16::from_f32(v).to_f32()`).
pub fn pack_int4_groups(
    rows: usize,
    cols: usize,
    group: usize,
    q: &[u8],
    scales: &[f32],
    mins: &[f32],
) -> Result<Vec<u8>> {
    const WHAT: &str = "pack_int4_groups";
    let format = WeightFormat::int4(group)?;
    if !cols.is_multiple_of(group) {
        return invalid(
            WHAT,
            format!("group size {group} does not divide {cols} columns"),
        );
    }
    let elems = rows
        .checked_mul(cols)
        .ok_or_else(|| Error::InvalidRequest(format!("{WHAT}: {rows}×{cols} overflows")))?;
    let groups = elems / group;
    check_len(WHAT, "q", q.len(), elems)?;
    check_len(WHAT, "scales", scales.len(), groups)?;
    check_len(WHAT, "mins", mins.len(), groups)?;
    if let Some(i) = q.iter().position(|&v| v > 15) {
        return invalid(WHAT, format!("quant {i} is {}, outside 0..=15", q[i]));
    }
    if let Some(i) = scales.iter().chain(mins).position(|s| !s.is_finite()) {
        return invalid(WHAT, format!("scale or minimum {i} is not finite"));
    }
    let mut out = Vec::with_capacity(groups * format.block_bytes());
    for ((quants, &scale), &min) in q.chunks_exact(group).zip(scales).zip(mins) {
        out.extend(f16::from_f32(scale).to_le_bytes());
        out.extend(f16::from_f32(min).to_le_bytes());
        pack_nibbles(quants, &mut out);
    }
    Ok(out)
}

/// Quantizes one activation row to INT8 for a W8A8 matmul: symmetric, one
/// scale per row (token). Returns the scale `max|x| / 127`; `q[i]` is
/// `x[i] * (127 / max|x|)` rounded to nearest, ties to even (what GPUs'
/// `round`/`rint` do), so that `x[i] ≈ scale * q[i]`. An all-zero row has
/// scale 0 and zero quants. Every backend computes exactly this.
#[inline]
pub fn quantize_activation_row_i8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x
        .iter()
        .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inverse = 127.0 / amax;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::WeightView;

    #[test]
    fn int8_packing_decodes_to_scale_times_quant() {
        let (rows, cols) = (3, 64);
        let q: Vec<i8> = (0..rows * cols)
            .map(|i| (i as i32 * 7 % 255 - 127) as i8)
            .collect();
        let scales = [0.5, -2.0, 1e-3];
        let bytes = pack_int8_per_channel(rows, cols, &q, &scales).unwrap();
        for format in [WeightFormat::Int8PerChannel, WeightFormat::W8A8] {
            let view = WeightView {
                format,
                rows,
                cols,
                data: &bytes,
            };
            let values = view.to_f32();
            for (i, (&v, &q)) in values.iter().zip(&q).enumerate() {
                assert_eq!(v, scales[i / cols] * q as f32);
            }
        }
        assert!(pack_int8_per_channel(2, 48, &[0; 96], &[1.0; 2]).is_err());
        assert!(pack_int8_per_channel(2, 32, &[0; 63], &[1.0; 2]).is_err());
        assert!(pack_int8_per_channel(2, 32, &[0; 64], &[1.0; 3]).is_err());
        assert!(pack_int8_per_channel(1, 32, &[0; 32], &[f32::NAN]).is_err());
    }

    #[test]
    fn int4_packing_decodes_to_scale_times_quant_plus_min() {
        let (rows, cols) = (2, 256);
        let q: Vec<u8> = (0..rows * cols).map(|i| (i * 5 % 16) as u8).collect();
        for group in [32, 64, 128] {
            let groups = rows * cols / group;
            let scales: Vec<f32> = (0..groups).map(|g| 0.25 * (g + 1) as f32).collect();
            let mins: Vec<f32> = (0..groups).map(|g| -(g as f32)).collect();
            let bytes = pack_int4_groups(rows, cols, group, &q, &scales, &mins).unwrap();
            let format = WeightFormat::int4(group).unwrap();
            assert_eq!(
                bytes.len() as u64,
                format.bytes_for(rows as u64, cols as u64).unwrap()
            );
            let view = WeightView {
                format,
                rows,
                cols,
                data: &bytes,
            };
            for (i, (&v, &q)) in view.to_f32().iter().zip(&q).enumerate() {
                let g = i / group;
                assert_eq!(
                    v,
                    scales[g] * q as f32 + mins[g],
                    "group {group}, element {i}"
                );
            }
        }
        let ok = |group, cols: usize, q: &[u8], groups| {
            pack_int4_groups(1, cols, group, q, &vec![1.0; groups], &vec![0.0; groups])
        };
        assert!(ok(128, 128, &[0; 128], 1).is_ok());
        let message = ok(128, 192, &[0; 192], 1).unwrap_err().to_string();
        assert!(message.contains("does not divide 192 columns"), "{message}");
        let message = ok(96, 192, &[0; 192], 2).unwrap_err().to_string();
        assert!(
            message.contains("group size 96 is not supported"),
            "{message}"
        );
        assert!(ok(64, 128, &[0; 127], 2).is_err());
        assert!(ok(64, 128, &[0; 128], 3).is_err());
        assert!(ok(64, 128, &[16; 128], 2).is_err());
    }

    #[test]
    fn activation_quantization_is_symmetric_per_row() {
        let x = [0.0, 1.5, -127.0, 2.5, 127.0, -0.5];
        let mut q = [0i8; 6];
        assert_eq!(quantize_activation_row_i8(&x, &mut q), 1.0);
        assert_eq!(q, [0, 2, -127, 2, 127, 0]);
        let halved: Vec<f32> = x.iter().map(|v| v / 2.0).collect();
        assert_eq!(quantize_activation_row_i8(&halved, &mut q), 0.5);
        assert_eq!(q, [0, 2, -127, 2, 127, 0]);
        assert_eq!(quantize_activation_row_i8(&[0.0; 4], &mut q[..4]), 0.0);
        assert_eq!(q[..4], [0; 4]);
    }
}
