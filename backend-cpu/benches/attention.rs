//! Paged attention of `CpuBackend` on 2 threads: one sequence whose cache
//! holds `CONTEXT` positions, attended by 1 query row (a decode step), 5
//! (verifying four drafted tokens) and 64 (a prefill chunk at depth), at
//! the head shapes of SmolLM2-135M (9 query heads over 3 KV heads, head
//! dim 64), Qwen2.5-0.5B (14 over 2, 64) and Gemma 3 270M (4 over 1, 256),
//! 16-token blocks, for every cache dtype a user picks with `--kv-dtype`.
//!
//! Throughput is query-key pairs per second ("elements": rows × query
//! heads × positions), so the three row counts compare directly: a step of
//! 5 rows that costs as much as one of 1 reports 5 times the pairs.
//!
//! `decode_context` times one layer's attention of a decode row at 2k, 8k,
//! 16k and 32k cached positions (F16 cache, the sparse figures' dtype):
//! `full` reads every block, `sparse16` is what `--speculate sparse` drafts
//! with, the block selection (key bounds, top 16 blocks per KV head, plus
//! the sink and recent blocks; `select16` alone) and the attention of each
//! KV head over its selected blocks. Those caches fit the last-level
//! cache; `decode_model` times a decode row's attention over every layer
//! of the model (4k and 16k positions, every dtype), whose caches do not,
//! so it reads them from memory as a real decode step does (and, for F16,
//! the sparse step's over every layer); not for Gemma 3, whose layers
//! mostly attend to a window of 512 positions.
//!
//! Run with `cargo bench -p tandem-cpu --bench attention -- --quick`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem_core::backend::{
    AttentionIndices, AttentionParams, BlockSelectParams, KvCacheLayout, KvDtype,
};
use tandem_core::sched::Rng;
use tandem_core::spec::sparse::{DEFAULT_SPARSE_BLOCKS, SPARSE_RECENT_BLOCKS, SPARSE_SINK_BLOCKS};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

const THREADS: usize = 2;
const CONTEXT: usize = 4096;
const BLOCK: usize = 16;

/// A model's attention: its query heads over its KV heads.
#[derive(Clone, Copy)]
struct Shape {
    model: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Layers that attend to the whole context (`decode_model`), if all do.
    layers: Option<usize>,
}

const SHAPES: [Shape; 3] = [
    Shape {
        model: "smollm2",
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        layers: Some(30),
    },
    Shape {
        model: "qwen2.5",
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        layers: Some(24),
    },
    Shape {
        model: "gemma3",
        heads: 4,
        kv_heads: 1,
        head_dim: 256,
        layers: None,
    },
];
const ROWS: [usize; 3] = [1, 5, 64];
const DTYPES: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Int4];
const DECODE_CONTEXTS: [usize; 4] = [2048, 8192, 16384, 32768];
const MODEL_CONTEXTS: [usize; 2] = [4096, 16384];

type Tensor = <CpuBackend as Backend>::Tensor;
type Indices = <CpuBackend as Backend>::Indices;
type KvCache = <CpuBackend as Backend>::KvCache;

