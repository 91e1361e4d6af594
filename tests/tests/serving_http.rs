//! `tandem serve` over HTTP on 127.0.0.1, in-process, with a tiny random
//! model: bad input gets clear 4xx errors and the server keeps serving; a
//! load test of 200 requests from 32 clients (a tenth cancelled mid-stream)
//! completes with the right token counts and leaves every KV block free; and
//! the official `openai` Python client passes its checks
//! (tests/serving/openai_client.py, installed by scripts/install-test-deps.sh).
//!
//! The HTTP client here is a few lines over `TcpStream` (HTTP/1.1,
//! `Connection: close`), enough for JSON and server-sent events.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_cpu::CpuBackend;
use tandem_server::{spawn_engine, BackgroundServer, ServerConfig};
use tandem_tests::{tiny, tiny_gguf};

const MODEL: &str = "tiny";
const KEY: &str = "sk-test";
const MAX_BODY: usize = 64 << 10;

struct TestServer {
    server: BackgroundServer,
    _dir: tempfile::TempDir,
}

/// A server with `num_blocks` KV blocks and room for `max_queue` waiting requests.
fn start(num_blocks: usize, max_queue: usize) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let engine = spawn_engine(move |inbox| {
        let files = tiny_gguf(&path, &tiny(WeightFormat::Q8_0, 21));
        let config = EngineConfig {
            num_blocks,
            max_batch_tokens: 256,
            max_waiting: max_queue,
            ..EngineConfig::default()
        };
        let engine = Engine::new(CpuBackend::new(2), &files, config, &mut |_, _| {})?;
        let ModelFiles { tokenizer, .. } = files;
        inbox.run(engine, tokenizer)
    })
    .unwrap();
    let config = ServerConfig {
        model_id: MODEL.into(),
        api_key: Some(KEY.into()),
        max_body_bytes: MAX_BODY,
    };
    let server = BackgroundServer::start(engine, config, "127.0.0.1:0".parse().unwrap()).unwrap();
    TestServer { server, _dir: dir }
}

/// Status and body of one request (the body de-chunked).
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body: a failed write is fine.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("a complete response head");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    (
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    )
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(KEY), body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The `data:` payloads of a server-sent event stream.
fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", None, b"");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        .parse()
        .unwrap()
}

