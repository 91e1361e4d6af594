// matmul with W8A8 weights (SmoothQuant): out[t, r] = s_r * a_t *
// sum_c q_x[t, c] * q_w[r, c] (+ bias[r]), where every activation row is
// quantized to INT8 here, per token, as tandem_core::quant::
// quantize_activation_row_i8 defines: a_t = max_c |x[t, c]| / 127 and
// q_x = round(x * 127 / max|x|) (ties to even, WGSL's `round`). Products of
// the INT8 quants are summed in i32; only the final sum becomes f32.
// The weight bytes are INT8's: the generator places matmul_int8.wgsl
// (binding 1 `W`, `row_scale`, `quants4`) before this file. `cols` is a
// multiple of 32. Entry points, bindings and dispatch as in
// backend-wgpu/src/wgsl/matmul.wgsl: `gemv` for up to 8 activation rows (one
// workgroup per weight row), `gemv_rows` for them on software adapters (one
// thread per weight row), `tiled` above (32 activation rows x 64 weight rows
// per workgroup).

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
const GEMV_MAX_ROWS: u32 = 8u;

// 127 / max|x| of a row, 0 for an all-zero row (whose quants are all 0).
fn inverse_scale(amax: f32) -> f32 {
    return select(0.0, 127.0 / amax, amax > 0.0);
}

// The INT8 quants of activations `t, c .. c + 4`.
fn quant_x4(t: u32, c: u32, inverse: f32) -> vec4<i32> {
    let base = t * P.cols + c;
    let x = vec4<f32>(X[base], X[base + 1u], X[base + 2u], X[base + 3u]);
    return vec4<i32>(clamp(round(x * inverse), vec4<f32>(-127.0), vec4<f32>(127.0)));
}

fn store(t: u32, r: u32, sum: i32, x_scale: f32) {
    let feature = P.row_start + r;
    var v = f32(sum) * (row_scale(r, P.cols) * x_scale);
    if P.has_bias != 0u {
        v += BIAS[feature];
    }
    OUT[t * P.n + feature] = v;
}

var<workgroup> gemv_sums: array<atomic<i32>, GEMV_MAX_ROWS>;

@compute @workgroup_size(WG)
fn gemv(ids: Ids, group: Group) {
    let r = group_index(group);
    if r >= P.chunk_rows {
        return;
    }
    let at = lane_of(ids);
    if ids.lid < GEMV_MAX_ROWS {
        atomicStore(&gemv_sums[ids.lid], 0);
    }
    var inverse: array<f32, GEMV_MAX_ROWS>;
    var x_scale: array<f32, GEMV_MAX_ROWS>;
    for (var t = 0u; t < P.rows; t++) {
        var m = 0.0;
        for (var c = ids.lid; c < P.cols; c += WG) {
            m = max(m, abs(X[t * P.cols + c]));
        }
        let amax = reduce_max(m, at);
        inverse[t] = inverse_scale(amax);
        x_scale[t] = amax / 127.0;
    }
    let pieces = P.cols / 4u;
    var acc: array<i32, GEMV_MAX_ROWS>;
    for (var p = ids.lid; p < pieces; p += WG) {
        let w = quants4(r, p, P.cols);
        for (var t = 0u; t < P.rows; t++) {
            acc[t] += dot(w, quant_x4(t, 4u * p, inverse[t]));
        }
    }
    for (var t = 0u; t < P.rows; t++) {
        atomicAdd(&gemv_sums[t], acc[t]);
    }
    workgroupBarrier();
    if ids.lid == 0u {
        for (var t = 0u; t < P.rows; t++) {
            store(t, r, atomicLoad(&gemv_sums[t]), x_scale[t]);
        }
    }
}

const GEMV_ROWS_WG: u32 = 64u;

