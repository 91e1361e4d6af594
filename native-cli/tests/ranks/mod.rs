//! Jobs of several CPU ranks under `mpirun` (as root, more ranks than
//! cores allowed), shared by the tensor, pipeline and expert parallel tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

/// `mpirun -np ranks tandem args... flags...`.
pub fn mpirun(ranks: usize, flags: &[&str], args: &[&str]) -> Output {
    mpirun_command(ranks, flags, args)
        .output()
        .expect("run mpirun")
}

pub fn mpirun_command(ranks: usize, flags: &[&str], args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(ranks.to_string())
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .args(flags)
        .env("TANDEM_OFFLINE", "1");
    c
}

/// How a job splits the model: its rank count and flags.
pub type Layout<'a> = (usize, &'a [&'a str]);

/// The generated ids and each token's top log-probabilities of a greedy run.
pub fn greedy(
    (ranks, flags): Layout<'_>,
    backend: &str,
    model: &Path,
    prompt: &str,
    tokens: usize,
) -> (String, Vec<Vec<f32>>) {
    let n = tokens.to_string();
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--backend",
        backend,
        "-t",
        "1",
        "-n",
        &n,
        "--token-ids",
        "--top-logprobs",
        "3",
        prompt,
    ];
    // A random model's end-of-text tokens (the three after the 256 bytes) are banned.
    if model.to_string_lossy().contains("tiny") {
        args.extend([
            "--logit-bias",
            "256=-100",
            "--logit-bias",
            "257=-100",
            "--logit-bias",
            "258=-100",
        ]);
    }
    let out = mpirun(ranks, flags, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{flags:?}: {stderr}");
    let ids = stderr
        .lines()
        .find(|l| l.starts_with("token ids:"))
        .unwrap_or_else(|| panic!("no token ids: {stderr}"))
        .to_string();
    // `logprobs 3: ID LP | ID LP ID LP ID LP`: every number after the `|`.
    let logprobs = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("logprobs").and_then(|l| l.split_once('|')))
        .map(|(_, top)| {
            top.split_whitespace()
                .skip(1)
                .step_by(2)
                .map(|v| v.parse().unwrap())
                .collect()
        })
        .collect();
    (ids, logprobs)
}

/// Greedy tokens of every layout equal one rank's on `backend`, top
/// log-probabilities within 1e-2.
pub fn assert_same_on(
    model: &Path,
    backend: &str,
    layouts: &[Layout<'_>],
    prompt: &str,
    tokens: usize,
) {
    let (ids, logprobs) = greedy((1, &[]), backend, model, prompt, tokens);
    assert_eq!(logprobs.len(), tokens, "{ids}");
    for &layout in layouts {
        let (split_ids, split_logprobs) = greedy(layout, backend, model, prompt, tokens);
        let name = format!("{} over {layout:?}", model.display());
        assert_eq!(split_ids, ids, "{name}");
        assert_eq!(split_logprobs.len(), tokens, "{name}: {split_ids}");
        for (a, b) in split_logprobs
            .iter()
            .flatten()
            .zip(logprobs.iter().flatten())
        {
            assert!((a - b).abs() < 1e-2, "{name}: logprob {a} vs {b}");
        }
    }
}

/// The same on CPU ranks.
pub fn assert_same_as_one_rank(model: &Path, layouts: &[Layout<'_>], prompt: &str, tokens: usize) {
    assert_same_on(model, "cpu", layouts, prompt, tokens)
}

pub fn random_model(dir: &Path, preset: &str, format: WeightFormat) -> PathBuf {
    let path = dir.join(format!("{preset}.gguf"));
    SyntheticModel::preset(preset, format, 5)
        .unwrap()
        .write_gguf(&path)
        .unwrap();
    path
}

/// Each rank's `weights` and `KV ... bytes per token` from its stderr line.
pub fn rank_memory((ranks, flags): Layout<'_>, model: &Path) -> Vec<(usize, usize)> {
    let args = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--backend",
        "cpu",
        "-t",
        "1",
        "-n",
        "2",
        "hi",
    ];
    let out = mpirun(ranks, flags, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let field = |line: &str, before: &str| -> usize {
        let rest = line.split(before).nth(1).unwrap();
        rest.split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches(',')
            .parse()
            .unwrap()
    };
    let lines: Vec<(usize, usize)> = stderr
        .split("rank ")
        .filter(|l| l.contains(&format!(" of {ranks}:")))
        .map(|l| (field(l, "; weights "), field(l, "bytes, KV ")))
        .collect();
    assert_eq!(lines.len(), ranks, "{stderr}");
    lines
}

/// The job failed without a panic, and every `error:` line it printed (at
/// least one; `one`: exactly one) names `message`.
pub fn assert_refused(out: &Output, message: &str, one: bool) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(
        !errors.is_empty() && (!one || errors.len() == 1),
        "{stderr}"
    );
    assert!(errors.iter().all(|e| e.contains(message)), "{stderr}");
}

/// The largest weight and KV bytes per token of any rank.
pub fn largest(ranks: &[(usize, usize)]) -> (usize, usize) {
    (
        ranks.iter().map(|r| r.0).max().unwrap(),
        ranks.iter().map(|r| r.1).max().unwrap(),
    )
}
