//! `tandem run --kv-dtype int8` on SmolLM2-135M Q4_1 generates the same
//! greedy text as an F16 KV cache for the first 16 tokens of three prompts,
//! and a bad `--kv-dtype` is a clear error.

use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("run tandem")
}

fn greedy_text(model: &str, kv_dtype: &str, prompt: &str) -> String {
    let out = tandem(&[
        "run",
        "--backend",
        "cpu",
        "--model",
        model,
        "--kv-dtype",
        kv_dtype,
        "-n",
        "16",
        prompt,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 completion")
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
