//! Where `--model` finds models, as a user meets it, without the network:
//! `hf:ORG/REPO[:QUANT]` against a local server in the Hugging Face hub's
//! URL layout (download and generate, resume after a cut connection, cache
//! hits, 404, 401, quantization choice).
#![cfg(feature = "hf")]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

mod cache_home;
mod common;
use cache_home::{generate, sha256_hex, stdout};
use common::assert_clear_error;

/// hf-hub's attempts at one file per run: the first and tandem's 3 retries.
const ATTEMPTS_PER_RUN: usize = 4;

fn tiny_gguf(format: WeightFormat, seed: u64) -> Vec<u8> {
    SyntheticModel::preset("tiny", format, seed)
        .unwrap()
        .to_gguf()
        .unwrap()
}

// ---------------------------------------------------------------------------
// A hub on 127.0.0.1, serving what hf-hub reads: the file list at
// /api/models/ORG/REPO/revision/main, and /ORG/REPO/resolve/main/FILE with
// etag, x-repo-commit and Content-Range for ranges. LFS files answer, as the
// hub does, with a redirect to a content server (/cdn/SHA256) and their
// sha256 in x-linked-etag.
// ---------------------------------------------------------------------------

struct HubFile {
    name: String,
    bytes: Vec<u8>,
    lfs: bool,
    /// Listed, but its URL answers 404 (a listing newer than the storage).
    missing: bool,
}

impl HubFile {
    fn lfs(name: &str, bytes: Vec<u8>) -> Self {
        Self {
            name: name.into(),
            bytes,
            lfs: true,
            missing: false,
        }
    }

    fn plain(name: &str, bytes: Vec<u8>) -> Self {
        Self {
            lfs: false,
            ..Self::lfs(name, bytes)
        }
    }
}

#[derive(Default)]
struct Behaviour {
    /// Requests without `Authorization: Bearer TOKEN` get 401.
    token: Option<String>,
    /// The next `cuts` data responses of LFS files stop after `cut_after` bytes.
    cut_after: usize,
    cuts: usize,
}

#[derive(Clone, Debug)]
struct Served {
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

struct HubServer {
    url: String,
    repos: Arc<HashMap<String, Vec<HubFile>>>,
    behaviour: Arc<Mutex<Behaviour>>,
    log: Arc<Mutex<Vec<Served>>>,
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

impl HubServer {
    fn start(repos: Vec<(&str, Vec<HubFile>)>, behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = Self {
            url,
            repos: Arc::new(repos.into_iter().map(|(r, f)| (r.to_string(), f)).collect()),
            behaviour: Arc::new(Mutex::new(behaviour)),
            log: Arc::default(),
        };
        let (repos, behaviour, log, url) = (
            server.repos.clone(),
            server.behaviour.clone(),
            server.log.clone(),
            server.url.clone(),
        );
        // Ends with the test process.
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, behaviour, log, url) =
                    (repos.clone(), behaviour.clone(), log.clone(), url.clone());
                std::thread::spawn(move || serve(stream, &repos, &behaviour, &log, &url));
            }
        });
        server
    }

    fn env(&self) -> (&'static str, &str) {
        ("HF_ENDPOINT", &self.url)
    }

    fn take_log(&self) -> Vec<Served> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

