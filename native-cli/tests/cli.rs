//! The `tandem` binary as a user meets it: bad files and requests give one
//! clear error line (never a panic), and every subcommand runs on a tiny
//! random model written to a temporary directory.

use std::path::{Path, PathBuf};

use tandem_core::model::gguf::{GgufValue, GgufWriter};
use tandem_core::model::synthetic::{gguf_metadata, SyntheticModel};
use tandem_core::quant::WeightFormat;

mod common;
use common::{assert_clear_error, tandem};

fn tiny_model(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    SyntheticModel::preset("tiny", WeightFormat::Q4_1, 9)
        .unwrap()
        .write_gguf(&path)
        .unwrap();
    path
}

#[test]
fn missing_model_file() {
    let out = tandem(&["run", "--model", "/no/such/model.gguf", "hi"]);
    assert_clear_error(&out, &["/no/such/model.gguf", "no such file"]);
}

#[test]
fn missing_default_model_says_how_to_fetch_it() {
    let out = tandem(&["run", "hi"]);
    assert_clear_error(&out, &["make model"]);
}

#[test]
fn not_a_gguf_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, b"PK\x03\x04 this is a zip file, not a model").unwrap();
    let out = tandem(&["run", "--model", path.to_str().unwrap(), "hi"]);
    assert_clear_error(&out, &["model.gguf", "GGUF"]);
}

#[test]
fn truncated_gguf_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(tiny_model(dir.path())).unwrap();
    for cut in [10, 2000, good.len() - 100] {
        let path = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &good[..cut]).unwrap();
        let out = tandem(&["inspect", path.to_str().unwrap()]);
        assert_clear_error(&out, &[&format!("cut{cut}.gguf")]);
    }
}

#[test]
fn gguf_without_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let model = SyntheticModel::preset("tiny", WeightFormat::F32, 1).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in gguf_metadata(&model.config) {
        if !k.starts_with("tokenizer.") {
            w.add_metadata(&k, v).unwrap();
        }
    }
    w.add_metadata("general.note", GgufValue::String("no tokenizer".into()))
        .unwrap();
    for t in model.f32_tensors() {
        let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor(&t.name, WeightFormat::F32, &t.shape, bytes)
            .unwrap();
    }
    let path = dir.path().join("notok.gguf");
    w.write(&path).unwrap();
    let out = tandem(&["run", "--model", path.to_str().unwrap(), "hi"]);
    assert_clear_error(&out, &["tokenizer"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let prompt = "a b c d ".repeat(200);
    let out = tandem(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--ctx",
        "64",
        &prompt,
    ]);
    assert_clear_error(&out, &["context"]);
}

#[test]
fn bad_sampling_option() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = tandem(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--top-p",
        "3",
        "hi",
    ]);
    assert_clear_error(&out, &["top_p"]);
}

#[test]
fn run_streams_only_the_completion() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = tandem(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "-n",
        "6",
        "--seed",
        "3",
        "--temperature",
        "0.8",
        "hello there",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("hello there"));
    assert!(
        stderr.contains("prefill:") && stderr.contains("decode:"),
        "{stderr}"
    );
}

#[test]
fn run_prints_the_generated_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "-n", "5"];
        args.extend_from_slice(extra);
        args.push("hello there");
        let out = tandem(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let plain = run(&[]);
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("token ids:"));
    let out = run(&["--token-ids", "--chat-template"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix("token ids: "))
        .unwrap_or_else(|| panic!("no token ids in {stderr}"));
    let ids: Vec<u32> = line.split(' ').map(|id| id.parse().unwrap()).collect();
    assert!((1..=5).contains(&ids.len()), "{line}");
}

