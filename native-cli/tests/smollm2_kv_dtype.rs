//! `tandem run --kv-dtype int8` on SmolLM2-135M Q4_1 generates the same
//! greedy text as an F16 KV cache for the first 16 tokens of three prompts,
//! and a bad `--kv-dtype` is a clear error; an `auto` plan is printed and
//! reproduced by its text.

use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("run tandem")
}

fn greedy_text(model: &str, kv_dtype: &str, prompt: &str) -> String {
    let out = run_with(model, kv_dtype, "16", &[], prompt);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 completion")
}

/// `tandem run` on the CPU with `--kv-dtype kv_dtype`, `n` tokens, `extra` options.
fn run_with(model: &str, kv_dtype: &str, n: &str, extra: &[&str], prompt: &str) -> Output {
    let mut args = vec![
        "run",
        "--backend",
        "cpu",
        "--model",
        model,
        "--kv-dtype",
        kv_dtype,
        "-n",
        n,
    ];
    args.extend_from_slice(extra);
    args.push(prompt);
    tandem(&args)
}

#[test]
fn int8_kv_generates_the_same_greedy_tokens_as_f16() {
    let model = tandem_tests::smollm2_path();
    let model = model.to_str().unwrap();
    for prompt in [
        "The capital of France is",
        "Light passing through a prism is split into",
        "def fibonacci(n):",
    ] {
        let f16 = greedy_text(model, "f16", prompt);
        let int8 = greedy_text(model, "int8", prompt);
        assert!(!f16.trim().is_empty(), "no completion for {prompt:?}");
        assert_eq!(int8, f16, "greedy continuation of {prompt:?}");
    }
}

#[test]
fn an_unknown_kv_dtype_is_a_clear_error() {
    let out = tandem(&["run", "--kv-dtype", "int3", "hello"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    for needle in ["--kv-dtype", "int3", "f16, int8, int4"] {
        assert!(
            error.contains(needle),
            "{error:?} does not mention {needle:?}"
        );
    }
}

const PRISM: &str = "Light passing through a prism is split into";

/// `--kv-dtype auto:BITS` calibrates, says the plan it chose, and keeps
/// within the budget; passing that plan back as `plan:...` gives the same
/// text without calibrating. A plan for another depth is refused.
#[test]
fn an_auto_plan_is_printed_and_reproduced_by_its_text() {
    let model = tandem_tests::smollm2_path();
    let model = model.to_str().unwrap();
    let auto = run_with(
        model,
        "auto:5",
        "12",
        &["--kv-calibration-tokens", "32"],
        PRISM,
    );
    let stderr = String::from_utf8_lossy(&auto.stderr);
    assert!(auto.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("KV plan (calibrated"))
        .unwrap_or_else(|| panic!("no plan in {stderr}"));
    let plan = line
        .split_whitespace()
        .find(|w| w.starts_with("plan:"))
        .expect("plan text");
    let bits: f64 = line
        .split(" bits per element")
        .next()
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no bits in {line}"));
    assert!(bits <= 5.0, "{line}");
    assert!(
        plan.contains("int2"),
        "5 bits needs some 2-bit layers: {line}"
    );
    let again = run_with(model, plan, "12", &[], PRISM);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(again.stdout, auto.stdout, "{plan}");

    let wrong = run_with(model, "plan:int8/int4*3", "12", &[], PRISM);
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success());
    assert!(
        stderr.contains("names 3 layers but the model has 30"),
        "{stderr}"
    );
}
