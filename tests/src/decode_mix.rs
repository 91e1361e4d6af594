//! A mixed serving workload for checking recorded decode steps (CUDA
//! graphs): six requests of awkward prompt lengths, greedy and sampled, one
//! with logprobs and one with two samples, two of them joining mid-run.
//! Run once with recording and once without, every event must be the same.

use std::collections::BTreeMap;

use tandem_core::engine::{Engine, EngineConfig, EngineStats, Request, TokenEvent};
use tandem_core::kv::SeqId;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{DraftLength, NgramProposer};
use tandem_core::Backend;

use crate::{tiny, tiny_gguf};

/// What a run produced: every event of every sequence, and the engine's counters.
pub type Run = (BTreeMap<SeqId, Vec<TokenEvent>>, EngineStats);

/// `len` token ids, different per `salt`.
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 250)
        .collect()
}

fn sampled(temperature: f32, top_k: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        seed,
        ..SamplingParams::default()
    }
}

/// The workload: `(step at which it is submitted, request)`.
pub fn requests() -> Vec<(u64, Request)> {
    let greedy = SamplingParams::default();
    let mut with_logprobs = Request::new(prompt(17, 2), greedy.clone(), 9);
    with_logprobs.logprobs = Some(3);
    let mut two_samples = Request::new(prompt(33, 3), sampled(0.7, 0, 11), 8);
    two_samples.samples = 2;
    vec![
        (0, Request::new(prompt(1, 0), greedy.clone(), 12)),
        (0, Request::new(prompt(5, 1), sampled(0.9, 0, 7), 10)),
        (0, with_logprobs),
        (0, two_samples),
        (3, Request::new(prompt(2, 4), greedy, 14)),
        (5, Request::new(prompt(40, 5), sampled(1.0, 20, 3), 7)),
    ]
}

/// An engine for the workload: prompts chunked at 24 tokens, decode
/// batches of up to 4 sequences recorded, room for `kv_tokens` tokens.
pub fn engine<B: Backend>(backend: B, files: &ModelFiles, kv_tokens: usize) -> Engine<B> {
    let config = EngineConfig {
        max_batch_tokens: 24,
        max_recorded_batch: 4,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(kv_tokens);
    Engine::new(backend, files, config, &mut |_, _| {}).unwrap()
}

/// Runs the workload to the end (with n-gram speculation if `speculate`),
/// removing sequences as they finish; checks no KV block leaked.
pub fn run<B: Backend>(mut engine: Engine<B>, speculate: bool) -> Run {
    if speculate {
        engine
            .set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(3))
            .unwrap();
    }
    let requests = requests();
    let mut events: BTreeMap<SeqId, Vec<TokenEvent>> = BTreeMap::new();
    let mut step = 0;
    loop {
        for (_, request) in requests.iter().filter(|(at, _)| *at == step) {
            engine.submit(request.clone()).unwrap();
        }
        let pending = requests.iter().any(|(at, _)| *at > step);
        if !engine.has_work() && !pending {
            break;
        }
        for event in engine.step().unwrap() {
            if event.finished.is_some() {
                engine.remove(event.seq);
            }
            events.entry(event.seq).or_default().push(event);
        }
        step += 1;
        assert!(step < 1000, "the run does not end");
    }
    assert_eq!(engine.kv_manager().num_used_blocks(), 0, "blocks leaked");
    assert_eq!(events.len(), 7, "six requests, one with two samples");
    (events, engine.stats())
}

/// On a backend that records: the workload on a tiny Q8_0 model gives the
/// same events with recording on and off, and recording replays without a
/// failure.
pub fn recorded_decode_matches_eager<B: Backend>(make_backend: impl Fn() -> B) {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 21));
    let mut eager = engine(make_backend(), &files, 2048);
    eager.enable_recording(false);
    let (want, _) = run(eager, false);
    let (got, stats) = run(engine(make_backend(), &files, 2048), false);
    let recorded = stats.recorded_steps;
    assert_eq!(recorded.failed, 0, "{recorded:?}");
    assert!(recorded.replayed > recorded.recorded, "{recorded:?}");
    assert_eq!(got, want);
}
