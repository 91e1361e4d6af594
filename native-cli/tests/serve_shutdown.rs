//! `tandem serve` stops cleanly on SIGTERM and SIGINT: new connections are
//! refused at once, the requests in flight get the grace period, then end
//! with `finish_reason: "abort"` and `[DONE]` (a non-streaming request: a
//! complete JSON body), and the process exits 0.
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

mod served;

/// A running `tandem serve` and what it has printed on stderr.
struct Server {
    child: Child,
    addr: SocketAddr,
    stderr: mpsc::Receiver<String>,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tandem"));
        command
            .args(["serve", "--model", model.to_str().unwrap()])
            .args(["--backend", "cpu", "--port", "0", "--model-id", "m"])
            .args(extra)
            .env("TANDEM_OFFLINE", "1");
        let (child, addr, stderr) = served::spawn(command);
        Server {
            child,
            addr,
            stderr,
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The exit code within `limit`, and every line printed on stderr.
    fn wait(mut self, limit: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + limit;
        let code = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the server still runs {limit:?} after the signal");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (code, self.stderr.try_iter().collect::<Vec<_>>().join("\n"))
    }
}

/// A request sent at once; the response is read by the caller.
fn send(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// The `data:` payloads of a stream, read to its end; `first` is told of the first content.
fn read_events(s: TcpStream, first: mpsc::Sender<()>) -> Vec<String> {
    let mut events = Vec::new();
    for line in BufReader::new(s).lines().map_while(Result::ok) {
        if let Some(data) = line.strip_prefix("data: ") {
            if data.contains("\"text\":\"") && !data.contains("\"text\":\"\"") {
                let _ = first.send(());
            }
            events.push(data.to_string());
        }
    }
    events
}

/// A model that runs for seconds: a large vocabulary and no end-of-text
/// token, so every request generates its `max_tokens`.
fn slow_model(dir: &Path) {
    let mut model = SyntheticModel::preset("tiny", WeightFormat::Q8_0, 5).unwrap();
    model.config.vocab_size = 32_000;
    model.config.max_context = 4096;
    model.write_hf_dir(dir).unwrap();
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("eos_token");
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn sigterm_ends_every_started_response_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    slow_model(dir.path());
    // One sequence at a time: the later requests wait in the queue.
    let server = Server::start(
        dir.path(),
        &[
            "--max-running",
            "1",
            "--kv-blocks",
            "600",
            "--shutdown-grace",
            "0.5",
        ],
    );
    let (first, started) = mpsc::channel();
    let request = |stream: bool| {
        json!({"model": "m", "prompt": "once upon a time", "max_tokens": 4000,
               "temperature": 0, "stream": stream})
    };
    // Six times 4,000 tokens, one request at a time: far more than the grace period.
    let streams: Vec<_> = (0..6)
        .map(|_| {
            let s = send(server.addr, "/v1/completions", &request(true));
            let first = first.clone();
            std::thread::spawn(move || read_events(s, first))
        })
        .collect();
    let mut single = send(server.addr, "/v1/completions", &request(false));
    started
        .recv_timeout(Duration::from_secs(60))
        .expect("no stream produced text");

    server.signal("TERM");
    let signalled = Instant::now();
    // The listener closes at once, while the streams still run.
    loop {
        match TcpStream::connect(server.addr) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            _ => assert!(
                signalled.elapsed() < Duration::from_secs(1),
                "still accepting connections after SIGTERM"
            ),
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut reasons = Vec::new();
    for s in streams {
        let events = s.join().unwrap();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let ends: Vec<String> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .filter_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        assert_eq!(ends.len(), 1, "{events:?}");
        reasons.extend(ends);
    }
    assert!(
        reasons.iter().all(|r| r == "abort" || r == "length"),
        "{reasons:?}"
    );
    assert!(reasons.iter().any(|r| r == "abort"), "{reasons:?}");
    let mut raw = String::new();
    single.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
    let body: Value = serde_json::from_str(body).expect("a complete JSON body");
    if head.starts_with("HTTP/1.1 200") {
        let reason = &body["choices"][0]["finish_reason"];
        assert!(reason == "abort" || reason == "length", "{body}");
    } else {
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("shutting down"),
            "{body}"
        );
    }
    let (code, stderr) = server.wait(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("shutting down"), "{stderr}");
    assert!(!stderr.contains("error"), "{stderr}");
}

#[test]
fn sigint_with_nothing_running_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    SyntheticModel::preset("tiny", WeightFormat::Q8_0, 1)
        .unwrap()
        .write_gguf(&path)
        .unwrap();
    let server = Server::start(&path, &["--shutdown-grace", "30"]);
    // An idle keep-alive connection does not hold the shutdown up.
    let mut idle = TcpStream::connect(server.addr).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = [0u8; 512];
    assert!(idle.read(&mut reply).unwrap() > 0);
    let signalled = Instant::now();
    server.signal("INT");
    let (code, stderr) = server.wait(Duration::from_secs(10));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "waited {:?} with nothing to finish",
        signalled.elapsed()
    );
}
