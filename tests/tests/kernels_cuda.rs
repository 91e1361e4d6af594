//! The cross-backend kernel suite (`tandem_tests::conformance`) on the CUDA backend, against the CPU
//! reference. On a machine without a CUDA driver or device it says so
//! ("CUDA: no device, conformance not run") and passes, unless
//! `TANDEM_REQUIRE_CUDA=1` (the GPU check script sets it), where that fails.
//!
//! The suite runs under four configurations so that every kernel path is
//! reached: the default (split-K decode attention for few rows, cuBLAS for
//! dense prefill, RMSNorm as its own launch), the prefill attention kernel
//! with the hand-written tiled GEMM, decode attention cut into 32-key splits
//! (the reduction kernel), and the matmul kernels' norm prologues with the
//! one-kernel MLP.
//! A few shapes the generic suite does not reach (float weights with
//! 16-byte-aligned rows, which take the vector GEMV) are checked here too.

use tandem_tests::conformance;

use std::io::Write;

use tandem_core::backend::{Backend, MatmulParams};
use tandem_core::kernels::{matmul_kernel_name, spec};
use tandem_core::quant::{quantize_row, WeightFormat, WeightView};
use tandem_cpu::CpuBackend;
use tandem_cuda::{AttentionPath, CudaBackend, CudaConfig, DensePrefill, NormPath};

fn cuda_required() -> bool {
    std::env::var("TANDEM_REQUIRE_CUDA").as_deref() == Ok("1")
}

/// The backend, or `None` after saying why there is none (a failure when
/// CUDA is required).
fn cuda_backend(config: CudaConfig) -> Option<CudaBackend> {
    match CudaBackend::with_config(0, config) {
        Ok(backend) => Some(backend),
        Err(e) if cuda_required() => panic!("TANDEM_REQUIRE_CUDA=1 but CUDA is unusable: {e}"),
        Err(e) => {
            // Straight to stderr: libtest captures `println!` of passing tests.
            let _ = writeln!(
                std::io::stderr(),
                "CUDA: no device, conformance not run ({e})"
            );
            None
        }
    }
}

const CONFIGURATIONS: [(&str, CudaConfig); 4] = [
    (
        "default",
        CudaConfig {
            attention: AttentionPath::Auto,
            dense_prefill: DensePrefill::CublasWhenPresent,
            norm: NormPath::Separate,
        },
    ),
    (
        "prefill attention, hand-written GEMM",
        CudaConfig {
            attention: AttentionPath::Prefill,
            dense_prefill: DensePrefill::Kernels,
            norm: NormPath::Separate,
        },
    ),
    (
        "split-K decode attention",
        CudaConfig {
            attention: AttentionPath::DecodeSplit { keys_per_split: 32 },
            dense_prefill: DensePrefill::CublasWhenPresent,
            norm: NormPath::Separate,
        },
    ),
    (
        "norm prologues, one-kernel MLP, hand-written GEMM",
        CudaConfig {
            attention: AttentionPath::Auto,
            dense_prefill: DensePrefill::Kernels,
            norm: NormPath::Prologue,
        },
    ),
];

#[test]
fn cuda_kernels_match_the_cpu_reference() {
    for (label, config) in CONFIGURATIONS {
        let Some(backend) = cuda_backend(config) else {
            return;
        };
        let report = conformance::run_conformance(&backend);
        println!("[{label}] {report}");
        let problems = report.problems();
        assert!(
            problems.is_empty(),
            "[{label}] CUDA conformance failures:\n{}",
            problems.join("\n")
        );
    }
}

/// SplitMix64, for inputs that are the same on every run.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn matmul_on<B: Backend>(
    backend: &B,
    format: WeightFormat,
    w: &[u8],
    n: usize,
    cols: usize,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let weight = backend
        .upload_weight(WeightView {
            format,
            rows: n,
            cols,
            data: w,
        })
        .expect("upload weight");
    let x = backend.upload(x).expect("upload x");
    let mut out = backend.alloc(rows * n).expect("alloc out");
    backend
        .matmul(&x, &weight, None, MatmulParams { rows }, &mut out)
        .expect("matmul");
    backend.download(&out, rows * n).expect("download")
}

