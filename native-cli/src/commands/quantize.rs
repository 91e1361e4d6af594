//! `tandem quantize`: writes a model whose linear layers are quantized by
//! one of the `tandem-quantize` methods, loadable by every other command
//! with `--model OUT`. Calibration text (`--calib`) feeds the methods that
//! look at activations (SmoothQuant, GPTQ, AWQ, mixed precision).
//!
//! The model is written into a hidden directory beside `--out` and renamed
//! into place only when complete, so a failed or interrupted run never
//! leaves a half-written model where a model is expected: a failed run
//! removes its directory; an interrupted one leaves it beside `--out`
//! (`.NAME.partial-PID`), never at it.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_core::model::safetensors::write_model_dir;
use tandem_quantize::calib;
use tandem_quantize::plan::{self, CalibrationText, Method, Options};

use crate::model_path;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Source model: GGUF file, Hugging Face directory, or `default`. Its
    /// dequantized weights are the full-precision reference.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Where to write the quantized model.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// f16, rtn, int8, w8a8-smoothquant, gptq, awq or mixed.
    #[arg(long)]
    pub method: String,
    /// Weight bits: 3 or 4 (groups) or 8 (per channel); the method's default when absent.
    #[arg(long)]
    pub bits: Option<u32>,
    /// Elements per scale of 3/4-bit weights: 32, 64 or 128; it must divide
    /// every quantized matrix's width (SmolLM2-135M's 576 takes 32 or 64).
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
    /// Calibration text (use a different text from the one you evaluate on).
    #[arg(long)]
    pub calib: Option<PathBuf>,
    /// Calibration tokens to use from the start of `--calib`.
    #[arg(long, default_value_t = 4096)]
    pub calib_tokens: usize,
    /// Calibration window length (tokens run through the model at once).
    #[arg(long, default_value_t = 512)]
    pub calib_window: usize,
    /// Tokens of the calibration text used to measure per-layer sensitivity (mixed).
    #[arg(long, default_value_t = 512)]
    pub sensitivity_tokens: usize,
    /// Bits per weight for the quantized linears (mixed only).
    #[arg(long)]
    pub budget_bits: Option<f64>,
    /// GPTQ: quantize columns in order of decreasing activation energy.
    #[arg(long)]
    pub act_order: bool,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let opts = Options {
        method: Method::from_name(&args.method)?,
        bits: args.bits,
        group: args.group_size,
        act_order: args.act_order,
        budget_bits: args.budget_bits,
    };
    // Bad options fail before the model is read.
    opts.scheme()?;
    if opts.method.needs_calibration() && args.calib.is_none() {
        bail!(
            "--method {} needs calibration text: --calib FILE",
            opts.method.name()
        );
    }
    if !opts.method.needs_calibration() && args.calib.is_some() {
        bail!(
            "--method {} uses no calibration text; drop --calib",
            opts.method.name()
        );
    }
    if args.act_order && !matches!(opts.method, Method::Gptq | Method::Mixed) {
        bail!("--act-order applies to gptq and mixed only");
    }
    let path = model_path::resolve(args.model.as_deref())?;
    check_destination(&args.out, &path)?;
    let files = tandem_core::model::load(&path)?;
    let start = Instant::now();
    let mut log = |line: String| eprint_line!("[{:6.1}s] {line}", start.elapsed().as_secs_f64());
    let calibration = match &args.calib {
        Some(file) => {
            let windows =
                calib::windows(&files.tokenizer, file, args.calib_tokens, args.calib_window)?;
            let tokens: usize = windows.iter().map(Vec::len).sum();
            log(format!(
                "calibrating on {tokens} tokens of {}",
                file.display()
            ));
            let sensitivity = calib::windows(
                &files.tokenizer,
                file,
                args.sensitivity_tokens,
                args.sensitivity_tokens.min(args.calib_window),
            )?;
            Some(CalibrationText {
                windows,
                sensitivity,
            })
        }
        None => None,
    };
    let quantized = plan::quantize(&files, &opts, calibration.as_ref(), &mut log)?;
    let mut metadata = quantized.metadata;
    if let Some(file) = &args.calib {
        metadata.push((
            "quantization.calibration_file".into(),
            file.display().to_string(),
        ));
    }
    let bytes: usize = quantized.tensors.iter().map(|t| t.data.len()).sum();
    let staged = StagedDir::beside(&args.out)?;
    write_model_dir(&files, quantized.tensors, &metadata, staged.path())
        .with_context(|| format!("writing {}", args.out.display()))?;
    staged.commit()?;
    for line in &quantized.report {
        println!("{line}");
    }
    println!(
        "wrote {} ({}, {:.2} MiB of rewritten tensors) in {:.1} s",
        args.out.display(),
        opts.method.name(),
        bytes as f64 / (1 << 20) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Refuses, before any work, an `--out` that is not a model directory this
/// run may replace: a file, a directory holding something else, or the
/// source model itself.
pub(crate) fn check_destination(out: &Path, source: &Path) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        bail!("--out {} exists and is not a directory", out.display());
    }
    let same = |a: &Path, b: &Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b);
    if same(out, source) {
        bail!(
            "--out {} is the source model; write the new model elsewhere",
            out.display()
        );
    }
    let empty = fs::read_dir(out)
        .with_context(|| format!("reading {}", out.display()))?
        .next()
        .is_none();
    if !empty && !out.join("config.json").is_file() {
        bail!(
            "--out {} exists and holds no model (no config.json): refusing to replace it",
            out.display()
        );
    }
    Ok(())
}

/// A directory written beside its destination, renamed there by
/// [`StagedDir::commit`] once complete and removed if dropped before.
pub(crate) struct StagedDir {
    path: PathBuf,
    destination: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// A fresh, empty `.NAME.partial-PID` beside `destination` (whose
    /// parents are created).
    pub(crate) fn beside(destination: &Path) -> Result<StagedDir> {
        let path = sibling(destination, "partial")?;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        if path.exists() {
            // Left by an interrupted run of a process that had this id.
            fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(StagedDir {
            path,
            destination: destination.to_path_buf(),
            committed: false,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the directory to its destination, replacing the model there:
    /// the old one is renamed aside first and removed once the new one is in
    /// place (and put back if that fails).
    pub(crate) fn commit(mut self) -> Result<()> {
        let destination = &self.destination;
        let into_place = |from: &Path| {
            fs::rename(from, destination)
                .with_context(|| format!("moving {} to {}", from.display(), destination.display()))
        };
        if destination.exists() {
            let old = sibling(destination, "old")?;
            fs::rename(destination, &old)
                .with_context(|| format!("moving {} aside", destination.display()))?;
            if let Err(e) = into_place(&self.path) {
                let _ = fs::rename(&old, destination);
                return Err(e);
            }
            fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
        } else {
            into_place(&self.path)?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// `.NAME.WHAT-PID` in the directory of `destination`.
fn sibling(destination: &Path, what: &str) -> Result<PathBuf> {
    let name = destination
        .file_name()
        .with_context(|| format!("--out {} names no directory", destination.display()))?;
    let hidden = format!(".{}.{what}-{}", name.to_string_lossy(), std::process::id());
    Ok(destination.with_file_name(hidden))
}