fn values(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

/// A cache of `context` random positions of `shape`'s KV heads (tracking key
/// bounds when `bounds`), and the sequence's block table: blocks in reverse
/// order, as a long-lived allocator hands them out.
fn filled_cache(
    backend: &CpuBackend,
    rng: &mut Rng,
    context: usize,
    shape: Shape,
    dtype: KvDtype,
    bounds: bool,
) -> (KvCache, Indices) {
    let blocks = context / BLOCK;
    let layout = KvCacheLayout::uniform(blocks, BLOCK, shape.kv_heads, shape.head_dim, dtype);
    let mut cache = backend.alloc_kv_cache(layout).unwrap();
    if bounds {
        backend.track_key_bounds(&mut cache).unwrap();
    }
    let width = shape.kv_heads * shape.head_dim;
    let (k, v) = (
        backend.upload(&values(rng, context * width)).unwrap(),
        backend.upload(&values(rng, context * width)).unwrap(),
    );
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let slots: Vec<u32> = (0..context)
        .map(|t| table[t / BLOCK] * BLOCK as u32 + (t % BLOCK) as u32)
        .collect();
    let slots = backend.upload_indices(&slots).unwrap();
    backend
        .paged_kv_write(&k, &v, &slots, context, &mut cache)
        .unwrap();
    (cache, backend.upload_indices(&table).unwrap())
}

/// The last `rows` positions of one sequence of `context`, their queries and
/// an output buffer.
fn query_rows(
    backend: &CpuBackend,
    rng: &mut Rng,
    context: usize,
    rows: usize,
    shape: Shape,
) -> (Indices, Indices, Tensor, Tensor) {
    let width = shape.heads * shape.head_dim;
    let positions: Vec<u32> = (context - rows..context).map(|t| t as u32).collect();
    (
        backend.upload_indices(&vec![0; rows]).unwrap(),
        backend.upload_indices(&positions).unwrap(),
        backend.upload(&values(rng, rows * width)).unwrap(),
        backend.alloc(rows * width).unwrap(),
    )
}

fn indices<'a>(
    row_seq: &'a Indices,
    positions: &'a Indices,
    block_tables: &'a Indices,
) -> AttentionIndices<'a, CpuBackend> {
    AttentionIndices {
        row_seq,
        positions,
        block_tables,
    }
}

fn params(rows: usize, shape: Shape, context: usize) -> AttentionParams {
    AttentionParams {
        rows,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        block_size: BLOCK,
        max_blocks_per_seq: context / BLOCK,
        scale: 1.0 / (shape.head_dim as f32).sqrt(),
        sliding_window: None,
        per_head_tables: false,
    }
}

fn attention(c: &mut Criterion) {
    let backend = CpuBackend::new(THREADS);
    let mut group = c.benchmark_group("paged_attention");
    let mut rng = Rng::new(5);
    for shape in SHAPES {
        let model = shape.model;
        for dtype in DTYPES {
            let (cache, tables) = filled_cache(&backend, &mut rng, CONTEXT, shape, dtype, false);
            for rows in ROWS {
                let p = params(rows, shape, CONTEXT);
                let (row_seq, positions, q, mut out) =
                    query_rows(&backend, &mut rng, CONTEXT, rows, shape);
                group.throughput(Throughput::Elements((rows * shape.heads * CONTEXT) as u64));
                group.bench_function(
                    BenchmarkId::new(format!("{model}/{dtype}"), format!("rows{rows}")),
                    |b| {
                        b.iter(|| {
                            let idx = indices(&row_seq, &positions, &tables);
                            backend
                                .paged_attention(black_box(&q), &cache, idx, p, &mut out)
                                .unwrap()
                        })
                    },
                );
            }
        }
    }
    group.finish();
}

fn decode_context(c: &mut Criterion) {
    let backend = CpuBackend::new(THREADS);
    let mut group = c.benchmark_group("decode_context");
    let mut rng = Rng::new(7);
    for shape in SHAPES {
        let model = shape.model;
        for context in DECODE_CONTEXTS {
            let (cache, tables) =
                filled_cache(&backend, &mut rng, context, shape, KvDtype::F16, true);
            let p = params(1, shape, context);
            let (row_seq, positions, q, mut out) =
                query_rows(&backend, &mut rng, context, 1, shape);
            let mut selected = selected_tables(&backend, shape.kv_heads, context);
            group.bench_function(BenchmarkId::new(format!("{model}/full"), context), |b| {
                b.iter(|| {
                    backend
                        .paged_attention(
                            black_box(&q),
                            &cache,
                            indices(&row_seq, &positions, &tables),
                            p,
                            &mut out,
                        )
                        .unwrap()
                })
            });
            group.bench_function(
                BenchmarkId::new(format!("{model}/select16"), context),
                |b| {
                    b.iter(|| {
                        let idx = indices(&row_seq, &positions, &tables);
                        backend
                            .select_kv_blocks(black_box(&q), &cache, idx, p, SELECT, &mut selected)
                            .unwrap()
                    })
                },
            );
            group.bench_function(
                BenchmarkId::new(format!("{model}/sparse16"), context),
                |b| {
                    b.iter(|| {
                        let rows = Rows {
                            q: black_box(&q),
                            row_seq: &row_seq,
                            positions: &positions,
                        };
                        attend_sparse(
                            &backend,
                            rows,
                            (&cache, &tables),
                            p,
                            &mut selected,
                            &mut out,
                        )
                    })
                },
            );
        }
    }
    group.finish();
}

