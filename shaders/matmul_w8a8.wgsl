// matmul with W8A8 weights (SmoothQuant): out[t, r] = s_r * a_t *
// sum_c q_x[t, c] * q_w[r, c] (+ bias[r]), where every activation row is
// quantized to INT8 here, per token, as tandem_core::quant::
// quantize_activation_row_i8 defines: a_t = max_c |x[t, c]| / 127 and
// q_x = round(x * 127 / max|x|) (ties to even, WGSL's `round`). Products of
// the INT8 quants are summed in i32; only the final sum becomes f32.
// The weight bytes are INT8's: the generator places matmul_int8.wgsl
// (binding 1 `W`, `row_scale`, `quants4`) and
// backend-wgpu/src/wgsl/matmul_common.wgsl before this file. `cols` is a
// multiple of 32. Entry points and dispatch as in
// backend-wgpu/src/wgsl/matmul.wgsl, the fused matmuls included (the norm
// prologue applies before the quantization, whose scale is then the
// normalised row's): `gemv` for up to 8 activation rows (one workgroup per
// output), `gemv_rows` for them on software adapters (one thread per
// output), `tiled` above (32 activation rows x 64 weight rows per workgroup).

// 127 / max|x| of a row, 0 for an all-zero row (whose quants are all 0).
fn inverse_scale(amax: f32) -> f32 {
    return select(0.0, 127.0 / amax, amax > 0.0);
}

// The INT8 quants of activations `t, c .. c + 4` as `x4` reads them.
fn quant_x4(t: u32, c: u32, inv: f32, inverse: f32) -> vec4<i32> {
    let x = x4(t, c, inv);
    return vec4<i32>(clamp(round(x * inverse), vec4<f32>(-127.0), vec4<f32>(127.0)));
}

// Output o's integer sums (one per weight row of the output) as floats.
fn dequant(o: u32, sums: vec2<i32>, x_scale: f32) -> vec2<f32> {
    var y = vec2<f32>(0.0);
    for (var h = 0u; h < PAIR; h++) {
        y[h] = f32(sums[h]) * (row_scale(weight_row(o, h), P.cols) * x_scale);
    }
    return y;
}

var<workgroup> gemv_sums: array<atomic<i32>, GEMV_ACC>;

@compute @workgroup_size(WG)
fn gemv(ids: Ids, group: Group) {
    let o = group_index(group);
    if o >= outputs() {
        return;
    }
    let at = lane_of(ids);
    if ids.lid < GEMV_ACC {
        atomicStore(&gemv_sums[ids.lid], 0);
    }
    let inv = gemv_norms(ids.lid, at);
    var inverse: array<f32, GEMV_MAX_ROWS>;
    var x_scale: array<f32, GEMV_MAX_ROWS>;
    for (var t = 0u; t < P.rows; t++) {
        var m = 0.0;
        for (var c = ids.lid; c < P.cols; c += WG) {
            m = max(m, abs(xin(t, c, inv[t])));
        }
        let amax = reduce_max(m, at);
        inverse[t] = inverse_scale(amax);
        x_scale[t] = amax / 127.0;
    }
    let pieces = P.cols / 4u;
    var acc: array<i32, GEMV_ACC>;
    for (var p = ids.lid; p < pieces; p += WG) {
        var w: array<vec4<i32>, PAIR>;
        for (var h = 0u; h < PAIR; h++) {
            w[h] = quants4(weight_row(o, h), p, P.cols);
        }
        for (var t = 0u; t < P.rows; t++) {
            let x = quant_x4(t, 4u * p, inv[t], inverse[t]);
            for (var h = 0u; h < PAIR; h++) {
                acc[h * GEMV_MAX_ROWS + t] += dot(w[h], x);
            }
        }
    }
    for (var i = 0u; i < GEMV_ACC; i++) {
        atomicAdd(&gemv_sums[i], acc[i]);
    }
    workgroupBarrier();
    if ids.lid == 0u {
        for (var t = 0u; t < P.rows; t++) {
            var sums = vec2<i32>(0);
            for (var h = 0u; h < PAIR; h++) {
                sums[h] = atomicLoad(&gemv_sums[h * GEMV_MAX_ROWS + t]);
            }
            emit(t, o, dequant(o, sums, x_scale[t]));
        }
    }
}

// One thread per output (software adapters): each thread finds the
// activation rows' scales itself. Never with a norm prologue: the host
// normalises first on these adapters (`WgpuBackend::own_prologue`).
@compute @workgroup_size(GEMV_ROWS_WG)
fn gemv_rows(ids: Ids, group: Group) {
    let o = group_index(group) * GEMV_ROWS_WG + ids.lid;
    let inv = unit_norms();
    if o >= outputs() {
        return;
    }
    let pieces = P.cols / 4u;
    for (var t = 0u; t < P.rows; t++) {
        var amax = 0.0;
        for (var c = 0u; c < P.cols; c++) {
            amax = max(amax, abs(xin(t, c, inv[t])));
        }
        let inverse = inverse_scale(amax);
        var sums = vec2<i32>(0);
        for (var p = 0u; p < pieces; p++) {
            let x = quant_x4(t, 4u * p, inv[t], inverse);
            for (var h = 0u; h < PAIR; h++) {
                sums[h] += dot(quants4(weight_row(o, h), p, P.cols), x);
            }
        }
        emit(t, o, dequant(o, sums, amax / 127.0));
    }
}

var<workgroup> x_quants: array<i32, TM * PITCH>;
var<workgroup> w_quants: array<i32, TN * PITCH>;
// max|x| of the tile's activation rows, as the bits of a non-negative f32
// (which order like the floats).
var<workgroup> amax_bits: array<atomic<u32>, TM>;

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
                m = max(m, abs(xin(t0 + tt, c, tile_inv(tt))));
            }
        }
        atomicMax(&amax_bits[tt], bitcast<u32>(m));
    }
    workgroupBarrier();
    // Thread (tx, ty) owns activation rows 2ty, 2ty+1 and tile columns tile_col(tx, 0..4).
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
                q = quant_x4(t0 + tt, k0 + 4u * piece, tile_inv(tt), inverse);
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
            let r = tile_weight_row(o0, rr);
            if r != NO_ROW {
                q = quants4(r, k0 / 4u + piece, P.cols);
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
                let b = w_quants[tile_col(tx, j) * PITCH + k];
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
        // Under GLU columns 0, 1 are gates and 2, 3 their up rows.
        for (var j = 0u; j < 4u / PAIR; j++) {
            let o = o0 + tile_col(tx, j);
            if t < P.rows && o < outputs() {
                let sums = vec2<i32>(acc[4u * i + j], acc[4u * i + (j + 2u) % 4u]);
                emit(t, o, dequant(o, sums, x_scale));
            }
        }
    }
}
