//! Running `tandem` with its model caches in a test's own temporary home,
//! shared by the tests that fetch models (`hub.rs`, `named_models.rs`) so
//! that neither reads nor fills the user's caches.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `tandem` with its caches in `home` and `envs` added.
pub fn tandem_in(home: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.args(args)
        .env("TANDEM_CACHE", home.join("tandem"))
        .env("HF_HOME", home.join("hf"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("TANDEM_OFFLINE");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run tandem")
}

pub fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Greedy text of `model` for a fixed prompt.
pub fn generate(home: &Path, model: &str, envs: &[(&str, &str)]) -> Output {
    let args = [
        "run",
        "--model",
        model,
        "--backend",
        "cpu",
        "-n",
        "6",
        "hello",
    ];
    tandem_in(home, &args, envs)
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
