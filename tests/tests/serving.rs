//! Serving behaviour of the engine on tiny random models: continuous
//! batching with preemption is invisible in greedy outputs, samples share
//! their prompt's blocks, the prefix cache reuses blocks without changing
//! results, priorities order the work, and removal frees blocks at once.

use std::collections::HashMap;

use tandem_core::engine::{Engine, EngineConfig, FinishReason, Request};
use tandem_core::kv::SeqId;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::{SamplingParams, SubmitError};
use tandem_cpu::CpuBackend;
use tandem_tests::{cpu_engine, tiny, tiny_gguf};

fn engine(files: &ModelFiles, num_blocks: usize, max_batch_tokens: usize) -> Engine<CpuBackend> {
    let config = EngineConfig {
        num_blocks,
        max_batch_tokens,
        ..EngineConfig::default()
    };
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap()
}

/// Deterministic pseudo-random prompt `i` of `len` tokens.
fn prompt(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| ((i * 7919 + t * 104_729 + t * t * 31) % (vocab - 1)) as u32)
        .collect()
}

/// Steps until idle, removing finished sequences; returns every sequence's generated tokens.
fn drain(e: &mut Engine<CpuBackend>) -> HashMap<SeqId, Vec<u32>> {
    let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            out.entry(ev.seq).or_default().push(ev.token);
            if ev.finished.is_some() {
                e.remove(ev.seq);
            }
        }
    }
    out
}

fn alone(files: &ModelFiles, prompt: &[u32], max_new: usize) -> Vec<u32> {
    let mut e = cpu_engine(files, 1024, 512);
    let s = e
        .add_request(prompt.to_vec(), SamplingParams::default(), max_new, vec![])
        .unwrap();
    drain(&mut e).remove(&s).unwrap()
}

#[test]
fn sixteen_concurrent_greedy_requests_match_each_run_alone() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 11));
    let vocab = files.config.vocab_size;
    let work: Vec<(Vec<u32>, usize)> = (0..16)
        .map(|i| (prompt(i, 5 + (i * 37) % 90, vocab), 4 + (i * 13) % 29))
        .collect();
    let want: Vec<Vec<u32>> = work.iter().map(|(p, n)| alone(&files, p, *n)).collect();
    // 24 blocks of 16 tokens cannot hold all 16 sequences at once: some are
    // preempted and recomputed. A 24-token budget chunks the longer prompts.
    let mut e = engine(&files, 24, 24);
    let mut ids = Vec::new();
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    for (i, (p, n)) in work.iter().enumerate() {
        ids.push(
            e.add_request(p.clone(), SamplingParams::default(), *n, vec![])
                .unwrap(),
        );
        // Requests join at different steps: a few steps between arrivals.
        for _ in 0..(i % 3) {
            for ev in e.step().unwrap() {
                got.entry(ev.seq).or_default().push(ev.token);
                if ev.finished.is_some() {
                    e.remove(ev.seq);
                }
            }
        }
    }
    for (s, tokens) in drain(&mut e) {
        got.entry(s).or_default().extend(tokens);
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id], want[i], "request {i}");
    }
    let stats = e.stats();
    assert!(stats.preemptions > 0, "the small pool forces preemptions");
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
}

#[test]
fn four_samples_of_a_200_token_prompt_hold_its_blocks_once() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_0, 12));
    let vocab = files.config.vocab_size;
    let mut e = engine(&files, 128, 512);
    let request = Request {
        samples: 4,
        ..Request::new(
            prompt(3, 200, vocab),
            SamplingParams {
                temperature: 0.8,
                seed: 5,
                ..Default::default()
            },
            8,
        )
    };
    let ids = e.submit(request).unwrap();
    assert_eq!(ids.len(), 4);
    let mut outputs: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let first = e.step().unwrap();
    assert_eq!(
        first.len(),
        4,
        "every sample draws its first token from the one prefill"
    );
    // 200 tokens = 12 full blocks + 8 tokens in a 13th, held once by all four.
    assert_eq!(e.kv_manager().num_used_blocks(), 13);
    for b in e.kv_manager().table(ids[0]).unwrap().blocks() {
        assert_eq!(e.kv_manager().allocator().ref_count(*b), 4);
    }
    // Writing the next token copies only the shared partial block.
    let second = e.step().unwrap();
    assert_eq!(e.kv_manager().num_used_blocks(), 12 + 4);
    for ev in first.into_iter().chain(second) {
        outputs.entry(ev.seq).or_default().push(ev.token);
    }
    for (s, tokens) in drain(&mut e) {
        outputs.entry(s).or_default().extend(tokens);
    }
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
    assert!(ids.iter().all(|s| outputs[s].len() == 8));
    let distinct: std::collections::HashSet<&Vec<u32>> = outputs.values().collect();
    assert!(distinct.len() > 1, "different seeds give different samples");
}

