// Paged KV write: row t of K and V ([rows, width], width = kv_heads * head_dim)
// goes to slot SLOTS[t] of the layer's caches (slot = block * block_size + offset).
// Slots past the cache are skipped (the host validates what it can).
//
// F32 caches hold `width` f32 per slot. F16 caches (flag KV_F16) hold
// `2 * ceil(width / 2)` halves per slot so that every slot starts on a word:
// `f16` elements with shader-f16, packed u32 pairs (pack2x16float) without,
// the same bits either way. One thread per element, or per pair of elements
// for F16 caches.

struct Params {
    rows: u32,
    width: u32,
    num_slots: u32,
    // Storage units per slot: f32 values, or u32 words (pairs) for F16 caches.
    slot_units: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> V: array<f32>;
@group(0) @binding(3) var<storage, read> SLOTS: array<u32>;
// #if KV_F16
// #if F16
@group(0) @binding(4) var<storage, read_write> K_CACHE: array<f16>;
@group(0) @binding(5) var<storage, read_write> V_CACHE: array<f16>;
// #else
@group(0) @binding(4) var<storage, read_write> K_CACHE: array<u32>;
@group(0) @binding(5) var<storage, read_write> V_CACHE: array<u32>;
// #endif
// #else
@group(0) @binding(4) var<storage, read_write> K_CACHE: array<f32>;
@group(0) @binding(5) var<storage, read_write> V_CACHE: array<f32>;
// #endif

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * P.slot_units {
        return;
    }
    let t = i / P.slot_units;
    let unit = i % P.slot_units;
    let slot = SLOTS[t];
    if slot >= P.num_slots {
        return;
    }
    let dst = slot * P.slot_units + unit;
// #if KV_F16
    // Elements 2u, 2u+1 of the row; the odd tail of an odd width is padded with 0.
    let e = 2u * unit;
    let src = t * P.width + e;
    var k = vec2<f32>(K[src], 0.0);
    var v = vec2<f32>(V[src], 0.0);
    if e + 1u < P.width {
        k.y = K[src + 1u];
        v.y = V[src + 1u];
    }
// #if F16
    K_CACHE[2u * dst] = f16(k.x);
    K_CACHE[2u * dst + 1u] = f16(k.y);
    V_CACHE[2u * dst] = f16(v.x);
    V_CACHE[2u * dst + 1u] = f16(v.y);
// #else
    K_CACHE[dst] = pack2x16float(k);
    V_CACHE[dst] = pack2x16float(v);
// #endif
// #else
    K_CACHE[dst] = K[t * P.width + unit];
    V_CACHE[dst] = V[t * P.width + unit];
// #endif
}
