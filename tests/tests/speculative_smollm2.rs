//! Speculative decoding on the default model (SmolLM2-135M-Instruct Q4_1):
//! greedy output is token for token the same as plain decoding for every
//! proposer and several draft lengths.

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{DraftLength, DraftModel, DraftModelConfig, NgramProposer, Proposer};
use tandem_cpu::CpuBackend;
use tandem_tests::smollm2_path;

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
];
const NEW_TOKENS: usize = 32;

fn engine(files: &ModelFiles) -> Engine<CpuBackend> {
    let config = EngineConfig::default().with_capacity_tokens(1024);
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap()
}

fn greedy(engine: &mut Engine<CpuBackend>, prompt: &[u32]) -> Vec<u32> {
    let id = engine
        .add_request(
            prompt.to_vec(),
            SamplingParams::default(),
            NEW_TOKENS,
            vec![],
        )
        .unwrap();
    let mut out = Vec::new();
    while !engine.is_finished(id) {
        out.extend(engine.step().unwrap().into_iter().map(|e| e.token));
    }
    engine.remove(id);
    out
}

fn self_draft(
    engine: &Engine<CpuBackend>,
    files: &ModelFiles,
    cascade: bool,
) -> DraftModel<CpuBackend> {
    let layers: Vec<usize> = (0..10).chain([29]).collect();
    let config = DraftModelConfig {
        block_size: 16,
        capacity_tokens: 1024,
        kv_dtype: Default::default(),
        max_batch_tokens: 256,
        cascade: cascade.then(NgramProposer::default),
    };
    DraftModel::load(engine.backend(), files, Some(&layers), config).unwrap()
}

#[test]
fn speculative_greedy_decoding_reproduces_plain_decoding() {
    let files = tandem_core::model::load(&smollm2_path()).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| files.tokenizer.encode(p, true).unwrap())
        .collect();
    let mut plain = engine(&files);
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut plain, p)).collect();
    let setups: [(&str, DraftLength); 4] = [
        ("ngram", DraftLength::Adaptive { max: 8 }),
        ("ngram", DraftLength::Fixed(5)),
        ("self", DraftLength::Fixed(3)),
        ("cascade", DraftLength::Fixed(6)),
    ];
    for (method, length) in setups {
        let mut e = engine(&files);
        let proposer: Box<dyn Proposer<CpuBackend>> = match method {
            "ngram" => Box::new(NgramProposer::default()),
            "self" => Box::new(self_draft(&e, &files, false)),
            _ => Box::new(self_draft(&e, &files, true)),
        };
        e.set_speculation(proposer, length).unwrap();
        for (prompt, want) in prompts.iter().zip(&want) {
            assert_eq!(&greedy(&mut e, prompt), want, "{method} {length:?}");
        }
        let stats = e.stats().speculation;
        // An adaptive length may rightly decide that drafting does not pay here.
        if let DraftLength::Fixed(_) = length {
            assert!(stats.proposed_tokens > 0, "{method}: nothing proposed");
        }
        eprintln!("{method} {length:?}: {}", stats.summary());
    }
}
