// What every matmul entry point shares: the float ones of wgsl/matmul.wgsl
// and W8A8's integer ones (shaders/matmul_w8a8.wgsl). Placed after the weight
// format's decoder, which declares the weight binding `W` (binding 1) and
// `decode4`, and after the kernel's own file for the fused matmuls.
//
// Plain matmul: out[t, row_start + r] = sum_c X[t, c] * W[r, c] (+ BIAS[row_start + r])
// for the rows `r < chunk_rows` of one weight chunk (weights larger than the
// adapter's storage binding limit are split by rows; one dispatch per chunk).
//
// The fused matmuls (flag FUSED) change two ends of the same loops:
// - the prologue (flag NORM: matmul_rms_norm, matmul_glu) RMS-normalises X's
//   rows as they are read. In `tiled` (and W8A8) each workgroup first
//   computes the inverse RMS of its activation rows, then `xin` and `x4`
//   return x * inv_rms * NORM[c] instead of x. `gemv` instead sums
//   x * NORM[c] against the weights and the squares of x alongside, in the
//   same pass over X, and scales each finished sum by the row's inverse
//   RMS. `gemv_rows` takes no prologue: on the CPU adapters it serves,
//   every output would recompute it, so the host normalises first
//   (`WgpuBackend::prologue`).
// - the epilogue: an entry point hands `emit(t, o, y)` the sums of output o
//   for activation row t; the kernel's file defines `emit` (the plain one is
//   below). Under GLU an output reads two weight rows, gate o and up o + f
//   (PAIR = 2), and y holds both sums: the thread that computed them applies
//   the activation in registers. Elsewhere y.y is unused.

