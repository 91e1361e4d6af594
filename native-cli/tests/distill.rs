//! `tandem distill` as a user runs it on a tiny random target: training
//! text from a corpus and from the target's own answers to instructions, a
//! reduced draft vocabulary, and the written draft used by `--speculate`.

use std::path::Path;

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

mod common;
use common::{assert_clear_error, tandem};

#[test]
fn a_distilled_draft_with_a_reduced_vocabulary_speculates_and_never_runs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny.gguf");
    SyntheticModel::preset("tiny", WeightFormat::F32, 4)
        .unwrap()
        .write_gguf(&target)
        .unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "light bends in glass and parts into colours. ".repeat(40),
    )
    .unwrap();
    let instructions = dir.path().join("instructions.txt");
    std::fs::write(&instructions, "say something\n\nsay more\n").unwrap();
    let draft = dir.path().join("draft");
    let (t, c, i, d) = (
        path(&target),
        path(&corpus),
        path(&instructions),
        path(&draft),
    );
    let distill = [&short_run(t, d)[..], &["--layers", "1"]].concat();
    let out = tandem(
        &[
            &distill[..],
            &["--corpus", c, "--instructions", i, "--answer-tokens", "6"],
            &["--draft-vocab", "60"],
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("answering instructions: 2/2"), "{stderr}");
    assert!(stderr.contains("draft vocabulary of 60 of"), "{stderr}");

    let inspect = tandem(&["inspect", d]);
    let shown = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        shown.contains("a draft's output head: 60 of them"),
        "{shown}"
    );

    let run = ["run", "--backend", "cpu", "-n", "16", "light bends"];
    let plain = tandem(&[&run[..], &["-m", t]].concat());
    assert!(plain.status.success());
    let speculative =
        tandem(&[&run[..], &["-m", t, "--speculate", &format!("draft:{d}")]].concat());
    let stderr = String::from_utf8_lossy(&speculative.stderr);
    assert!(speculative.status.success(), "{stderr}");
    assert_eq!(speculative.stdout, plain.stdout);
    assert!(stderr.contains("60 of"), "{stderr}");

    let alone = tandem(&[&run[..], &["-m", d]].concat());
    assert_clear_error(&alone, &["60 of its", "--speculate draft:DIR"]);

    let nothing = tandem(&distill);
    let stderr = String::from_utf8_lossy(&nothing.stderr);
    assert!(
        !nothing.status.success() && stderr.contains("--corpus"),
        "{stderr}"
    );
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let out = tandem(&[&distill[..], &["--instructions", path(&empty)]].concat());
    assert_clear_error(&out, &["no instructions"]);
}

#[test]
fn an_eagle_head_within_a_parameter_budget_speculates_and_never_runs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny.gguf");
    SyntheticModel::preset("tiny", WeightFormat::F32, 5)
        .unwrap()
        .write_gguf(&target)
        .unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "glass bends the light into bands. ".repeat(40)).unwrap();
    let head = dir.path().join("eagle");
    let (t, c, h) = (path(&target), path(&corpus), path(&head));
    let distill = [&short_run(t, h)[..], &["--corpus", c, "--kind", "eagle"]].concat();
    // The tiny target's one layer costs a few thousand parameters; its
    // embedding alone already exceeds 1K.
    let out = tandem(&[&distill[..], &["--budget-params", "1K"]].concat());
    assert_clear_error(&out, &["--budget-params 1000", "one layer"]);
    let out = tandem(&[&distill[..], &["--budget-params", "50M"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("at the second draft"), "{stderr}");
    assert!(stderr.contains("student of layers [0, 1]"), "{stderr}");

    let inspect = tandem(&["inspect", h]);
    let shown = String::from_utf8_lossy(&inspect.stdout);
    assert!(shown.contains("an EAGLE head"), "{shown}");

    let run = ["run", "--backend", "cpu", "-n", "16", "light bends"];
    let plain = tandem(&[&run[..], &["-m", t]].concat());
    assert!(plain.status.success());
    for k in ["1", "3", "auto"] {
        let speculate = [
            "-m",
            t,
            "--speculate",
            &format!("draft:{h}"),
            "--draft-k",
            k,
        ];
        let speculative = tandem(&[&run[..], &speculate[..]].concat());
        let stderr = String::from_utf8_lossy(&speculative.stderr);
        assert!(speculative.status.success(), "{stderr}");
        assert_eq!(speculative.stdout, plain.stdout, "k {k}");
        assert!(stderr.contains("EAGLE head"), "{stderr}");
    }
    let cascade = tandem(
        &[
            &run[..],
            &["-m", t, "--cascade", &format!("ngram,draft:{h}")],
        ]
        .concat(),
    );
    assert_clear_error(&cascade, &["cascade inside an EAGLE head"]);
    let alone = tandem(&[&run[..], &["-m", h]].concat());
    assert_clear_error(&alone, &["EAGLE head", "--speculate draft:DIR"]);
}

/// `tandem distill` of `target` into `out` for three short steps on one thread.
fn short_run<'a>(target: &'a str, out: &'a str) -> Vec<&'a str> {
    let steps = [
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--eval-tokens",
        "32",
    ];
    let rest = ["--eval-every", "0", "-t", "1"];
    [&["distill", "-m", target, "--out", out][..], &steps, &rest].concat()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}
