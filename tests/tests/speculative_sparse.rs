//! Sparse self-speculation (`--speculate sparse:BLOCKS`, and with n-gram
//! drafts for it, `--cascade ngram,sparse`) on tiny random models with
//! prompts of many KV blocks: greedy output identical to plain decoding for
//! several block budgets, KV dtypes and draft lengths (also with a sliding
//! window, a KV budget and several sequences at once); a
//! draft that reads every block is the target itself (all drafts
//! accepted), one that reads a few is not; sampled output distributed
//! exactly as the target's; and no block leaked.

use std::collections::BTreeMap;

use tandem_core::backend::KvDtype;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::kv::{EvictionConfig, EvictionPolicy, KvBudget};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::{Rng, SamplingParams};
use tandem_core::spec::{DraftLength, NgramProposer, SparseDraft};
use tandem_cpu::CpuBackend;
use tandem_tests::exact_sampling::{assert_sampled_as, exact_joint};
use tandem_tests::{generate, tiny, tiny_gguf};

/// `n` random tokens of the tiny vocabulary.
fn random_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_u64() % 320) as u32).collect()
}

fn engine(
    files: &ModelFiles,
    dtype: KvDtype,
    eviction: Option<EvictionConfig>,
) -> Engine<CpuBackend> {
    engine_of(files, dtype, eviction, 4096)
}

fn engine_of(
    files: &ModelFiles,
    dtype: KvDtype,
    eviction: Option<EvictionConfig>,
    tokens: usize,
) -> Engine<CpuBackend> {
    let config = EngineConfig {
        max_batch_tokens: 96,
        kv_precision: dtype.into(),
        kv_eviction: eviction,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(tokens);
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap()
}

fn sparse(engine: &mut Engine<CpuBackend>, blocks: usize, length: DraftLength) {
    let draft = SparseDraft::new(blocks).unwrap();
    engine.set_speculation(Box::new(draft), length).unwrap();
}

fn sparse_cascade(engine: &mut Engine<CpuBackend>, blocks: usize, length: DraftLength) {
    let draft = SparseDraft::new(blocks)
        .unwrap()
        .with_cascade(NgramProposer::default());
    engine.set_speculation(Box::new(draft), length).unwrap();
}

/// Random tokens, the last 40 of which repeat an earlier stretch, so
/// n-gram lookup has something to propose.
fn repetitive_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut p = random_prompt(n - 40, seed);
    let stretch = p[n / 3..n / 3 + 40].to_vec();
    p.extend(stretch);
    p
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        random_prompt(301, 1),
        repetitive_prompt(170, 2),
        random_prompt(20, 3),
    ]
}

#[test]
fn greedy_output_is_identical_for_every_block_budget() {
    let greedy = |_: usize| SamplingParams::default();
    for (preset, dtype) in [
        ("tiny", KvDtype::F32),
        ("tiny", KvDtype::F16),
        ("tiny", KvDtype::Int8),
        ("tiny-mistral", KvDtype::F32),
        ("tiny-qwen3", KvDtype::F16),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model =
            tandem_core::model::synthetic::SyntheticModel::preset(preset, WeightFormat::Q8_0, 31)
                .unwrap();
        let target = tiny_gguf(dir.path(), &model);
        let want = generate(&mut engine(&target, dtype, None), &prompts(), &greedy, 40);
        for blocks in [1, 3, 64] {
            for length in [
                DraftLength::Fixed(1),
                DraftLength::Fixed(4),
                DraftLength::Adaptive { max: 6 },
            ] {
                let mut e = engine(&target, dtype, None);
                sparse(&mut e, blocks, length);
                let got = generate(&mut e, &prompts(), &greedy, 40);
                let what = format!("{preset} {dtype:?} sparse:{blocks} {length:?}");
                assert_eq!(got, want, "{what}");
                if let DraftLength::Fixed(_) = length {
                    assert!(
                        e.stats().speculation.proposed_tokens > 0,
                        "{what}: no drafts"
                    );
                }
                assert_eq!(e.kv_manager().num_used_blocks(), 0, "{what}: blocks leaked");
            }
            let mut e = engine(&target, dtype, None);
            sparse_cascade(&mut e, blocks, DraftLength::Fixed(5));
            let got = generate(&mut e, &prompts(), &greedy, 40);
            assert_eq!(got, want, "{preset} {dtype:?} ngram,sparse:{blocks}");
            assert_eq!(e.kv_manager().num_used_blocks(), 0);
        }
    }
}

#[test]
fn a_draft_reading_every_block_is_the_target_and_one_reading_few_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 8));
    let greedy = |_: usize| SamplingParams::default();
    let prompt = vec![random_prompt(400, 9)];
    let acceptance = |blocks: usize| {
        let mut e = engine(&target, KvDtype::F32, None);
        sparse(&mut e, blocks, DraftLength::Fixed(4));
        generate(&mut e, &prompt, &greedy, 60);
        e.stats().speculation.acceptance_rate()
    };
    // 400 tokens are 25 blocks: 64 selected is every one of them.
    assert_eq!(acceptance(64), 1.0);
    let few = acceptance(1);
    assert!(few < 1.0, "one block of 20 drafted exactly: {few}");
}

