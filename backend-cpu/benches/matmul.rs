//! Matmul throughput of `CpuBackend` on 2 threads at SmolLM2-135M's shapes
//! (dim 576, ffn 1536, vocab 49152), against the reference; and GGML's
//! other formats at the shapes of Qwen2.5-0.5B (dim 896, k/v 128, ffn 4864,
//! vocab 151936) and Gemma 3 270M (dim 640, q 1024, k/v 256, ffn 2048,
//! vocab 262144), the `ggml_gemv` and `ggml_gemm512` groups.
//!
//! Shapes are written `input × output` (`cols × n`). GEMV (one token, the
//! decode case) reports weight bytes per second; GEMM (512 tokens, prefill)
//! reports FLOP/s as "elements"/s (2 per multiply-add). `decode_step` runs
//! the matmuls of one whole decode token of SmolLM2's Q4_1 file (30 layers
//! plus the Q8_0 output matrix, about 96 MB) and of Qwen2.5-0.5B's Q4_K_M
//! (24 layers of Q5_0 with Q8_0, Q6_K and Q4_K, and a Q8_0 output matrix,
//! about 390 MB), so the weights stream from memory as in real decoding:
//! its time bounds tokens/s from the matmuls alone.
//!
//! Run with `cargo bench -p tandem-cpu --bench matmul -- --quick`; with
//! `TANDEM_BENCH_CPU_ISA=avx2` (or `avx512`, `portable`) the backend runs
//! those kernels instead of the best this CPU has.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem_core::backend::MatmulParams;
use tandem_core::quant::{quantize_matrix, Int4Group, WeightFormat, WeightView};
use tandem_core::sched::Rng;
use tandem_core::Backend;
use tandem_cpu::{reference, CpuBackend, CpuIsa, Tensor, Weight};

const THREADS: usize = 2;

const PREFILL_TOKENS: usize = 512;

/// The backend on `THREADS` threads, with the kernels
/// `TANDEM_BENCH_CPU_ISA` names, if set.
fn backend() -> CpuBackend {
    let isa = match std::env::var("TANDEM_BENCH_CPU_ISA").as_deref() {
        Err(_) | Ok("best") => CpuIsa::Best,
        Ok("avx512") => CpuIsa::Avx512,
        Ok("avx2") => CpuIsa::Avx2,
        Ok("portable") => CpuIsa::Portable,
        Ok(other) => panic!("TANDEM_BENCH_CPU_ISA={other}: not best, avx512, avx2 or portable"),
    };
    CpuBackend::with_isa(THREADS, isa).unwrap_or_else(|e| panic!("{e}"))
}

/// Deterministic pseudo-random values in `[-scale, scale)`.
fn values(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32 * scale)
        .collect()
}

/// Rows quantized from random values; taller matrices repeat them, so
/// vocabulary-sized ones cost no more memory than their bytes.
const DISTINCT_ROWS: usize = 4096;

/// A `cols × n` matrix (`n` rows of `cols`) in `format`, as bytes.
fn weight_bytes(format: WeightFormat, cols: usize, n: usize, seed: u64) -> Vec<u8> {
    let distinct = quantize_matrix(
        format,
        cols,
        &values(cols * n.min(DISTINCT_ROWS), seed, 0.05),
    );
    let row_bytes = distinct.len() / n.clamp(1, DISTINCT_ROWS);
    distinct
        .iter()
        .copied()
        .cycle()
        .take(row_bytes * n)
        .collect()
}

fn view(format: WeightFormat, cols: usize, n: usize, bytes: &[u8]) -> WeightView<'_> {
    WeightView {
        format,
        rows: n,
        cols,
        data: bytes,
    }
}

struct Operands {
    weight: Weight,
    x: Tensor,
    out: Tensor,
}

fn operands(
    backend: &CpuBackend,
    bytes: &[u8],
    format: WeightFormat,
    cols: usize,
    n: usize,
    tokens: usize,
) -> Operands {
    Operands {
        weight: backend.upload_weight(view(format, cols, n, bytes)).unwrap(),
        x: backend.upload(&values(tokens * cols, 7, 1.0)).unwrap(),
        out: backend.alloc(tokens * n).unwrap(),
    }
}

fn run(backend: &CpuBackend, ops: &mut Operands, tokens: usize) {
    backend
        .matmul(
            black_box(&ops.x),
            &ops.weight,
            None,
            MatmulParams { rows: tokens },
            &mut ops.out,
        )
        .unwrap();
}

