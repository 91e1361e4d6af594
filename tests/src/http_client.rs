//! A few lines of HTTP/1.1 over `TcpStream` (`Connection: close`), enough
//! for the server's JSON and server-sent events in tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

/// Status and body (de-chunked) of one request; `key` goes in as a bearer token.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let authorization = key.map(|k| format!("Bearer {k}"));
    let (status, _, body) = request_with_head(addr, method, path, authorization.as_deref(), body);
    (status, body)
}

/// Status, response head and body of one request, `authorization` sent as given.
pub fn request_with_head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: &[u8],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the test server");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("set a read timeout");
    let auth = authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send the request head");
    // The server may answer (413) before reading the whole body: a failed write is fine.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the response");
    parse_response(&raw)
}

/// Status, head and body (de-chunked) of a raw response.
pub fn parse_response(raw: &[u8]) -> (u16, String, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("a complete response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, head.to_string(), body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// The workspace's virtual environment's Python, with the `openai` package.
pub fn venv_python() -> PathBuf {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/install-test-deps.sh (make test does)",
        python.display()
    );
    python
}

/// The `data:` payloads of a server-sent event stream.
pub fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}
