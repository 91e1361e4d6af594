//! The engine's features unchanged on Mixture-of-Experts models: speculative
//! decoding (n-gram, another MoE model, the target's own first layer) gives
//! the greedy tokens of plain decoding, and INT8/INT4 KV caches run every
//! MoE family as they run the dense model: logits close to an F32 cache's,
//! most greedy tokens kept, INT8 output independent of batching.

use tandem_core::backend::KvDtype;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{DraftLength, DraftModel, DraftModelConfig, NgramProposer, Proposer};
use tandem_cpu::CpuBackend;
use tandem_tests::{cpu_engine, generate, tiny_gguf};

const MOE_PRESETS: [&str; 6] = [
    "tiny",
    "tiny-mixtral",
    "tiny-qwen2moe",
    "tiny-qwen3moe",
    "tiny-olmoe",
    "tiny-granitemoe",
];

/// A prompt with repeats, so n-gram lookup finds something to propose.
const PROMPT: [u32; 29] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 5, 77, 300, 12, 8, 9, 10, 11, 250, 5, 77, 300, 12, 256,
    99, 1, 2, 19, 18, 17,
];

fn prompts() -> Vec<Vec<u32>> {
    vec![
        PROMPT.to_vec(),
        PROMPT[3..].to_vec(),
        vec![7, 7, 7, 7, 7, 7],
        PROMPT[..11].to_vec(),
    ]
}

fn greedy(_: usize) -> SamplingParams {
    SamplingParams::default()
}

fn moe_model(dir: &std::path::Path, name: &str, format: WeightFormat, seed: u64) -> ModelFiles {
    tiny_gguf(dir, &SyntheticModel::preset(name, format, seed).unwrap())
}

fn draft_config() -> DraftModelConfig {
    DraftModelConfig {
        block_size: 16,
        capacity_tokens: 2048,
        kv_dtype: Default::default(),
        max_batch_tokens: 64,
        cascade: None,
    }
}

#[test]
fn speculation_on_a_moe_model_gives_the_greedy_tokens_of_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let target = moe_model(dir.path(), "tiny-qwen2moe", WeightFormat::Q8_0, 11);
    let other_dir = tempfile::tempdir().unwrap();
    let other = moe_model(other_dir.path(), "tiny-olmoe", WeightFormat::Q8_0, 12);
    let want = generate(&mut cpu_engine(&target, 1024, 64), &prompts(), &greedy, 32);
    let proposer = |name: &str, b: &CpuBackend| -> Box<dyn Proposer<CpuBackend>> {
        match name {
            "n-gram" => Box::new(NgramProposer::default()),
            "another MoE model" => {
                Box::new(DraftModel::load(b, &other, None, draft_config()).unwrap())
            }
            _ => Box::new(DraftModel::load(b, &target, Some(&[1]), draft_config()).unwrap()),
        }
    };
    for name in ["n-gram", "another MoE model", "the target's layer 1"] {
        for length in [DraftLength::Fixed(1), DraftLength::Fixed(4)] {
            // A small step budget cuts some verifications short.
            let mut engine = cpu_engine(&target, 1024, 13);
            let p = proposer(name, engine.backend());
            engine.set_speculation(p, length).unwrap();
            let got = generate(&mut engine, &prompts(), &greedy, 32);
            assert_eq!(got, want, "{name}, {length:?}");
            let stats = engine.stats().speculation;
            assert!(
                stats.proposed_tokens > 0,
                "{name} {length:?} proposed nothing"
            );
            assert_eq!(
                engine.kv_manager().num_used_blocks(),
                0,
                "{name}: blocks leaked"
            );
        }
    }
}

fn engine_with_kv(
    files: &ModelFiles,
    kv_dtype: KvDtype,
    max_batch_tokens: usize,
) -> Engine<CpuBackend> {
    let config = EngineConfig {
        kv_precision: kv_dtype.into(),
        max_batch_tokens,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(1024);
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap()
}

/// The mean logit error and the share of positions whose greedy token
/// survives a quantized cache on these models (logits span a few units):
/// INT8 codes carry 1/255 of each group's range, INT4 1/15. A routing
/// decision near a tie may flip, so MoE models are judged on the mean, not
/// the largest error.
fn kv_bounds(dtype: KvDtype) -> (f32, f32) {
    match dtype {
        KvDtype::Int8 => (0.02, 0.9),
        _ => (0.25, 0.5),
    }
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

/// Every MoE family, and the dense `tiny` beside them as the baseline, with
/// INT8 and INT4 caches. INT8 greedy tokens stay independent of batching
/// and chunking; INT4 keys are re-quantized over their block at each write,
/// so there (on dense models too) the chunking may change a token.
#[test]
fn quantized_kv_runs_every_moe_family() {
    for name in ["tiny"].into_iter().chain(MOE_PRESETS) {
        let dir = tempfile::tempdir().unwrap();
        let files = moe_model(dir.path(), name, WeightFormat::Q8_0, 21);
        let vocab = files.config.vocab_size;
        let exact = engine_with_kv(&files, KvDtype::F32, 7)
            .score(&PROMPT, 0)
            .unwrap();
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            // Chunks of 7 rows: K/V written across several steps and blocks.
            let got = engine_with_kv(&files, dtype, 7).score(&PROMPT, 0).unwrap();
            assert!(got.iter().all(|v| v.is_finite()), "{name} {dtype}");
            let (max_mean, min_agreeing) = kv_bounds(dtype);
            let total: f32 = got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).sum();
            let mean = total / got.len() as f32;
            assert!(mean < max_mean, "{name} {dtype}: mean |diff| {mean}");
            let agreeing = got
                .chunks(vocab)
                .zip(exact.chunks(vocab))
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            let share = agreeing as f32 / PROMPT.len() as f32;
            assert!(
                share >= min_agreeing,
                "{name} {dtype}: greedy token kept at {agreeing} of {} positions",
                PROMPT.len()
            );
            if dtype == KvDtype::Int8 {
                let batched = generate(
                    &mut engine_with_kv(&files, dtype, 64),
                    &prompts(),
                    &greedy,
                    16,
                );
                let alone: Vec<Vec<u32>> = prompts()
                    .into_iter()
                    .map(|p| {
                        generate(&mut engine_with_kv(&files, dtype, 64), &[p], &greedy, 16)
                            .remove(0)
                    })
                    .collect();
                assert_eq!(
                    batched, alone,
                    "{name} {dtype}: batching changed the tokens"
                );
            }
        }
    }
}