#[test]
fn aligned_float_rows_take_the_vector_gemv_and_match() {
    let Some(cuda) = cuda_backend(CudaConfig::default()) else {
        return;
    };
    let cpu = CpuBackend::new(2);
    let (n, cols) = (37, 256);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16] {
        let tolerance = spec(matmul_kernel_name(format))
            .expect("manifest entry")
            .tolerance;
        let w: Vec<u8> = values(1, n * cols)
            .chunks(cols)
            .flat_map(|row| quantize_row(format, row))
            .collect();
        for rows in [1, 2, 5, 8, 24] {
            let x = values(rows as u64 + 7, rows * cols);
            let got = matmul_on(&cuda, format, &w, n, cols, &x, rows);
            let want = matmul_on(&cpu, format, &w, n, cols, &x, rows);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, r)| (g - r).abs() / (1.0 + r.abs()))
                .fold(0.0f32, f32::max);
            assert!(
                worst <= tolerance,
                "{format} {rows}x{cols} by {n}x{cols}: error {worst} > {tolerance}"
            );
        }
    }
}

/// The GGUF formats at a real model's width (Qwen2.5-0.5B's FFN, 4864 =
/// 19 super-blocks) through every GEMV template (1, 2, 4, 8 tokens) and two
/// token tiles of the tiled kernel, which the generic suite's shapes do not
/// all reach.
#[test]
fn gguf_formats_match_through_every_gemv_width_and_token_tile() {
    let Some(cuda) = cuda_backend(CudaConfig::default()) else {
        return;
    };
    let cpu = CpuBackend::new(2);
    let (n, cols) = (19, 4864);
    for format in [
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::IQ4_NL,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ] {
        let tolerance = spec(matmul_kernel_name(format))
            .expect("manifest entry")
            .tolerance;
        let w: Vec<u8> = values(3, n * cols)
            .chunks(cols)
            .flat_map(|row| quantize_row(format, row))
            .collect();
        for rows in [1, 2, 4, 7, 8, 65] {
            // Multiples of 1/128 reaching 127/128 in every block of 32: exact
            // in the Q8 activations the CPU matmul may use.
            let x: Vec<f32> = values(rows as u64 + 11, rows * cols)
                .iter()
                .enumerate()
                .map(|(i, v)| match i % 32 {
                    0 => 127.0 / 128.0,
                    _ => (v * 127.0).round() / 128.0,
                })
                .collect();
            let got = matmul_on(&cuda, format, &w, n, cols, &x, rows);
            let want = matmul_on(&cpu, format, &w, n, cols, &x, rows);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, r)| (g - r).abs() / (1.0 + r.abs()))
                .fold(0.0f32, f32::max);
            assert!(
                worst <= tolerance,
                "{format} {rows}x{cols} by {n}x{cols}: error {worst} > {tolerance}"
            );
        }
    }
}

/// `scripts/gpu-check.sh` only runs on a lent GPU machine; its logic is
/// checked here with stand-in binaries: each step runs, a failing step is
/// recorded without stopping the others, and the bench JSON becomes decode
/// figures.
mod gpu_check_script {
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh")
    }

    fn run(args: &[&str], bin_dir: &Path, out_dir: &Path) -> (Output, String) {
        run_with_budget(args, bin_dir, out_dir, "450")
    }

    fn run_with_budget(
        args: &[&str],
        bin_dir: &Path,
        out_dir: &Path,
        budget_s: &str,
    ) -> (Output, String) {
        let output = Command::new("bash")
            .arg(script())
            .args(args)
            .env("GPU_CHECK_BUDGET_S", budget_s)
            .env("TANDEM_GPU_BIN", bin_dir)
            .env("OUT", out_dir)
            .env_remove("TANDEM_CACHE")
            .output()
            .expect("run bash");
        let summary = std::fs::read_to_string(out_dir.join("summary.txt")).unwrap_or_default();
        (output, summary)
    }

    fn stand_in(dir: &Path, name: &str, body: &str) {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write stand-in");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    /// Stand-ins for the staged binaries: tests that pass (or fail), and a
    /// `tandem` whose bench prints the JSON the real one prints.
    fn stand_ins(kernels_exit: i32) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        stand_in(
            dir.path(),
            "kernels_cuda",
            &format!("echo running conformance; exit {kernels_exit}"),
        );
        // Every test binary has a stand-in, so a real one built under
        // target/release is never run.
        stand_in(dir.path(), "end_to_end", "echo end to end ok");
        stand_in(dir.path(), "end_to_end_cuda", "echo cuda end to end ok");
        stand_in(
            dir.path(),
            "tandem",
            r#"echo "args: $*"
case "$*" in
  *llama3-8b*f16*) echo '{"decode_tokens_per_s":290.5,"weight_bytes":16060522496}' ;;
  *llama3-8b*q4_1*) echo '{"decode_tokens_per_s":700.0,"weight_bytes":5019000000}' ;;
  *bench*) echo '{"decode_tokens_per_s":2500.0,"weight_bytes":98000000}' ;;
  *) echo "cuda:0 NVIDIA H200" ;;
