//! A backend failure in one engine step (a kernel, a refused allocation, a
//! readback, a copy-on-write, a draft model's pass), injected by
//! `tandem_tests::faulty_cpu`, ends the requests of that step only: the
//! engine removes them once, with the error, and frees their KV; every
//! other request finishes with exactly the tokens a run without the fault
//! gives, and every KV block comes back. Over HTTP, the failed request gets
//! an error (500, or an error event in its stream) and the server goes on
//! serving.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{json, Value};
use tandem_core::engine::{Engine, EngineConfig, Request};
use tandem_core::kv::SeqId;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{DraftLength, DraftModel, DraftModelConfig};
use tandem_server::{spawn_engine, BackgroundServer, ServerConfig};
use tandem_tests::faulty_cpu::{Faults, FaultyCpu};
use tandem_tests::http_client::{events, request};
use tandem_tests::{cpu_engine, tiny, tiny_gguf};

/// One request of the workload: its prompt, its new tokens and its samples.
struct Work {
    prompt: Vec<u32>,
    max_new: usize,
    samples: usize,
}

/// Six requests of different lengths, one of them with two samples (forked
/// from one prompt, so the next write copies their shared block).
fn workload(vocab: usize) -> Vec<Work> {
    (0..6)
        .map(|i| Work {
            prompt: (0..5 + (i * 17) % 40)
                .map(|t| ((i * 7919 + t * 104_729 + t * t * 31) % (vocab - 1)) as u32)
                .collect(),
            max_new: 6 + (i * 5) % 11,
            samples: if i == 1 { 2 } else { 1 },
        })
        .collect()
}

/// Each request's greedy tokens, run alone on a backend that never fails.
fn expected(files: &ModelFiles, work: &[Work]) -> Vec<Vec<u32>> {
    work.iter()
        .map(|w| {
            let mut e = cpu_engine(files, 1024, 512);
            let id = e
                .add_request(
                    w.prompt.clone(),
                    SamplingParams::default(),
                    w.max_new,
                    vec![],
                )
                .unwrap();
            let mut tokens = Vec::new();
            while e.has_work() {
                tokens.extend(e.step().unwrap().iter().map(|ev| ev.token));
            }
            assert!(e.is_finished(id));
            tokens
        })
        .collect()
}

/// Where a fault strikes: the `nth` call of `operation` after `after_steps` steps.
#[derive(Clone, Copy, Debug)]
struct Fault {
    operation: &'static str,
    nth: u64,
    after_steps: usize,
}

/// What a run with one fault gave each sequence.
struct Outcome {
    /// Sequence → (request, tokens before it finished or failed).
    tokens: BTreeMap<SeqId, (usize, Vec<u32>)>,
    failed: BTreeSet<SeqId>,
}

