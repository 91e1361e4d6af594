//! Constrained decoding on tiny random models with a hand-written
//! constraint (token i from one of alternating sets, a fixed number of
//! them, then only stop tokens): greedy and sampled outputs always follow
//! it; speculation (n-gram and a draft model) gives the same greedy tokens
//! as plain constrained decoding; preemption keeps the constraint's state;
//! a constraint that fails ends its own request only; constrained greedy on
//! wgpu and on a recording backend equals the CPU's.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_core::engine::{Engine, FinishReason, Request};
use tandem_core::kv::SeqId;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::{ConstraintFactory, SamplingParams, TokenConstraint, TokenMask};
use tandem_core::spec::{DraftLength, DraftModel, DraftModelConfig, NgramProposer, Proposer};
use tandem_core::{Backend, Error, Result};
use tandem_tests::backend_e2e::engine_on;
use tandem_tests::recording_cpu::RecordingCpu;
use tandem_tests::{cpu_engine, tiny, tiny_gguf};
use tandem_wgpu::{WgpuBackend, WgpuOptions};

/// Its tokens repeat, so n-gram lookup proposes some that fit the sets.
const PROMPT: [u32; 29] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 5, 77, 300, 12, 8, 9, 10, 11, 250, 5, 77, 300, 12, 256,
    99, 1, 2, 19, 18, 17,
];
const STOP: u32 = 2;
const EVEN: [u32; 7] = [10, 20, 30, 40, 77, 300, 5];
const ODD: [u32; 4] = [12, 99, 256, 311];

/// Exactly `len` tokens, even positions from [`EVEN`], odd ones from
/// [`ODD`]; the mask fails at position `fail_at`.
#[derive(Clone, Debug)]
struct Alternating {
    len: usize,
    fail_at: Option<usize>,
}

struct AlternatingState {
    rule: Alternating,
    at: usize,
}

fn allowed_at(at: usize) -> &'static [u32] {
    if at.is_multiple_of(2) {
        &EVEN
    } else {
        &ODD
    }
}

impl ConstraintFactory for Alternating {
    fn start(&self) -> Result<Box<dyn TokenConstraint>> {
        Ok(Box::new(AlternatingState {
            rule: self.clone(),
            at: 0,
        }))
    }

    fn describe(&self) -> String {
        format!("{} alternating tokens", self.len)
    }
}

impl TokenConstraint for AlternatingState {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()> {
        if self.rule.fail_at == Some(self.at) {
            return Err(Error::Constraint(format!(
                "the test grammar broke at token {}",
                self.at
            )));
        }
        allowed_at(self.at).iter().for_each(|&t| mask.allow(t));
        Ok(())
    }

    fn advance(&mut self, token: u32) -> Result<()> {
        if self.at >= self.rule.len || !allowed_at(self.at).contains(&token) {
            return Err(Error::Constraint(format!(
                "token {token} is not allowed at {}",
                self.at
            )));
        }
        self.at += 1;
        Ok(())
    }

    fn rollback(&mut self, n: usize) -> Result<()> {
        self.at = self
            .at
            .checked_sub(n)
            .ok_or_else(|| Error::Constraint(format!("cannot take back {n} tokens")))?;
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.at == self.rule.len
    }
}

/// Whether `out` is `len` tokens of the alternating sets, then `stop` if given.
fn follows(out: &[u32], len: usize, stop: Option<u32>) -> bool {
    let body_ok = out.len() >= len
        && out[..len]
            .iter()
            .enumerate()
            .all(|(i, t)| allowed_at(i).contains(t));
    body_ok && out[len..] == *stop.as_slice()
}

fn request(prompt: &[u32], params: SamplingParams, rule: Alternating, samples: usize) -> Request {
    Request {
        stop_tokens: vec![STOP],
        samples,
        constraint: Some(Arc::new(rule)),
        ..Request::new(prompt.to_vec(), params, 40)
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        PROMPT.to_vec(),
        PROMPT[3..].to_vec(),
        vec![7, 7, 7, 7, 7, 7],
        PROMPT[..11].to_vec(),
    ]
}

