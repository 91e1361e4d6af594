//! Speculative decoding on tiny random models: greedy output identical to
//! plain decoding for every proposer and draft length, sampled output
//! distributed exactly as the target's (chi-square against the exact joint
//! distribution, also with a deliberately bad draft and with drafts
//! distilled by `tandem-distill` and loaded from their directory, one of
//! them with a reduced output vocabulary, one an EAGLE head drafting from
//! the target's hidden states), and the KV bookkeeping
//! consistent through rejections, preemptions and removals.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use proptest::prelude::*;
use tandem_core::engine::Engine;
use tandem_core::kv::SeqId;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{
    self_draft_candidates, DraftLength, DraftModel, DraftModelConfig, EagleDraft, NgramProposer,
    Proposer,
};
use tandem_cpu::CpuBackend;
use tandem_tests::distilled::Distilled;
use tandem_tests::exact_sampling::{assert_sampled_as, exact_joint};
use tandem_tests::{cpu_engine, generate, tiny, tiny_gguf};

/// A prompt with repeats, so n-gram lookup finds something to propose.
const PROMPT: [u32; 29] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 5, 77, 300, 12, 8, 9, 10, 11, 250, 5, 77, 300, 12, 256,
    99, 1, 2, 19, 18, 17,
];

enum Method {
    Ngram,
    /// A different random model with the same vocabulary: a poor draft.
    OtherModel,
    /// The target's first layer only.
    SelfLayers,
    /// n-gram drafting for the other model.
    Cascade,
    /// The other model is an EAGLE head of the target.
    Eagle,
}

fn draft_config(cascade: bool) -> DraftModelConfig {
    DraftModelConfig {
        block_size: 16,
        capacity_tokens: 2048,
        kv_dtype: Default::default(),
        max_batch_tokens: 64,
        cascade: cascade.then(NgramProposer::default),
    }
}

fn proposer(
    method: &Method,
    engine: &Engine<CpuBackend>,
    target: &ModelFiles,
    other: &ModelFiles,
) -> Box<dyn Proposer<CpuBackend>> {
    let b = engine.backend();
    match method {
        Method::Ngram => Box::new(NgramProposer::default()),
        Method::OtherModel => {
            Box::new(DraftModel::load(b, other, None, draft_config(false)).unwrap())
        }
        Method::SelfLayers => {
            Box::new(DraftModel::load(b, target, Some(&[1]), draft_config(false)).unwrap())
        }
        Method::Cascade => Box::new(DraftModel::load(b, other, None, draft_config(true)).unwrap()),
        Method::Eagle => {
            let hidden = target.config.hidden_size;
            Box::new(EagleDraft::load(b, other, hidden, draft_config(false)).unwrap())
        }
    }
}

/// A draft distilled from `target` on windows of the test prompt's first
/// 12 tokens followed by random ones (the sampled test's kind of text).
fn distilled_draft(target: &ModelFiles, dir: &Path, kind: Distilled) -> ModelFiles {
    tandem_tests::distilled::draft(target, dir, kind, &PROMPT[..12])
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        PROMPT.to_vec(),
        PROMPT[3..].to_vec(),
        vec![7, 7, 7, 7, 7, 7],
        PROMPT[..11].to_vec(),
    ]
}

#[test]
fn greedy_output_is_identical_with_every_proposer_and_draft_length() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 11));
    let other_dir = tempfile::tempdir().unwrap();
    let other = tiny_gguf(other_dir.path(), &tiny(WeightFormat::Q8_0, 12));
    let distilled_dir = tempfile::tempdir().unwrap();
    let distilled = distilled_draft(&target, distilled_dir.path(), Distilled::Layers);
    let reduced_dir = tempfile::tempdir().unwrap();
    let reduced = distilled_draft(&target, reduced_dir.path(), Distilled::Reduced(100));
    let eagle_dir = tempfile::tempdir().unwrap();
    let eagle = distilled_draft(&target, eagle_dir.path(), Distilled::Eagle);
    let greedy = |_: usize| SamplingParams::default();
    let want = generate(&mut cpu_engine(&target, 1024, 64), &prompts(), &greedy, 40);
    for (method, draft) in [
        (Method::Ngram, &other),
        (Method::OtherModel, &other),
        (Method::OtherModel, &distilled),
        (Method::OtherModel, &reduced),
        (Method::Eagle, &eagle),
        (Method::SelfLayers, &other),
        (Method::Cascade, &other),
    ] {
        for length in [
            DraftLength::Fixed(1),
            DraftLength::Fixed(3),
            DraftLength::Fixed(7),
            DraftLength::Adaptive { max: 6 },
        ] {
            // A small step budget cuts some verifications short.
            let mut engine = cpu_engine(&target, 1024, 13);
            let p = proposer(&method, &engine, &target, draft);
            let name = p.describe();
            engine.set_speculation(p, length).unwrap();
            let got = generate(&mut engine, &prompts(), &greedy, 40);
            assert_eq!(got, want, "{name}, {length:?}");
            // An adaptive length may rightly decide that drafting does not pay here.
            if let DraftLength::Fixed(_) = length {
                let stats = engine.stats().speculation;
                assert!(
                    stats.proposed_tokens > 0,
                    "{name} {length:?} proposed nothing"
                );
            }
            assert_eq!(
                engine.kv_manager().num_used_blocks(),
                0,
                "{name}: blocks leaked"
            );
        }
    }
}

