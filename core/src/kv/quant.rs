//! Quantized KV cache rows (INT8 and INT4): the block layout every backend
//! stores, and the reference quantize/dequantize the CPU backend runs and
//! the GPU kernels reproduce.
//!
//! # Layout
//!
//! A cache is `[num_blocks, block_size]` slots, as for F32/F16; one slot holds
//! one token's K (or V) for all KV heads as `slot_words` little-endian u32
//! words. Each head's `head_dim` elements are cut into groups of
//! [`KV_GROUP`] (32) consecutive elements (the last group of a head may be
//! shorter; its codes are padded with zeros). With `G = kv_heads *
//! ceil(head_dim / 32)` groups per slot and `b` bits per code:
//!
//! | words of a slot | content |
//! |---|---|
//! | `[g * b, (g + 1) * b)` for group `g = head * groups_per_head + i` | the group's 32 codes, `32 / b` per word, element `e` in bits `b * (e % (32 / b))` of word `e / (32 / b)` |
//! | `G * b + g` | the group's parameters: f16 `scale` (low half), f16 `min` (high half) |
//!
//! so `slot_words = G * (b + 1)`: 9 bits per element for INT8, 5 for INT4.
//! Scales and zero points live in the slot itself, so copying a block
//! (copy-on-write) or truncating a sequence needs nothing beyond the codes'
//! own bookkeeping.
//!
//! # Quantization
//!
//! Asymmetric, per token, per head, per group: `min`/`max` of the group give
//! `scale = (max - min) / (2^b - 1)`; both are rounded to f16 (saturating at
//! ±65504) and the codes are `q = clamp(floor((x - min) / scale + 0.5), 0,
//! 2^b - 1)` with the rounded values, so the dequantized `min + q * scale` is
//! what every backend reads back. Asymmetric codes beat symmetric ones on
//! SmolLM2's keys, whose channels are far from centred on 0 (see the notes
//! in the README's KV table).

use crate::backend::KvDtype;

/// Elements per quantization group (the last group of a head may be shorter).
pub const KV_GROUP: usize = 32;

/// Largest finite f16: scales and zero points saturate there.
const F16_MAX: f32 = 65504.0;

/// Where a quantized slot keeps each group's codes and parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuantLayout {
    /// Bits per code: 8 or 4.
    pub bits: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `ceil(head_dim / KV_GROUP)`.
    pub groups_per_head: usize,
}

impl KvQuantLayout {
    /// The layout of a quantized dtype; `None` for F32 and F16.
    pub fn new(dtype: KvDtype, kv_heads: usize, head_dim: usize) -> Option<Self> {
        let bits = match dtype {
            KvDtype::Int8 => 8,
            KvDtype::Int4 => 4,
            KvDtype::F32 | KvDtype::F16 => return None,
        };
        Some(KvQuantLayout {
            bits,
            kv_heads,
            head_dim,
            groups_per_head: head_dim.div_ceil(KV_GROUP),
        })
    }

    pub fn groups(&self) -> usize {
        self.kv_heads * self.groups_per_head
    }

    /// u32 words of one slot (one token's K or V, all heads).
    pub fn slot_words(&self) -> usize {
        self.groups() * (self.bits + 1)
    }

    fn codes_per_word(&self) -> usize {
        32 / self.bits
    }

    fn max_code(&self) -> u32 {
        (1 << self.bits) - 1
    }

    /// Quantizes one token's row (`kv_heads * head_dim` values) into `slot`.
    pub fn quantize_row(&self, row: &[f32], slot: &mut [u32]) {
        let (codes, params) = slot[..self.slot_words()].split_at_mut(self.groups() * self.bits);
        codes.fill(0);
        for (head, x) in row.chunks_exact(self.head_dim).enumerate() {
            for (i, x) in x.chunks(KV_GROUP).enumerate() {
                let g = head * self.groups_per_head + i;
                let (scale, min) = group_params(x, self.max_code());
                params[g] = pack_params(scale, min);
                let (scale, min) = unpack_params(params[g]);
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                let words = &mut codes[g * self.bits..][..self.bits];
                for (e, &v) in x.iter().enumerate() {
                    let q = ((v - min) * inv + 0.5)
                        .floor()
                        .clamp(0.0, self.max_code() as f32);
                    let shift = self.bits * (e % self.codes_per_word());
                    words[e / self.codes_per_word()] |= (q as u32) << shift;
                }
            }
        }
    }

    /// Dequantizes head `head` of a slot into `out` (`head_dim` values).
    pub fn dequantize_head(&self, slot: &[u32], head: usize, out: &mut [f32]) {
        let params = &slot[self.groups() * self.bits..];
        let mask = self.max_code();
        for (i, out) in out[..self.head_dim].chunks_mut(KV_GROUP).enumerate() {
            let g = head * self.groups_per_head + i;
            let (scale, min) = unpack_params(params[g]);
            let words = &slot[g * self.bits..][..self.bits];
            for (e, o) in out.iter_mut().enumerate() {
                let shift = self.bits * (e % self.codes_per_word());
                let q = (words[e / self.codes_per_word()] >> shift) & mask;
                *o = min + q as f32 * scale;
            }
        }
    }