fn serve(
    mut stream: TcpStream,
    repos: &HashMap<String, Vec<HubFile>>,
    behaviour: &Mutex<Behaviour>,
    log: &Mutex<Vec<Served>>,
    url: &str,
) {
    let Some((path, headers)) = read_request(&stream) else {
        return;
    };
    let range = headers.get("range").cloned();
    let auth = headers.get("authorization").cloned();
    log.lock().unwrap().push(Served {
        path: path.clone(),
        range: range.clone(),
        auth: auth.clone(),
    });
    let token = behaviour.lock().unwrap().token.clone();
    let authorized = token.is_none_or(|t| auth.as_deref() == Some(&format!("Bearer {t}")));
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(6, '/').collect();
    let reply = |stream: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(body);
    };
    match parts[..] {
        ["api", "models", org, name, "revision", "main"] => {
            let repo = format!("{org}/{name}");
            match repos.get(&repo) {
                _ if !authorized => reply(&mut stream, "401 Unauthorized", &[], b"{}"),
                None => reply(&mut stream, "404 Not Found", &[], b"{}"),
                Some(files) => {
                    let siblings: Vec<serde_json::Value> = files
                        .iter()
                        .map(|f| serde_json::json!({ "rfilename": f.name }))
                        .collect();
                    let body =
                        serde_json::json!({ "id": repo, "sha": COMMIT, "siblings": siblings });
                    reply(&mut stream, "200 OK", &[], body.to_string().as_bytes());
                }
            }
        }
        [org, name, "resolve", "main", file] => {
            let found = repos
                .get(&format!("{org}/{name}"))
                .and_then(|files| files.iter().find(|f| f.name == file && !f.missing));
            let Some(f) = found.filter(|_| authorized) else {
                let status = if authorized {
                    "404 Not Found"
                } else {
                    "401 Unauthorized"
                };
                return reply(&mut stream, status, &[], b"");
            };
            let sha = sha256_hex(&f.bytes);
            let commit = ("x-repo-commit", COMMIT.to_string());
            if f.lfs {
                let headers = [
                    commit,
                    ("x-linked-etag", format!("\"{sha}\"")),
                    ("x-linked-size", f.bytes.len().to_string()),
                    ("etag", format!("\"{}\"", &sha[..40])),
                    ("Location", format!("{url}/cdn/{org}/{name}/{file}")),
                ];
                reply(&mut stream, "302 Found", &headers, b"");
            } else {
                let etag = ("etag", format!("\"{}\"", &sha[..40]));
                serve_bytes(stream, &f.bytes, range.as_deref(), &[commit, etag], None);
            }
        }
        ["cdn", org, name, file] => {
            let found = repos
                .get(&format!("{org}/{name}"))
                .and_then(|files| files.iter().find(|f| f.name == file));
            let Some(f) = found else {
                return reply(&mut stream, "404 Not Found", &[], b"");
            };
            let cut = {
                let mut b = behaviour.lock().unwrap();
                let probe = range.as_deref() == Some("bytes=0-0");
                (!probe && b.cuts > 0).then(|| {
                    b.cuts -= 1;
                    b.cut_after
                })
            };
            serve_bytes(stream, &f.bytes, range.as_deref(), &[], cut);
        }
        _ => reply(&mut stream, "404 Not Found", &[], b""),
    }
}

/// The request's path and lowercase headers.
fn read_request(stream: &TcpStream) -> Option<(String, HashMap<String, String>)> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut headers = HashMap::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).ok()?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let (k, v) = header.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    Some((path, headers))
}

/// `bytes` or the range asked for; with `cut`, the connection drops after
/// that many bytes of the body.
fn serve_bytes(
    mut stream: TcpStream,
    bytes: &[u8],
    range: Option<&str>,
    extra: &[(&str, String)],
    cut: Option<usize>,
) {
    let (status, start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let start: usize = a.parse().unwrap();
            let end = if b.is_empty() {
                bytes.len() - 1
            } else {
                b.parse().unwrap()
            };
            ("206 Partial Content", start, end.min(bytes.len() - 1))
        }
        None => ("200 OK", 0, bytes.len() - 1),
    };
    let body = &bytes[start..=end];
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{end}/{}\r\nConnection: close\r\n",
        body.len(),
        bytes.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let sent = cut.map_or(body.len(), |n| n.min(body.len()));
    let _ = stream.write_all(&body[..sent]);
    let _ = stream.flush();
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

fn data_requests(log: &[Served]) -> Vec<&Served> {
    log.iter()
        .filter(|s| s.path.starts_with("/cdn/") || s.path.contains("/resolve/"))
        .collect()
}

/// A repo of two tiny GGUF quantizations and a README.
fn gguf_repo() -> (Vec<HubFile>, Vec<u8>) {
    let q4_1 = tiny_gguf(WeightFormat::Q4_1, 3);
    let files = vec![
        HubFile::plain("README.md", b"# tiny\n".to_vec()),
        HubFile::lfs("tiny-Q4_0.gguf", tiny_gguf(WeightFormat::Q4_0, 3)),
        HubFile::lfs("tiny-Q4_1.gguf", q4_1.clone()),
    ];
    (files, q4_1)
}

/// The greedy text of the GGUF `bytes` loaded from a plain file.
fn local_text(home: &Path, bytes: &[u8]) -> String {
    let path = home.join("local.gguf");
    std::fs::write(&path, bytes).unwrap();
    stdout(&generate(home, path.to_str().unwrap(), &[]))
}