#[test]
fn drafts_stop_at_stop_tokens_and_length_limits() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 3));
    let greedy = SamplingParams::default();
    let mut plain = cpu_engine(&target, 512, 64);
    let full = generate(&mut plain, &[PROMPT.to_vec()], &|_| greedy.clone(), 30).remove(0);
    // Stop at the token generated in 9th place: speculation must not run past it.
    let stop = full[8];
    let first_stop = full.iter().position(|&t| t == stop).unwrap();
    for max_new in [1, 2, 5, 17] {
        let mut engine = cpu_engine(&target, 512, 64);
        let p = proposer(&Method::SelfLayers, &engine, &target, &target);
        engine.set_speculation(p, DraftLength::Fixed(4)).unwrap();
        let id = engine
            .add_request(PROMPT.to_vec(), greedy.clone(), max_new, vec![stop])
            .unwrap();
        let mut got = Vec::new();
        while engine.has_work() {
            got.extend(engine.step().unwrap().into_iter().map(|e| e.token));
        }
        let n = max_new.min(first_stop + 1);
        assert_eq!(got, full[..n], "max_new {max_new}");
        assert_eq!(engine.tokens(id).unwrap().len(), PROMPT.len() + n);
        // A finished sequence holds K/V for at most its tokens.
        let table = engine.kv_manager().table(id).unwrap();
        assert!(table.num_tokens() <= PROMPT.len() + n);
    }
}

#[test]
fn sampled_output_has_exactly_the_targets_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 21));
    let other_dir = tempfile::tempdir().unwrap();
    let other = tiny_gguf(other_dir.path(), &tiny(WeightFormat::F32, 22));
    // The target's own weights in Q4_0: a good but imperfect draft, so drafts
    // are accepted and rejected with non-trivial probability ratios.
    let near_dir = tempfile::tempdir().unwrap();
    let near = tiny_gguf(near_dir.path(), &tiny(WeightFormat::Q4_0, 21));
    let distilled_dir = tempfile::tempdir().unwrap();
    let distilled = distilled_draft(&target, distilled_dir.path(), Distilled::Layers);
    let reduced_dir = tempfile::tempdir().unwrap();
    let reduced = distilled_draft(&target, reduced_dir.path(), Distilled::Reduced(100));
    let eagle_dir = tempfile::tempdir().unwrap();
    let eagle = distilled_draft(&target, eagle_dir.path(), Distilled::Eagle);
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 4,
        ..Default::default()
    };
    // The first token comes from the prompt pass; tokens 2 and 3 are speculated.
    let n_tokens = 3;
    let prompt = PROMPT[..12].to_vec();
    let exact = exact_joint(
        &mut cpu_engine(&target, 512, 64),
        &prompt,
        &params,
        n_tokens,
    );
    let samples = 6000;
    for (method, draft) in [
        (Method::OtherModel, &near),
        (Method::OtherModel, &other),
        (Method::OtherModel, &distilled),
        (Method::OtherModel, &reduced),
        (Method::Eagle, &eagle),
        (Method::Cascade, &near),
        (Method::Ngram, &other),
        (Method::SelfLayers, &other),
    ] {
        let mut engine = cpu_engine(&target, 16 * 1024, 512);
        let p = proposer(&method, &engine, &target, draft);
        let name = p.describe();
        engine.set_speculation(p, DraftLength::Fixed(3)).unwrap();
        let prompts = vec![prompt.clone(); samples];
        let with_seed = |i: usize| SamplingParams {
            seed: 1000 + i as u64,
            ..params.clone()
        };
        let mut counts: BTreeMap<Vec<u32>, f64> = BTreeMap::new();
        // In waves: the engine's waiting queue holds 1024 requests.
        for (wave, prompts) in prompts.chunks(1000).enumerate() {
            let seed = |i: usize| with_seed(wave * 1000 + i);
            for mut tokens in generate(&mut engine, prompts, &seed, n_tokens + 2) {
                tokens.truncate(n_tokens);
                *counts.entry(tokens).or_default() += 1.0;
            }
        }
        let stats = engine.stats().speculation;
        assert!(stats.proposed_tokens > 0, "{name} proposed nothing");
        // Its drafts must be accepted (the random model's never are) for the
        // test to weigh them.
        if [&distilled, &reduced, &eagle]
            .iter()
            .any(|d| std::ptr::eq(draft, *d))
        {
            assert!(
                stats.acceptance_rate() > 0.05,
                "{name}: acceptance {:.2}",
                stats.acceptance_rate()
            );
        }
        let what = format!("{name} (acceptance {:.2})", stats.acceptance_rate());
        assert_sampled_as(&what, &exact, counts, samples);
    }
}

