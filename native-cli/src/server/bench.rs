//! `tandem bench-serve`: serving throughput measured on the engine itself
//! (no HTTP), with a synthetic workload of mixed prompt and output lengths.
//!
//! Continuous batching and the static-batching baseline run the same engine
//! and the same requests; they differ only in when requests are handed in.
//! Static batching submits `max_running` requests, steps until every one is
//! done, then submits the next group, so short requests leave idle slots
//! behind; continuous batching submits everything and the scheduler fills a
//! slot the step after it frees up. Where a step's cost grows with its
//! batch (a compute-bound CPU), both finish the same work in about the same
//! time and the difference shows in latency; where a step costs about the
//! same at any batch size (memory-bound decoding on a GPU), continuous
//! batching's fuller steps also raise throughput.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use anyhow::Result;
use tandem_core::engine::{Engine, Request};
use tandem_core::kv::KvCacheManager;
use tandem_core::sched::{Rng, SamplingParams};
use tandem_core::Backend;

/// One benchmark request: prompt tokens and exactly how many tokens to generate.
#[derive(Clone, Debug)]
pub struct BenchRequest {
    pub prompt: Vec<u32>,
    pub output_tokens: usize,
}

/// Mixed lengths: prompts of 16..=256 tokens, outputs of 8..=128, drawn
/// from `seed`; token ids avoid the first 256 ids (often special or byte tokens).
pub fn mixed_workload(vocab: usize, requests: usize, seed: u64) -> Vec<BenchRequest> {
    let mut rng = Rng::new(seed);
    let mut draw = |lo: usize, hi: usize| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    (0..requests)
        .map(|_| {
            let prompt_len = draw(16, 256);
            let output_tokens = draw(8, 128);
            let prompt = (0..prompt_len)
                .map(|_| draw(256, vocab - 1) as u32)
                .collect();
            BenchRequest {
                prompt,
                output_tokens,
            }
        })
        .collect()
}

/// Every request starts with the same `system_tokens`-token system prompt,
/// then 20..=60 tokens of its own; 16 tokens out.
pub fn shared_prefix_workload(
    vocab: usize,
    requests: usize,
    system_tokens: usize,
    seed: u64,
) -> Vec<BenchRequest> {
    let mut rng = Rng::new(seed);
    let mut draw = |lo: usize, hi: usize| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    let system: Vec<u32> = (0..system_tokens)
        .map(|_| draw(256, vocab - 1) as u32)
        .collect();
    (0..requests)
        .map(|_| {
            let mut prompt = system.clone();
            let own = draw(20, 60);
            prompt.extend((0..own).map(|_| draw(256, vocab - 1) as u32));
            BenchRequest {
                prompt,
                output_tokens: 16,
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Batching {
    Continuous,
    /// Groups of the engine's `max_running` requests, each run to completion.
    Static,
}

#[derive(Clone, Debug)]
pub struct RunReport {
    pub output_tokens: usize,
    pub seconds: f64,
    /// Filled slots of the blocks sequences hold over all their slots, over all steps.
    pub kv_utilization: f64,
    pub prefix_hit_rate: f64,
    pub preemptions: u64,
    pub steps: u64,
    /// Mean seconds from the start (when every request has arrived) to a
    /// request's first token, and to its last.
    pub mean_first_token: f64,
    pub mean_latency: f64,
}

impl RunReport {
    pub fn tokens_per_second(&self) -> f64 {
        self.output_tokens as f64 / self.seconds.max(1e-9)
    }
}

/// Slots holding a token in the used blocks (a block shared by several
/// sequences counts once, as far as its fullest holder fills it).
fn filled_slots(kv: &KvCacheManager, bs: usize) -> u64 {
    let mut filled: HashMap<u32, usize> = HashMap::new();
    for (_, t) in kv.sequences() {
        for (i, &b) in t.blocks().iter().enumerate() {
            let n = t.num_tokens().saturating_sub(i * bs).min(bs);
            let f = filled.entry(b).or_default();
            *f = (*f).max(n);
        }
    }
    filled.values().map(|&n| n as u64).sum()
}

/// Runs `workload` greedily on `engine` with the given batching.
pub fn run<B: Backend>(
    engine: &mut Engine<B>,
    workload: &[BenchRequest],
    batching: Batching,
) -> Result<RunReport> {
    let before = engine.stats();
    let group = match batching {
        Batching::Continuous => workload.len().max(1),
        Batching::Static => engine.config().max_running,
    };
    let bs = engine.kv_manager().block_size();
    let (mut held, mut allocated) = (0u64, 0u64);
    let mut output_tokens = 0;
    let mut seen = HashSet::new();
    let (mut first_token_sum, mut latency_sum) = (0.0, 0.0);
    let started = Instant::now();
    for requests in workload.chunks(group) {
        for r in requests {
            let request =
                Request::new(r.prompt.clone(), SamplingParams::default(), r.output_tokens);
            engine.submit(request)?;
        }
        while engine.has_work() {
            for ev in engine.step()? {
                output_tokens += 1;
                let now = started.elapsed().as_secs_f64();
                if seen.insert(ev.seq) {
                    first_token_sum += now;
                }
                if ev.finished.is_some() {
                    latency_sum += now;
                    engine.remove(ev.seq);
                }
            }
            let kv = engine.kv_manager();
            held += filled_slots(kv, bs);
            allocated += (kv.num_used_blocks() * bs) as u64;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = engine.stats();
    let prompt_tokens = after.prompt_tokens - before.prompt_tokens;
    Ok(RunReport {
        output_tokens,
        seconds,
        kv_utilization: held as f64 / allocated.max(1) as f64,
        prefix_hit_rate: (after.prefix_hit_tokens - before.prefix_hit_tokens) as f64
            / prompt_tokens.max(1) as f64,
        preemptions: after.preemptions - before.preemptions,
        steps: after.steps - before.steps,
        mean_first_token: first_token_sum / workload.len().max(1) as f64,
        mean_latency: latency_sum / workload.len().max(1) as f64,
    })
}