/// Runs `requests` together to the end, removing sequences as they finish
/// (as the server does); each sample's tokens and finish reason, in
/// submission order.
fn run<B: Backend>(
    engine: &mut Engine<B>,
    requests: Vec<Request>,
) -> Vec<(Vec<u32>, Option<FinishReason>)> {
    let ids: Vec<SeqId> = requests
        .into_iter()
        .flat_map(|r| engine.submit(r).unwrap())
        .collect();
    let mut out: HashMap<SeqId, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            let o = out.entry(ev.seq).or_default();
            o.0.push(ev.token);
            o.1 = ev.finished;
            if ev.finished.is_some() {
                engine.remove(ev.seq);
            }
        }
    }
    ids.iter()
        .map(|id| out.remove(id).unwrap_or_default())
        .collect()
}

fn rule(i: usize) -> Alternating {
    Alternating {
        len: 9 + 2 * i,
        fail_at: None,
    }
}

fn greedy_requests() -> Vec<Request> {
    (prompts().iter().enumerate())
        .map(|(i, p)| request(p, SamplingParams::default(), rule(i), 1))
        .collect()
}

fn sampled_requests(seed: u64) -> Vec<Request> {
    (prompts().iter().enumerate())
        .map(|(i, p)| {
            let params = SamplingParams {
                temperature: 1.3,
                top_p: 0.95,
                seed: seed + i as u64,
                ..Default::default()
            };
            request(p, params, rule(i), 3)
        })
        .collect()
}

fn check_all_follow(outputs: &[(Vec<u32>, Option<FinishReason>)], samples: usize) {
    for (k, (out, finished)) in outputs.iter().enumerate() {
        let len = rule(k / samples).len;
        assert!(follows(out, len, Some(STOP)), "output {k}: {out:?}");
        assert_eq!(*finished, Some(FinishReason::Stop), "output {k}");
    }
}

fn target() -> (tempfile::TempDir, ModelFiles) {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 11));
    (dir, files)
}

#[test]
fn greedy_and_sampled_outputs_follow_the_constraint() {
    let (_dir, files) = target();
    let mut engine = cpu_engine(&files, 2048, 64);
    let greedy = run(&mut engine, greedy_requests());
    check_all_follow(&greedy, 1);
    // Unconstrained, the random model does not write this pattern.
    let free: Vec<Request> = (greedy_requests().into_iter())
        .map(|r| Request {
            constraint: None,
            ..r
        })
        .collect();
    let free = run(&mut engine, free);
    assert!(
        free.iter()
            .enumerate()
            .any(|(i, (out, _))| !follows(out, rule(i).len, Some(STOP))),
        "the test needs a model that does not follow the pattern by itself"
    );
    for seed in [1, 40] {
        let sampled = run(&mut engine, sampled_requests(seed));
        check_all_follow(&sampled, 3);
        // Sampling still chooses among the allowed tokens.
        let first: Vec<&Vec<u32>> = sampled.iter().step_by(3).map(|o| &o.0).collect();
        let distinct: std::collections::HashSet<&Vec<u32>> = sampled.iter().map(|o| &o.0).collect();
        assert!(
            distinct.len() > first.len(),
            "seed {seed}: samples all alike"
        );
    }
    assert_eq!(engine.kv_manager().num_used_blocks(), 0);
}

fn draft_model(
    engine: &Engine<tandem_cpu::CpuBackend>,
    other: &ModelFiles,
) -> DraftModel<tandem_cpu::CpuBackend> {
    let config = DraftModelConfig {
        block_size: 16,
        capacity_tokens: 2048,
        kv_dtype: Default::default(),
        max_batch_tokens: 64,
        cascade: None,
    };
    DraftModel::load(engine.backend(), other, None, config).unwrap()
}

#[test]
fn speculation_gives_the_constrained_greedy_tokens_and_follows_the_constraint_when_sampling() {
    let (_dir, files) = target();
    let other_dir = tempfile::tempdir().unwrap();
    let other = tiny_gguf(other_dir.path(), &tiny(WeightFormat::Q8_0, 12));
    let want = run(&mut cpu_engine(&files, 2048, 64), greedy_requests());
    for draft_from_model in [false, true] {
        for length in [DraftLength::Fixed(3), DraftLength::Adaptive { max: 6 }] {
            // A small step budget cuts some verifications short.
            let mut engine = cpu_engine(&files, 2048, 13);
            let proposer: Box<dyn Proposer<_>> = match draft_from_model {
                true => Box::new(draft_model(&engine, &other)),
                false => Box::new(NgramProposer::default()),
            };
            let name = format!("{}, {length:?}", proposer.describe());
            engine.set_speculation(proposer, length).unwrap();
            assert_eq!(run(&mut engine, greedy_requests()), want, "{name}");
            check_all_follow(&run(&mut engine, sampled_requests(3)), 3);
            let stats = engine.stats().speculation;
            if let DraftLength::Fixed(_) = length {
                assert!(stats.proposed_tokens > 0, "{name} proposed nothing");
            }
            assert_eq!(engine.kv_manager().num_used_blocks(), 0, "{name}");
        }
    }
}

