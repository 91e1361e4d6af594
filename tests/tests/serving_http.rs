//! `tandem serve` over HTTP on 127.0.0.1, in-process, with a tiny random
//! model: bad input gets clear 4xx errors and the server keeps serving; a
//! load test of 200 requests from 32 clients (a tenth cancelled mid-stream)
//! completes with the right token counts and leaves every KV block free; and
//! the official `openai` Python client passes its checks
//! (tests/serving/openai_client.py, installed by scripts/install-test-deps.sh).
//! Chat messages are checked turn by turn (tool turns and assistant turns
//! with tool calls included); completions take a batch of one prompt; the
//! API key's scheme is case-insensitive.

mod serving_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use serving_support::{
    assert_drains, events, http, http_with_head, metric, post, start, venv_python, KEY, MAX_BODY,
    MODEL,
};

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
            "the prompt has 600 tokens",
        ),
        (
            "text that cannot fit the context by its length alone",
            completion(json!({"prompt": "a".repeat(MAX_BODY - 1000)}))
                .to_string()
                .into(),
            400,
            "the prompt has at least",
        ),
        (
            "a batch of two prompts",
            completion(json!({"prompt": ["one", "two"]}))
                .to_string()
                .into(),
            400,
            "'prompt' holds 2 prompts",
        ),
        (
            "a batch of two token lists",
            completion(json!({"prompt": [[1, 2], [3]]}))
                .to_string()
                .into(),
            400,
            "'prompt' holds 2 prompts",
        ),
        (
            "a token id outside the vocabulary",
            completion(json!({"prompt": [[1, 100000]]}))
                .to_string()
                .into(),
            400,
            "'prompt'",
        ),
        (
            "a timeout of zero",
            completion(json!({"timeout": 0})).to_string().into(),
            400,
            "'timeout'",
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
    let user = json!({"role": "user", "content": "hi"});
    let chat_cases = [
        (json!("hi"), "'messages' must be a list", "messages"),
        (json!([]), "empty", "messages"),
        (
            json!([{"content": "x"}]),
            "'messages[0].role' is required",
            "messages[0].role",
        ),
        (
            json!([user, {"role": "wizard", "content": "x"}]),
            "'messages[1].role' must be system, developer, user, assistant or tool, not 'wizard'",
            "messages[1].role",
        ),
        (
            json!([{"role": "user", "content": null}]),
            "'messages[0].content' is required",
            "messages[0].content",
        ),
        (
            json!([{"role": "user"}]),
            "'messages[0].content' is required",
            "messages[0].content",
        ),
        (
            json!([{"role": "user", "content": 7}]),
            "'messages[0].content' must be a string or a list of text parts",
            "messages[0].content",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "'messages[0].content[0]' must be a text part",
            "messages[0].content[0]",
        ),
        (
            json!([{"role": "assistant", "content": "I am here."}]),
            "has no 'user' message",
            "messages",
        ),
        (
            json!([{"role": "system", "content": "Be brief."}]),
            "has no 'user' message",
            "messages",
        ),
        (
            json!([user, {"role": "tool", "content": "42"}]),
            "'messages[1].tool_call_id' is required in a tool message",
            "messages[1].tool_call_id",
        ),
        (
            json!([user, {"role": "function", "content": "42", "name": "f"}]),
            "'messages[1].role' is 'function', which OpenAI has deprecated",
            "messages[1].role",
        ),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]}]),
            "'messages[1].tool_calls[0]' must be {\"id\"",
            "messages[1].tool_calls[0]",
        ),
        (
            json!([user, {"role": "user", "content": "x",
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]}]),
            "'messages[1].tool_calls' is only for assistant messages",
            "messages[1].tool_calls",
        ),
        (
            json!(["hi"]),
            "'messages[0]' must be an object",
            "messages[0]",
        ),
        (
            json!([{"role": "user", "content": "a".repeat(MAX_BODY - 1000)}]),
            "the prompt has at least",
            "messages",
        ),
    ];
    for (messages, message, param) in chat_cases {
        let body = json!({"model": MODEL, "messages": messages});
        let (status, err) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {err}");
        assert!(
            err["error"]["message"].as_str().unwrap().contains(message),
            "{body}: {err}"
        );
        assert_eq!(err["error"]["param"], param, "{body}: {err}");
    }
    // The tiny model's template (the ChatML fallback) cannot show tools.
    let with_tools = json!({"model": MODEL, "messages": [user],
        "tools": [{"type": "function", "function": {"name": "f"}}]});
    let (status, err) = post(addr, "/v1/chat/completions", &with_tools);
    assert_eq!(
        (status, &err["error"]["param"]),
        (400, &json!("tools")),
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("this model's chat template does not support tools"),
        "{err}"
    );
    // A conversation with calls and their answers renders without tools.
    let answered = json!({"model": MODEL, "max_tokens": 2, "messages": [
        user,
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]});
    let (status, ok) = post(addr, "/v1/chat/completions", &answered);
    assert_eq!(status, 200, "{ok}");
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
fn what_openai_accepts_is_accepted() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let ok = |path: &str, body: Value| {
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 200, "{body}: {v}");
        v
    };
    let one = |prompt: Value| {
        ok(
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}),
        )
    };
    // A batch of one token list is the token list; a batch of one text, the text.
    let ids = one(json!([[9, 69, 28]]));
    assert_eq!(ids["usage"]["prompt_tokens"], 3, "{ids}");
    assert_eq!(
        ids["choices"][0]["text"],
        one(json!([9, 69, 28]))["choices"][0]["text"]
    );
    let text = one(json!(["hello there"]));
    assert_eq!(
        text["choices"][0]["text"],
        one(json!("hello there"))["choices"][0]["text"]
    );
    // `developer` is a system turn; content may be a list of text parts.
    let chat = |messages: Value| {
        ok(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}),
        )
    };
    let parts = chat(json!([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
    ]));
    let plain = chat(json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]));
    assert_eq!(parts["usage"], plain["usage"]);
    assert_eq!(
        parts["choices"][0]["message"],
        plain["choices"][0]["message"]
    );
    // RFC 7235: the scheme is case-insensitive; the key is not.
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    for (authorization, status) in [
        (format!("bearer {KEY}"), 200),
        (format!("BEARER {KEY}"), 200),
        (format!("Bearer {}", KEY.to_uppercase()), 401),
        (format!("Bearer {KEY}x"), 401),
        (format!("Basic {KEY}"), 401),
    ] {
        let (got, _, text) = http_with_head(
            addr,
            "POST",
            "/v1/completions",
            Some(&authorization),
            body.as_bytes(),
        );
        assert_eq!(got, status, "{authorization}: {text}");
    }
    assert_drains(addr);
}

#[test]
fn a_full_queue_is_503_with_retry_after() {
    let t = start(32, 0);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let (status, head, text) = http_with_head(
        t.server.addr,
        "POST",
        "/v1/completions",
        Some(&format!("Bearer {KEY}")),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 503, "{text}");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue is full"),
        "{err}"
    );
    assert!(
        head.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"),
        "{head}"
    );
}

/// One load-test request: `(expected tokens, tokens reported)`, or `None` when cancelled.
fn load_request(addr: SocketAddr, i: usize) -> Option<(u64, u64, String)> {
    let max_tokens = 3 + (i % 17) as u64;
    let prompt: Vec<u32> = (0..(4 + i % 50))
        .map(|t| ((i * 31 + t * 7) % 250) as u32 + 1)
        .collect();
    let stream = i.is_multiple_of(2);
    let mut body = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
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
