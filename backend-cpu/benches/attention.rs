//! Paged attention of `CpuBackend` on 2 threads: one sequence whose cache
//! holds `CONTEXT` positions, attended by 1 query row (a decode step), 5
//! (verifying four drafted tokens) and 64 (a prefill chunk at depth), at
//! the head shapes of SmolLM2-135M (9 query heads over 3 KV heads) and
//! Qwen2.5-0.5B (14 over 2), head dim 64, 16-token blocks, for every
//! cache dtype a user picks with `--kv-dtype`.
//!
//! Throughput is query-key pairs per second ("elements": rows × query
//! heads × positions), so the three row counts compare directly: a step of
//! 5 rows that costs as much as one of 1 reports 5 times the pairs.
//!
//! Run with `cargo bench -p tandem-cpu --bench attention -- --quick`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem_core::backend::{AttentionIndices, AttentionParams, KvCacheLayout, KvDtype};
use tandem_core::sched::Rng;
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

const THREADS: usize = 2;
const CONTEXT: usize = 4096;
const BLOCK: usize = 16;
const HEAD_DIM: usize = 64;

/// `(model, query heads, KV heads)`.
const SHAPES: [(&str, usize, usize); 2] = [("smollm2", 9, 3), ("qwen2.5", 14, 2)];
const ROWS: [usize; 3] = [1, 5, 64];
const DTYPES: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Int4];

fn values(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

fn attention(c: &mut Criterion) {
    let backend = CpuBackend::new(THREADS);
    let mut group = c.benchmark_group("paged_attention");
    let mut rng = Rng::new(5);
    let blocks = CONTEXT / BLOCK;
    for (model, heads, kv_heads) in SHAPES {
        for dtype in DTYPES {
            let layout = KvCacheLayout::uniform(blocks, BLOCK, kv_heads, HEAD_DIM, dtype);
            let mut cache = backend.alloc_kv_cache(layout).unwrap();
            let width = kv_heads * HEAD_DIM;
            let (k, v) = (
                backend.upload(&values(&mut rng, CONTEXT * width)).unwrap(),
                backend.upload(&values(&mut rng, CONTEXT * width)).unwrap(),
            );
            // Blocks in reverse order, as a long-lived allocator hands them out.
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let slots: Vec<u32> = (0..CONTEXT)
                .map(|t| table[t / BLOCK] * BLOCK as u32 + (t % BLOCK) as u32)
                .collect();
            let slots = backend.upload_indices(&slots).unwrap();
            backend
                .paged_kv_write(&k, &v, &slots, CONTEXT, &mut cache)
                .unwrap();
            let tables = backend.upload_indices(&table).unwrap();
            for rows in ROWS {
                let p = AttentionParams {
                    rows,
                    heads,
                    kv_heads,
                    head_dim: HEAD_DIM,
                    block_size: BLOCK,
                    max_blocks_per_seq: blocks,
                    scale: 1.0 / (HEAD_DIM as f32).sqrt(),
                    sliding_window: None,
                };
                let positions: Vec<u32> = (CONTEXT - rows..CONTEXT).map(|t| t as u32).collect();
                let (row_seq, positions) = (
                    backend.upload_indices(&vec![0; rows]).unwrap(),
                    backend.upload_indices(&positions).unwrap(),
                );
                let q = backend
                    .upload(&values(&mut rng, rows * heads * HEAD_DIM))
                    .unwrap();
                let mut out = backend.alloc(rows * heads * HEAD_DIM).unwrap();
                group.throughput(Throughput::Elements((rows * heads * CONTEXT) as u64));
                group.bench_function(
                    BenchmarkId::new(format!("{model}/{dtype}"), format!("rows{rows}")),
                    |b| {
                        b.iter(|| {
                            let idx = AttentionIndices {
                                row_seq: &row_seq,
                                positions: &positions,
                                block_tables: &tables,
                            };
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

criterion_group!(benches, attention);
criterion_main!(benches);