/// A budget the sequences never reach changes nothing. One that evicts
/// gives other tokens than plain decoding under it, as any speculation
/// does: eviction runs after each step, and a verification step adds k+1
/// tokens before it runs; the tables then keep their holes through drafting
/// and rollback, and no block leaks.
#[test]
fn sparse_drafts_work_under_a_kv_budget() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 4));
    let greedy = |_: usize| SamplingParams::default();
    let roomy = EvictionConfig::new(KvBudget::Tokens(1024), EvictionPolicy::H2o);
    let want = generate(
        &mut engine(&target, KvDtype::F32, None),
        &prompts(),
        &greedy,
        40,
    );
    let mut e = engine(&target, KvDtype::F32, Some(roomy));
    sparse(&mut e, 2, DraftLength::Fixed(3));
    assert_eq!(generate(&mut e, &prompts(), &greedy, 40), want);
    let tight = EvictionConfig::new(KvBudget::Tokens(160), EvictionPolicy::H2o);
    let mut e = engine(&target, KvDtype::F32, Some(tight));
    sparse(&mut e, 2, DraftLength::Fixed(3));
    let ids: Vec<_> = prompts()
        .into_iter()
        .map(|p| {
            e.add_request(p, SamplingParams::default(), 40, vec![])
                .unwrap()
        })
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    let table = e.kv_manager().table(ids[0]).unwrap();
    assert!(
        table.has_evicted() && table.live_blocks() <= 11,
        "{table:?}"
    );
    for (id, prompt) in ids.into_iter().zip(prompts()) {
        assert_eq!(e.tokens(id).unwrap().len(), prompt.len() + 40);
        e.remove(id);
    }
    assert!(e.stats().speculation.accepted_tokens > 0);
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
}

#[test]
fn sampled_output_has_exactly_the_targets_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 21));
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 4,
        ..Default::default()
    };
    // 200 tokens: 13 blocks, of which a draft of 2 reads 7; repeats for
    // the n-gram level.
    let prompt = repetitive_prompt(200, 5);
    let n_tokens = 3;
    let exact = exact_joint(
        &mut engine(&target, KvDtype::F32, None),
        &prompt,
        &params,
        n_tokens,
    );
    for cascade in [false, true] {
        // Each sequence holds its own last block, beside the shared prompt.
        let mut e = engine_of(&target, KvDtype::F32, None, 32 * 1024);
        match cascade {
            false => sparse(&mut e, 2, DraftLength::Fixed(3)),
            true => sparse_cascade(&mut e, 2, DraftLength::Fixed(3)),
        }
        let samples = 4000;
        let mut counts: BTreeMap<Vec<u32>, f64> = BTreeMap::new();
        for wave in 0..samples / 500 {
            let seed = |i: usize| SamplingParams {
                seed: 1000 + (wave * 500 + i) as u64,
                ..params.clone()
            };
            let prompts = vec![prompt.clone(); 500];
            for mut tokens in generate(&mut e, &prompts, &seed, n_tokens + 2) {
                tokens.truncate(n_tokens);
                *counts.entry(tokens).or_default() += 1.0;
            }
        }
        let stats = e.stats().speculation;
        let rate = stats.acceptance_rate();
        assert!(rate > 0.05 && rate < 1.0, "acceptance {rate}");
        let name = if cascade {
            "ngram,sparse:2"
        } else {
            "sparse:2"
        };
        let what = format!("{name} (acceptance {rate:.2})");
        assert_sampled_as(&what, &exact, counts, samples);
        assert_eq!(e.kv_manager().num_used_blocks(), 0);
    }
}

/// The key bounds sparse drafting keeps are counted beside the KV cache:
/// none before, `[kv_heads, 2, head_dim]` f32 per block and layer after.
#[test]
fn the_key_bounds_are_counted_per_token() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 8));
    let mut e = engine(&target, KvDtype::Int4, None);
    let kv = e.kv_bytes_per_token();
    assert_eq!(e.key_bounds_bytes_per_token(), 0);
    sparse(&mut e, 2, DraftLength::Fixed(3));
    let c = &target.config;
    let per_block = 2 * 4 * c.num_kv_heads * c.head_dim * c.num_layers;
    assert_eq!(
        e.key_bounds_bytes_per_token(),
        per_block.div_ceil(e.config().block_size)
    );
    assert_eq!(e.kv_bytes_per_token(), kv);
}

#[test]
fn a_draft_of_no_blocks_is_refused() {
    let e = SparseDraft::new(0).err().unwrap().to_string();
    assert!(e.contains("at least one"), "{e}");
}