#[test]
fn logit_bias_and_penalties_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let ids = |extra: &[&str]| -> Vec<u32> {
        let mut args = vec![
            "run",
            "--model",
            model.to_str().unwrap(),
            "-n",
            "4",
            "--token-ids",
        ];
        args.extend_from_slice(extra);
        args.push("hello there");
        let out = tandem(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let line = stderr
            .lines()
            .find_map(|l| l.strip_prefix("token ids: "))
            .unwrap_or_else(|| panic!("no token ids in {stderr}"));
        line.split(' ').map(|id| id.parse().unwrap()).collect()
    };
    let plain = ids(&[]);
    let ban = format!("{}=-100", plain[0]);
    let banned = ids(&["--logit-bias", &ban, "--frequency-penalty", "-0.5"]);
    assert_ne!(banned[0], plain[0]);
    assert_eq!(ids(&["--logit-bias", "7=100"]), vec![7; 4]);
    let model = model.to_str().unwrap();
    let out = tandem(&["run", "--model", model, "--logit-bias", "seven=1", "hi"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains("'seven' in 'seven=1' is not a token id"),
        "{stderr}"
    );
    for (bad, named) in [
        (["--logit-bias", "7=101"], "logit_bias"),
        (["--presence-penalty", "3"], "presence_penalty"),
    ] {
        let mut args = vec!["run", "--model", model];
        args.extend_from_slice(&bad);
        args.push("hi");
        assert_clear_error(&tandem(&args), &[named]);
    }
}

#[test]
fn inspect_perplexity_and_bench_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let out = tandem(&["inspect", m]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("architecture:   llama") && text.contains("Q4_1"),
        "{text}"
    );

    let corpus = dir.path().join("text.txt");
    std::fs::write(
        &corpus,
        "the quick brown fox jumps over the lazy dog. ".repeat(30),
    )
    .unwrap();
    let out = tandem(&[
        "perplexity",
        "--model",
        m,
        "--file",
        corpus.to_str().unwrap(),
        "--ctx",
        "64",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("PPL = ") && text.contains(" +/- "),
        "{text}"
    );

    let bench = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["bench", "--model", m, "-n", "4", "-r", "1", "--json"];
        args.extend_from_slice(extra);
        let out = tandem(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // Alone, then after a context of 37 tokens (two full blocks reused, 5 fed again).
    for extra in [&["-p", "16"][..], &["-d", "37", "-p", "8"]] {
        let json = bench(extra);
        assert!(json["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(json["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let json = bench(&["--batch", "1,3", "-p", "8"]);
    let batches = json["batches"].as_array().unwrap();
    let sizes: Vec<_> = batches.iter().map(|b| b["sequences"].as_u64()).collect();
    assert_eq!(sizes, [Some(1), Some(3)]);
    for b in batches {
        assert!(b["prompt_tokens_per_s"].as_f64().unwrap() > 0.0, "{b}");
        assert!(b["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{b}");
    }
    for (bad, named) in [
        (&["--batch", "2,0"][..], "invalid value '0' for '--batch"),
        (
            &["--batch", "2", "-d", "16"],
            "'--batch <N,...>' cannot be used with '--depth",
        ),
    ] {
        let mut args = vec!["bench", "--model", m];
        args.extend_from_slice(bad);
        let out = tandem(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
        assert!(stderr.contains(named), "{stderr}");
    }
}

/// `--kv-block-size` sets the paging unit: INT4 keys keep one scale and
/// minimum per channel per block, so larger blocks cost fewer bytes per
/// token; a size that is not a power of two from 4 to 256 is refused.
#[test]
fn the_kv_block_size_sets_the_paging_unit() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let bytes_per_token = |block: &str| -> usize {
        let out = tandem(&["inspect", m, "--kv-dtype", "int4", "--kv-block-size", block]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = text
            .lines()
            .find(|l| l.starts_with("KV per token:"))
            .unwrap();
        assert!(
            line.contains(&format!("blocks of {block} tokens")),
            "{line}"
        );
        line.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    assert!(bytes_per_token("32") < bytes_per_token("16"));
    let corpus = dir.path().join("text.txt");
    std::fs::write(&corpus, "a b c d e f g h i j k l m n o p ".repeat(8)).unwrap();
    let corpus = corpus.to_str().unwrap();
    let runs: [&[&str]; 3] = [
        &["run", "-n", "4", "hello"],
        &["perplexity", "--file", corpus, "--ctx", "24"],
        &["bench", "-p", "20", "-n", "4", "-r", "1"],
    ];
    for run in runs {
        let mut args = run.to_vec();
        args.extend(["--model", m, "--kv-dtype", "int4", "--kv-block-size", "8"]);
        let out = tandem(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {stderr}", run[0]);
    }
    for bad in ["12", "2", "512", "x"] {
        let out = tandem(&["run", "--model", m, "--kv-block-size", bad, "hi"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
        assert!(stderr.contains("--kv-block-size"), "{stderr}");
    }
}

#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    if tandem_cuda::driver_present() {
        eprintln!("a CUDA driver is present: the no-driver error cannot be checked here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = tandem(&[
        "run",
        "--backend",
        "cuda",
        "--model",
        model.to_str().unwrap(),
        "hi",
    ]);
    assert_clear_error(&out, &["no CUDA driver found"]);
    // `auto` falls back to the CPU quietly.
    let out = tandem(&[
        "run",
        "--backend",
        "auto",
        "-n",
        "2",
        "--model",
        model.to_str().unwrap(),
        "hi",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn speculative_run_prints_the_same_text_and_its_stats() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let base = [
        "run",
        "--model",
        m,
        "--backend",
        "cpu",
        "-n",
        "24",
        "a b a b a b",
    ];
    let plain = tandem(&base);
    assert!(plain.status.success());
    for method in [
        &["--speculate", "ngram"][..],
        &["--speculate", "self:1", "--draft-k", "3"],
        &["--speculate", "self:auto"],
        &["--cascade", &format!("ngram,draft:{m}")],
        &["--speculate", "sparse:1", "--draft-k", "2"],
    ] {
        let out = tandem(&[&base[..], method].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{method:?}: {stderr}");
        assert_eq!(out.stdout, plain.stdout, "{method:?}");
        assert!(stderr.contains("speculation: acceptance"), "{stderr}");
        // Only sparse drafting keeps key bounds, and says what they cost.
        assert_eq!(
            stderr.contains("key bounds of every KV block"),
            method[1].starts_with("sparse"),
            "{stderr}"
        );
    }
}

#[test]
fn bad_speculation_options() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| {
        let args = [
            &["run", "--model", m, "--backend", "cpu", "-n", "4"][..],
            extra,
            &["hi"],
        ]
        .concat();
        tandem(&args)
    };
    assert_clear_error(
        &run(&["--speculate", "magic"]),
        &["unknown speculation method", "magic"],
    );
    assert_clear_error(
        &run(&["--speculate", "ngram", "--draft-k", "0"]),
        &["--draft-k"],
    );
    assert_clear_error(&run(&["--speculate", "self:0-7"]), &["layer list", "0-1"]);
    assert_clear_error(&run(&["--speculate", "self:0,1"]), &["every layer"]);
    assert_clear_error(&run(&["--cascade", "draft:x,ngram"]), &["--cascade"]);
    assert_clear_error(
        &run(&["--speculate", "draft:/nonexistent/draft.gguf"]),
        &["/nonexistent/draft.gguf"],
    );
    let other = dir.path().join("other.gguf");
    let mut shape = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 9).unwrap();
    shape.config.vocab_size = 300;
    shape.write_gguf(&other).unwrap();
    assert_clear_error(
        &run(&["--speculate", &format!("draft:{}", other.display())]),
        &["vocabulary"],
    );
}

/// Probing for a GPU under `--backend auto` prints no false alarm: on a
/// machine without a display session (no `XDG_RUNTIME_DIR`), Mesa's Vulkan
/// device-select layer made libwayland print `error: XDG_RUNTIME_DIR is
/// invalid or not set` before a run that worked.
#[test]
fn probing_for_a_gpu_prints_no_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "--backend", "auto", "--model"])
        .arg(&model)
        .args(["-n", "2", "hello"])
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("NODEVICE_SELECT")
        .env("TANDEM_OFFLINE", "1")
        .output()
        .expect("run tandem");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert!(errors.is_empty(), "{errors:?}");
}

/// `--cpu-isa` runs the kernels it names (the backend line says which) or
/// refuses clearly: on a CPU without them, or with another backend.
#[test]
fn the_cpu_isa_option_picks_the_kernels_or_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "-n", "3"];
        args.extend_from_slice(extra);
        args.push("hello");
        tandem(&args)
    };
    // Which sets this CPU runs, as the backend itself detects them.
    let runs = |isa| tandem_cpu::CpuBackend::with_isa(1, isa).is_ok();
    for (choice, kernels, supported) in [
        ("portable", "portable", true),
        ("avx2", "AVX2)", runs(tandem_cpu::CpuIsa::Avx2)),
        (
            "avx512",
            "AVX2+AVX512-VNNI+VBMI",
            runs(tandem_cpu::CpuIsa::Avx512),
        ),
    ] {
        let out = run(&["--backend", "cpu", "--cpu-isa", choice]);
        if supported {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{choice}: {stderr}");
            assert!(
                stderr.contains("backend: cpu (") && stderr.contains(kernels),
                "--cpu-isa {choice} ran other kernels: {stderr}"
            );
        } else {
            assert_clear_error(&out, &["this CPU cannot run the", "kernels"]);
        }
    }
    let out = run(&["--backend", "wgpu", "--cpu-isa", "portable"]);
    assert_clear_error(&out, &["--cpu-isa", "--backend cpu"]);
    let out = run(&["--backend", "cpu", "--cpu-isa", "sse9"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("invalid value 'sse9'"),
        "{stderr}"
    );
}
