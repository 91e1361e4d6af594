//! KV eviction (`--kv-budget`, `--kv-evict`): a budget larger than the
//! sequence changes nothing; `streaming` keeps exactly the sinks and the
//! window; `h2o` keeps the blocks every query attends to; every policy on
//! every KV dtype on the CPU and wgpu (lavapipe) backends keeps each
//! sequence within its budget while it grows past the KV pool, and the two
//! backends agree under eviction; the API's per-request fields.

mod serving_support;

use tandem_core::backend::{AttentionIndices, AttentionParams, Backend, KvCacheLayout, KvDtype};
use tandem_core::engine::{Engine, EngineConfig, Request};
use tandem_core::kv::{EvictionConfig, EvictionPolicy, KvBudget, KvCacheManager, EVICTED_BLOCK};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_cpu::{reference, CpuBackend};
use tandem_tests::{max_abs_diff, tiny, tiny_gguf};
use tandem_wgpu::{WgpuBackend, WgpuOptions};

const BLOCK: usize = 4;

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + 11) % 250).collect()
}

fn eviction(policy: EvictionPolicy, budget: usize, sinks: usize, recent: usize) -> EvictionConfig {
    EvictionConfig {
        sinks,
        recent: Some(recent),
        ..EvictionConfig::new(KvBudget::Tokens(budget), policy)
    }
}

fn engine<B: Backend>(
    backend: B,
    files: &ModelFiles,
    dtype: KvDtype,
    blocks: usize,
    kv_eviction: Option<EvictionConfig>,
) -> Engine<B> {
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: blocks,
        max_batch_tokens: 16,
        kv_precision: dtype.into(),
        kv_eviction,
        ..EngineConfig::default()
    };
    Engine::new(backend, files, config, &mut |_, _| {}).expect("engine")
}

/// Greedy tokens after `prompt`; after every step from the first token on
/// the sequence's live blocks are checked against `budget_blocks`. The
/// sequence is kept.
fn run<B: Backend>(
    engine: &mut Engine<B>,
    prompt: &[u32],
    n: usize,
    budget_blocks: Option<usize>,
) -> (u64, Vec<u32>) {
    let seq = engine
        .add_request(prompt.to_vec(), SamplingParams::default(), n, vec![])
        .expect("request");
    while !engine.is_finished(seq) {
        engine.step().expect("step");
        // SnapKV selects once the prompt is computed (its first token out).
        let prompt_done = engine.tokens(seq).is_some_and(|t| t.len() > prompt.len());
        if let (Some(budget), Some(table), true) =
            (budget_blocks, engine.kv_manager().table(seq), prompt_done)
        {
            assert!(
                table.live_blocks() <= budget,
                "{} live blocks over a budget of {budget}",
                table.live_blocks()
            );
        }
    }
    let tokens = engine.tokens(seq).expect("kept")[prompt.len()..].to_vec();
    (seq, tokens)
}

