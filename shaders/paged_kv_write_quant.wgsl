// Quantized paged KV write (INT8, INT4, INT2): row t of K and V ([rows,
// width], width = kv_heads * head_dim) is quantized into slot SLOTS[t] of the
// layer's caches, K and V each at its own bits. Slot layout
// (tandem_core::kv::quant): `slot_words` u32 words per slot; group g (head * groups_per_head + i, 32 elements, the
// last of a head possibly shorter) keeps its codes in words
// [g * bits, (g + 1) * bits), `32 / bits` codes per word from the low bits
// up, and its f16 scale (low half) and f16 min (high half) in word
// `groups * bits + g`. Asymmetric: scale = (max - min) / (2^bits - 1), both
// rounded to f16 (saturating at 65504), code = floor((x - min) / scale + 0.5)
// clamped to [0, 2^bits - 1]. One thread per (row, group) quantizes that
// group of V, and of K unless `keys` is 0: INT4 keys are quantized per
// channel over each block by paged_kv_write_int4_keys.wgsl. Slots past the
// cache are skipped.

struct Params {
    rows: u32,
    kv_heads: u32,
    head_dim: u32,
    groups_per_head: u32,
    num_slots: u32,
    key_slot_words: u32,
    key_bits: u32,
    value_slot_words: u32,
    value_bits: u32,
    // 1: K is written here too; 0: V only (INT4, whose keys are per block).
    keys: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> V: array<f32>;
@group(0) @binding(3) var<storage, read> SLOTS: array<u32>;
@group(0) @binding(4) var<storage, read_write> K_CACHE: array<u32>;
@group(0) @binding(5) var<storage, read_write> V_CACHE: array<u32>;

const WG: u32 = 64u;
const GROUP: u32 = 32u;
const F16_MAX: f32 = 65504.0;

// Input element i of K (which == 0) or V.
fn load(which: u32, i: u32) -> f32 {
    if which == 0u {
        return K[i];
    }
    return V[i];
}

fn store(which: u32, i: u32, word: u32) {
    if which == 0u {
        K_CACHE[i] = word;
    } else {
        V_CACHE[i] = word;
    }
}

// Quantizes `len` inputs from `src` as group g of the slot starting at word
// `base`, at `bits` bits per code.
fn quantize_group(which: u32, src: u32, len: u32, base: u32, g: u32, bits: u32) {
    let max_code = (1u << bits) - 1u;
    let per_word = 32u / bits;
    var lo = 3.0e38;
    var hi = -3.0e38;
    for (var e = 0u; e < len; e++) {
        let x = load(which, src + e);
        lo = min(lo, x);
        hi = max(hi, x);
    }
    let params = pack2x16float(vec2<f32>(
        min((hi - lo) / f32(max_code), F16_MAX),
        clamp(lo, -F16_MAX, F16_MAX),
    ));
    let rounded = unpack2x16float(params);
    let scale = rounded.x;
    let zero = rounded.y;
    var inv = 0.0;
    if scale > 0.0 {
        inv = 1.0 / scale;
    }
    for (var w = 0u; w < bits; w++) {
        var word = 0u;
        for (var k = 0u; k < per_word; k++) {
            let e = w * per_word + k;
            if e < len {
                let q = clamp(floor((load(which, src + e) - zero) * inv + 0.5), 0.0, f32(max_code));
                word |= u32(q) << (k * bits);
            }
        }
        store(which, base + g * bits + w, word);
    }
    store(which, base + P.kv_heads * P.groups_per_head * bits + g, params);
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let groups = P.kv_heads * P.groups_per_head;
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * groups {
        return;
    }
    let t = i / groups;
    let g = i % groups;
    let slot = SLOTS[t];
    if slot >= P.num_slots {
        return;
    }
    let head = g / P.groups_per_head;
    let first = (g % P.groups_per_head) * GROUP;
    let len = min(GROUP, P.head_dim - first);
    let src = t * P.kv_heads * P.head_dim + head * P.head_dim + first;
    if P.keys != 0u {
        quantize_group(0u, src, len, slot * P.key_slot_words, g, P.key_bits);
    }
    quantize_group(1u, src, len, slot * P.value_slot_words, g, P.value_bits);
}