/// What `--speculate sparse` selects by default.
const SELECT: BlockSelectParams = BlockSelectParams {
    top_blocks: DEFAULT_SPARSE_BLOCKS,
    sink_blocks: SPARSE_SINK_BLOCKS,
    recent_blocks: SPARSE_RECENT_BLOCKS,
};

/// Room for the tables (one per KV head) that a selection writes.
fn selected_tables(backend: &CpuBackend, kv_heads: usize, context: usize) -> Indices {
    backend
        .upload_indices(&vec![0; kv_heads * context / BLOCK])
        .unwrap()
}

/// A call's query rows.
#[derive(Clone, Copy)]
struct Rows<'a> {
    q: &'a Tensor,
    row_seq: &'a Indices,
    positions: &'a Indices,
}

/// A sparse draft step's attention of one layer: the block selection,
/// then each KV head's attention over its selected blocks.
fn attend_sparse(
    backend: &CpuBackend,
    rows: Rows<'_>,
    (cache, tables): (&KvCache, &Indices),
    p: AttentionParams,
    selected: &mut Indices,
    out: &mut Tensor,
) {
    let idx = indices(rows.row_seq, rows.positions, tables);
    backend
        .select_kv_blocks(rows.q, cache, idx, p, SELECT, selected)
        .unwrap();
    let per_head = AttentionParams {
        per_head_tables: true,
        ..p
    };
    let idx = indices(rows.row_seq, rows.positions, selected);
    backend
        .paged_attention(rows.q, cache, idx, per_head, out)
        .unwrap()
}

/// One decode step's attention over every layer of the model (30 caches
/// for SmolLM2, 24 for Qwen2.5), as a real step reads them: from memory,
/// since a whole model's cache outgrows the last-level cache.
fn decode_model(c: &mut Criterion) {
    let backend = CpuBackend::new(THREADS);
    let mut group = c.benchmark_group("decode_model");
    group.sample_size(10);
    let mut rng = Rng::new(9);
    for shape in SHAPES {
        let (model, Some(layers)) = (shape.model, shape.layers) else {
            continue;
        };
        for (context, dtype) in MODEL_CONTEXTS
            .into_iter()
            .flat_map(|c| DTYPES.map(|d| (c, d)))
        {
            // F16 caches track key bounds, for the sparse step.
            let sparse = dtype == KvDtype::F16;
            let caches: Vec<(KvCache, Indices)> = (0..layers)
                .map(|_| filled_cache(&backend, &mut rng, context, shape, dtype, sparse))
                .collect();
            let p = params(1, shape, context);
            let (row_seq, positions, q, mut out) =
                query_rows(&backend, &mut rng, context, 1, shape);
            let id = BenchmarkId::new(format!("{model}/{dtype}"), context);
            group.bench_function(id, |b| {
                b.iter(|| {
                    for (cache, tables) in &caches {
                        backend
                            .paged_attention(
                                black_box(&q),
                                cache,
                                indices(&row_seq, &positions, tables),
                                p,
                                &mut out,
                            )
                            .unwrap()
                    }
                })
            });
            if !sparse {
                continue;
            }
            let mut selected = selected_tables(&backend, shape.kv_heads, context);
            let id = BenchmarkId::new(format!("{model}/{dtype}/sparse16"), context);
            group.bench_function(id, |b| {
                b.iter(|| {
                    let rows = Rows {
                        q: black_box(&q),
                        row_seq: &row_seq,
                        positions: &positions,
                    };
                    for cache in &caches {
                        attend_sparse(
                            &backend,
                            rows,
                            (&cache.0, &cache.1),
                            p,
                            &mut selected,
                            &mut out,
                        )
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, attention, decode_context, decode_model);
criterion_main!(benches);
