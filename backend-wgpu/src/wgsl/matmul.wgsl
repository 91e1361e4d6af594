// Matmul entry points shared by every shaders/matmul_FORMAT.wgsl, placed
// after the format file, which declares the weight binding `W` (binding 1) and
// `fn decode4(row, piece, cols) -> vec4<f32>`: the weight values at columns
// `4 * piece .. 4 * piece + 4` of local row `row`, zero past `cols`.
//
// out[t, row_start + r] = sum_c X[t, c] * W[r, c] (+ BIAS[row_start + r]) for
// the rows `r < chunk_rows` of one weight chunk (weights larger than the
// adapter's storage binding limit are split by rows; one dispatch per chunk).
//
// `gemv` serves few activation rows (decode): one workgroup per weight row,
// consecutive threads read consecutive 4-value pieces of the row (coalesced),
// each thread keeps one partial per activation row, then one reduction per
// activation row. `tiled` serves many rows (prefill): a 32x64 output tile per
// workgroup, stepping K by one 32-value block staged (dequantized) in
// workgroup memory, 2x4 outputs per thread. `gemv_rows` serves few rows on
// CPU adapters: one thread per weight row and no barriers, since there a
// barrier switches every invocation and `gemv`'s reductions dominate.

struct Params {
    rows: u32,
    cols: u32,
    // Row stride of OUT: the output features of the whole weight.
    n: u32,
    row_start: u32,
    chunk_rows: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 128u;
// Largest activation row count `gemv` takes; the host picks `tiled` above it.
const GEMV_MAX_ROWS: u32 = 8u;

fn x4(t: u32, c: u32) -> vec4<f32> {
    let base = t * P.cols + c;
    if c + 3u < P.cols {
        return vec4<f32>(X[base], X[base + 1u], X[base + 2u], X[base + 3u]);
    }
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if c + i < P.cols {
            v[i] = X[base + i];
        }
    }
    return v;
}

fn store(t: u32, r: u32, sum: f32) {
    let feature = P.row_start + r;
    var v = sum;
    if P.has_bias != 0u {
        v += BIAS[feature];
    }
    OUT[t * P.n + feature] = v;
}

@compute @workgroup_size(WG)
fn gemv(ids: Ids, group: Group) {
    let r = group_index(group);
    if r >= P.chunk_rows {
        return;
    }
    let pieces = (P.cols + 3u) / 4u;
    var acc: array<f32, GEMV_MAX_ROWS>;
    for (var p = ids.lid; p < pieces; p += WG) {
        let w = decode4(r, p, P.cols);
        for (var t = 0u; t < P.rows; t++) {
            acc[t] += dot(w, x4(t, 4u * p));
        }
    }
    let at = lane_of(ids);
    for (var t = 0u; t < P.rows; t++) {
        let sum = reduce_sum(acc[t], at);
        if ids.lid == 0u {
            store(t, r, sum);
        }
    }
}

const GEMV_ROWS_WG: u32 = 64u;

@compute @workgroup_size(GEMV_ROWS_WG)
fn gemv_rows(ids: Ids, group: Group) {
    let r = group_index(group) * GEMV_ROWS_WG + ids.lid;
    if r >= P.chunk_rows {
        return;
    }
    let pieces = (P.cols + 3u) / 4u;
    var acc: array<f32, GEMV_MAX_ROWS>;
    for (var p = 0u; p < pieces; p++) {
        let w = decode4(r, p, P.cols);
        for (var t = 0u; t < P.rows; t++) {
            acc[t] += dot(w, x4(t, 4u * p));
        }
    }
    for (var t = 0u; t < P.rows; t++) {
        store(t, r, acc[t]);
    }
}

const TILE_WG: u32 = 256u;
const TM: u32 = 32u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Row pitch of the staged tiles; the extra column spreads rows over banks.
const PITCH: u32 = TK + 1u;

var<workgroup> x_tile: array<f32, TM * PITCH>;
var<workgroup> w_tile: array<f32, TN * PITCH>;

@compute @workgroup_size(TILE_WG)
fn tiled(ids: Ids, group: Group) {
    let tiles_n = (P.chunk_rows + TN - 1u) / TN;
    let g = group_index(group);
    let t0 = (g / tiles_n) * TM;
    let r0 = (g % tiles_n) * TN;
    if t0 >= P.rows {
        return;
    }
    let lid = ids.lid;
    // Thread (tx, ty) owns activation rows 2ty, 2ty+1 and weight rows 4tx..4tx+4 of the tile.
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<f32, 8>;
    for (var k0 = 0u; k0 < P.cols; k0 += TK) {
        for (var i = 0u; i < TM * TK / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let tt = e / TK;
            let kk = e % TK;
            var v = 0.0;
            if t0 + tt < P.rows && k0 + kk < P.cols {
                v = X[(t0 + tt) * P.cols + k0 + kk];
            }
            x_tile[tt * PITCH + kk] = v;
        }
        for (var i = 0u; i < TN * (TK / 4u) / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let rr = e / (TK / 4u);
            let piece = e % (TK / 4u);
            var w = vec4<f32>(0.0);
            if r0 + rr < P.chunk_rows {
                w = decode4(r0 + rr, k0 / 4u + piece, P.cols);
            }
            let at = rr * PITCH + 4u * piece;
            w_tile[at] = w.x;
            w_tile[at + 1u] = w.y;
            w_tile[at + 2u] = w.z;
            w_tile[at + 3u] = w.w;
        }
        workgroupBarrier();
        for (var k = 0u; k < TK; k++) {
            let a0 = x_tile[(2u * ty) * PITCH + k];
            let a1 = x_tile[(2u * ty + 1u) * PITCH + k];
            for (var j = 0u; j < 4u; j++) {
                let b = w_tile[(4u * tx + j) * PITCH + k];
                acc[j] += a0 * b;
                acc[4u + j] += a1 * b;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 2u; i++) {
        let t = t0 + 2u * ty + i;
        for (var j = 0u; j < 4u; j++) {
            let r = r0 + 4u * tx + j;
            if t < P.rows && r < P.chunk_rows {
                store(t, r, acc[4u * i + j]);
            }
        }
    }
}