/// Waits (boundedly) until the engine holds no sequence and no KV block.
fn assert_drains(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let busy = metric(addr, "tandem_kv_blocks_used")
            + metric(addr, "tandem_requests_running")
            + metric(addr, "tandem_requests_waiting");
        if busy == 0.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "KV blocks or sequences still held"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_input_gets_clear_errors_and_the_server_keeps_serving() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let completion = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed JSON",
            b"{\"model\": ".to_vec(),
            400,
            "not valid JSON",
        ),
        ("not an object", b"[1, 2]".to_vec(), 400, "JSON object"),
        (
            "wrong type",
            completion(json!({"max_tokens": "ten"})).to_string().into(),
            400,
            "'max_tokens'",
        ),
        (
            "negative max_tokens",
            completion(json!({"max_tokens": -5})).to_string().into(),
            400,
            "'max_tokens'",
        ),
        (
            "huge max_tokens",
            completion(json!({"max_tokens": 1u64 << 40}))
                .to_string()
                .into(),
            400,
            "maximum context length",
        ),
        (
            "empty prompt",
            completion(json!({"prompt": ""})).to_string().into(),
            400,
            "empty",
        ),
        (
            "prompt of wrong type",
            completion(json!({"prompt": {"a": 1}})).to_string().into(),
            400,
            "'prompt'",
        ),
        (
            "prompt longer than the context",
            completion(json!({"prompt": vec![65; 600]}))
                .to_string()
                .into(),
            400,
            "maximum context length",
        ),
        (
            "n = 0",
            completion(json!({"n": 0})).to_string().into(),
            400,
            "'n'",
        ),
        (
            "temperature 5",
            completion(json!({"temperature": 5})).to_string().into(),
            400,
            "'temperature'",
        ),
        (
            "stop of wrong type",
            completion(json!({"stop": 3})).to_string().into(),
            400,
            "'stop'",
        ),
        (
            "missing model",
            json!({"prompt": "x"}).to_string().into(),
            400,
            "'model'",
        ),
        (
            "unknown model",
            completion(json!({"model": "gpt-9"})).to_string().into(),
            404,
            "does not exist",
        ),
        (
            "oversized body",
            completion(json!({"prompt": "a".repeat(MAX_BODY * 3)}))
                .to_string()
                .into(),
            413,
            "larger than",
        ),
    ];
    for (what, body, status, message) in cases {
        let (got, text) = http(addr, "POST", "/v1/completions", Some(KEY), &body);
        assert_eq!(got, status, "{what}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{what}: {text}"));
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains(message), "{what}: {msg}");
    }
    let chat_cases = [
        (json!({"model": MODEL, "messages": "hi"}), "'messages'"),
        (json!({"model": MODEL, "messages": []}), "empty"),
        (
            json!({"model": MODEL, "messages": [{"content": "x"}]}),
            "'role'",
        ),
    ];
    for (body, message) in chat_cases {
        let (status, err) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {err}");
        assert!(
            err["error"]["message"].as_str().unwrap().contains(message),
            "{err}"
        );
    }
    let (status, text) = http(addr, "POST", "/v1/completions", Some("wrong"), b"{}");
    assert_eq!(status, 401, "{text}");
    let (status, _) = http(addr, "GET", "/v1/nothing", Some(KEY), b"");
    assert_eq!(status, 404);
    // Still serving, and nothing leaked.
    let (status, ok) = post(addr, "/v1/completions", &completion(json!({})));
    assert_eq!(status, 200, "{ok}");
    assert!(ok["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert_eq!(http(addr, "GET", "/health", None, b"").0, 200);
    assert_drains(addr);
}

#[test]
fn a_full_queue_is_503_with_an_openai_error() {
    let t = start(32, 0);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let (status, err) = post(t.server.addr, "/v1/completions", &body);
    assert_eq!(status, 503, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue is full"),
        "{err}"
    );
}

/// One load-test request: `(expected tokens, tokens reported)`, or `None` when cancelled.
fn load_request(addr: SocketAddr, i: usize) -> Option<(u64, u64, String)> {
    let max_tokens = 3 + (i % 17) as u64;
    let prompt: Vec<u32> = (0..(4 + i % 50))
        .map(|t| ((i * 31 + t * 7) % 250) as u32 + 1)
        .collect();
    let stream = i.is_multiple_of(2);
    let body = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": stream, "stream_options": {"include_usage": true},
    });
    if i % 10 == 3 {
        // Cancel mid-stream: read the first event, then hang up.
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": true});
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let text = body.to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        )
        .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains("data:") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "stream closed before the first event");
            seen.extend_from_slice(&buf[..n]);
        }
        return None;
    }
    let (status, text) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(KEY),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let (usage, finish) = if stream {
        let events = events(&text);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let finish = chunks
            .iter()
            .find_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap();
        (chunks.last().unwrap()["usage"].clone(), finish)
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        let finish = v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string();
        (v["usage"].clone(), finish)
    };
    Some((
        max_tokens,
        usage["completion_tokens"].as_u64().unwrap(),
        finish,
    ))
}

#[test]
fn two_hundred_requests_from_32_clients_complete_and_free_every_block() {
    // A pool smaller than 32 full requests: admission waits and preemption happen too.
    let t = start(48, 512);
    let addr = t.server.addr;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..32)
        .map(|_| {
            let next = next.clone();
            std::thread::spawn(move || {
                let mut results = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= 200 {
                        return results;
                    }
                    results.push((i, load_request(addr, i)));
                }
            })
        })
        .collect();
    let mut completed = 0;
    let mut cancelled = 0;
    for c in clients {
        for (i, r) in c.join().unwrap() {
            match r {
                None => cancelled += 1,
                Some((want, got, finish)) => {
                    completed += 1;
                    match finish.as_str() {
                        "length" => assert_eq!(got, want, "request {i}"),
                        "stop" => assert!(got <= want, "request {i}"),
                        other => panic!("request {i}: finish reason {other}"),
                    }
                }
            }
        }
    }
    assert_eq!((completed, cancelled), (180, 20));
    assert!(started.elapsed() < Duration::from_secs(300));
    assert_drains(addr);
    assert_eq!(metric(addr, "tandem_kv_blocks_free"), 48.0);
}

/// The workspace's virtual environment with the `openai` package.
fn venv_python() -> PathBuf {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/install-test-deps.sh (make test does)",
        python.display()
    );
    python
}

#[test]
fn the_official_openai_client_works_against_the_server() {
    let python = venv_python();
    let t = start(128, 64);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("serving/openai_client.py");
    let base_url = format!("http://{}/v1", t.server.addr);
    let out = std::process::Command::new(python)
        .arg(script)
        .args([&base_url, MODEL, KEY])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    assert_drains(t.server.addr);
}
