//! The kernel manifest: every fused kernel Tandem runs, once.
//!
//! Each entry exists three times under the same name: a method of the CPU
//! reference backend, `shaders/NAME.wgsl` (or, where WGSL cannot express
//! it, a listed composition of other entries: [`WEBGPU_COMPOSITIONS`]) and
//! `kernels/NAME.cu`. The manifest test in `tests/` checks that no
//! implementation is missing and no file is stray; the cross-backend tests
//! compare every backend present with the CPU reference within `tolerance`.

/// One fused kernel.
#[derive(Debug)]
pub struct KernelSpec {
    /// File stem in `shaders/` and `kernels/`, and the `Backend` method it implements.
    pub name: &'static str,
    /// The `Backend` method this entry is (several entries may share one
    /// method, e.g. `matmul` dispatches on the weight format).
    pub method: &'static str,
    pub inputs: &'static str,
    pub outputs: &'static str,
    /// Largest allowed `|x - ref| / (1 + |ref|)` against the CPU reference.
    pub tolerance: f32,
}

/// Entries WebGPU runs as a sequence of other entries' dispatches, with
/// why: `(name, parts)`, and no `shaders/NAME.wgsl`.
///
/// `mlp_residual` needs one workgroup to sum the others' partial products
/// after they are written. CUDA orders that with `__threadfence` and an
/// atomic counter; WGSL atomics are relaxed and `storageBarrier` reaches
/// one workgroup only, so nothing makes another workgroup's stores visible
/// within a dispatch. Two dispatches are the portable form.
pub const WEBGPU_COMPOSITIONS: &[(&str, &[&str])] =
    &[("mlp_residual", &["matmul_glu", "matmul_residual"])];