esac"#,
        );
        dir
    }

    #[test]
    fn the_script_parses() {
        let status = Command::new("bash")
            .arg("-n")
            .arg(script())
            .status()
            .expect("bash -n");
        assert!(status.success());
    }

    #[test]
    fn its_arithmetic_passes_its_self_test() {
        let out = tempfile::tempdir().expect("temp dir");
        let (output, _) = run(&["--self-test"], out.path(), out.path());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[test]
    fn a_dry_run_lists_every_step_and_runs_none() {
        let bins = stand_ins(0);
        let out = tempfile::tempdir().expect("temp dir");
        let (output, summary) = run(&["--dry-run"], bins.path(), out.path());
        assert!(output.status.success(), "{summary}");
        for step in [
            "would run test-kernels_cuda (limit 120s): ",
            "--skip gpu_check_script",
            "would run test-end_to_end",
            "would run bench-smollm2-135m",
            "--random-weights llama3-8b --weight-format f16",
            "--random-weights llama3-8b --weight-format q4_1",
        ] {
            assert!(summary.contains(step), "dry run lacks {step:?}:\n{summary}");
        }
        assert!(
            !out.path().join("test-kernels_cuda.log").exists(),
            "a dry run ran a step"
        );
    }

    #[test]
    fn a_run_reports_figures_and_fails_on_a_missed_target_or_a_failed_step() {
        let bins = stand_ins(0);
        let out = tempfile::tempdir().expect("temp dir");
        let (output, summary) = run(&[], bins.path(), out.path());
        // Every step passes; the stand-in Q4_1 figure misses its target,
        // which alone fails the run.
        assert!(
            !output.status.success(),
            "a missed target passed:\n{summary}"
        );
        assert!(!summary.contains("FAILED test-"), "{summary}");
        assert!(
            summary.contains("FAILED: target Llama-3-8B Q4_1: 68.4% of 4.8 TB/s (target >= 70%)"),
            "{summary}"
        );
        assert!(
            summary.contains("SmolLM2-135M: decode 2500.0 tokens/s"),
            "{summary}"
        );
        // (16060522496 - 128256 * 4096 * 2) bytes * 290.5 / 4.8e12 = 90.8%
        assert!(
            summary.contains("Llama-3-8B F16: decode 290.5 tokens/s at batch 1, 15.010 GB"),
            "{summary}"
        );
        assert!(summary.contains("90.8% of 4.8 TB/s"), "{summary}");

        let bins = stand_ins(1);
        let out = tempfile::tempdir().expect("temp dir");
        let (output, summary) = run(&[], bins.path(), out.path());
        assert!(
            !output.status.success(),
            "a failed test step passed:\n{summary}"
        );
        assert!(
            summary.contains("FAILED test-kernels_cuda (exit 1"),
            "{summary}"
        );
        assert!(
            summary.contains("Llama-3-8B Q4_1: decode 700.0 tokens/s"),
            "{summary}"
        );
    }

    #[test]
    fn steps_past_the_time_budget_are_skipped_and_fail_the_run() {
        let bins = stand_ins(0);
        let out = tempfile::tempdir().expect("temp dir");
        let (output, summary) = run_with_budget(&[], bins.path(), out.path(), "0");
        assert!(!output.status.success(), "{summary}");
        assert!(
            summary.contains("SKIPPED test-kernels_cuda: the time budget is spent"),
            "{summary}"
        );
        assert!(
            summary.contains("bench-llama3-8b-q4_1 (not run: time budget spent)"),
            "{summary}"
        );
    }
}
