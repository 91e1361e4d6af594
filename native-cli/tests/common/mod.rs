//! Helpers shared by the CLI test binaries: running `tandem` and checking
//! that a failure is one clear error line.
#![allow(dead_code)] // each test binary uses its own part

use std::process::{Command, Output};

/// Runs the `tandem` binary with `args`, no model cache and no downloads.
pub fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("TANDEM_CACHE", "/nonexistent-tandem-cache")
        .env("TANDEM_OFFLINE", "1")
        .output()
        .expect("run tandem")
}

/// The command failed with exactly one `error:` line naming `needles`, and no panic.
pub fn assert_clear_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    for n in needles {
        assert!(
            errors[0].contains(n),
            "{:?} does not mention {n:?}",
            errors[0]
        );
    }
}