    /// Dequantizes a whole slot into `out` (`kv_heads * head_dim` values).
    pub fn dequantize_row(&self, slot: &[u32], out: &mut [f32]) {
        for (head, out) in out.chunks_exact_mut(self.head_dim).enumerate() {
            self.dequantize_head(slot, head, out);
        }
    }
}

/// `(scale, min)` of a group before f16 rounding.
fn group_params(x: &[f32], max_code: u32) -> (f32, f32) {
    let (lo, hi) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    (
        ((hi - lo) / max_code as f32).min(F16_MAX),
        lo.clamp(-F16_MAX, F16_MAX),
    )
}

fn pack_params(scale: f32, min: f32) -> u32 {
    let scale = half::f16::from_f32(scale).to_bits() as u32;
    let min = half::f16::from_f32(min).to_bits() as u32;
    scale | (min << 16)
}

fn unpack_params(word: u32) -> (f32, f32) {
    (
        half::f16::from_bits(word as u16).to_f32(),
        half::f16::from_bits((word >> 16) as u16).to_f32(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn round_trip(dtype: KvDtype, kv_heads: usize, head_dim: usize, row: &[f32]) -> Vec<f32> {
        let layout = KvQuantLayout::new(dtype, kv_heads, head_dim).unwrap();
        let mut slot = vec![u32::MAX; layout.slot_words()];
        layout.quantize_row(row, &mut slot);
        let mut out = vec![f32::NAN; row.len()];
        layout.dequantize_row(&slot, &mut out);
        out
    }

    /// Each element comes back within half a step (plus f16 rounding of the
    /// group's parameters) of its group's range.
    fn assert_within_half_step(dtype: KvDtype, head_dim: usize, row: &[f32], got: &[f32]) {
        let levels = if dtype == KvDtype::Int8 { 255.0 } else { 15.0 };
        for (h, (x, y)) in row.chunks(head_dim).zip(got.chunks(head_dim)).enumerate() {
            for (i, (x, y)) in x.chunks(KV_GROUP).zip(y.chunks(KV_GROUP)).enumerate() {
                let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let step = (hi - lo) / levels;
                let bound = 0.5 * step + 2e-3 * (hi.abs().max(lo.abs())) + 1e-6;
                for (e, (a, b)) in x.iter().zip(y).enumerate() {
                    assert!(
                        (a - b).abs() <= bound,
                        "{dtype:?} head {h} group {i} element {e}: {a} came back as {b} (bound {bound})"
                    );
                }
            }
        }
    }

    #[test]
    fn slot_words_follow_the_documented_layout() {
        let int4 = KvQuantLayout::new(KvDtype::Int4, 3, 64).unwrap();
        assert_eq!(int4.slot_words(), 6 * 5);
        let int8 = KvQuantLayout::new(KvDtype::Int8, 2, 40).unwrap();
        assert_eq!(int8.slot_words(), 4 * 9);
        assert!(KvQuantLayout::new(KvDtype::F16, 2, 40).is_none());
    }

    #[test]
    fn round_trips_with_awkward_head_sizes() {
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            for (kv_heads, head_dim) in [(1, 1), (3, 7), (2, 33), (3, 64), (1, 80), (5, 130)] {
                let row = values(kv_heads * head_dim, (kv_heads * 1000 + head_dim) as u64);
                let got = round_trip(dtype, kv_heads, head_dim, &row);
                assert_within_half_step(dtype, head_dim, &row, &got);
            }
        }
    }

    /// An outlier widens only its own group's step: the other groups of the
    /// row keep their precision.
    #[test]
    fn an_outlier_stays_in_its_group() {
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            let mut row = values(2 * 96, 7);
            row[40] = 300.0;
            let got = round_trip(dtype, 2, 96, &row);
            assert_within_half_step(dtype, 96, &row, &got);
            assert!(
                (got[40] - 300.0).abs() < 0.5,
                "the outlier itself: {}",
                got[40]
            );
            let levels = if dtype == KvDtype::Int8 { 255.0 } else { 15.0 };
            for e in (0..row.len()).filter(|e| !(32..64).contains(e)) {
                assert!(
                    (row[e] - got[e]).abs() <= 1.01 / levels + 1e-3,
                    "element {e}"
                );
            }
        }
    }

    #[test]
    fn constant_and_extreme_groups_survive() {
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            let got = round_trip(dtype, 1, 32, &[0.25; 32]);
            assert!(got.iter().all(|&v| v == 0.25), "{got:?}");
            let mut row = vec![0.0; 40];
            row[3] = 1e6;
            row[35] = -1e6;
            let got = round_trip(dtype, 1, 40, &row);
            assert!(got.iter().all(|v| v.is_finite()), "{got:?}");
            assert!(got[3] >= 65504.0 && got[35] <= -65504.0, "{got:?}");
        }
    }
}