/// Runs `work` on a backend with `fault`: half the requests first, the
/// rest once the fault is armed (so some wait while it strikes). Checks on
/// the way that a failure is reported once per sequence, with the injected
/// error, that a failed sequence is gone and gets no token after, and that
/// every KV block comes back at the end.
fn run_with(files: &ModelFiles, work: &[Work], fault: Fault, speculate: bool) -> Outcome {
    let faults = Faults::new();
    // 4 running at most and a 24-token budget: steps hold some sequences,
    // not all; prompts are prefilled in chunks.
    let config = EngineConfig {
        num_blocks: 48,
        max_batch_tokens: 24,
        max_running: 4,
        ..EngineConfig::default()
    };
    let backend = FaultyCpu::new(2, Arc::clone(&faults));
    let mut e = Engine::new(backend, files, config, &mut |_, _| {}).unwrap();
    if speculate {
        let draft_config = DraftModelConfig {
            block_size: 16,
            capacity_tokens: 2048,
            kv_dtype: Default::default(),
            max_batch_tokens: 64,
            cascade: None,
        };
        let draft = DraftModel::load(e.backend(), files, Some(&[0]), draft_config).unwrap();
        e.set_speculation(Box::new(draft), DraftLength::Fixed(3))
            .unwrap();
    }
    let mut outcome = Outcome {
        tokens: BTreeMap::new(),
        failed: BTreeSet::new(),
    };
    let submit = |e: &mut Engine<FaultyCpu>, outcome: &mut Outcome, i: usize| {
        let w = &work[i];
        let request = Request {
            samples: w.samples,
            ..Request::new(w.prompt.clone(), SamplingParams::default(), w.max_new)
        };
        for id in e.submit(request).unwrap() {
            outcome.tokens.insert(id, (i, Vec::new()));
        }
    };
    let half = work.len() / 2;
    (0..half).for_each(|i| submit(&mut e, &mut outcome, i));
    let mut steps = 0;
    while e.has_work() || steps <= fault.after_steps {
        if steps == fault.after_steps {
            faults.arm(fault.operation, fault.nth);
            (half..work.len()).for_each(|i| submit(&mut e, &mut outcome, i));
        }
        steps += 1;
        match e.step() {
            Ok(events) => {
                for ev in events {
                    assert!(
                        !outcome.failed.contains(&ev.seq),
                        "{fault:?}: a token after failing"
                    );
                    outcome.tokens.get_mut(&ev.seq).unwrap().1.push(ev.token);
                    if ev.finished.is_some() {
                        e.remove(ev.seq);
                    }
                }
            }
            Err(failure) => {
                assert!(
                    failure.to_string().contains("injected fault"),
                    "{fault:?}: {failure}"
                );
                for &id in &failure.failed {
                    assert!(outcome.tokens.contains_key(&id), "{fault:?}: unknown {id}");
                    assert!(outcome.failed.insert(id), "{fault:?}: {id} failed twice");
                    assert!(e.tokens(id).is_none(), "{fault:?}: {id} is still there");
                }
            }
        }
        assert!(steps < 1000, "{fault:?}: the engine made no progress");
    }
    assert_eq!(faults.fired(), [fault.operation], "{fault:?} never struck");
    let stats = e.stats();
    assert_eq!((stats.running, stats.waiting), (0, 0), "{fault:?}");
    assert_eq!(
        e.kv_manager().num_used_blocks(),
        0,
        "{fault:?}: KV blocks leaked"
    );
    outcome
}

/// The failed sequences got a correct start, the others all their tokens.
fn check(fault: Fault, outcome: &Outcome, want: &[Vec<u32>]) {
    assert!(!outcome.failed.is_empty(), "{fault:?}: no sequence failed");
    assert!(
        outcome.failed.len() < outcome.tokens.len(),
        "{fault:?}: every sequence failed"
    );
    for (id, (request, tokens)) in &outcome.tokens {
        if outcome.failed.contains(id) {
            assert!(
                want[*request].starts_with(tokens),
                "{fault:?}: request {request} went wrong before failing"
            );
        } else {
            assert_eq!(tokens, &want[*request], "{fault:?}: request {request}");
        }
    }
}

#[test]
fn a_failed_step_ends_its_own_requests_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 41));
    let work = workload(files.config.vocab_size);
    let want = expected(&files, &work);
    let faults = [
        // A kernel failing in the first step (prompt chunks only).
        ("argmax", 1, 0),
        ("paged_attention", 1, 0),
        // Mid-run, with sequences decoding, prefilling and waiting.
        ("paged_attention", 2, 3),
        ("matmul", 5, 4),
        // An allocation refused.
        ("alloc", 3, 2),
        // The readback failing (greedy batches read back ids).
        ("download_indices", 1, 5),
        // The copy of the block the two samples share.
        ("copy_kv_blocks", 1, 0),
    ];
    for (operation, nth, after_steps) in faults {
        let fault = Fault {
            operation,
            nth,
            after_steps,
        };
        check(fault, &run_with(&files, &work, fault, false), &want);
    }
}

#[test]
fn a_failure_while_speculating_settles_the_drafts() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 42));
    let work = workload(files.config.vocab_size);
    let want = expected(&files, &work);
    // The draft model's passes and the target's alternate: these strike
    // both, drafts in flight or not.
    for nth in 1..=6 {
        let fault = Fault {
            operation: "paged_attention",
            nth,
            after_steps: 3,
        };
        check(fault, &run_with(&files, &work, fault, true), &want);
    }
}