struct Params {
    rows: u32,
    cols: u32,
    // The output features of the whole weight.
    n: u32,
    row_start: u32,
    chunk_rows: u32,
    has_bias: u32,
// #if NORM
    has_norm: u32,
    eps: f32,
// #endif
// #if SPLIT
    // First features of the second and third parts (n where there is none).
    split1: u32,
    split2: u32,
// #endif
// #if GLU
    // 0: SiLU (SwiGLU), 1: GELU with the tanh approximation (GeGLU).
    gelu: u32,
// #endif
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
// #if NORM
@group(0) @binding(5) var<storage, read> NORM: array<f32>;
// #endif

const WG: u32 = 128u;
// Largest activation row count the GEMV paths take; the host picks `tiled` above it.
const GEMV_MAX_ROWS: u32 = 8u;
const GEMV_ROWS_WG: u32 = 64u;

// Weight rows per output.
// #if GLU
const PAIR: u32 = 2u;
// #else
const PAIR: u32 = 1u;
// #endif
// Per-thread sums of the GEMV paths: [weight row of the output][activation row].
const GEMV_ACC: u32 = GEMV_MAX_ROWS * PAIR;

// `tiled`: 32 activation rows x 64 weight rows per workgroup, stepping K by 32.
const TILE_WG: u32 = 256u;
const TM: u32 = 32u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Row pitch of the staged tiles; the extra column spreads rows over banks.
const PITCH: u32 = TK + 1u;
// Outputs per tile: its weight rows are those outputs' gate rows, then their up rows.
const TO: u32 = TN / PAIR;
// `tile_weight_row` of a tile row past the chunk.
const NO_ROW: u32 = 0xffffffffu;

// Outputs of this dispatch.
fn outputs() -> u32 {
    return P.chunk_rows / PAIR;
}

// Local weight row h of output o: o itself, or under GLU o + f for the up row.
fn weight_row(o: u32, h: u32) -> u32 {
    return o + h * outputs();
}

// Weight row of tile row rr in the tile of outputs o0.., or NO_ROW.
fn tile_weight_row(o0: u32, rr: u32) -> u32 {
    let o = o0 + rr % TO;
    if o >= outputs() {
        return NO_ROW;
    }
    return weight_row(o, rr / TO);
}

// Tile column j (0..4) of thread tx: columns 2tx, 2tx+1 of each half of the
// tile, so under GLU the thread holds the gate (j = 0, 1) and up (j = 2, 3)
// rows of outputs 2tx, 2tx+1.
fn tile_col(tx: u32, j: u32) -> u32 {
    return (j / 2u) * (TN / 2u) + 2u * tx + j % 2u;
}

// Activation t, column c (zero past cols), times the norm weight under the
// norm prologue.
fn xw(t: u32, c: u32) -> f32 {
    if c >= P.cols {
        return 0.0;
    }
    let v = X[t * P.cols + c];
// #if NORM
    if P.has_norm != 0u {
        return v * NORM[c];
    }
// #endif
    return v;
}

// Activations t, c .. c + 4 as stored (zero past cols).
fn x4raw(t: u32, c: u32) -> vec4<f32> {
    if c + 3u >= P.cols {
        var v = vec4<f32>(0.0);
        for (var i = 0u; i < 4u && c + i < P.cols; i++) {
            v[i] = X[t * P.cols + c + i];
        }
        return v;
    }
    let base = t * P.cols + c;
    return vec4<f32>(X[base], X[base + 1u], X[base + 2u], X[base + 3u]);
}

// Whether this dispatch applies the norm prologue.
fn has_norm() -> bool {
// #if NORM
    if P.has_norm != 0u {
        return true;
    }
// #endif
    return false;
}

// The norm weights of columns c .. c + 4 (zero past cols) under the
// prologue, else ones.
fn norm4(c: u32) -> vec4<f32> {
// #if NORM
    if P.has_norm != 0u {
        if c + 3u >= P.cols {
            var v = vec4<f32>(0.0);
            for (var i = 0u; i < 4u && c + i < P.cols; i++) {
                v[i] = NORM[c + i];
            }
            return v;
        }
        return vec4<f32>(NORM[c], NORM[c + 1u], NORM[c + 2u], NORM[c + 3u]);
    }
// #endif
    return vec4<f32>(1.0);
}

// Activations t, c .. c + 4, as `xw` reads them.
fn x4w(t: u32, c: u32) -> vec4<f32> {
    return x4raw(t, c) * norm4(c);
}

// Activation t, column c as the matmul reads it: under the norm prologue
// normalised by the row's inverse RMS `inv` and the norm weight.
fn xin(t: u32, c: u32, inv: f32) -> f32 {
// #if NORM
    if P.has_norm != 0u {
        return xw(t, c) * inv;
    }
// #endif
    return xw(t, c);
}

// Activations t, c .. c + 4, as `xin` reads them.
fn x4(t: u32, c: u32, inv: f32) -> vec4<f32> {
// #if NORM
    if P.has_norm != 0u {
        return x4w(t, c) * inv;
    }
// #endif
    return x4w(t, c);
}

fn bias(feature: u32) -> f32 {
    if P.has_bias != 0u {
        return BIAS[feature];
    }
    return 0.0;
}

fn unit_norms() -> array<f32, GEMV_MAX_ROWS> {
    var inv: array<f32, GEMV_MAX_ROWS>;
    for (var t = 0u; t < GEMV_MAX_ROWS; t++) {
        inv[t] = 1.0;
    }
    return inv;
}

// #if NORM
// Sum of X[t, c]^2 over the columns first, first + stride, ...
fn squares(t: u32, first: u32, stride: u32) -> f32 {
    var s = 0.0;
    for (var c = first; c < P.cols; c += stride) {
        let v = X[t * P.cols + c];
        s += v * v;
    }
    return s;
}

fn inv_rms(sum_squares: f32) -> f32 {
    return 1.0 / sqrt(sum_squares / f32(P.cols) + P.eps);
}

// Inverse RMS of each activation row (1 without the prologue), computed by
// the whole workgroup of W8A8's `gemv` before it quantizes (uniform
// control flow).
fn gemv_norms(lid: u32, at: Lane) -> array<f32, GEMV_MAX_ROWS> {
    var inv = unit_norms();
    if P.has_norm != 0u {
        for (var t = 0u; t < P.rows; t++) {
            inv[t] = inv_rms(reduce_sum(squares(t, lid, WG), at));
        }
    }
    return inv;
}

// The inverse RMS of each activation row (1 without the prologue) from the
// squares a `gemv` thread summed alongside its dot products, summed over
// the workgroup (uniform control flow).
fn summed_norms(sq: array<f32, GEMV_MAX_ROWS>, at: Lane) -> array<f32, GEMV_MAX_ROWS> {
    var inv = unit_norms();
    if P.has_norm != 0u {
        for (var t = 0u; t < P.rows; t++) {
            inv[t] = inv_rms(reduce_sum(sq[t], at));
        }
    }
    return inv;
}

var<workgroup> tile_parts: array<f32, TILE_WG>;
var<workgroup> tile_inv_rms: array<f32, TM>;

// Inverse RMS of the tile's activation rows t0 .. t0 + TM, eight threads a
// row (uniform control flow).
fn tile_norms(lid: u32, t0: u32) {
    if P.has_norm == 0u {
        return;
    }
    let tt = lid / (TILE_WG / TM);
    var s = 0.0;
    if t0 + tt < P.rows {
        s = squares(t0 + tt, lid % (TILE_WG / TM), TILE_WG / TM);
    }
    tile_parts[lid] = s;
    workgroupBarrier();
    if lid < TM {
        var total = 0.0;
        for (var i = 0u; i < TILE_WG / TM; i++) {
            total += tile_parts[lid * (TILE_WG / TM) + i];
        }
        tile_inv_rms[lid] = inv_rms(total);
    }
    workgroupBarrier();
}

fn tile_inv(tt: u32) -> f32 {
    return tile_inv_rms[tt];
}
// #else
fn gemv_norms(lid: u32, at: Lane) -> array<f32, GEMV_MAX_ROWS> {
    return unit_norms();
}

fn summed_norms(sq: array<f32, GEMV_MAX_ROWS>, at: Lane) -> array<f32, GEMV_MAX_ROWS> {
    return unit_norms();
}

fn tile_norms(lid: u32, t0: u32) {}

fn tile_inv(tt: u32) -> f32 {
    return 1.0;
}
// #endif

// #if !FUSED
fn emit(t: u32, o: u32, y: vec2<f32>) {
    let feature = P.row_start + o;
    OUT[t * P.n + feature] = y.x + bias(feature);
}
// #endif
