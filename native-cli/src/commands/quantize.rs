//! `tandem quantize`: writes a model whose linear layers are quantized by
//! one of the `tandem-quantize` methods, loadable by every other command
//! with `--model OUT`. Calibration text (`--calib`) feeds the methods that
//! look at activations (SmoothQuant, GPTQ, AWQ, mixed precision).

use std::path::PathBuf;
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
    let files = tandem_core::model::load(&path)?;
    let start = Instant::now();
    let mut log = |line: String| eprintln!("[{:6.1}s] {line}", start.elapsed().as_secs_f64());
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
    write_model_dir(&files, quantized.tensors, &metadata, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
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
