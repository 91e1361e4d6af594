//! One client cannot hold `tandem serve` (in-process, tiny random models):
//! megabyte prompts are read and tokenized off the async runtime, so
//! `/health` and a live stream go on meanwhile; half-sent requests are
//! closed after the read timeouts, and connections past the cap wait for a
//! free slot; a request past its deadline ends with `finish_reason:
//! "timeout"` and frees its KV blocks at once.

mod serving_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::engine::EngineConfig;
use tandem_core::quant::WeightFormat;
use tandem_server::ServerConfig;
use tandem_tests::tiny;

use serving_support::{
    assert_drains_within, http, metric, post, server_config, slow_model, start_with, ModelFormat,
    Stream, MODEL,
};

fn engine_config() -> EngineConfig {
    EngineConfig {
        num_blocks: 600,
        max_batch_tokens: 256,
        ..EngineConfig::default()
    }
}

/// Seconds `/health` took to answer.
fn health_latency(addr: SocketAddr) -> f64 {
    let started = Instant::now();
    let (status, _) = http(addr, "GET", "/health", None, b"");
    assert_eq!(status, 200);
    started.elapsed().as_secs_f64()
}

/// `bytes` bytes of words.
fn words(bytes: usize) -> String {
    let mut rng = tandem_core::sched::Rng::new(7);
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        let len = 2 + (rng.next_u64() % 8) as usize;
        text.extend((0..len).map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char));
        text.push(' ');
    }
    text.truncate(bytes);
    text
}

#[test]
fn megabyte_prompts_do_not_stall_health_or_a_live_stream() {
    // No token floor for this tokenizer: every prompt is tokenized in full.
    let config = ServerConfig {
        max_body_bytes: 4 << 20,
        ..server_config()
    };
    let t = start_with(
        slow_model(),
        ModelFormat::HfWithoutEosOrFloor,
        engine_config(),
        config,
    );
    let addr = t.server.addr;
    let mut live = Stream::post(
        addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "once", "max_tokens": 4000, "temperature": 0, "stream": true}),
    );
    live.next_event().expect("the stream started");
    let live = std::thread::spawn(move || {
        std::iter::from_fn(|| live.next_event())
            .map(|(_, at)| at)
            .collect::<Vec<Instant>>()
    });
    let prompt = json!({"model": MODEL, "prompt": words(3_900_000), "max_tokens": 4}).to_string();
    let started = Instant::now();
    // More oversize prompts than this machine has cores: some wait for a slot.
    let oversize: Vec<_> = (0..3)
        .map(|_| {
            let prompt = prompt.clone();
            std::thread::spawn(move || {
                let (status, text) = http(
                    addr,
                    "POST",
                    "/v1/completions",
                    Some(serving_support::KEY),
                    prompt.as_bytes(),
                );
                (status, text, started.elapsed().as_secs_f64())
            })
        })
        .collect();
    let mut health = 0f64;
    while !oversize.iter().all(|h| h.is_finished()) {
        health = health.max(health_latency(addr));
        std::thread::sleep(Duration::from_millis(20));
    }
    let finished = Instant::now();
    drop(t); // ends the stream
    let arrivals = live.join().unwrap();
    let during = |at: &Instant| (started..finished).contains(at);
    assert!(
        arrivals.iter().filter(|at| during(at)).count() > 1,
        "the stream ended before the oversize prompts did"
    );
    let longest_pause = arrivals
        .windows(2)
        .filter(|w| during(&w[1]))
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .fold(0f64, f64::max);
    for h in oversize {
        let (status, text, seconds) = h.join().unwrap();
        assert_eq!(status, 400, "{text}");
        assert!(
            text.contains("maximum context length") && !text.contains("at least"),
            "tokenized in full: {text}"
        );
        println!("an oversize prompt answered after {seconds:.2} s");
    }
    println!("/health worst {health:.3} s, the stream's longest pause {longest_pause:.3} s");
    assert!(health < 1.0, "/health took {health:.2} s");
    assert!(
        longest_pause < 2.0,
        "the stream paused {longest_pause:.2} s"
    );
}

/// A connection that has sent part of a request head and then nothing.
fn half_sent(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    s
}

/// Whether the server closed `s` within `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn eleven_hundred_half_sent_requests_neither_block_health_nor_stay_open() {
    // Client and server ends of every connection live in this process.
    tandem_server::connections::raise_fd_limit(4096);
    let config = ServerConfig {
        header_read_timeout: Duration::from_secs(2),
        max_connections: 1200,
        ..server_config()
    };
    let t = start_with(
        tiny(WeightFormat::Q8_0, 3),
        ModelFormat::Gguf,
        engine_config(),
        config,
    );
    let addr = t.server.addr;
    let mut held: Vec<TcpStream> = (0..1100).map(|_| half_sent(addr)).collect();
    let latency = health_latency(addr);
    assert!(
        latency < 1.0,
        "/health took {latency:.2} s beside 1,100 half-sent requests"
    );
    let started = Instant::now();
    for (i, s) in held.iter_mut().enumerate() {
        assert!(
            closed_within(s, Duration::from_secs(10)),
            "connection {i} still open"
        );
    }
    let waited = started.elapsed().as_secs_f64();
    assert!(
        waited > 1.0,
        "closed after {waited:.2} s, before the timeout"
    );
    assert!(health_latency(addr) < 1.0);
}