fn snapshot(home: &Path, repo: &str) -> PathBuf {
    home.join("hf/hub")
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(COMMIT)
}

#[test]
fn downloads_a_quantization_then_generates_and_hits_the_cache() {
    let home = tempfile::tempdir().unwrap();
    let (files, q4_1) = gguf_repo();
    let hub = HubServer::start(vec![("org/tiny", files)], Behaviour::default());
    let want = local_text(home.path(), &q4_1);

    let first = stdout(&generate(home.path(), "hf:org/tiny:q4_1", &[hub.env()]));
    assert_eq!(first, want);
    let cached = snapshot(home.path(), "org/tiny").join("tiny-Q4_1.gguf");
    assert_eq!(std::fs::read(&cached).unwrap(), q4_1);
    let log = hub.take_log();
    assert!(data_requests(&log).iter().all(|s| !s.path.contains("Q4_0")));
    assert!(!data_requests(&log).is_empty());
    assert!(log.iter().all(|s| s.auth.is_none()), "{log:?}");

    // A cache hit: the file list is asked for, no file.
    let second = stdout(&generate(home.path(), "hf:org/tiny:Q4_1", &[hub.env()]));
    assert_eq!(second, want);
    let log = hub.take_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].path.starts_with("/api/models/org/tiny"));

    // Offline, not even that; and a file name works as well as a quantization.
    let offline = [hub.env(), ("HF_HUB_OFFLINE", "1")];
    let third = stdout(&generate(
        home.path(),
        "hf:org/tiny:tiny-Q4_1.gguf",
        &offline,
    ));
    assert_eq!(third, want);
    assert!(hub.take_log().is_empty());
    let out = generate(home.path(), "hf:org/tiny:Q4_0", &offline);
    assert_clear_error(&out, &["Q4_0", "HF_HUB_OFFLINE"]);
}

#[test]
fn resumes_after_a_cut_connection_in_the_same_run() {
    let home = tempfile::tempdir().unwrap();
    let (files, q4_1) = gguf_repo();
    let cut_after = q4_1.len() / 3;
    let behaviour = Behaviour {
        cut_after,
        cuts: 1,
        ..Behaviour::default()
    };
    let hub = HubServer::start(vec![("org/tiny", files)], behaviour);
    let want = local_text(home.path(), &q4_1);

    assert_eq!(
        stdout(&generate(home.path(), "hf:org/tiny:Q4_1", &[hub.env()])),
        want
    );
    let ranges: Vec<Option<String>> = hub
        .take_log()
        .into_iter()
        .filter(|s| s.path.starts_with("/cdn/"))
        .map(|s| s.range)
        .collect();
    let resumed = format!("bytes={cut_after}-");
    assert!(ranges.contains(&Some(resumed)), "{ranges:?}");
}

#[test]
fn a_download_cut_every_time_fails_clearly_and_the_next_run_resumes_it() {
    let home = tempfile::tempdir().unwrap();
    let (files, q4_1) = gguf_repo();
    let cut_after = q4_1.len() / (2 * ATTEMPTS_PER_RUN);
    let behaviour = Behaviour {
        cut_after,
        cuts: ATTEMPTS_PER_RUN,
        ..Behaviour::default()
    };
    let hub = HubServer::start(vec![("org/tiny", files)], behaviour);

    let out = generate(home.path(), "hf:org/tiny:Q4_1", &[hub.env()]);
    assert_clear_error(&out, &["org/tiny/tiny-Q4_1.gguf", "run again to resume"]);
    let part = home
        .path()
        .join("hf/hub/models--org--tiny/blobs")
        .join(format!("{}.part", sha256_hex(&q4_1)));
    let kept = std::fs::metadata(&part).unwrap().len() as usize;
    assert_eq!(kept, ATTEMPTS_PER_RUN * cut_after);
    hub.take_log();

    let want = local_text(home.path(), &q4_1);
    assert_eq!(
        stdout(&generate(home.path(), "hf:org/tiny:Q4_1", &[hub.env()])),
        want
    );
    let log = hub.take_log();
    let first_data = log
        .iter()
        .find(|s| s.path.starts_with("/cdn/") && s.range.as_deref() != Some("bytes=0-0"))
        .unwrap();
    assert_eq!(first_data.range, Some(format!("bytes={kept}-")));
    assert!(!part.exists());
}