#[test]
fn cached_prefix_blocks_are_reused_without_changing_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F16, 13));
    let vocab = files.config.vocab_size;
    let system = prompt(9, 100, vocab);
    let with_tail = |tail: usize| {
        let mut p = system.clone();
        p.extend(prompt(tail, 10 + tail, vocab));
        p
    };
    let mut e = engine(&files, 64, 512);
    let a = e
        .add_request(with_tail(1), SamplingParams::default(), 6, vec![])
        .unwrap();
    drain(&mut e);
    let b = e
        .add_request(with_tail(2), SamplingParams::default(), 6, vec![])
        .unwrap();
    let got = drain(&mut e).remove(&b).unwrap();
    assert_ne!(a, b);
    let stats = e.stats();
    // The second request found the 6 full blocks of the shared 100 tokens.
    assert_eq!(stats.prefix_hit_tokens, 96);
    assert_eq!(got, alone(&files, &with_tail(2), 6));
}

#[test]
fn removing_a_sequence_frees_its_blocks_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 14));
    let vocab = files.config.vocab_size;
    let mut e = engine(&files, 64, 512);
    let s = e
        .add_request(prompt(1, 70, vocab), SamplingParams::default(), 50, vec![])
        .unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.kv_manager().num_used_blocks() >= 5);
    e.remove(s);
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
    assert!(!e.has_work());
}

#[test]
fn a_high_priority_request_preempts_low_priority_ones_and_all_finish_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 15));
    let vocab = files.config.vocab_size;
    let low: Vec<Vec<u32>> = (0..3).map(|i| prompt(20 + i, 60, vocab)).collect();
    let high = prompt(30, 60, vocab);
    // 16 blocks: the three low-priority sequences fill the pool.
    let mut e = engine(&files, 16, 512);
    let low_ids: Vec<SeqId> = low
        .iter()
        .map(|p| {
            e.add_request(p.clone(), SamplingParams::default(), 40, vec![])
                .unwrap()
        })
        .collect();
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    for _ in 0..3 {
        for ev in e.step().unwrap() {
            got.entry(ev.seq).or_default().push(ev.token);
        }
    }
    let request = Request {
        priority: 5,
        ..Request::new(high.clone(), SamplingParams::default(), 10)
    };
    let h = e.submit(request).unwrap()[0];
    let mut finished_order = Vec::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            got.entry(ev.seq).or_default().push(ev.token);
            if ev.finished.is_some() {
                assert_eq!(ev.finished, Some(FinishReason::Length));
                finished_order.push(ev.seq);
                e.remove(ev.seq);
            }
        }
    }
    assert_eq!(
        finished_order[0], h,
        "the high-priority request finishes first"
    );
    assert!(e.stats().preemptions > 0);
    assert_eq!(got[&h], alone(&files, &high, 10));
    for (id, p) in low_ids.iter().zip(&low) {
        assert_eq!(got[id], alone(&files, p, 40));
    }
}

#[test]
fn a_full_waiting_queue_refuses_requests() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 16));
    let config = EngineConfig {
        num_blocks: 32,
        max_waiting: 2,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(CpuBackend::new(2), &files, config, &mut |_, _| {}).unwrap();
    for _ in 0..2 {
        e.submit(Request::new(vec![1, 2, 3], SamplingParams::default(), 4))
            .unwrap();
    }
    let err = e
        .submit(Request::new(vec![1, 2, 3], SamplingParams::default(), 4))
        .unwrap_err();
    assert!(matches!(err, SubmitError::QueueFull(2)), "{err}");
    drain(&mut e);
    e.submit(Request::new(vec![1, 2, 3], SamplingParams::default(), 4))
        .unwrap();
}

#[test]
fn logprobs_describe_the_sampled_token() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 17));
    let mut e = engine(&files, 32, 512);
    let request = Request {
        logprobs: Some(3),
        ..Request::new(vec![5, 6, 7, 8], SamplingParams::default(), 3)
    };
    e.submit(request).unwrap();
    let events = e.step().unwrap();
    let lp = events[0].logprobs.as_ref().unwrap();
    assert_eq!(lp.top.len(), 3);
    // Greedy: the sampled token is the most likely one.
    assert_eq!(lp.top[0].0, events[0].token);
    assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
    assert!(lp.top[0].1 >= lp.top[1].1 && lp.top[1].1 >= lp.top[2].1 && lp.logprob <= 0.0);
}

#[test]
fn smollm2_batched_and_preempted_greedy_outputs_match_each_run_alone() {
    let files = tandem_core::model::load(&tandem_tests::smollm2_path()).unwrap();
    let tok = &files.tokenizer;
    let texts = [
        "The capital of France is",
        "Rust is a programming language that",
        "Once upon a time, in a small village by the sea, there lived",
        "def fibonacci(n):",
        "The three primary colors are",
        "Water boils at",
        "In 1969, the first humans",
        "A haiku about autumn:",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let max_new = |i: usize| 6 + 3 * i;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| alone(&files, p, max_new(i)))
        .collect();
    // 6 blocks of 16 tokens for 8 sequences of up to 40 tokens: preemption is certain.
    let mut e = engine(&files, 6, 32);
    let ids: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            e.add_request(p.clone(), SamplingParams::default(), max_new(i), vec![])
                .unwrap()
        })
        .collect();
    let got = drain(&mut e);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id], want[i], "{:?}", texts[i]);
    }
    assert!(e.stats().preemptions > 0);
}
