//! Quantized KV cache rows (INT8, INT4, INT2): the block layout every backend
//! stores, and the reference quantize/dequantize the CPU backend runs and
//! the GPU kernels reproduce.
//!
//! # Layout
//!
//! A cache is `[num_blocks, block_size]` slots, as for F32/F16; one slot holds
//! one token's K (or V) for all KV heads as `slot_words` little-endian u32
//! words (INT8 K and V, INT4 and INT2 V; INT4 and INT2 keys are per block,
//! see below). Each head's `head_dim` elements are cut into groups of
//! [`KV_GROUP`] (32) consecutive elements (the last group of a head may be
//! shorter; its codes are padded with zeros). With `G = kv_heads *
//! ceil(head_dim / 32)` groups per slot and `b` bits per code:
//!
//! | words of a slot | content |
//! |---|---|
//! | `[g * b, (g + 1) * b)` for group `g = head * groups_per_head + i` | the group's 32 codes, `32 / b` per word, element `e` in bits `b * (e % (32 / b))` of word `e / (32 / b)` |
//! | `G * b + g` | the group's parameters: f16 `scale` (low half), f16 `min` (high half) |
//!
//! so `slot_words = G * (b + 1)`: 9 bits per element for INT8, 5 for INT4,
//! 3 for INT2. A layer's keys and values may have different bits (the
//! plans of `--kv-dtype auto`, [`crate::kv::plan`]); each has its own slots.
//! Scales and zero points live in the slot itself, so copying a block
//! (copy-on-write) or truncating a sequence needs nothing beyond the codes'
//! own bookkeeping.
//!
//! # INT4 and INT2 keys
//!
//! INT4 and INT2 keys are quantized per channel over each KV block instead (KIVI):
//! key channels of SmolLM2-like models have very different ranges, so a
//! per-token group of 32 spends its 16 levels on the widest channel, while a
//! channel's range over a block's tokens is narrow (on SmolLM2-135M,
//! +11.4% perplexity per token against +1.4% per channel). Values keep the
//! per-token slots above. A key block of `block_size` tokens, `C = kv_heads *
//! head_dim` channels (`channel = head * head_dim + d`), `b` bits per code,
//! `n = 32 / b` codes per word (8 or 16) and `W = ceil(C / n)` code words per
//! token is `block_size * W + C` u32 words:
//!
//! | words of a block | content |
//! |---|---|
//! | `[t * W, (t + 1) * W)` for offset `t` | token `t`'s codes: channel `c` in bits `b * (c % n)` of word `c / n` (unused high codes of the last word are 0) |
//! | `block_size * W + c` | channel `c`'s parameters over the block's valid tokens: f16 `scale` (low half), f16 `min` (high half) |
//!
//! The valid tokens of a block are offsets `0..n` (tokens are appended in
//! position order; a rollback only shortens `n`). A write of the run of
//! offsets `first..=last` dequantizes offsets `0..first`, adds the new
//! values and quantizes offsets `0..=last` again per channel (codes past
//! `last`, a rolled-back tail, are zeroed). A prefill chunk thus quantizes a
//! block once from the exact values; decoding re-quantizes it as the range
//! grows. Re-quantizing under an unchanged range reproduces every code, so
//! a token whose values stay inside the range costs the others nothing. The
//! parameters live in the block, so copy-on-write copies whole blocks.
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

use std::ops::Range;

use crate::backend::KvDtype;

/// Elements per quantization group (the last group of a head may be shorter).
pub const KV_GROUP: usize = 32;

/// Largest finite f16: scales and zero points saturate there.
const F16_MAX: f32 = 65504.0;

/// Where a quantized slot keeps each group's codes and parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuantLayout {
    /// Bits per code: 8, 4 or 2.
    pub bits: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `ceil(head_dim / KV_GROUP)`.
    pub groups_per_head: usize,
}

