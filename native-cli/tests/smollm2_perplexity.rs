//! `tandem perplexity` on SmolLM2-135M Q4_1 over the first windows of the
//! shared evaluation text agrees with the independent NumPy reference
//! (tests/reference/perplexity_reference.py) within 1%: the CLI end to end
//! (tokenizer, windows, scoring, `--chunks`). Over the whole text (30
//! windows) it is the same computation, minutes in a test build: the
//! README's perplexity table gives that command.

use std::path::Path;
use std::process::Command;

#[test]
fn perplexity_of_six_windows_agrees_with_the_reference_within_one_percent() {
    let model = tandem_tests::smollm2_path();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/eval/opticks-part1.txt");
    assert!(
        text.exists(),
        "{} is missing (the shared/ folder sits beside the repository)",
        text.display()
    );
    let fixture: serde_json::Value = serde_json::from_str(include_str!(
        "../../tests/fixtures/smollm2_perplexity_reference.json"
    ))
    .unwrap();
    // The reference's running perplexity after this many windows.
    const WINDOWS: usize = 6;
    let want = fixture["running_ppl"][WINDOWS - 1].as_f64().unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "perplexity",
            "--model",
            model.to_str().unwrap(),
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "512",
            "--chunks",
            &WINDOWS.to_string(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: f64 = stdout
        .trim()
        .strip_prefix("PPL = ")
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {stdout:?}"));
    let rel = (got - want).abs() / want;
    eprintln!(
        "perplexity {got} vs reference {want} ({:+.3}%)",
        100.0 * (got - want) / want
    );
    assert!(
        rel < 0.01,
        "perplexity {got} differs from the reference {want} by {:.2}%",
        rel * 100.0
    );
}
