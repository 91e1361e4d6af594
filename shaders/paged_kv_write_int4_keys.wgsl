// INT4 and INT2 paged KV write, keys: row t of K ([rows, channels], channels
// = kv_heads * head_dim) goes to slot SLOTS[t] of the layer's key cache,
// which is quantized per channel over each block at `bits` bits per code
// (the values go through paged_kv_write_quant.wgsl). Block layout
// (tandem_core::kv::quant, "INT4 and INT2 keys"): with n = 32 / bits codes
// per word, a block of block_size tokens is block_size * W + channels u32
// words, W = ceil(channels / n): token t's codes in words [t * W, (t + 1) *
// W), channel c in bits bits * (c % n) of word c / n; then channel c's f16
// scale (low half) and f16 min (high half) in word block_size * W + c.
//
// Rows of one block are consecutive in a call, at consecutive offsets, and
// the block's valid tokens before the call are offsets [0, first) (tokens
// are appended in position order; after a rollback the stale tail is
// ignored). One thread per (row, code word): only the first row of a run of
// rows in one block works. It dequantizes the block's valid tokens in its n
// channels, adds the run's values, and quantizes offsets [0, last] again per
// channel over their range (asymmetric: scale = (max - min) / (2^bits - 1),
// both rounded to f16 and saturating at 65504, code = floor((x - min) /
// scale + 0.5) clamped to [0, 2^bits - 1]); offsets past `last` get code 0. It owns whole
// words, so no two threads touch one. Slots past the cache are skipped.

struct Params {
    rows: u32,
    channels: u32,
    block_size: u32,
    num_slots: u32,
    bits: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> SLOTS: array<u32>;
@group(0) @binding(3) var<storage, read_write> K_CACHE: array<u32>;

const WG: u32 = 64u;
// Most codes per word (INT2).
const LANES: u32 = 16u;
const F16_MAX: f32 = 65504.0;

// Block holding a slot, or NO_BLOCK for a slot past the cache.
const NO_BLOCK: u32 = 0xffffffffu;

fn block_of(t: u32) -> u32 {
    let slot = SLOTS[t];
    if slot >= P.num_slots {
        return NO_BLOCK;
    }
    return slot / P.block_size;
}

fn code_of(x: f32, zero: f32, inv: f32, max_code: f32) -> u32 {
    return u32(clamp(floor((x - zero) * inv + 0.5), 0.0, max_code));
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let per_word = 32u / P.bits;
    let mask = (1u << P.bits) - 1u;
    let max_code = f32(mask);
    let per_token = (P.channels + per_word - 1u) / per_word;
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * per_token {
        return;
    }
    let t = i / per_token;
    let w = i % per_token;
    let block = block_of(t);
    if block == NO_BLOCK || (t > 0u && block_of(t - 1u) == block) {
        return;
    }
    var run = 1u;
    while t + run < P.rows && block_of(t + run) == block {
        run++;
    }
    let first = SLOTS[t] % P.block_size;
    let last = min(first + run - 1u, P.block_size - 1u);
    let base = block * (P.block_size * per_token + P.channels);
    let params_at = base + P.block_size * per_token;
    let c0 = w * per_word;
    let lanes = min(per_word, P.channels - c0);

    // The old parameters, then each channel's range over the valid tokens
    // and the run's values.
    var old_scale: array<f32, LANES>;
    var old_min: array<f32, LANES>;
    var lo: array<f32, LANES>;
    var hi: array<f32, LANES>;
    for (var k = 0u; k < lanes; k++) {
        let old = unpack2x16float(K_CACHE[params_at + c0 + k]);
        old_scale[k] = old.x;
        old_min[k] = old.y;
        lo[k] = 3.0e38;
        hi[k] = -3.0e38;
    }
    for (var o = 0u; o <= last; o++) {
        var word = 0u;
        if o < first {
            word = K_CACHE[base + o * per_token + w];
        }
        for (var k = 0u; k < lanes; k++) {
            var x: f32;
            if o < first {
                x = old_min[k] + f32((word >> (P.bits * k)) & mask) * old_scale[k];
            } else {
                x = K[(t + o - first) * P.channels + c0 + k];
            }
            lo[k] = min(lo[k], x);
            hi[k] = max(hi[k], x);
        }
    }

    var new_min: array<f32, LANES>;
    var inv: array<f32, LANES>;
    var packed: array<u32, LANES>;
    for (var k = 0u; k < lanes; k++) {
        packed[k] = pack2x16float(vec2<f32>(
            min((hi[k] - lo[k]) / max_code, F16_MAX),
            clamp(lo[k], -F16_MAX, F16_MAX),
        ));
        let rounded = unpack2x16float(packed[k]);
        new_min[k] = rounded.y;
        inv[k] = 0.0;
        if rounded.x > 0.0 {
            inv[k] = 1.0 / rounded.x;
        }
    }

    for (var o = 0u; o < P.block_size; o++) {
        let at = base + o * per_token + w;
        var word = 0u;
        if o <= last {
            var old_word = 0u;
            if o < first {
                old_word = K_CACHE[at];
            }
            for (var k = 0u; k < lanes; k++) {
                var x: f32;
                if o < first {
                    x = old_min[k] + f32((old_word >> (P.bits * k)) & mask) * old_scale[k];
                } else {
                    x = K[(t + o - first) * P.channels + c0 + k];
                }
                word |= code_of(x, new_min[k], inv[k], max_code) << (P.bits * k);
            }
        }
        K_CACHE[at] = word;
    }
    for (var k = 0u; k < lanes; k++) {
        K_CACHE[params_at + c0 + k] = packed[k];
    }
}