impl KvQuantLayout {
    /// The layout of a quantized dtype; `None` for F32 and F16.
    pub fn new(dtype: KvDtype, kv_heads: usize, head_dim: usize) -> Option<Self> {
        let bits = dtype.code_bits()?;
        Some(KvQuantLayout {
            bits,
            kv_heads,
            head_dim,
            groups_per_head: head_dim.div_ceil(KV_GROUP),
        })
    }

    #[inline]
    pub fn groups(&self) -> usize {
        self.kv_heads * self.groups_per_head
    }

    /// u32 words of one slot (one token's K or V, all heads).
    #[inline]
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
                let (scale, min) = range_params(x.iter().copied(), self.max_code());
                params[g] = pack_params(scale, min);
                let (scale, min) = unpack_params(params[g]);
                let inv = inverse(scale);
                let words = &mut codes[g * self.bits..][..self.bits];
                for (e, &v) in x.iter().enumerate() {
                    let q = code(v, min, inv, self.max_code());
                    let shift = self.bits * (e % self.codes_per_word());
                    words[e / self.codes_per_word()] |= q << shift;
                }
            }
        }
    }

    /// Dequantizes head `head` of a slot into `out` (`head_dim` values).
    // Inlined into the CPU attention kernels, compiled there for their
    // instruction set: called once per key row, it is their inner loop.
    #[inline(always)]
    pub fn dequantize_head(&self, slot: &[u32], head: usize, out: &mut [f32]) {
        let params = &slot[self.groups() * self.bits..];
        for (i, out) in out[..self.head_dim].chunks_mut(KV_GROUP).enumerate() {
            let g = head * self.groups_per_head + i;
            let (scale, min) = unpack_params(params[g]);
            let words = &slot[g * self.bits..][..self.bits];
            match self.bits {
                2 => decode_codes::<2>(words, scale, min, out),
                4 => decode_codes::<4>(words, scale, min, out),
                8 => decode_codes::<8>(words, scale, min, out),
                bits => {
                    let per_word = 32 / bits;
                    for (e, o) in out.iter_mut().enumerate() {
                        let q = (words[e / per_word] >> (bits * (e % per_word))) & self.max_code();
                        *o = min + q as f32 * scale;
                    }
                }
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

/// Where an INT4 or INT2 key block keeps its codes and per-channel
/// parameters (layout table: module docs, "INT4 and INT2 keys").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyBlockLayout {
    /// Bits per code: 4 or 2.
    pub bits: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl KeyBlockLayout {
    /// The key layout of INT4 and INT2 caches; `None` for the others
    /// (whose keys are per-token slots like their values).
    pub fn new(
        dtype: KvDtype,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Option<Self> {
        let bits = match dtype {
            KvDtype::Int4 => 4,
            KvDtype::Int2 => 2,
            KvDtype::F32 | KvDtype::F16 | KvDtype::Int8 => return None,
        };
        Some(KeyBlockLayout {
            bits,
            kv_heads,
            head_dim,
            block_size,
        })
    }

    /// Channels of a token: `kv_heads * head_dim`.
    #[inline]
    pub fn channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Codes per u32 word: 8 or 16.
    #[inline]
    pub fn codes_per_word(&self) -> usize {
        32 / self.bits
    }

    #[inline]
    fn max_code(&self) -> u32 {
        (1 << self.bits) - 1
    }

    /// Code words of one token: `ceil(channels / codes_per_word)`.
    #[inline]
    pub fn words_per_token(&self) -> usize {
        self.channels().div_ceil(self.codes_per_word())
    }

    /// u32 words of one block: the tokens' codes, then one parameter word
    /// per channel.
    #[inline]
    pub fn block_words(&self) -> usize {
        self.block_size * self.words_per_token() + self.channels()
    }

    /// Writes `rows` (`n` tokens of `channels` values) at offsets
    /// `first..first + n` of `block`: the offsets `0..first` already there
    /// are the block's valid tokens and are dequantized, then all
    /// `first + n` tokens are quantized again per channel over their range.
    /// Later offsets (a rolled-back tail) are ignored and their codes zeroed.
    pub fn write_run(&self, block: &mut [u32], first: usize, rows: &[f32]) {
        let channels = self.channels();
        let len = first + rows.len() / channels;
        assert!(len <= self.block_size, "a run past the end of its block");
        let mut tokens = vec![0.0; len * channels];
        let (old, new) = tokens.split_at_mut(first * channels);
        for (offset, out) in old.chunks_exact_mut(channels).enumerate() {
            self.dequantize_token(block, offset, out);
        }
        new.copy_from_slice(&rows[..new.len()]);
        self.quantize_block(&tokens, block);
    }

    /// Quantizes `tokens` (the block's `len <= block_size` valid tokens of
    /// `channels` values, offsets `0..len`) into `block`, each channel over
    /// its range in those tokens; codes of offsets `len..` are zero.
    pub fn quantize_block(&self, tokens: &[f32], block: &mut [u32]) {
        let channels = self.channels();
        let per_token = self.words_per_token();
        let per_word = self.codes_per_word();
        let (codes, params) = block[..self.block_words()].split_at_mut(self.block_size * per_token);
        codes.fill(0);
        for (c, param) in params.iter_mut().enumerate() {
            let column = || tokens.iter().skip(c).step_by(channels).copied();
            let (scale, min) = range_params(column(), self.max_code());
            *param = pack_params(scale, min);
            let (scale, min) = unpack_params(*param);
            let inv = inverse(scale);
            let shift = self.bits * (c % per_word);
            for (offset, x) in column().enumerate() {
                codes[offset * per_token + c / per_word] |=
                    code(x, min, inv, self.max_code()) << shift;
            }
        }
    }

    /// Dequantizes head `head` of the token at `offset` into `out`
    /// (`head_dim` values).
    #[inline(always)]
    pub fn dequantize_head(&self, block: &[u32], offset: usize, head: usize, out: &mut [f32]) {
        self.dequantize_head_tokens(block, offset..offset + 1, head, out);
    }

    /// Dequantizes head `head` of the tokens at `offsets` into `out`, one
    /// token's `head_dim` values after the other. Each channel's parameters
    /// are decoded once for all the tokens: a key tile reads sixteen tokens
    /// of one block, and decoding the two f16 parameters of every element
    /// cost more than the rest of its dequantization.
    // Inlined into the CPU attention kernels, compiled there for their
    // instruction set: called once per key tile, it is their inner loop.
    #[inline(always)]
    pub fn dequantize_head_tokens(
        &self,
        block: &[u32],
        offsets: Range<usize>,
        head: usize,
        out: &mut [f32],
    ) {
        let per_token = self.words_per_token();
        let hd = self.head_dim;
        let first = head * hd;
        let params = &block[self.block_size * per_token + first..][..hd];
        let out = &mut out[..offsets.len() * hd];
        const WORD: usize = 8;
        // Sixteen channels at a time as loops of fixed length (vector
        // code) where the head starts a word, then channel by channel.
        const RUN: usize = 2 * WORD;
        let whole = if self.bits == 4 && first.is_multiple_of(WORD) {
            hd / RUN * RUN
        } else {
            0
        };
        for (run, params) in params[..whole].chunks_exact(RUN).enumerate() {
            let (mut scales, mut mins) = ([0f32; RUN], [0f32; RUN]);
            for ((scale, min), &p) in scales.iter_mut().zip(&mut mins).zip(params) {
                (*scale, *min) = unpack_params(p);
            }
            let word = (first + run * RUN) / WORD;
            for (offset, out) in offsets.clone().zip(out.chunks_exact_mut(hd)) {
                let codes: [u8; RUN] = nibbles(&block[offset * per_token + word..][..2]);
                let out = &mut out[run * RUN..][..RUN];
                for (((o, &q), &scale), &min) in out.iter_mut().zip(&codes).zip(&scales).zip(&mins)
                {
                    *o = min + f32::from(q) * scale;
                }
            }
        }
        let (per_word, mask) = (self.codes_per_word(), self.max_code());
        for (d, &p) in params.iter().enumerate().skip(whole) {
            let c = first + d;
            let (scale, min) = unpack_params(p);
            for (offset, out) in offsets.clone().zip(out.chunks_exact_mut(hd)) {
                let q = (block[offset * per_token + c / per_word] >> (self.bits * (c % per_word)))
                    & mask;
                out[d] = min + q as f32 * scale;
            }
        }
    }

    /// Dequantizes the token at `offset` into `out` (`channels` values).
    pub fn dequantize_token(&self, block: &[u32], offset: usize, out: &mut [f32]) {
        for (head, out) in out.chunks_exact_mut(self.head_dim).enumerate() {
            self.dequantize_head(block, offset, head, out);
        }
    }
}

/// Dequantizes a group's `BITS`-bit codes (`32 / BITS` per word, lowest
/// bits first) into `out`.
#[inline(always)]
fn decode_codes<const BITS: usize>(words: &[u32], scale: f32, min: f32, out: &mut [f32]) {
    let mask = (1u32 << BITS) - 1;
    let per_word = 32 / BITS;
    // A whole group (every one but a short head's last) as bytes of codes
    // first, then one loop of fixed length over them: vector code, where
    // indexing the words per code makes the compiler gather.
    if let (Ok(out), Some(words), 4 | 8) = (
        <&mut [f32; KV_GROUP]>::try_from(&mut *out),
        words.get(..KV_GROUP / per_word),
        BITS,
    ) {
        let codes: [u8; KV_GROUP] = if BITS == 8 {
            le_bytes(words)
        } else {
            nibbles(words)
        };
        for (o, &q) in out.iter_mut().zip(&codes) {
            *o = min + f32::from(q) * scale;
        }
        return;
    }
    for (&word, out) in words.iter().zip(out.chunks_mut(per_word)) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = min + ((word >> (BITS * k)) & mask) as f32 * scale;
        }
    }
}

/// The first `N` bytes of `words`, little-endian.
#[inline(always)]
fn le_bytes<const N: usize>(words: &[u32]) -> [u8; N] {
    let mut bytes = [0u8; N];
    for (word, bytes) in words.iter().zip(bytes.chunks_exact_mut(4)) {
        bytes.copy_from_slice(&word.to_le_bytes());
    }
    bytes
}

/// The first `N` four-bit codes of `words`, lowest bits first.
#[inline(always)]
fn nibbles<const N: usize>(words: &[u32]) -> [u8; N] {
    let mut codes = [0u8; N];
    let bytes: [u8; 32] = le_bytes(words);
    for (i, &b) in bytes[..N / 2].iter().enumerate() {
        (codes[2 * i], codes[2 * i + 1]) = (b & 15, b >> 4);
    }
    codes
}

/// `(scale, min)` of a group (or channel) before f16 rounding.
fn range_params(x: impl Iterator<Item = f32>, max_code: u32) -> (f32, f32) {
    let (lo, hi) = x.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    (
        ((hi - lo) / max_code as f32).min(F16_MAX),
        lo.clamp(-F16_MAX, F16_MAX),
    )
}

/// `1 / scale` with the f16-rounded scale; 0 for a constant group.
fn inverse(scale: f32) -> f32 {
    if scale > 0.0 {
        1.0 / scale
    } else {
        0.0
    }
}

/// The code of `x` for the rounded `min` and `inv = 1 / scale`.
fn code(x: f32, min: f32, inv: f32, max_code: u32) -> u32 {
    ((x - min) * inv + 0.5).floor().clamp(0.0, max_code as f32) as u32
}

fn pack_params(scale: f32, min: f32) -> u32 {
    let scale = half::f16::from_f32(scale).to_bits() as u32;
    let min = half::f16::from_f32(min).to_bits() as u32;
    scale | (min << 16)
}

// Attention reads every cached element through here, so it must inline:
// half's own conversion is an out-of-line call with a CPU-feature dispatch.
#[inline(always)]
fn unpack_params(word: u32) -> (f32, f32) {
    (f16_to_f32(word as u16), f16_to_f32((word >> 16) as u16))
}

/// Exact f16 → f32 for every f16: the bits moved into f32 position are the
/// value scaled by 2^-112 (normal or subnormal alike), so one multiply by
/// 2^112 restores it; infinities and NaN get the f32 exponent of all ones.
/// A select, not a branch, so that loops over parameters vectorize.
#[inline(always)]
fn f16_to_f32(bits: u16) -> f32 {
    let magnitude = (bits & 0x7fff) as u32;
    let finite = f32::from_bits(magnitude << 13) * f32::from_bits(0x7780_0000);
    let special = f32::from_bits((magnitude << 13) | 0x7f80_0000);
    let value = if magnitude >= 0x7c00 { special } else { finite };
    f32::from_bits(value.to_bits() | ((bits as u32 & 0x8000) << 16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} instead of {want}"
            );
        }
    }

    /// `len` values uniform in `[-1, 1)`.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::sched::Rng::new(seed);
        (0..len)
            .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
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

    /// Each key element comes back within half a step (plus f16 rounding of
    /// the parameters) of its channel's range over `tokens`.
    fn assert_keys_within(keys: &KeyBlockLayout, tokens: &[f32], got: &[f32], steps: f32) {
        let c = keys.channels();
        for ch in 0..c {
            let column: Vec<f32> = tokens.iter().skip(ch).step_by(c).copied().collect();
            let lo = column.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = column.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let bound = steps * (hi - lo) / 15.0 + 2e-3 * hi.abs().max(lo.abs()) + 1e-6;
            for (t, &x) in column.iter().enumerate() {
                let y = got[t * c + ch];
                assert!(
                    (x - y).abs() <= bound,
                    "{keys:?} token {t} channel {ch}: {x} came back as {y} (bound {bound})"
                );
            }
        }
    }

    fn dequantize_keys(keys: &KeyBlockLayout, block: &[u32], len: usize) -> Vec<f32> {
        let c = keys.channels();
        let mut out = vec![f32::NAN; len * c];
        for (t, out) in out.chunks_exact_mut(c).enumerate() {
            keys.dequantize_token(block, t, out);
        }
        out
    }

    fn key_layout(kv_heads: usize, head_dim: usize, block_size: usize) -> KeyBlockLayout {
        KeyBlockLayout::new(KvDtype::Int4, kv_heads, head_dim, block_size).unwrap()
    }

    /// INT2 key blocks: 16 codes per word, each key back within half of its
    /// channel's step (range / 3), over runs written one after another.
    #[test]
    fn int2_key_blocks_keep_each_channel_within_half_a_step() {
        let keys = KeyBlockLayout::new(KvDtype::Int2, 3, 20, 5).unwrap();
        assert_eq!(keys.words_per_token(), 4);
        assert_eq!(keys.block_words(), 5 * 4 + 60);
        let mut rng = 7u32;
        let mut next = || {
            rng = rng.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (rng >> 8) as f32 / (1 << 24) as f32 * 4.0 - 2.0
        };
        let tokens: Vec<f32> = (0..5 * 60).map(|_| next()).collect();
        let mut block = vec![u32::MAX; keys.block_words()];
        keys.write_run(&mut block, 0, &tokens[..2 * 60]);
        keys.write_run(&mut block, 2, &tokens[2 * 60..]);
        let got = dequantize_keys(&keys, &block, 5);
        // The first two tokens went through one re-quantization: a step more.
        let c = keys.channels();
        for ch in 0..c {
            let column: Vec<f32> = tokens.iter().skip(ch).step_by(c).copied().collect();
            let lo = column.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = column.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (t, &x) in column.iter().enumerate() {
                let steps = if t < 2 { 1.5 } else { 0.5 };
                let bound = steps * (hi - lo) / 3.0 + 4e-3;
                assert!(
                    (x - got[t * c + ch]).abs() <= bound,
                    "token {t} channel {ch}"
                );
            }
        }
    }

    #[test]
    fn key_blocks_follow_the_documented_layout() {
        let keys = key_layout(3, 64, 16);
        assert_eq!(keys.words_per_token(), 24);
        assert_eq!(keys.block_words(), 16 * 24 + 192);
        assert_eq!(key_layout(3, 7, 5).block_words(), 5 * 3 + 21);
        assert!(KeyBlockLayout::new(KvDtype::Int8, 3, 64, 16).is_none());
        // SmolLM2-135M: 96 + 48 key bytes and 120 value bytes per token.
        assert_eq!(KvDtype::Int4.bytes_per_token(3, 64, 16), 264);
        assert_eq!(KvDtype::F16.bytes_per_token(3, 64, 16), 768);
        // Token 1, channel 10 of 21 (head 1, d 3): word 1, bits 8..12;
        // parameters of channel 10 after the 5 * 3 code words.
        let keys = key_layout(3, 7, 5);
        let mut block = vec![0u32; keys.block_words()];
        block[3 + 1] = 0xd << 8;
        block[15 + 10] = pack_params(0.5, -1.0);
        let mut head = [0.0; 7];
        keys.dequantize_head(&block, 1, 1, &mut head);
        assert_eq!(head, [0.0, 0.0, 0.0, 5.5, 0.0, 0.0, 0.0]);
    }

    /// A run of tokens read at once (a key tile) has the bits the layout
    /// gives each token alone, whichever channels start a word.
    #[test]
    fn key_tokens_read_together_match_each_alone() {
        for dtype in [KvDtype::Int4, KvDtype::Int2] {
            for (kv_heads, head_dim, block_size) in
                [(3, 64, 16), (3, 40, 16), (2, 24, 8), (2, 9, 5)]
            {
                let keys = KeyBlockLayout::new(dtype, kv_heads, head_dim, block_size).unwrap();
                let tokens = values(block_size * keys.channels(), head_dim as u64);
                let mut block = vec![0u32; keys.block_words()];
                keys.quantize_block(&tokens, &mut block);
                for head in 0..kv_heads {
                    for offsets in [0..block_size, 1..block_size - 1, 2..3] {
                        let mut together = vec![f32::NAN; offsets.len() * head_dim];
                        keys.dequantize_head_tokens(&block, offsets.clone(), head, &mut together);
                        for (offset, got) in offsets.zip(together.chunks_exact(head_dim)) {
                            // Channel by channel, as the layout table reads.
                            let (w, n) = (keys.words_per_token(), keys.codes_per_word());
                            let alone: Vec<f32> = (head * head_dim..(head + 1) * head_dim)
                                .map(|c| {
                                    let word = block[offset * w + c / n] >> (keys.bits * (c % n));
                                    let (scale, min) = unpack_params(block[block_size * w + c]);
                                    min + (word & keys.max_code()) as f32 * scale
                                })
                                .collect();
                            let bits =
                                |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(got),
                                bits(&alone),
                                "{dtype:?} head {head} offset {offset}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Whole blocks and partly filled ones, with an outlier channel whose
    /// range leaves the other channels' steps alone.
    #[test]
    fn key_blocks_round_trip_per_channel() {
        for (kv_heads, head_dim, block_size) in [(3, 40, 16), (3, 7, 5), (1, 7, 16), (2, 9, 5)] {
            let keys = key_layout(kv_heads, head_dim, block_size);
            let c = keys.channels();
            for len in [1, 2, block_size - 1, block_size] {
                let mut tokens = values(len * c, (c * 100 + len) as u64);
                for t in 0..len {
                    tokens[t * c + c / 2] = 40.0 * (t as f32 - 2.0);
                }
                let mut block = vec![u32::MAX; keys.block_words()];
                keys.quantize_block(&tokens, &mut block);
                let got = dequantize_keys(&keys, &block, len);
                assert_keys_within(&keys, &tokens, &got, 0.5);
                for (i, (&x, &y)) in tokens.iter().zip(&got).enumerate() {
                    if i % c != c / 2 {
                        assert!(
                            (x - y).abs() <= 1.0 / 15.0 + 1e-3,
                            "element {i}: {x} vs {y}"
                        );
                    }
                }
                let per_token = keys.words_per_token();
                assert!(
                    block[len * per_token..block_size * per_token]
                        .iter()
                        .all(|&w| w == 0),
                    "codes past the valid tokens are zero"
                );
            }
        }
    }

    /// Decoding writes a block one token at a time, re-quantizing the earlier
    /// tokens as the range grows; a prefill writes it at once. Both stay near
    /// the exact values: at once within half a step, one at a time within
    /// 2.5 steps of the range so far (each widening of a channel's range
    /// rounds its earlier tokens again; uniform random tokens, which widen
    /// it often, came within 1.91 steps over 200 blocks of 16 x 120).
    #[test]
    fn key_blocks_written_token_by_token_stay_close() {
        for (kv_heads, head_dim, block_size, seed) in [
            (3, 40, 16, 1),
            (3, 40, 16, 2),
            (3, 40, 16, 3),
            (3, 7, 5, 4),
            (1, 7, 16, 5),
        ] {
            let keys = key_layout(kv_heads, head_dim, block_size);
            let c = keys.channels();
            let tokens = values(block_size * c, seed);
            let mut at_once = vec![0u32; keys.block_words()];
            keys.write_run(&mut at_once, 0, &tokens);
            assert_keys_within(
                &keys,
                &tokens,
                &dequantize_keys(&keys, &at_once, block_size),
                0.5,
            );
            let mut one_by_one = vec![0u32; keys.block_words()];
            for (t, row) in tokens.chunks_exact(c).enumerate() {
                keys.write_run(&mut one_by_one, t, row);
                let got = dequantize_keys(&keys, &one_by_one, t + 1);
                assert_keys_within(&keys, &tokens[..(t + 1) * c], &got, 2.5);
            }
        }
    }

    /// A token inside every channel's range leaves the parameters and the
    /// earlier tokens' codes exactly as they were.
    #[test]
    fn requantizing_under_an_unchanged_range_keeps_every_code() {
        for (kv_heads, head_dim, block_size) in [(3, 40, 16), (3, 7, 5)] {
            let keys = key_layout(kv_heads, head_dim, block_size);
            let c = keys.channels();
            let len = block_size - 1;
            let mut tokens = values(len * c, 5 + c as u64);
            tokens[c + 1] = 1000.0;
            let mut block = vec![0u32; keys.block_words()];
            keys.write_run(&mut block, 0, &tokens);
            let before = block.clone();
            let inside = dequantize_keys(&keys, &block, 1);
            keys.write_run(&mut block, len, &inside);
            let per_token = keys.words_per_token();
            assert_eq!(block[..len * per_token], before[..len * per_token]);
            assert_eq!(
                block[block_size * per_token..],
                before[block_size * per_token..]
            );
            assert_eq!(
                block[len * per_token..][..per_token],
                before[..per_token],
                "the new token has token 0's codes"
            );
        }
    }

    /// After a rollback to offset 4, the stale tokens 4.. (huge values) are
    /// not part of the range, and their codes are cleared: the block is
    /// exactly its 4 valid tokens plus the new one, quantized afresh.
    #[test]
    fn a_rewrite_after_rollback_ignores_the_stale_tail() {
        for (kv_heads, head_dim, block_size) in [(3, 7, 16), (3, 40, 5)] {
            let keys = key_layout(kv_heads, head_dim, block_size);
            let c = keys.channels();
            let tokens = values(5 * c, 17);
            let mut block = vec![0u32; keys.block_words()];
            keys.write_run(&mut block, 0, &tokens[..4 * c]);
            let stale = vec![500.0; (block_size - 4) * c];
            keys.write_run(&mut block, 4, &stale[..c]);
            keys.write_run(&mut block, 5, &stale[c..]);
            let mut want_tokens = dequantize_keys(&keys, &block, 4);
            want_tokens.extend_from_slice(&tokens[4 * c..]);
            keys.write_run(&mut block, 4, &tokens[4 * c..]);
            let mut want = vec![u32::MAX; keys.block_words()];
            keys.quantize_block(&want_tokens, &mut want);
            assert_eq!(block, want);
            let got = dequantize_keys(&keys, &block, 5);
            assert_keys_within(&keys, &want_tokens, &got, 0.5);
        }
    }
}