pub const MANIFEST: &[KernelSpec] = &[
    KernelSpec {
        name: "embedding",
        method: "embedding",
        inputs: "table [vocab, dim] any weight format; tokens [rows] u32",
        outputs: "out [rows, dim] f32",
        tolerance: 1e-5,
    },
    KernelSpec {
        name: "rms_norm",
        method: "rms_norm",
        inputs: "x [rows, dim] f32; weight [dim] f32",
        outputs: "out [rows, dim] f32",
        tolerance: 1e-4,
    },
    KernelSpec {
        name: "rms_norm_residual",
        method: "rms_norm_residual",
        inputs: "residual [rows, dim] f32 (updated); delta [rows, dim] f32; weight [dim] f32",
        outputs: "residual += delta; out [rows, dim] f32",
        tolerance: 1e-4,
    },
    KernelSpec {
        name: "matmul_f32",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] F32; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-3,
    },
    KernelSpec {
        name: "matmul_f16",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] F16; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 2e-3,
    },
    KernelSpec {
        name: "matmul_bf16",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] BF16; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 2e-3,
    },
    KernelSpec {
        name: "matmul_q8_0",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q8_0 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q4_0",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q4_0 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q4_1",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q4_1 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_int8",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] INT8 rows (f32 scale per row); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_w8a8",
        method: "matmul",
        inputs: "x [rows, cols] f32 (quantized per row to INT8 inside); w [n, cols] W8A8 rows; bias [n] f32 optional",
        outputs: "out [rows, n] f32 (i8 x i8 products summed in i32)",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_int4",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] INT4_G64 or INT4_G128 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q5_0",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q5_0 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q5_1",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q5_1 blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_iq4_nl",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] IQ4_NL blocks; bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q2_k",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q2_K super-blocks (cols % 256 == 0); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q3_k",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q3_K super-blocks (cols % 256 == 0); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q4_k",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q4_K super-blocks (cols % 256 == 0); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q5_k",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q5_K super-blocks (cols % 256 == 0); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_q6_k",
        method: "matmul",
        inputs: "x [rows, cols] f32; w [n, cols] Q6_K super-blocks (cols % 256 == 0); bias [n] f32 optional",
        outputs: "out [rows, n] f32",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_rms_norm",
        method: "matmul_rms_norm",
        inputs: "x [rows, cols] f32; norm [cols] f32 optional (RMSNorm prologue, eps); w [n, cols] any weight format (e.g. Q, K, V concatenated by rows); bias [n] f32 optional; up to 3 output widths summing to n",
        outputs: "y = norm(x) w^T + bias, its columns split in order into the outputs [rows, width_i]",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_glu",
        method: "matmul_glu",
        inputs: "x [rows, cols] f32; norm [cols] f32 optional (RMSNorm prologue, eps); w [2f, cols] any weight format, gate rows then up rows; SwiGLU or GeGLU",
        outputs: "out [rows, f] = act(y[:, i]) * y[:, f + i], y = norm(x) w^T",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "matmul_residual",
        method: "matmul_residual",
        inputs: "x [rows, cols] f32; w [n, cols] any weight format; out [rows, n] f32 (updated)",
        outputs: "out += x w^T",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "mlp_residual",
        method: "mlp_residual",
        inputs: "residual [rows, dim] f32 (updated); norm [dim] f32 (RMSNorm prologue, eps); gate_up [2f, dim] and down [dim, f], one weight format; SwiGLU or GeGLU",
        outputs: "residual += glu(norm(residual) gate_up^T) down^T, the [rows, f] intermediate kept on chip",
        tolerance: 1e-2,
    },
    KernelSpec {
        name: "rope",
        method: "rope",
        inputs: "x [rows, heads*head_dim] f32 (in place); positions [rows] u32; inv_freq [rotary_dim/2] f32",
        outputs: "x rotated",
        tolerance: 1e-4,
    },
    KernelSpec {
        name: "paged_kv_write",
        method: "paged_kv_write",
        inputs: "k, v [rows, kv_heads*head_dim] f32; slots [rows] u32",
        outputs: "K/V cache rows at the given slots",
        tolerance: 1e-3,
    },
    KernelSpec {
        name: "paged_attention",
        method: "paged_attention",
        inputs: "q [rows, heads*head_dim]; K/V cache; row_seq, positions [rows] u32; block_tables [seqs, max_blocks] u32 ([seqs, kv_heads, max_blocks] with per_head_tables)",
        outputs: "out [rows, heads*head_dim] f32 (causal, online softmax; EVICTED_BLOCK table entries skipped); variant paged_attention_scores: scores [rows, kv_heads, max_blocks] f32 += softmax mass per table entry, summed over each KV head's query heads",
        tolerance: 2e-3,
    },
    KernelSpec {
        name: "paged_kv_write_quant",
        method: "paged_kv_write",
        inputs: "k, v [rows, kv_heads*head_dim] f32; slots [rows] u32",
        outputs: "INT8 K/V and INT4 V cache slots at the given slots: codes and per-(head, group of 32) f16 scale and min (layout: kv::quant)",
        tolerance: 1e-3,
    },
    KernelSpec {
        name: "paged_kv_write_int4_keys",
        method: "paged_kv_write",
        inputs: "k [rows, kv_heads*head_dim] f32; slots [rows] u32 (a block's rows consecutive, at consecutive offsets)",
        outputs: "INT4 K cache blocks: codes and per-channel f16 scale and min over each block's valid tokens, re-quantized as the block fills (layout: kv::quant)",
        tolerance: 2e-3,
    },
    KernelSpec {
        name: "paged_attention_quant",
        method: "paged_attention",
        inputs: "q [rows, heads*head_dim]; INT8/INT4 K/V cache; row_seq, positions [rows] u32; block_tables [seqs, max_blocks] u32 ([seqs, kv_heads, max_blocks] with per_head_tables)",
        outputs: "out [rows, heads*head_dim] f32 (causal, online softmax, K/V dequantized on read; EVICTED_BLOCK table entries skipped); variant paged_attention_scores as for paged_attention",
        tolerance: 2e-3,
    },
    KernelSpec {
        name: "kv_key_bounds",
        method: "paged_kv_write",
        inputs: "k [rows, kv_heads*head_dim] f32; slots [rows] u32 (a block's rows consecutive); a cache that tracks key bounds (track_key_bounds)",
        outputs: "key bounds [num_blocks, kv_heads, 2, head_dim] f32: per block and KV head each channel's minimum and maximum, restarted by a write to the block's first slot (sparse speculation)",
        tolerance: 0.0,
    },
    KernelSpec {
        name: "select_kv_blocks",
        method: "select_kv_blocks",
        inputs: "q [rows, heads*head_dim]; key bounds of the cache; row_seq, positions [rows] u32; block_tables [seqs, max_blocks] u32; top, sink and recent block counts",
        outputs: "tables [seqs, kv_heads, max_blocks] u32: per KV head, the sequence's table with entries outside the sinks, the recent window and that head's top blocks by Σ_c max(q_c·min_c, q_c·max_c) made EVICTED_BLOCK",
        tolerance: 0.0,
    },
    KernelSpec {
        name: "swiglu",
        method: "swiglu",
        inputs: "gate, up [len] f32",
        outputs: "out = silu(gate) * up",
        tolerance: 1e-5,
    },
    KernelSpec {
        name: "geglu",
        method: "geglu",
        inputs: "gate, up [len] f32",
        outputs: "out = gelu(gate) * up, GELU's tanh approximation",
        tolerance: 1e-5,
    },
    KernelSpec {
        name: "scale",
        method: "scale",
        inputs: "x [len] f32; factor f32",
        outputs: "x *= factor, in place",
        tolerance: 1e-6,
    },
    KernelSpec {
        name: "gather_rows",
        method: "gather_rows",
        inputs: "x [*, width] f32; rows [n] u32",
        outputs: "out [n, width] f32",
        tolerance: 0.0,
    },
    KernelSpec {
        name: "moe_route",
        method: "moe_route",
        inputs: "logits [rows, experts (+1 shared gate)] f32; experts, k, normalize, shared_gate",
        outputs: "ids [rows, k (+1)] u32, weights [rows, k (+1)] f32: softmax, top-k (descending, lower index first among equals), renormalised if asked; shared slot sigmoid(gate)",
        tolerance: 1e-5,
    },
    KernelSpec {
        name: "moe_combine",
        method: "moe_combine",
        inputs: "y [count, width] f32; rows [count] u32 (distinct); ids [*, slots] u32; weights [*, slots] f32; expert",
        outputs: "out[rows[i]] += weight(rows[i], expert) * y[i]",
        tolerance: 1e-5,
    },
    KernelSpec {
        name: "argmax",
        method: "argmax",
        inputs: "x [rows, width] f32",
        outputs: "out [rows] u32 (lowest index among ties)",
        tolerance: 0.0,
    },
];

/// The manifest entry of `matmul` for a weight format.
pub fn matmul_kernel_name(format: crate::quant::WeightFormat) -> &'static str {
    use crate::quant::WeightFormat::*;
    match format {
        F32 => "matmul_f32",
        F16 => "matmul_f16",
        BF16 => "matmul_bf16",
        Q8_0 => "matmul_q8_0",
        Q4_0 => "matmul_q4_0",
        Q4_1 => "matmul_q4_1",
        Int8PerChannel => "matmul_int8",
        W8A8 => "matmul_w8a8",
        Int4 { .. } => "matmul_int4",
        Q5_0 => "matmul_q5_0",
        Q5_1 => "matmul_q5_1",
        IQ4_NL => "matmul_iq4_nl",
        Q2_K => "matmul_q2_k",
        Q3_K => "matmul_q3_k",
        Q4_K => "matmul_q4_k",
        Q5_K => "matmul_q5_k",
        Q6_K => "matmul_q6_k",
    }
}

pub fn spec(name: &str) -> Option<&'static KernelSpec> {
    MANIFEST.iter().find(|k| k.name == name)
}
