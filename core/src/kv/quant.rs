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
mod tests;
