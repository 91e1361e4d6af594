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
        for (kv_heads, head_dim, block_size) in [(3, 64, 16), (3, 40, 16), (2, 24, 8), (2, 9, 5)] {
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
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
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