#[test]
fn missing_repos_and_files_are_named() {
    let home = tempfile::tempdir().unwrap();
    let (mut files, _) = gguf_repo();
    files.push(HubFile {
        missing: true,
        ..HubFile::lfs("tiny-Q8_0.gguf", vec![0; 64])
    });
    let hub = HubServer::start(vec![("org/tiny", files)], Behaviour::default());
    let out = generate(home.path(), "hf:org/nothing-here", &[hub.env()]);
    assert_clear_error(&out, &["org/nothing-here", "404"]);
    let out = generate(home.path(), "hf:org/tiny:Q8_0", &[hub.env()]);
    assert_clear_error(&out, &["org/tiny/tiny-Q8_0.gguf", "404"]);
}

#[test]
fn a_gated_repo_needs_hf_token() {
    let home = tempfile::tempdir().unwrap();
    let (files, q4_1) = gguf_repo();
    let behaviour = Behaviour {
        token: Some("s3cret".into()),
        ..Behaviour::default()
    };
    let hub = HubServer::start(vec![("org/tiny", files)], behaviour);
    let out = generate(home.path(), "hf:org/tiny:Q4_1", &[hub.env()]);
    assert_clear_error(&out, &["org/tiny", "401", "HF_TOKEN"]);
    let wrong = [hub.env(), ("HF_TOKEN", "guess")];
    let out = generate(home.path(), "hf:org/tiny:Q4_1", &wrong);
    assert_clear_error(&out, &["refused the token", "HF_TOKEN"]);
    hub.take_log();

    let want = local_text(home.path(), &q4_1);
    let right = [hub.env(), ("HF_TOKEN", "s3cret")];
    assert_eq!(
        stdout(&generate(home.path(), "hf:org/tiny:Q4_1", &right)),
        want
    );
    let log = hub.take_log();
    assert!(!log.is_empty());
    assert!(
        log.iter()
            .all(|s| s.auth.as_deref() == Some("Bearer s3cret")),
        "{log:?}"
    );
}

#[test]
fn quantization_choices_that_are_not_one_file_list_the_files() {
    let home = tempfile::tempdir().unwrap();
    let (files, _) = gguf_repo();
    let hub = HubServer::start(vec![("org/tiny", files)], Behaviour::default());
    for (model, needles) in [
        (
            "hf:org/tiny:Q8_0",
            &["'Q8_0'", "tiny-Q4_0.gguf", "tiny-Q4_1.gguf"][..],
        ),
        (
            "hf:org/tiny:q4",
            &["several", "tiny-Q4_0.gguf", "tiny-Q4_1.gguf"],
        ),
        (
            "hf:org/tiny",
            &["several", "hf:org/tiny:QUANT", "tiny-Q4_1.gguf"],
        ),
        ("hf:org/tiny:README.md", &["README.md", "not a GGUF"]),
        ("hf:org", &["hf:ORG/REPO"]),
    ] {
        let out = generate(home.path(), model, &[hub.env()]);
        assert_clear_error(&out, needles);
    }
    assert!(data_requests(&hub.take_log()).is_empty());
}

/// The tensor names in a safetensors file's header.
fn safetensors_names(bytes: &[u8]) -> Vec<String> {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

#[test]
fn a_safetensors_repo_is_downloaded_whole() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("local-hf");
    SyntheticModel::preset("tiny", WeightFormat::F32, 5)
        .unwrap()
        .write_hf_dir(&dir)
        .unwrap();
    let want = stdout(&generate(home.path(), dir.to_str().unwrap(), &[]));
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    let weight_map: serde_json::Map<String, serde_json::Value> = safetensors_names(&weights)
        .into_iter()
        .map(|n| (n, "model.safetensors".into()))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    let mut files = vec![
        HubFile::plain(
            "model.safetensors.index.json",
            index.to_string().into_bytes(),
        ),
        HubFile::lfs("model.safetensors", weights),
        HubFile::plain("README.md", b"# tiny\n".to_vec()),
    ];
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        files.push(HubFile::plain(name, std::fs::read(dir.join(name)).unwrap()));
    }
    let hub = HubServer::start(vec![("org/tiny-hf", files)], Behaviour::default());

    assert_eq!(
        stdout(&generate(home.path(), "hf:org/tiny-hf", &[hub.env()])),
        want
    );
    let snapshot = snapshot(home.path(), "org/tiny-hf");
    assert!(snapshot.join("model.safetensors.index.json").is_file());
    assert!(!snapshot.join("README.md").exists());
}
