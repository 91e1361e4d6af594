//! llguidance constraints in the engine on a tiny random model: its output
//! is garbage, but the grammar forces it into shape, so every output must
//! parse and fit its schema, greedy and sampled, with and without n-gram
//! speculation (greedy tokens identical to plain constrained decoding).
//! This model likes whitespace: between JSON tokens it takes all the
//! grammar allows (`tandem_structured::JSON_WHITESPACE`), hence the room.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Value};
use tandem_core::engine::{Engine, FinishReason, Request};
use tandem_core::kv::SeqId;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::spec::{DraftLength, NgramProposer};
use tandem_core::tokenizer::Tokenizer;
use tandem_cpu::CpuBackend;
use tandem_structured::{OutputFormat, RequestedFormat, StructuredOutput};
use tandem_tests::{cpu_engine, tiny, tiny_gguf};

/// Every field bounded, so even random choices among the allowed tokens end.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "home": {
                "type": "object",
                "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                "required": ["floor"],
                "additionalProperties": false
            }
        },
        "required": ["name", "age", "role", "tags", "home"],
        "additionalProperties": false
    })
}

/// Whether `v` fits [`person_schema`] (checked by hand: no schema validator here).
fn is_person(v: &Value) -> bool {
    let o = match v.as_object() {
        Some(o) if o.len() == 5 => o,
        _ => return false,
    };
    let int_in = |v: &Value, lo: i64, hi: i64| v.as_i64().is_some_and(|n| (lo..=hi).contains(&n));
    o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && int_in(&o["age"], 0, 120)
        && matches!(o["role"].as_str(), Some("admin" | "user"))
        && o["tags"]
            .as_array()
            .is_some_and(|a| a.len() <= 3 && a.iter().all(Value::is_boolean))
        && o["home"]
            .as_object()
            .is_some_and(|h| h.len() == 1 && int_in(&h["floor"], -2, 9))
}

fn request(
    out: &StructuredOutput,
    params: SamplingParams,
    samples: usize,
    tok: &Tokenizer,
) -> Request {
    let requested = RequestedFormat {
        format: OutputFormat::JsonSchema(person_schema()),
        param: "response_format".into(),
    };
    Request {
        stop_tokens: tok.eos_tokens().to_vec(),
        samples,
        constraint: out.compile(&requested).unwrap(),
        ..Request::new(vec![5, 77, 300, 12, 256, 99, 5, 77], params, 2000)
    }
}

/// Each sample's text, after checking it ended with EOS.
fn run(engine: &mut Engine<CpuBackend>, requests: Vec<Request>, tok: &Tokenizer) -> Vec<String> {
    let ids: Vec<SeqId> = requests
        .into_iter()
        .flat_map(|r| engine.submit(r).unwrap())
        .collect();
    let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            out.entry(ev.seq).or_default().push(ev.token);
            if let Some(reason) = ev.finished {
                assert_eq!(
                    reason,
                    FinishReason::Stop,
                    "the JSON did not end: {:?}",
                    tok.decode(&out[&ev.seq])
                );
                engine.remove(ev.seq);
            }
        }
    }
    ids.iter().map(|id| tok.decode(&out[id]).unwrap()).collect()
}

#[test]
fn random_model_output_is_valid_json_of_the_schema_with_and_without_speculation() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 21));
    let tok = files.tokenizer.clone();
    let structured = StructuredOutput::new(Arc::new(tok.clone()));
    let requests = || {
        let mut r = vec![request(&structured, SamplingParams::default(), 1, &tok)];
        for seed in [0, 10] {
            let params = SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            };
            r.push(request(&structured, params, 2, &tok));
        }
        r
    };
    let plain = run(&mut cpu_engine(&files, 4096, 64), requests(), &tok);
    let mut speculative = cpu_engine(&files, 4096, 64);
    speculative
        .set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(4))
        .unwrap();
    let with_drafts = run(&mut speculative, requests(), &tok);
    assert!(speculative.stats().speculation.proposed_tokens > 0);
    assert_eq!(
        with_drafts[0], plain[0],
        "greedy output changed with drafts"
    );
    for text in plain.iter().chain(&with_drafts) {
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(is_person(&value), "{text}");
    }
    let distinct: std::collections::HashSet<&String> = plain.iter().collect();
    assert!(distinct.len() > 2, "sampling chose nothing: {plain:?}");
}