// One thread per weight row (software adapters): each thread finds the
// activation rows' scales itself.
@compute @workgroup_size(GEMV_ROWS_WG)
fn gemv_rows(ids: Ids, group: Group) {
    let r = group_index(group) * GEMV_ROWS_WG + ids.lid;
    if r >= P.chunk_rows {
        return;
    }
    let pieces = P.cols / 4u;
    for (var t = 0u; t < P.rows; t++) {
        var amax = 0.0;
        for (var c = 0u; c < P.cols; c++) {
            amax = max(amax, abs(X[t * P.cols + c]));
        }
        let inverse = inverse_scale(amax);
        var acc = 0;
        for (var p = 0u; p < pieces; p++) {
            acc += dot(quants4(r, p, P.cols), quant_x4(t, 4u * p, inverse));
        }
        store(t, r, acc, amax / 127.0);
    }
}

const TILE_WG: u32 = 256u;
const TM: u32 = 32u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Row pitch of the staged tiles; the extra column spreads rows over banks.
const PITCH: u32 = TK + 1u;

var<workgroup> x_quants: array<i32, TM * PITCH>;
var<workgroup> w_quants: array<i32, TN * PITCH>;
// max|x| of the tile's activation rows, as the bits of a non-negative f32
// (which order like the floats).
var<workgroup> amax_bits: array<atomic<u32>, TM>;

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
    if lid < TM {
        atomicStore(&amax_bits[lid], 0u);
    }
    workgroupBarrier();
    {
        // 8 threads per activation row.
        let tt = lid / 8u;
        var m = 0.0;
        if t0 + tt < P.rows {
            for (var c = lid % 8u; c < P.cols; c += 8u) {
                m = max(m, abs(X[(t0 + tt) * P.cols + c]));
            }
        }
        atomicMax(&amax_bits[tt], bitcast<u32>(m));
    }
    workgroupBarrier();
    // Thread (tx, ty) owns activation rows 2ty, 2ty+1 and weight rows 4tx..4tx+4 of the tile.
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<i32, 8>;
    for (var k0 = 0u; k0 < P.cols; k0 += TK) {
        for (var i = 0u; i < TM * (TK / 4u) / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let tt = e / (TK / 4u);
            let piece = e % (TK / 4u);
            var q = vec4<i32>(0);
            if t0 + tt < P.rows {
                let inverse = inverse_scale(bitcast<f32>(atomicLoad(&amax_bits[tt])));
                q = quant_x4(t0 + tt, k0 + 4u * piece, inverse);
            }
            let at = tt * PITCH + 4u * piece;
            x_quants[at] = q.x;
            x_quants[at + 1u] = q.y;
            x_quants[at + 2u] = q.z;
            x_quants[at + 3u] = q.w;
        }
        for (var i = 0u; i < TN * (TK / 4u) / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let rr = e / (TK / 4u);
            let piece = e % (TK / 4u);
            var q = vec4<i32>(0);
            if r0 + rr < P.chunk_rows {
                q = quants4(r0 + rr, k0 / 4u + piece, P.cols);
            }
            let at = rr * PITCH + 4u * piece;
            w_quants[at] = q.x;
            w_quants[at + 1u] = q.y;
            w_quants[at + 2u] = q.z;
            w_quants[at + 3u] = q.w;
        }
        workgroupBarrier();
        for (var k = 0u; k < TK; k++) {
            let a0 = x_quants[(2u * ty) * PITCH + k];
            let a1 = x_quants[(2u * ty + 1u) * PITCH + k];
            for (var j = 0u; j < 4u; j++) {
                let b = w_quants[(4u * tx + j) * PITCH + k];
                acc[j] += a0 * b;
                acc[4u + j] += a1 * b;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 2u; i++) {
        let tt = 2u * ty + i;
        let t = t0 + tt;
        let x_scale = bitcast<f32>(atomicLoad(&amax_bits[tt])) / 127.0;
        for (var j = 0u; j < 4u; j++) {
            let r = r0 + 4u * tx + j;
            if t < P.rows && r < P.chunk_rows {
                store(t, r, acc[4u * i + j], x_scale);
            }
        }
    }
}
