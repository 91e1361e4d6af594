//! `--tp N` under `mpirun`: CPU ranks, oversubscribed on a small machine.
//! A model split over ranks gives the single-rank greedy tokens (and top
//! log-probabilities within 1e-2) on tiny random models of every wiring
//! and on the real checkpoints, with head and FFN counts that do not divide
//! evenly; a split that cannot be made is one clear error; each rank's
//! weights and KV shrink with the rank count; `serve --tp 2` passes the
//! official client's checks and frees its KV; a rank that dies ends the
//! job within seconds.
#![cfg(all(unix, feature = "mpi"))]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_core::quant::WeightFormat;

mod ranks;
mod served;
use ranks::{
    assert_refused, assert_same_as_one_rank, assert_same_on, largest, mpirun, mpirun_command,
    random_model, rank_memory, Layout,
};
use tandem_tests::http_client::{request, venv_python};
use tandem_tests::model_path;

/// The flags of `--tp n`.
fn tp(n: usize) -> Layout<'static> {
    let flags: &'static [&'static str] = match n {
        2 => &["--tp", "2"],
        3 => &["--tp", "3"],
        4 => &["--tp", "4"],
        _ => panic!("no layout for --tp {n}"),
    };
    (n, flags)
}

#[test]
fn random_models_of_every_wiring_give_the_single_rank_tokens() {
    let dir = tempfile::tempdir().unwrap();
    // tiny: 4 heads in 2 KV groups, FFN 160 = 5 blocks of 32 (2 ranks: 64 and 96
    // features; 4 ranks: each KV head replicated on two ranks).
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    assert_same_as_one_rank(&tiny, &[tp(2), tp(4)], "Once upon", 12);
    for preset in ["tiny-qwen2", "tiny-gemma3", "tiny-qwen3"] {
        let model = random_model(dir.path(), preset, WeightFormat::F16);
        assert_same_as_one_rank(&model, &[tp(2)], "Once upon", 8);
    }
}

#[test]
fn wgpu_ranks_give_the_single_rank_tokens() {
    // Their all-reduces go through the host: each rank reads its partial sums back.
    let dir = tempfile::tempdir().unwrap();
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    assert_same_on(&tiny, "wgpu", &[tp(2)], "Once upon", 8);
}

#[test]
fn real_checkpoints_give_the_single_rank_tokens() {
    // SmolLM2: 9 heads in 3 KV groups, so 2 ranks hold 3 and 6 heads.
    let prompt = "The capital of France is";
    assert_same_as_one_rank(&model_path("smollm2-135m"), &[tp(2), tp(3)], prompt, 16);
    // Qwen2.5-0.5B (Q4_K_M): O's 448-column slices cut its 256-element blocks.
    assert_same_as_one_rank(
        &model_path("qwen2.5-0.5b"),
        &[tp(2)],
        "def fibonacci(n):",
        12,
    );
}

#[test]
fn a_split_that_cannot_be_made_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    let out = mpirun(
        3,
        &["--tp", "3"],
        &[
            "run",
            "--model",
            tiny.to_str().unwrap(),
            "--backend",
            "cpu",
            "hi",
        ],
    );
    let message = "--tp 3: 4 query heads in 2 KV groups cannot be split over 3 ranks";
    assert_refused(&out, message, true);
    // The rank count and --tp disagree.
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "--model", tiny.to_str().unwrap(), "--tp", "3", "hi"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--tp 3 needs 3 ranks"), "{stderr}");
}

#[test]
fn each_rank_holds_less_weight_and_kv_as_ranks_are_added() {
    let model = model_path("smollm2-135m");
    let file = std::fs::metadata(&model).unwrap().len() as usize;
    // Full KV: 30 layers × 3 KV heads × 64 × (K + V) × 4 bytes.
    let full_kv = 30 * 3 * 64 * 2 * 4;
    let two = rank_memory(tp(2), &model);
    let three = rank_memory(tp(3), &model);
    let (w2, kv2) = largest(&two);
    let (w3, kv3) = largest(&three);
    println!("--tp 2: {two:?}\n--tp 3: {three:?}");
    // The tied embedding (28.7 MiB) is on every rank; the layers are split.
    assert!(
        w2 < file * 7 / 10 && w3 < w2,
        "weights per rank: {w2} and {w3} of {file}"
    );
    assert_eq!((kv2, kv3), (full_kv * 2 / 3, full_kv / 3));
}