const KEY: &str = "sk-test";

/// A server on the faulty backend that runs one request at a time (the
/// next waits), and its faults.
fn start_server(dir: &std::path::Path) -> (BackgroundServer, Arc<Faults>) {
    let faults = Faults::new();
    let path = dir.to_path_buf();
    let engine_faults = Arc::clone(&faults);
    let engine = spawn_engine(move |inbox| {
        let files = tiny_gguf(&path, &tiny(WeightFormat::Q8_0, 43));
        let backend = FaultyCpu::new(2, engine_faults);
        let config = EngineConfig {
            max_running: 1,
            ..EngineConfig::default()
        };
        let engine = Engine::new(backend, &files, config, &mut |_, _| {})?;
        let ModelFiles { tokenizer, .. } = files;
        inbox.run(engine, tokenizer)
    })
    .unwrap();
    let config = ServerConfig {
        model_id: "tiny".into(),
        api_key: Some(KEY.into()),
        ..ServerConfig::default()
    };
    let server = BackgroundServer::start(engine, config, "127.0.0.1:0".parse().unwrap()).unwrap();
    (server, faults)
}

/// A greedy completion of `prompt`.
fn complete(addr: SocketAddr, prompt: &str, max_tokens: usize, stream: bool) -> (u16, String) {
    let body = json!({
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    });
    request(
        addr,
        "POST",
        "/v1/completions",
        Some(KEY),
        body.to_string().as_bytes(),
    )
}

/// The completion's text, from a 200 JSON answer.
fn text(answer: &(u16, String)) -> String {
    assert_eq!(answer.0, 200, "{}", answer.1);
    let v: Value = serde_json::from_str(&answer.1).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The error message of the last event of a stream that failed.
fn stream_error(answer: &(u16, String)) -> String {
    assert_eq!(answer.0, 200, "{}", answer.1);
    let events = events(&answer.1);
    assert!(
        events.len() > 1,
        "tokens came before the failure: {}",
        answer.1
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    last["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn waiting(addr: SocketAddr) -> f64 {
    let (_, text) = request(addr, "GET", "/metrics", None, b"");
    text.lines()
        .find_map(|l| l.strip_prefix("tandem_requests_waiting "))
        .expect("tandem_requests_waiting in /metrics")
        .parse()
        .unwrap()
}

const FIRST: &str = "the light through the prism";
const SECOND: &str = "colours of a rainbow after rain";

#[test]
fn the_server_fails_the_request_of_a_failed_step_and_serves_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let (server, faults) = start_server(dir.path());
    let addr = server.addr;
    let clean = [FIRST, SECOND].map(|prompt| text(&complete(addr, prompt, 12, false)));

    // A kernel fails in the prompt's step: the request gets a 500.
    faults.arm("paged_attention", 1);
    let (status, body) = complete(addr, FIRST, 12, false);
    assert_eq!(status, 500, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("injected fault"), "{message}");
    assert_eq!(text(&complete(addr, FIRST, 12, false)), clean[0]);

    // The first request streams while the second waits behind it; a
    // readback of the first's fails: its stream ends with the error, the
    // second is answered in full.
    faults.hold("download_indices");
    let first = std::thread::spawn(move || complete(addr, FIRST, 60, true));
    faults.wait_until_holding();
    let second = std::thread::spawn(move || complete(addr, SECOND, 12, false));
    // Step the first request until the engine has taken the second in.
    while waiting(addr) < 1.0 {
        assert!(
            !first.is_finished(),
            "the first request ended before the second came"
        );
        faults.hold("download_indices");
        faults.release();
        faults.wait_until_holding();
    }
    faults.arm("download_indices", 1);
    faults.release();
    let message = stream_error(&first.join().unwrap());
    assert!(message.contains("injected fault"), "{message}");
    assert_eq!(text(&second.join().unwrap()), clean[1]);
    assert_eq!(faults.fired(), ["paged_attention", "download_indices"]);

    assert_eq!(text(&complete(addr, SECOND, 12, false)), clean[1]);
    let (status, _) = request(addr, "GET", "/health", None, b"");
    assert_eq!(status, 200);
}