#[test]
fn self_draft_candidates_load_and_draft() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 5));
    let engine = cpu_engine(&target, 256, 64);
    // Two layers: only one candidate shape exists (first layer dropped).
    for layers in self_draft_candidates(4).into_iter().chain([vec![0]]) {
        let layers: Vec<usize> = layers.into_iter().filter(|&l| l < 2).collect();
        let d = DraftModel::load(
            engine.backend(),
            &target,
            Some(&layers),
            draft_config(false),
        );
        assert!(d.is_ok(), "{layers:?}");
    }
    // The whole model as its own draft predicts exactly what the model does.
    let mut engine = engine;
    let vocab = target.config.vocab_size;
    let want: Vec<u32> = engine
        .score(&PROMPT, 0)
        .unwrap()
        .chunks(vocab)
        .map(tandem_core::sched::sampling::argmax)
        .collect();
    let mut whole = DraftModel::load(engine.backend(), &target, None, draft_config(false)).unwrap();
    assert_eq!(
        whole.greedy_predictions(engine.backend(), &PROMPT).unwrap(),
        want
    );
    let err = DraftModel::load(engine.backend(), &target, Some(&[5]), draft_config(false))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("layer 5 does not exist"), "{err}");
}

#[derive(Clone, Debug)]
enum Op {
    Add { stem: usize, tail: Vec<u32> },
    Steps(usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..3usize, prop::collection::vec(0..320u32, 1..20))
            .prop_map(|(stem, tail)| Op::Add { stem, tail }),
        5 => (1..4usize).prop_map(Op::Steps),
        1 => (0..8usize).prop_map(Op::Remove),
    ]
}

/// Every block's reference count equals the number of tables holding it,
/// and the used blocks are exactly those held.
fn check_kv(engine: &Engine<CpuBackend>, live: &[SeqId]) {
    let kv = engine.kv_manager();
    let mut held: HashMap<u32, u32> = HashMap::new();
    for (id, table) in kv.sequences() {
        assert!(
            live.contains(&id),
            "sequence {id} has a table but was removed"
        );
        let tokens = engine.tokens(id).unwrap();
        assert!(
            table.num_tokens() <= tokens.len(),
            "seq {id}: K/V beyond its tokens"
        );
        assert!(table.capacity(kv.block_size()) >= table.num_tokens());
        for &b in table.blocks() {
            *held.entry(b).or_default() += 1;
        }
    }
    for (&b, &n) in &held {
        assert_eq!(kv.allocator().ref_count(b), n, "block {b}");
    }
    assert_eq!(kv.num_used_blocks(), held.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn kv_bookkeeping_stays_consistent_through_rejections(
        ops in prop::collection::vec(op(), 1..40),
        eagle in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let target = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 31));
        let stems = [PROMPT.to_vec(), PROMPT[..17].to_vec(), vec![4; 20]];
        // A small pool: sequences get preempted with drafts in flight.
        let mut engine = cpu_engine(&target, 160, 24);
        // The self-draft with an n-gram cascade, or an EAGLE head fed the
        // hidden states of prefix hits, recomputed prompts and removed sequences.
        let draft: Box<dyn Proposer<CpuBackend>> = match eagle {
            true => {
                let head = distilled_draft(&target, &dir.path().join("eagle"), Distilled::Eagle);
                proposer(&Method::Eagle, &engine, &target, &head)
            }
            false => Box::new(
                DraftModel::load(engine.backend(), &target, Some(&[0]), draft_config(true)).unwrap(),
            ),
        };
        engine.set_speculation(draft, DraftLength::Adaptive { max: 5 }).unwrap();
        let mut plain = cpu_engine(&target, 4096, 512);
        let mut live: Vec<SeqId> = Vec::new();
        let mut prompts: HashMap<SeqId, Vec<u32>> = HashMap::new();
        let mut generated: HashMap<SeqId, Vec<u32>> = HashMap::new();
        for op in ops {
            match op {
                Op::Add { stem, tail } => {
                    let mut p = stems[stem].clone();
                    p.extend(tail);
                    let id = engine.add_request(p.clone(), SamplingParams::default(), 12, vec![]).unwrap();
                    prompts.insert(id, p);
                    live.push(id);
                }
                Op::Steps(n) => {
                    for _ in 0..n {
                        match engine.step() {
                            Ok(events) => {
                                for e in events {
                                    generated.entry(e.seq).or_default().push(e.token);
                                }
                            }
                            Err(e) if matches!(e.error, tandem_core::Error::KvCacheFull(_)) => {
                                assert!(e.failed.is_empty(), "{e}: nothing was in the step");
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                Op::Remove(i) => {
                    if !live.is_empty() {
                        let id = live.remove(i % live.len());
                        engine.remove(id);
                    }
                }
            }
            check_kv(&engine, &live);
        }
        // Whatever finished must be exactly what plain greedy decoding gives.
        for &id in &live {
            if engine.is_finished(id) {
                let want = generate(&mut plain, &[prompts[&id].clone()], &|_| SamplingParams::default(), 12);
                prop_assert_eq!(&generated[&id], &want[0]);
            }
        }
        for id in live {
            engine.remove(id);
        }
        prop_assert_eq!(engine.kv_manager().num_used_blocks(), 0);
    }
}
