//! What the HTTP serving tests share: in-process servers on tiny random
//! models, and `tandem_tests::http_client` with the tests' key and JSON.

#![allow(dead_code)] // each test binary uses its own part

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_cpu::CpuBackend;
use tandem_server::{spawn_engine, BackgroundServer, ServerConfig};
use tandem_tests::{tiny, tiny_gguf};

pub const MODEL: &str = "tiny";
pub const KEY: &str = "sk-test";
pub const MAX_BODY: usize = 64 << 10;

pub struct TestServer {
    pub server: BackgroundServer,
    _dir: tempfile::TempDir,
}

/// The configuration of the tests' servers: their model name and key, a 64 KiB body limit.
pub fn server_config() -> ServerConfig {
    ServerConfig {
        model_id: MODEL.into(),
        api_key: Some(KEY.into()),
        max_body_bytes: MAX_BODY,
        // Dropping a server ends what still runs after this.
        shutdown_grace: Duration::from_millis(200),
        ..ServerConfig::default()
    }
}

/// A server with `num_blocks` KV blocks and room for `max_queue` waiting requests.
pub fn start(num_blocks: usize, max_queue: usize) -> TestServer {
    let engine = EngineConfig {
        num_blocks,
        max_batch_tokens: 256,
        max_waiting: max_queue,
        ..EngineConfig::default()
    };
    start_with(
        tiny(WeightFormat::Q8_0, 21),
        ModelFormat::Gguf,
        engine,
        server_config(),
    )
}

/// How the model reaches the engine.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    /// A Hugging Face directory whose tokenizer names no end-of-text token,
    /// so every request generates its `max_tokens`.
    HfWithoutEos,
    /// The same, and the tokenizer's normalizer strips text, so it has no
    /// token floor: every prompt is tokenized in full.
    HfWithoutEosOrFloor,
}

/// `model` as a Hugging Face directory in `dir`, changed as `format` says.
fn write_hf(model: &SyntheticModel, format: ModelFormat, dir: &Path) {
    model.write_hf_dir(dir).unwrap();
    let edit = |name: &str, change: &dyn Fn(&mut Value)| {
        let file = dir.join(name);
        let mut json: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        change(&mut json);
        std::fs::write(&file, json.to_string()).unwrap();
    };
    edit("tokenizer_config.json", &|c| {
        c.as_object_mut().unwrap().remove("eos_token");
    });
    if format == ModelFormat::HfWithoutEosOrFloor {
        edit("tokenizer.json", &|t| {
            t["normalizer"] = json!({"type": "Strip", "strip_left": true, "strip_right": true});
        });
    }
}

pub fn start_with(
    model: SyntheticModel,
    format: ModelFormat,
    engine: EngineConfig,
    config: ServerConfig,
) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let engine = spawn_engine(move |inbox| {
        let files = match format {
            ModelFormat::Gguf => tiny_gguf(&path, &model),
            _ => {
                write_hf(&model, format, &path);
                tandem_core::model::load(&path)?
            }
        };
        let engine = Engine::new(CpuBackend::new(2), &files, engine, &mut |_, _| {})?;
        let ModelFiles { tokenizer, .. } = files;
        inbox.run(engine, tokenizer)
    })
    .unwrap();
    let server = BackgroundServer::start(engine, config, "127.0.0.1:0".parse().unwrap()).unwrap();
    TestServer { server, _dir: dir }
}

/// A model slow enough for requests to still be running a second later (a
/// 32,000-token vocabulary: its output layer is most of the work), with
/// room for 4,096 tokens.
pub fn slow_model() -> SyntheticModel {
    let mut model = tiny(WeightFormat::Q8_0, 5);
    model.config.vocab_size = 32_000;
    model.config.max_context = 4096;
    model
}

/// A request that is sent at once and read as it comes: server-sent events
/// with the time each arrived.
pub struct Stream {
    socket: TcpStream,
    buffer: Vec<u8>,
}

impl Stream {
    pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Stream {
        let mut socket = TcpStream::connect(addr).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        let body = body.to_string();
        write!(
            socket,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        Stream {
            socket,
            buffer: Vec::new(),
        }
    }

    /// The next `data:` payload and when it arrived; `None` at the end of the response.
    pub fn next_event(&mut self) -> Option<(String, Instant)> {
        loop {
            let text = String::from_utf8_lossy(&self.buffer).into_owned();
            if let Some(at) = text.find("data:") {
                if let Some(end) = text[at..].find('\n') {
                    let event = text[at + 5..at + end].trim().to_string();
                    self.buffer.drain(..at + end + 1);
                    return Some((event, Instant::now()));
                }
            }
            let mut chunk = [0u8; 4096];
            match self.socket.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Every remaining event.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_event().map(|(e, _)| e)).collect()
    }
}

#[allow(unused_imports)] // each test binary uses its own part
pub use tandem_tests::http_client::{
    events, parse_response, request as http, request_with_head as http_with_head, venv_python,
};

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(KEY), body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The body of a 200 answer to `body` at `path`.
pub fn ok(addr: SocketAddr, path: &str, body: Value) -> Value {
    let (status, v) = post(addr, path, &body);
    assert_eq!(status, 200, "{body}: {v}");
    v
}

/// A completion request for `prompt` with `extra` fields, greedy, token ids in logprobs.
pub fn completion(prompt: Value, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "logprobs": 0, "return_tokens_as_token_ids": true,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", None, b"");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        .parse()
        .unwrap()
}

/// Waits (boundedly) until the engine holds no sequence and no KV block.
pub fn assert_drains(addr: SocketAddr) {
    assert_drains_within(addr, Duration::from_secs(10));
}

/// The engine holds no sequence and no KV block at most `limit` from now.
pub fn assert_drains_within(addr: SocketAddr, limit: Duration) {
    let deadline = Instant::now() + limit;
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
