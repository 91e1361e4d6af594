//! `tandem quantize` as a user meets it: every method writes a model that
//! `perplexity` and `inspect` load with `--model OUT`, bad options or
//! calibration files give one clear error line, and a run that fails or is
//! killed while writing leaves no half-written model at `OUT`.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

mod common;
use common::{assert_clear_error, tandem};

struct Fixture {
    dir: PathBuf,
    model: String,
    calib: String,
}

impl Fixture {
    fn new(tag: &str) -> Fixture {
        let dir =
            std::env::temp_dir().join(format!("tandem-quantize-cli-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("tiny.gguf");
        SyntheticModel::preset("tiny", WeightFormat::Q4_1, 9)
            .unwrap()
            .write_gguf(&model)
            .unwrap();
        let calib = dir.join("calib.txt");
        std::fs::write(
            &calib,
            "Light is refracted by the prism into colours. ".repeat(30),
        )
        .unwrap();
        Fixture {
            model: model.display().to_string(),
            calib: calib.display().to_string(),
            dir,
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_method_writes_a_model_the_other_commands_load() {
    let f = Fixture::new("methods");
    let runs: [(&str, &[&str], &str); 7] = [
        ("f16", &[], "F16"),
        ("rtn", &["--group-size", "32"], "Q4_1"),
        ("int8", &[], "INT8"),
        ("w8a8-smoothquant", &["--calib"], "W8A8"),
        (
            "gptq",
            &["--group-size", "32", "--act-order", "--calib"],
            "Q4_1",
        ),
        ("awq", &["--group-size", "32", "--calib"], "Q4_1"),
        (
            "mixed",
            &["--group-size", "32", "--budget-bits", "7", "--calib"],
            "layer 0:",
        ),
    ];
    for (method, extra, expect) in runs {
        let out_dir = f.path(method);
        let mut args = vec![
            "quantize", "--model", &f.model, "--out", &out_dir, "--method", method,
        ];
        args.extend_from_slice(extra);
        if extra.last() == Some(&"--calib") {
            args.push(&f.calib);
        }
        let report = stdout(&tandem(&args));
        assert!(report.contains("wrote"), "{report}");
        let inspect = stdout(&tandem(&["inspect", &out_dir]));
        assert!(inspect.contains("layer formats:"), "{inspect}");
        assert!(inspect.contains(expect), "{method}: {inspect}");
        let ppl = stdout(&tandem(&[
            "perplexity",
            "--backend",
            "cpu",
            "--model",
            &out_dir,
            "--file",
            &f.calib,
            "--ctx",
            "32",
        ]));
        assert!(ppl.contains("PPL = "), "{method}: {ppl}");
    }
}

#[test]
fn bad_options_and_calibration_files_give_clear_errors() {
    let f = Fixture::new("errors");
    let out = f.path("out");
    let empty = f.path("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let base = [
        "quantize",
        "--model",
        f.model.as_str(),
        "--out",
        out.as_str(),
    ];
    let cases: [(&[&str], &[&str]); 8] = [
        (
            &["--method", "rtn", "--bits", "5"],
            &["5-bit weights are not supported"],
        ),
        (
            &["--method", "rtn", "--group-size", "64"],
            &["group size 64 does not divide the 160 columns of blk.0.ffn_down.weight"],
        ),
        (
            &["--method", "rtn", "--group-size", "100"],
            &["group size 100 is not supported"],
        ),
        (
            &["--method", "gptq"],
            &["--method gptq needs calibration text"],
        ),
        (
            &[
                "--method",
                "gptq",
                "--group-size",
                "32",
                "--calib",
                "/no/such/calib.txt",
            ],
            &["calibration file /no/such/calib.txt"],
        ),
        (
            &["--method", "awq", "--group-size", "32", "--calib", &empty],
            &["calibration file", "is empty"],
        ),
        (
            &["--method", "mixed", "--calib", &f.calib],
            &["needs --budget-bits"],
        ),
        (&["--method", "fp4"], &["unknown method 'fp4'"]),
    ];
    for (extra, needles) in cases {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        assert_clear_error(&tandem(&args), needles);
        assert!(!Path::new(&out).exists(), "{extra:?} wrote a model");
    }
}

/// Every file of the directory `dir`, by name.
fn files(dir: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// The hidden directories runs left in `dir` (beside their `--out`).
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect()
}

/// `tandem quantize --method f16` of `model` into `out`, allowed to write
/// files of at most 4 KiB: the weights do not fit. With `interrupt` the
/// process is killed there (SIGXFSZ), otherwise the write fails (EFBIG).
fn quantize_without_room(model: &str, out: &str, interrupt: bool) -> Output {
    let ignore = if interrupt { "" } else { "trap '' XFSZ; " };
    Command::new("sh")
        .arg("-c")
        .arg(format!("{ignore}ulimit -f 8; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "quantize", "--model", model, "--out", out, "--method", "f16",
        ])
        .env("TANDEM_OFFLINE", "1")
        .output()
        .expect("run tandem under sh")
}

#[test]
fn a_run_that_fails_or_dies_while_writing_leaves_no_half_written_model() {
    let f = Fixture::new("staged");
    let out = f.path("out");
    // A write that fails: nothing at --out, nothing left beside it.
    assert_clear_error(
        &quantize_without_room(&f.model, &out, false),
        &["File too large"],
    );
    assert!(!Path::new(&out).exists(), "a half-written model at --out");
    assert_eq!(leftovers(&f.dir), Vec::<String>::new());
    // A run killed mid-write: nothing at --out either.
    let killed = quantize_without_room(&f.model, &out, true);
    assert_eq!(killed.status.signal(), Some(25), "{killed:?}");
    assert!(!Path::new(&out).exists(), "a half-written model at --out");
    for partial in leftovers(&f.dir) {
        std::fs::remove_dir_all(f.dir.join(partial)).unwrap();
    }

    // A model already at --out stays as it was through both.
    let quantize = |method: &str| {
        tandem(&[
            "quantize", "--model", &f.model, "--out", &out, "--method", method,
        ])
    };
    stdout(&quantize("f16"));
    let before = files(&out);
    assert!(before.contains_key("config.json"), "{:?}", before.keys());
    assert_clear_error(
        &quantize_without_room(&f.model, &out, false),
        &["File too large"],
    );
    assert!(quantize_without_room(&f.model, &out, true)
        .status
        .signal()
        .is_some());
    assert!(files(&out) == before, "the model at --out changed");

    // A run that completes replaces it, and leaves nothing beside it.
    stdout(&quantize("int8"));
    assert!(files(&out) != before);
    assert!(stdout(&tandem(&["inspect", &out])).contains("INT8"));
    assert_eq!(
        leftovers(&f.dir).len(),
        1,
        "the killed run's directory only"
    );

    // A directory that holds no model is never replaced.
    let notes = f.dir.join("notes");
    std::fs::create_dir(&notes).unwrap();
    std::fs::write(notes.join("todo.txt"), "keep me").unwrap();
    let notes = notes.display().to_string();
    let refused = tandem(&[
        "quantize", "--model", &f.model, "--out", &notes, "--method", "f16",
    ]);
    assert_clear_error(&refused, &["holds no model"]);
    assert_eq!(files(&notes).len(), 1);
}
