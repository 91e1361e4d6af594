// matmul_rms_norm: y = norm(x) W^T + BIAS with the optional RMSNorm prologue
// (P.has_norm; `x * inv_rms * NORM`, the row's inverse RMS computed inside
// the kernel), the columns of y split in order into OUT, OUT1 and OUT2 (Q, K
// and V from one concatenated weight; the host binds spare buffers for
// absent parts). The generator composes the weight format's decoder,
// backend-wgpu/src/wgsl/matmul_common.wgsl (flags FUSED, NORM, SPLIT) and the
// matmul entry points (wgsl/matmul.wgsl, or W8A8's) with this epilogue. Each
// weight chunk is its own dispatch; its features go to whichever part holds them.

@group(0) @binding(6) var<storage, read_write> OUT1: array<f32>;
@group(0) @binding(7) var<storage, read_write> OUT2: array<f32>;

fn emit(t: u32, o: u32, y: vec2<f32>) {
    let feature = P.row_start + o;
    let v = y.x + bias(feature);
    if feature < P.split1 {
        OUT[t * P.split1 + feature] = v;
    } else if feature < P.split2 {
        OUT1[t * (P.split2 - P.split1) + feature - P.split1] = v;
    } else {
        OUT2[t * (P.n - P.split2) + feature - P.split2] = v;
    }
}