/// The API key of the served jobs.
const KEY: &str = "tp-test-key";

/// A `tandem serve --tp 2` job and its stderr lines.
struct Job {
    mpirun: Child,
    addr: SocketAddr,
    _stderr: mpsc::Receiver<String>,
}

impl Job {
    fn start(model: &Path) -> Job {
        let command = mpirun_command(
            2,
            &["--tp", "2"],
            &[
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--backend",
                "cpu",
                "-t",
                "1",
                "--port",
                "0",
                "--model-id",
                "m",
                "--api-key",
                KEY,
            ],
        );
        let (mpirun, addr, stderr) = served::spawn(command);
        Job {
            mpirun,
            addr,
            _stderr: stderr,
        }
    }

    /// The process id of rank `rank` (a child of `mpirun`).
    fn rank_pid(&self, rank: usize) -> u32 {
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", self.mpirun.id()))
                .unwrap();
        children
            .split_whitespace()
            .map(|p| p.parse::<u32>().unwrap())
            .find(|p| {
                let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
                env.split(|&b| b == 0)
                    .any(|v| v == format!("OMPI_COMM_WORLD_RANK={rank}").as_bytes())
            })
            .unwrap_or_else(|| panic!("no rank {rank} among {children}"))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.mpirun.kill();
        let _ = self.mpirun.wait();
    }
}

fn kv_blocks_used(addr: SocketAddr) -> f64 {
    let (status, body) = request(addr, "GET", "/metrics", Some(KEY), b"");
    assert_eq!(status, 200);
    body.lines()
        .find(|l| l.starts_with("tandem_kv_blocks_used "))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or_else(|| panic!("no tandem_kv_blocks_used in {body}"))
}

/// Sends a streaming completion and hangs up once its first event arrives.
fn cancel_after_first_event(addr: SocketAddr, body: &str) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    while !String::from_utf8_lossy(&seen).contains("data:") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn serving_over_two_ranks_passes_the_official_client_and_frees_kv() {
    let job = Job::start(&model_path("smollm2-135m"));
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/serving/openai_client.py");
    let out = Command::new(venv_python())
        .arg(script)
        .args([&format!("http://{}/v1", job.addr), "m", KEY])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Streams dropped after their first event, beside streams read to the end.
    let body = |stream: bool| {
        format!(r#"{{"model":"m","prompt":"Tell me a story","max_tokens":24,"stream":{stream}}}"#)
    };
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let (addr, body) = (job.addr, body(i % 2 == 0));
            std::thread::spawn(move || match i % 4 {
                0 => cancel_after_first_event(addr, &body),
                _ => assert_eq!(
                    request(addr, "POST", "/v1/completions", Some(KEY), body.as_bytes()).0,
                    200
                ),
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while kv_blocks_used(job.addr) > 0.0 {
        assert!(
            Instant::now() < deadline,
            "KV blocks still in use after the load test"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_rank_that_dies_ends_the_job_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    let mut job = Job::start(&tiny);
    let follower = job.rank_pid(1);
    assert!(Command::new("kill")
        .args(["-9", &follower.to_string()])
        .status()
        .unwrap()
        .success());
    let killed = Instant::now();
    loop {
        if let Some(status) = job.mpirun.try_wait().unwrap() {
            assert!(!status.success());
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the job outlived its dead rank by 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn inspect_devices_lists_every_ranks_devices() {
    let out = mpirun(3, &[], &["inspect", "--devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..3 {
        let host = format!("rank {rank}: host ");
        assert!(stdout.contains(&host), "{stdout}");
        let default = format!("local rank {rank} (default --device {rank})");
        assert!(stdout.contains(&default), "{stdout}");
        assert!(stdout.contains(&format!("rank {rank}: cpu: ")), "{stdout}");
    }
}