fn wgpu() -> WgpuBackend {
    WgpuBackend::new(WgpuOptions::default()).unwrap_or_else(|e| {
        panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers`")
    })
}

#[test]
fn a_budget_larger_than_the_sequence_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 3));
    let p = prompt(37);
    let mut plain = engine(CpuBackend::new(2), &files, KvDtype::F32, 64, None);
    let (_, want) = run(&mut plain, &p, 40, None);
    for policy in EvictionPolicy::ALL {
        let config = eviction(policy, 200, 4, 16);
        let mut evicting = engine(CpuBackend::new(2), &files, KvDtype::F32, 64, Some(config));
        let (seq, got) = run(&mut evicting, &p, 40, None);
        assert_eq!(got, want, "{policy}");
        assert!(
            !evicting.kv_manager().table(seq).unwrap().has_evicted(),
            "{policy}"
        );
    }
}

#[test]
fn streaming_keeps_exactly_the_sinks_and_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 5));
    // 32 tokens = 8 blocks: the sink block and the newest 7.
    let config = eviction(EvictionPolicy::Streaming, 32, 3, 8);
    let mut e = engine(CpuBackend::new(2), &files, KvDtype::F32, 40, Some(config));
    let (seq, tokens) = run(&mut e, &prompt(45), 60, Some(8));
    assert_eq!(tokens.len(), 60);
    let table = e.kv_manager().table(seq).unwrap();
    let entries = table.blocks().len();
    assert_eq!(entries, (45usize + 60 - 1).div_ceil(BLOCK));
    let live: Vec<usize> = (0..entries)
        .filter(|&i| table.blocks()[i] != EVICTED_BLOCK)
        .collect();
    let mut want = vec![0];
    want.extend(entries - 7..entries);
    assert_eq!(live, want);
    // A rewind into evicted KV is refused and changes nothing; one inside
    // the kept window works.
    let len = e.tokens(seq).unwrap().len();
    let err = e.rewind(seq, 6).unwrap_err().to_string();
    assert!(err.contains("evicted"), "{err}");
    assert_eq!(e.tokens(seq).unwrap().len(), len);
    e.rewind(seq, len - 5).unwrap();
    e.extend(seq, &[1, 2, 3], 4).unwrap();
    while !e.is_finished(seq) {
        e.step().expect("step");
    }
    assert_eq!(e.tokens(seq).unwrap().len(), len - 5 + 3 + 4);
}

#[test]
fn a_sequence_under_a_budget_grows_past_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 6));
    // A pool of 20 blocks (80 tokens) and a sequence of 200.
    let config = eviction(EvictionPolicy::Streaming, 24, 4, 8);
    let mut e = engine(CpuBackend::new(2), &files, KvDtype::F32, 20, Some(config));
    let (_, tokens) = run(&mut e, &prompt(60), 140, Some(6));
    assert_eq!(tokens.len(), 140);
    let mut plain = engine(CpuBackend::new(2), &files, KvDtype::F32, 20, None);
    let err = plain
        .add_request(prompt(90), SamplingParams::default(), 10, vec![])
        .unwrap_err();
    assert!(err.to_string().contains("KV cache"), "{err}");
}

#[test]
fn a_request_may_carry_its_own_budget() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 8));
    let mut e = engine(CpuBackend::new(2), &files, KvDtype::F32, 64, None);
    let request = Request {
        kv_eviction: Some(eviction(EvictionPolicy::Streaming, 16, 4, 4)),
        ..Request::new(prompt(30), SamplingParams::default(), 20)
    };
    let seq = e.submit(request).expect("submit")[0];
    while !e.is_finished(seq) {
        e.step().expect("step");
    }
    assert_eq!(e.kv_manager().table(seq).unwrap().live_blocks(), 4);
    let bad = Request {
        kv_eviction: Some(eviction(EvictionPolicy::H2o, 4, 4, 4)),
        ..Request::new(prompt(30), SamplingParams::default(), 20)
    };
    let err = e.submit(bad).unwrap_err().to_string();
    assert!(err.contains("--kv-budget"), "{err}");
}

/// Keys of blocks 2 and 5 point where every query points; the others are
/// noise. H2O's scores from the attention kernel keep exactly those two
/// among the evictable blocks.
fn h2o_keeps_the_attended_blocks<B: Backend>(be: &B) {
    let (kv_heads, heads, hd) = (2, 4, 16);
    let blocks = 12usize;
    let layout = KvCacheLayout {
        num_blocks: 16,
        block_size: BLOCK,
        kv_heads,
        head_dim: hd,
        keys: KvDtype::F32,
        values: KvDtype::F32,
    };
    let len = blocks * BLOCK - 2;
    let mut manager = KvCacheManager::new(16, BLOCK);
    manager.add_sequence(0).unwrap();
    let slots = manager.reserve(0, len).unwrap().slots;
    let table = manager.table(0).unwrap().blocks().to_vec();
    let noise = |i: usize| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.2;
    let k: Vec<f32> = (0..len * kv_heads * hd)
        .map(|i| {
            let block = i / (kv_heads * hd) / BLOCK;
            if (block == 2 || block == 5) && i % hd == 0 {
                4.0
            } else {
                noise(i)
            }
        })
        .collect();
    let v: Vec<f32> = (0..k.len()).map(noise).collect();
    let mut cache = be.alloc_kv_cache(layout).unwrap();
    let (kt, vt, st) = (
        be.upload(&k).unwrap(),
        be.upload(&v).unwrap(),
        be.upload_indices(&slots).unwrap(),
    );
    be.paged_kv_write(&kt, &vt, &st, len, &mut cache).unwrap();
    // The last 8 positions query, each head along the first dimension.
    let rows = 8;
    let q: Vec<f32> = (0..rows * heads * hd)
        .map(|i| if i % hd == 0 { 3.0 } else { noise(i + 5) })
        .collect();
    let positions: Vec<u32> = ((len - rows) as u32..len as u32).collect();
    let p = AttentionParams {
        rows,
        heads,
        kv_heads,
        head_dim: hd,
        block_size: BLOCK,
        max_blocks_per_seq: blocks,
        scale: 0.25,
        sliding_window: None,
        per_head_tables: false,
    };
    let (qt, rs, pt, bt) = (
        be.upload(&q).unwrap(),
        be.upload_indices(&vec![0; rows]).unwrap(),
        be.upload_indices(&positions).unwrap(),
        be.upload_indices(&table).unwrap(),
    );
    let idx = AttentionIndices {
        row_seq: &rs,
        positions: &pt,
        block_tables: &bt,
    };
    let mut scores = be.upload(&vec![0.0; rows * kv_heads * blocks]).unwrap();
    be.paged_attention_scores(&qt, &cache, idx, p, &mut scores)
        .unwrap();
    let scores = be.download(&scores, rows * kv_heads * blocks).unwrap();
    let mut mass = vec![0f32; blocks];
    for head in scores.chunks(blocks) {
        mass.iter_mut().zip(head).for_each(|(m, s)| *m += s);
    }
    let total: f32 = mass.iter().sum();
    assert!((total - (rows * heads) as f32).abs() < 1e-2, "{total}");
    manager.add_block_scores(0, &mass, 1.0).unwrap();
    // Budget: the sink block, blocks 2 and 5, and the window's last two.
    let plan = eviction(EvictionPolicy::H2o, 5 * BLOCK, 1, BLOCK)
        .plan(1000, BLOCK)
        .unwrap();
    manager.evict_over_budget(0, &plan).unwrap();
    let t = manager.table(0).unwrap();
    let live: Vec<usize> = (0..blocks)
        .filter(|&i| t.blocks()[i] != EVICTED_BLOCK)
        .collect();
    assert_eq!(live, vec![0, 2, 5, 10, 11], "mass {mass:?}");
}

#[test]
fn h2o_keeps_the_blocks_every_query_attends_to_on_the_cpu() {
    h2o_keeps_the_attended_blocks(&CpuBackend::new(2));
}

#[test]
fn h2o_keeps_the_blocks_every_query_attends_to_on_wgpu() {
    h2o_keeps_the_attended_blocks(&wgpu());
}

#[test]
fn cpu_attention_over_evicted_blocks_matches_the_reference() {
    let be = CpuBackend::new(2);
    let layout = KvCacheLayout {
        num_blocks: 10,
        block_size: 3,
        kv_heads: 2,
        head_dim: 24,
        keys: KvDtype::F32,
        values: KvDtype::F32,
    };
    let n_slots = layout.num_slots();
    let noise = |i: usize, s: usize| (((i * 7919 + s) % 1000) as f32 / 500.0) - 1.0;
    let k: Vec<f32> = (0..n_slots * 48).map(|i| noise(i, 1)).collect();
    let v: Vec<f32> = (0..n_slots * 48).map(|i| noise(i, 2)).collect();
    let slots: Vec<u32> = (0..n_slots as u32).collect();
    let mut cache = be.alloc_kv_cache(layout).unwrap();
    let (kt, vt, st) = (
        be.upload(&k).unwrap(),
        be.upload(&v).unwrap(),
        be.upload_indices(&slots).unwrap(),
    );
    be.paged_kv_write(&kt, &vt, &st, n_slots, &mut cache)
        .unwrap();
    let table = [
        7,
        EVICTED_BLOCK,
        3,
        EVICTED_BLOCK,
        EVICTED_BLOCK,
        EVICTED_BLOCK,
        EVICTED_BLOCK,
        1,
        9,
    ];
    let positions = [25u32, 24, 22, 8];
    let rows = positions.len();
    let q: Vec<f32> = (0..rows * 6 * 24).map(|i| noise(i, 3)).collect();
    let p = AttentionParams {
        rows,
        heads: 6,
        kv_heads: 2,
        head_dim: 24,
        block_size: 3,
        max_blocks_per_seq: table.len(),
        scale: 0.2,
        sliding_window: None,
        per_head_tables: false,
    };
    let (qt, rs, pt, bt) = (
        be.upload(&q).unwrap(),
        be.upload_indices(&[0; 4]).unwrap(),
        be.upload_indices(&positions).unwrap(),
        be.upload_indices(&table).unwrap(),
    );
    let idx = AttentionIndices {
        row_seq: &rs,
        positions: &pt,
        block_tables: &bt,
    };
    let mut out = be.alloc(rows * 6 * 24).unwrap();
    be.paged_attention(&qt, &cache, idx, p, &mut out).unwrap();
    let got = be.download(&out, rows * 6 * 24).unwrap();
    let mut want = vec![0.0; got.len()];
    reference::paged_attention(&q, &k, &v, &[0; 4], &positions, &table, p, &mut want);
    assert!(max_abs_diff(&got, &want) < 1e-4);
    // With the holes filled in, the output differs: the holes were skipped.
    let full: Vec<u32> = table
        .iter()
        .map(|&b| if b == EVICTED_BLOCK { 0 } else { b })
        .collect();
    let mut unevicted = vec![0.0; got.len()];
    reference::paged_attention(&q, &k, &v, &[0; 4], &positions, &full, p, &mut unevicted);
    assert!(max_abs_diff(&got, &unevicted) > 1e-3);
}

/// Every policy on every KV dtype: the sequence stays within its budget as
/// it grows past the pool, on the CPU and on wgpu, and under `streaming`
/// (whose choice does not hang on near ties) the two backends score the
/// same text within the dtype's tolerance.
#[test]
fn every_policy_on_every_kv_dtype_on_cpu_and_wgpu() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 9));
    let text = prompt(90);
    for dtype in [KvDtype::F16, KvDtype::Int8, KvDtype::Int4] {
        for policy in EvictionPolicy::ALL {
            let config = eviction(policy, 24, 4, 8);
            let mut cpu = engine(CpuBackend::new(2), &files, dtype, 20, Some(config));
            let (_, cpu_tokens) = run(&mut cpu, &prompt(50), 60, Some(6));
            assert_eq!(cpu_tokens.len(), 60, "{dtype} {policy}");
            let mut on_gpu = engine(wgpu(), &files, dtype, 20, Some(config));
            let (_, gpu_tokens) = run(&mut on_gpu, &prompt(50), 60, Some(6));
            assert_eq!(gpu_tokens.len(), 60, "{dtype} {policy}");
        }
        let config = eviction(EvictionPolicy::Streaming, 24, 4, 8);
        let mut cpu = engine(CpuBackend::new(2), &files, dtype, 20, Some(config));
        let mut on_gpu = engine(wgpu(), &files, dtype, 20, Some(config));
        let mut plain = engine(CpuBackend::new(2), &files, dtype, 40, None);
        let want = cpu.score(&text, 60).unwrap();
        let got = on_gpu.score(&text, 60).unwrap();
        let full = plain.score(&text, 60).unwrap();
        let tolerance = if dtype == KvDtype::F16 { 2e-3 } else { 1e-2 };
        assert!(
            max_abs_diff(&got, &want) < tolerance,
            "{dtype}: wgpu vs cpu"
        );
        assert!(
            max_abs_diff(&full, &want) > 10.0 * tolerance,
            "{dtype}: eviction had no effect"
        );
    }
}

/// The OpenAI API's extension fields reach the engine: a budget larger than
/// the sequence changes no logprob, a small one changes them, and bad
/// values get a 400 naming the field.
#[test]
fn the_api_takes_a_budget_per_request() {
    use serde_json::{json, Value};
    let t = serving_support::start(128, 16);
    let addr = t.server.addr;
    let text: String = (0..150)
        .map(|i| (b'a' + (i * 7 % 26) as u8) as char)
        .collect();
    let ask = |extra: Value| {
        let mut body = json!({
            "model": serving_support::MODEL, "prompt": text, "max_tokens": 24,
            "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": true,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        serving_support::post(addr, "/v1/completions", &body)
    };
    let logprobs = |(status, v): (u16, Value)| {
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["logprobs"]["token_logprobs"].clone()
    };
    let full = logprobs(ask(json!({})));
    let roomy = logprobs(ask(json!({"kv_budget": 1000, "kv_evict": "h2o"})));
    assert_eq!(full, roomy);
    let small = logprobs(ask(
        json!({"kv_budget": "12.5%", "kv_evict": "streaming", "kv_recent": 16}),
    ));
    assert_ne!(full, small);
    for (extra, field) in [
        (json!({"kv_budget": "lots"}), "kv_budget"),
        (json!({"kv_budget": 0}), "kv_budget"),
        (json!({"kv_budget": 8}), "kv_budget"),
        (json!({"kv_budget": 64, "kv_evict": "lru"}), "kv_evict"),
        (json!({"kv_evict": "h2o"}), "kv_evict"),
        (json!({"kv_budget": 64, "kv_sinks": -1}), "kv_sinks"),
    ] {
        let (status, v) = ask(extra.clone());
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], field, "{extra}: {v}");
    }
}

/// Two sequences under budgets in a pool that holds neither's length nor
/// both budgets at once: they preempt each other, recompute, and both
/// finish, and every block is free afterwards.
#[test]
fn sequences_under_budgets_preempt_and_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 10));
    for policy in EvictionPolicy::ALL {
        let config = eviction(policy, 24, 4, 8);
        let mut e = engine(CpuBackend::new(2), &files, KvDtype::F32, 12, Some(config));
        let prompts = [prompt(10), prompt(11)];
        let out = tandem_tests::generate(&mut e, &prompts, &|_| SamplingParams::default(), 80);
        assert!(out.iter().all(|t| t.len() == 80), "{policy}");
        assert!(
            e.stats().preemptions > 0,
            "{policy}: no preemption happened"
        );
        assert_eq!(e.kv_manager().num_free_blocks(), 12, "{policy}");
    }
}