#[test]
fn preemption_keeps_the_constraint_where_the_kept_tokens_are() {
    let (_dir, files) = target();
    let requests = || {
        let mut r = greedy_requests();
        r.extend(sampled_requests(9));
        r
    };
    let want = run(&mut cpu_engine(&files, 4096, 64), requests());
    // Room for about two sequences at a time.
    let mut small = cpu_engine(&files, 128, 64);
    let got = run(&mut small, requests());
    assert!(small.stats().preemptions > 0, "nothing was preempted");
    assert_eq!(got, want);
    // And with drafts riding when sequences are preempted.
    let mut spec = cpu_engine(&files, 128, 64);
    spec.set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(4))
        .unwrap();
    assert_eq!(run(&mut spec, greedy_requests()), want[..4]);
}

#[test]
fn a_failing_constraint_ends_only_its_own_request_with_its_error() {
    let (_dir, files) = target();
    for speculate in [false, true] {
        let mut engine = cpu_engine(&files, 2048, 64);
        if speculate {
            engine
                .set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(3))
                .unwrap();
        }
        let broken = Alternating {
            len: 12,
            fail_at: Some(4),
        };
        let bad = engine
            .submit(request(&PROMPT, SamplingParams::default(), broken, 1))
            .unwrap()[0];
        let good = engine
            .submit(request(&PROMPT[3..], SamplingParams::default(), rule(1), 1))
            .unwrap()[0];
        let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
        let mut failures = Vec::new();
        while engine.has_work() {
            match engine.step() {
                Ok(events) => {
                    for ev in events {
                        out.entry(ev.seq).or_default().push(ev.token);
                    }
                }
                Err(e) => failures.push((e.failed, e.error.to_string())),
            }
        }
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].0, vec![bad]);
        assert!(
            failures[0]
                .1
                .contains("output constraint: the test grammar broke at token 4"),
            "{}",
            failures[0].1
        );
        // Plainly, the 4 tokens before the failure come out; a verification
        // that meets the failure at a draft position emits none of its drafts.
        let bad_out = out.get(&bad).cloned().unwrap_or_default();
        assert!(follows(&bad_out, bad_out.len(), None));
        match speculate {
            false => assert_eq!(bad_out.len(), 4),
            true => assert!(bad_out.len() <= 4),
        }
        assert!(follows(&out[&good], rule(1).len, Some(STOP)));
        engine.remove(good);
        assert_eq!(engine.kv_manager().num_used_blocks(), 0);
    }
}

#[test]
fn a_complete_grammar_with_no_stop_token_ends_the_output() {
    let (_dir, files) = target();
    for speculate in [false, true] {
        let mut engine = cpu_engine(&files, 2048, 64);
        if speculate {
            engine
                .set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(4))
                .unwrap();
        }
        let requests = greedy_requests()
            .into_iter()
            .map(|r| Request {
                stop_tokens: Vec::new(),
                ..r
            })
            .collect();
        for (i, (out, finished)) in run(&mut engine, requests).iter().enumerate() {
            assert!(follows(out, rule(i).len, None), "{i}: {out:?}");
            assert_eq!(*finished, Some(FinishReason::Stop));
        }
    }
}

#[test]
fn constrained_greedy_on_a_recording_backend_equals_the_cpu() {
    let (_dir, files) = target();
    let want = run(&mut cpu_engine(&files, 2048, 64), greedy_requests());
    let mut recording = engine_on(RecordingCpu::new(2), &files, 2048, 64);
    assert_eq!(run(&mut recording, greedy_requests()), want);
}

#[test]
fn constrained_greedy_on_wgpu_equals_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 11));
    let want = run(&mut cpu_engine(&files, 2048, 64), greedy_requests());
    let backend = WgpuBackend::new(WgpuOptions {
        disable_f16: true,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers` (make test does it)"));
    let mut gpu = engine_on(backend, &files, 2048, 64);
    assert_eq!(run(&mut gpu, greedy_requests()), want);
}
