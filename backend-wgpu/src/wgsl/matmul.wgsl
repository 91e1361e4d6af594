// Matmul entry points shared by every shaders/matmul_FORMAT.wgsl and the
// fused matmuls, placed after wgsl/matmul_common.wgsl (bindings, the norm
// prologue, the pairing of gate and up rows, the plain epilogue `emit`).
// The format file declares `fn decode4(row, piece, cols) -> vec4<f32>`: the
// weight values at columns `4 * piece .. 4 * piece + 4` of local row `row`,
// zero past `cols`.
//
// `gemv` serves few activation rows (decode): one workgroup per output,
// consecutive threads read consecutive 4-value pieces of its weight rows
// (coalesced), each thread keeps one partial per activation row and weight
// row, then one reduction each. `tiled` serves many rows (prefill): a 32x64
// tile of activation and weight rows per workgroup, stepping K by one
// 32-value block staged (dequantized) in workgroup memory, 2x4 sums per
// thread. `gemv_rows` serves few rows on CPU adapters: one thread per output
// and no barriers, since there a barrier switches every invocation and
// `gemv`'s reductions dominate; it takes no norm prologue.

// Adds piece p of output o's weight rows times each activation row's piece
// (times the norm weight under the prologue) to acc, and under the
// prologue the squares of the activations to sq.
fn accumulate(acc: ptr<function, array<f32, GEMV_ACC>>, sq: ptr<function, array<f32, GEMV_MAX_ROWS>>, o: u32, p: u32) {
    var w: array<vec4<f32>, PAIR>;
    for (var h = 0u; h < PAIR; h++) {
        w[h] = decode4(weight_row(o, h), p, P.cols);
    }
    let normed = has_norm();
    var nw = vec4<f32>(1.0);
    if normed {
        nw = norm4(4u * p);
    }
    for (var t = 0u; t < P.rows; t++) {
        var x = x4raw(t, 4u * p);
        if normed {
            (*sq)[t] += dot(x, x);
            x *= nw;
        }
        for (var h = 0u; h < PAIR; h++) {
            (*acc)[h * GEMV_MAX_ROWS + t] += dot(w[h], x);
        }
    }
}

@compute @workgroup_size(WG)
fn gemv(ids: Ids, group: Group) {
    let o = group_index(group);
    if o >= outputs() {
        return;
    }
    let at = lane_of(ids);
    let pieces = (P.cols + 3u) / 4u;
    var acc: array<f32, GEMV_ACC>;
    var sq: array<f32, GEMV_MAX_ROWS>;
    for (var p = ids.lid; p < pieces; p += WG) {
        accumulate(&acc, &sq, o, p);
    }
    let inv = summed_norms(sq, at);
    for (var t = 0u; t < P.rows; t++) {
        var y = vec2<f32>(0.0);
        for (var h = 0u; h < PAIR; h++) {
            y[h] = reduce_sum(acc[h * GEMV_MAX_ROWS + t], at) * inv[t];
        }
        if ids.lid == 0u {
            emit(t, o, y);
        }
    }
}

@compute @workgroup_size(GEMV_ROWS_WG)
fn gemv_rows(ids: Ids, group: Group) {
    let o = group_index(group) * GEMV_ROWS_WG + ids.lid;
    if o >= outputs() {
        return;
    }
    let pieces = (P.cols + 3u) / 4u;
    var acc: array<f32, GEMV_ACC>;
    // No prologue here (the host normalises first), so no squares either.
    var sq: array<f32, GEMV_MAX_ROWS>;
    for (var p = 0u; p < pieces; p++) {
        accumulate(&acc, &sq, o, p);
    }
    for (var t = 0u; t < P.rows; t++) {
        var y = vec2<f32>(0.0);
        for (var h = 0u; h < PAIR; h++) {
            y[h] = acc[h * GEMV_MAX_ROWS + t];
        }
        emit(t, o, y);
    }
}

var<workgroup> x_tile: array<f32, TM * PITCH>;
var<workgroup> w_tile: array<f32, TN * PITCH>;

@compute @workgroup_size(TILE_WG)
fn tiled(ids: Ids, group: Group) {
    let tiles_n = (outputs() + TO - 1u) / TO;
    let g = group_index(group);
    let t0 = (g / tiles_n) * TM;
    let o0 = (g % tiles_n) * TO;
    if t0 >= P.rows {
        return;
    }
    let lid = ids.lid;
    tile_norms(lid, t0);
    // Thread (tx, ty) owns activation rows 2ty, 2ty+1 and tile columns tile_col(tx, 0..4).
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<f32, 8>;
    for (var k0 = 0u; k0 < P.cols; k0 += TK) {
        for (var i = 0u; i < TM * TK / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let tt = e / TK;
            let kk = e % TK;
            var v = 0.0;
            if t0 + tt < P.rows {
                v = xin(t0 + tt, k0 + kk, tile_inv(tt));
            }
            x_tile[tt * PITCH + kk] = v;
        }
        for (var i = 0u; i < TN * (TK / 4u) / TILE_WG; i++) {
            let e = lid + i * TILE_WG;
            let rr = e / (TK / 4u);
            let piece = e % (TK / 4u);
            var w = vec4<f32>(0.0);
            let r = tile_weight_row(o0, rr);
            if r != NO_ROW {
                w = decode4(r, k0 / 4u + piece, P.cols);
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
                let b = w_tile[tile_col(tx, j) * PITCH + k];
                acc[j] += a0 * b;
                acc[4u + j] += a1 * b;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 2u; i++) {
        let t = t0 + 2u * ty + i;
        // Under GLU columns 0, 1 are gates and 2, 3 their up rows.
        for (var j = 0u; j < 4u / PAIR; j++) {
            let o = o0 + tile_col(tx, j);
            if t < P.rows && o < outputs() {
                emit(t, o, vec2<f32>(acc[4u * i + j], acc[4u * i + (j + 2u) % 4u]));
            }
        }
    }
}