/// GGML's formats the model files use, then Tandem's (`tandem quantize`):
/// INT4 groups of 128 only run at the shapes whose width they divide.
const FORMATS: [WeightFormat; 6] = [
    WeightFormat::Q4_1,
    WeightFormat::Q8_0,
    WeightFormat::Int8PerChannel,
    WeightFormat::W8A8,
    WeightFormat::Int4 {
        group: Int4Group::G64,
    },
    WeightFormat::Int4 {
        group: Int4Group::G128,
    },
];

fn gemv(c: &mut Criterion) {
    let backend = backend();
    let mut group = c.benchmark_group("gemv");
    for format in FORMATS {
        for (cols, n) in [(576usize, 1536), (1536, 576), (576, 49152)] {
            if !cols.is_multiple_of(format.block_elems()) {
                continue;
            }
            let bytes = weight_bytes(format, cols, n, 1);
            let mut ops = operands(&backend, &bytes, format, cols, n, 1);
            group.throughput(Throughput::Bytes(bytes.len() as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{n}")),
                |b| b.iter(|| run(&backend, &mut ops, 1)),
            );
        }
    }
    group.finish();
}

fn gemm(c: &mut Criterion) {
    let backend = backend();
    let mut group = c.benchmark_group("gemm512");
    for format in FORMATS {
        for (cols, n) in [(576usize, 576), (576, 192), (576, 1536), (1536, 576)] {
            if !cols.is_multiple_of(format.block_elems()) {
                continue;
            }
            let bytes = weight_bytes(format, cols, n, 2);
            let mut ops = operands(&backend, &bytes, format, cols, n, PREFILL_TOKENS);
            group.throughput(Throughput::Elements((2 * PREFILL_TOKENS * cols * n) as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{n}")),
                |b| b.iter(|| run(&backend, &mut ops, PREFILL_TOKENS)),
            );
        }
    }
    group.finish();
}

/// The shapes (`cols × n`) of Qwen2.5-0.5B and Gemma 3 270M at which each
/// GGML format runs: the formats their Q4_K_M files use at every linear
/// shape, the other formats at the FFN's two.
const QWEN_SHAPES: [(usize, usize); 5] = [
    (896, 896),
    (896, 128),
    (896, 4864),
    (4864, 896),
    (896, 151936),
];
const GEMMA_SHAPES: [(usize, usize); 5] = [
    (640, 1024),
    (640, 256),
    (640, 2048),
    (2048, 640),
    (640, 262144),
];

fn ggml_shapes(format: WeightFormat) -> Vec<(usize, usize)> {
    let all = QWEN_SHAPES.into_iter().chain(GEMMA_SHAPES);
    match format {
        // The output matrices (tied embeddings) are Q8_0 or Q6_K.
        WeightFormat::Q8_0 | WeightFormat::Q6_K => all.collect(),
        WeightFormat::Q4_K | WeightFormat::Q5_0 => all.filter(|&(_, n)| n < 100_000).collect(),
        _ => vec![(896, 4864), (4864, 896)],
    }
}

const GGML_FORMATS: [WeightFormat; 9] = [
    WeightFormat::Q4_K,
    WeightFormat::Q6_K,
    WeightFormat::Q5_0,
    WeightFormat::Q8_0,
    WeightFormat::Q5_K,
    WeightFormat::Q3_K,
    WeightFormat::Q2_K,
    WeightFormat::Q5_1,
    WeightFormat::IQ4_NL,
];

fn ggml_gemv(c: &mut Criterion) {
    let backend = backend();
    let mut group = c.benchmark_group("ggml_gemv");
    for format in GGML_FORMATS {
        for (cols, n) in ggml_shapes(format) {
            if !cols.is_multiple_of(format.block_elems()) {
                continue;
            }
            let bytes = weight_bytes(format, cols, n, 1);
            let mut ops = operands(&backend, &bytes, format, cols, n, 1);
            group.throughput(Throughput::Bytes(bytes.len() as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{n}")),
                |b| b.iter(|| run(&backend, &mut ops, 1)),
            );
        }
    }
    group.finish();
}

fn ggml_gemm(c: &mut Criterion) {
    let backend = backend();
    let mut group = c.benchmark_group("ggml_gemm512");
    group.sample_size(10);
    for format in GGML_FORMATS {
        for (cols, n) in [(896usize, 896), (896, 4864), (4864, 896)] {
            if !cols.is_multiple_of(format.block_elems()) {
                continue;
            }
            let bytes = weight_bytes(format, cols, n, 2);
            let mut ops = operands(&backend, &bytes, format, cols, n, PREFILL_TOKENS);
            group.throughput(Throughput::Elements((2 * PREFILL_TOKENS * cols * n) as u64));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{cols}x{n}")),
                |b| b.iter(|| run(&backend, &mut ops, PREFILL_TOKENS)),
            );
        }
    }
    group.finish();
}

/// The reference at two shapes, for the fast/reference ratio.
fn reference_matmul(c: &mut Criterion) {
    let mut group = c.benchmark_group("reference");
    group.sample_size(10);
    let format = WeightFormat::Q4_1;
    let (cols, n) = (576, 1536);
    let bytes = weight_bytes(format, cols, n, 1);
    for tokens in [1, 64] {
        let x = values(tokens * cols, 7, 1.0);
        let mut out = vec![0.0; tokens * n];
        group.throughput(Throughput::Elements((2 * tokens * cols * n) as u64));
        group.bench_function(
            BenchmarkId::new(format.name(), format!("{tokens}x{cols}x{n}")),
            |b| {
                b.iter(|| {
                    reference::matmul(
                        black_box(&x),
                        view(format, cols, n, &bytes),
                        None,
                        tokens,
                        &mut out,
                    )
                })
            },
        );
    }
    group.finish();
}

/// The matmuls of one decode token of a model: per layer, `(cols, n,
/// format)` of each matrix, the format depending on the layer as the
/// model's file has it; then the output matrix.
struct DecodeModel {
    name: &'static str,
    layers: usize,
    layer: fn(usize) -> Vec<(usize, usize, WeightFormat)>,
    output: (usize, usize, WeightFormat),
}

/// A layer's Q, K, V, O, FFN gate, up and down matrices, in that order and
/// in `formats`.
fn layer_matrices(
    dim: usize,
    kv: usize,
    ffn: usize,
    formats: [WeightFormat; 7],
) -> Vec<(usize, usize, WeightFormat)> {
    let shapes = [
        (dim, dim),
        (dim, kv),
        (dim, kv),
        (dim, dim),
        (dim, ffn),
        (dim, ffn),
        (ffn, dim),
    ];
    shapes
        .into_iter()
        .zip(formats)
        .map(|((cols, n), format)| (cols, n, format))
        .collect()
}

/// SmolLM2-135M-Instruct Q4_1 (dim 576, k/v 192, ffn 1536, vocab 49152).
fn smollm2_layer(_: usize) -> Vec<(usize, usize, WeightFormat)> {
    layer_matrices(576, 192, 1536, [WeightFormat::Q4_1; 7])
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (dim 896, k/v 128, ffn 4864): Q5_0
/// but for the V and FFN-down matrices, Q8_0 and Q6_K in the layers
/// llama.cpp's Q4_K_M mix gives more bits, Q5_0 and Q4_K in the others.
fn qwen25_layer(layer: usize) -> Vec<(usize, usize, WeightFormat)> {
    let q5_0 = WeightFormat::Q5_0;
    let more_bits = [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21].contains(&layer);
    let (v, down) = if more_bits {
        (WeightFormat::Q8_0, WeightFormat::Q6_K)
    } else {
        (q5_0, WeightFormat::Q4_K)
    };
    layer_matrices(896, 128, 4864, [q5_0, q5_0, v, q5_0, q5_0, q5_0, down])
}

const DECODE_MODELS: [DecodeModel; 2] = [
    DecodeModel {
        name: "smollm2_135m_q4_1",
        layers: 30,
        layer: smollm2_layer,
        output: (576, 49152, WeightFormat::Q8_0),
    },
    DecodeModel {
        name: "qwen2.5_0.5b_q4_k_m",
        layers: 24,
        layer: qwen25_layer,
        output: (896, 151936, WeightFormat::Q8_0),
    },
];

/// Every matmul of one decode token of each of [`DECODE_MODELS`], in the
/// order a decode step runs them.
fn decode_step(c: &mut Criterion) {
    let backend = backend();
    let mut group = c.benchmark_group("decode_step");
    group.sample_size(20);
    for model in &DECODE_MODELS {
        let shapes = (0..model.layers)
            .flat_map(|layer| (model.layer)(layer))
            .chain([model.output]);
        let mut matrices = Vec::new();
        let mut bytes_total = 0;
        for (i, (cols, n, format)) in shapes.enumerate() {
            let bytes = weight_bytes(format, cols, n, i as u64 + 3);
            bytes_total += bytes.len();
            matrices.push(operands(&backend, &bytes, format, cols, n, 1));
        }
        group.throughput(Throughput::Bytes(bytes_total as u64));
        group.bench_function(model.name, |b| {
            b.iter(|| {
                for ops in &mut matrices {
                    run(&backend, ops, 1);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    gemv,
    gemm,
    reference_matmul,
    decode_step,
    ggml_gemv,
    ggml_gemm
);
criterion_main!(benches);