#[test]
fn connections_past_the_cap_wait_for_a_free_slot() {
    let config = ServerConfig {
        header_read_timeout: Duration::from_secs(1),
        max_connections: 4,
        ..server_config()
    };
    let t = start_with(
        tiny(WeightFormat::Q8_0, 3),
        ModelFormat::Gguf,
        engine_config(),
        config,
    );
    let addr = t.server.addr;
    let _held: Vec<TcpStream> = (0..4).map(|_| half_sent(addr)).collect();
    // The fifth connection is answered once a half-sent one times out.
    let waited = health_latency(addr);
    assert!(
        (0.7..8.0).contains(&waited),
        "/health answered after {waited:.2} s"
    );
}

#[test]
fn a_body_that_stops_arriving_gets_408() {
    let config = ServerConfig {
        body_read_timeout: Duration::from_secs(1),
        ..server_config()
    };
    let t = start_with(
        tiny(WeightFormat::Q8_0, 3),
        ModelFormat::Gguf,
        engine_config(),
        config,
    );
    let mut s = TcpStream::connect(t.server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 1000\r\n\r\n{{\"model\": ",
        serving_support::KEY
    )
    .unwrap();
    let started = Instant::now();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let waited = started.elapsed().as_secs_f64();
    let (status, head, body) = serving_support::parse_response(&raw);
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("did not arrive within 1 s"), "{body}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    assert!((0.9..5.0).contains(&waited), "answered after {waited:.2} s");
}

/// The `finish_reason` of every chunk that has one, and `usage`, of a stream's events.
fn stream_end(events: &[String]) -> (Vec<String>, Value) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let reasons = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    (reasons, chunks.last().unwrap()["usage"].clone())
}

/// A completion request for [`slow_model`] with `extra` fields.
fn long_request(extra: Value) -> Value {
    let mut body =
        json!({"model": MODEL, "prompt": "once upon", "max_tokens": 4000, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn requests_past_their_deadline_end_with_timeout_and_free_their_blocks() {
    let t = start_with(
        slow_model(),
        ModelFormat::HfWithoutEos,
        engine_config(),
        server_config(),
    );
    let addr = t.server.addr;
    // A deadline a quarter of the way through 4,000 tokens on this machine.
    let started = Instant::now();
    let (status, v) = post(
        addr,
        "/v1/completions",
        &long_request(json!({"max_tokens": 200})),
    );
    assert_eq!(status, 200, "{v}");
    let quarter = started.elapsed() * 5;
    let timeout = json!(quarter.as_secs_f64());
    let freed_within = quarter.min(Duration::from_millis(500));

    // Streaming: tokens, then the end.
    let mut stream = Stream::post(
        addr,
        "/v1/completions",
        &long_request(
            json!({"timeout": timeout, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let events = stream.rest();
    let (reasons, usage) = stream_end(&events);
    assert_eq!(reasons, ["timeout"], "{events:?}");
    let generated = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..4000).contains(&generated), "{usage}");
    // Its blocks are free now, not when 4,000 tokens would have been generated.
    assert_drains_within(addr, freed_within);

    // Non-streaming: the text so far.
    let started = Instant::now();
    let (status, v) = post(
        addr,
        "/v1/completions",
        &long_request(json!({"timeout": timeout})),
    );
    let waited = started.elapsed();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "timeout", "{v}");
    let generated = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..4000).contains(&generated), "{v}");
    assert!(
        waited >= quarter,
        "ended after {waited:?}, before {quarter:?}"
    );
    assert_drains_within(addr, freed_within);

    // A deadline that passes before the first token: 504 for a single answer...
    let (status, v) = post(
        addr,
        "/v1/completions",
        &long_request(json!({"timeout": 1e-6})),
    );
    assert_eq!(
        (status, &v["error"]["code"]),
        (504, &json!("timeout")),
        "{v}"
    );
    // ...and for a stream, the end with nothing before it.
    let mut stream = Stream::post(
        addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "timeout": 1e-6, "stream": true}),
    );
    let events = stream.rest();
    let (reasons, _) = stream_end(&events);
    assert_eq!(reasons, ["timeout"], "{events:?}");
    assert_eq!(events.len(), 3, "role chunk, end chunk, [DONE]: {events:?}");
    assert_drains_within(addr, Duration::from_millis(500));
}

#[test]
fn the_server_deadline_applies_to_every_request_and_caps_theirs() {
    let config = ServerConfig {
        request_timeout: Some(Duration::from_micros(1)),
        ..server_config()
    };
    let t = start_with(
        slow_model(),
        ModelFormat::HfWithoutEos,
        engine_config(),
        config,
    );
    for extra in [json!({}), json!({"timeout": 1000})] {
        let (status, v) = post(t.server.addr, "/v1/completions", &long_request(extra));
        assert_eq!(
            (status, &v["error"]["code"]),
            (504, &json!("timeout")),
            "{v}"
        );
    }
    assert_eq!(metric(t.server.addr, "tandem_kv_blocks_used"), 0.0);
}
