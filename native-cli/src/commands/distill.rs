//! `tandem distill`: trains a draft model for speculative decoding from the
//! target itself (`tandem-distill`) and writes it as a model directory that
//! `--speculate draft:DIR` loads.
//!
//! Every checkpoint is written into `.NAME.partial-PID` beside `--out` and
//! renamed into place, as `tandem quantize` does, so `--out` always holds a
//! complete model. Ctrl-C stops training after the current step and writes
//! a last checkpoint; a second Ctrl-C ends the process at once, leaving the
//! previous checkpoint in place.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::spec::parse_layers;
use tandem_distill::corpus::EvalSource;
use tandem_distill::train::Progress;
use tandem_distill::write::write_student;
use tandem_distill::{distill, vocab, Corpus, Device, Options, Student};

use super::quantize::{check_destination, StagedDir};
use crate::model_path;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DraftKind {
    /// A few of the target's layers, its embedding and head, trained as a whole model.
    Layers,
    /// An EAGLE head on the target's last hidden state (not available yet).
    Eagle,
}

#[derive(Args, Debug)]
pub struct DistillArgs {
    /// Target model: GGUF file, Hugging Face directory or named model.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Where to write the draft model (a directory).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Training text.
    #[arg(long, required_unless_present = "instructions")]
    pub corpus: Option<PathBuf>,
    /// Chat instructions, one per line: the target answers each (greedy, up
    /// to `--answer-tokens`), and the conversations, in its chat template,
    /// are training text too (after `--corpus`, if given).
    #[arg(long)]
    pub instructions: Option<PathBuf>,
    /// Most tokens of each answer to `--instructions`.
    #[arg(long, default_value_t = 256)]
    pub answer_tokens: usize,
    /// Evaluation text; without it the last `--eval-tokens` of the
    /// training text (the corpus, then the conversations) are held out of
    /// training and evaluated on.
    #[arg(long)]
    pub eval: Option<PathBuf>,
    /// Tokens held out of the training text for evaluation when there is no `--eval`.
    #[arg(long, default_value_t = 1024)]
    pub eval_tokens: usize,
    /// Evaluation windows at most (the target's logits for them stay in memory).
    #[arg(long, default_value_t = 4)]
    pub eval_windows: usize,
    #[arg(long, value_enum, default_value = "layers")]
    pub kind: DraftKind,
    /// The target's layers the student starts from, e.g. `0,7,15,22,29` or
    /// `0-3,29`; by default a sixth of them, evenly spread, first and last included.
    #[arg(long)]
    pub layers: Option<String>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Windows per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Peak learning rate (AdamW, warm-up then cosine decay).
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f64,
    /// Steps between evaluations and checkpoints.
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    /// Keep only this many tokens in the draft's output head: the chat
    /// template's markers and end-of-sequence, the training text's most
    /// frequent tokens, then the lowest unused ids (a reduced draft
    /// vocabulary: each drafted token costs less, and the draft never
    /// proposes the others). By default it keeps them all.
    #[arg(long)]
    pub draft_vocab: Option<usize>,
    /// Storage format of the trained matrices: f32, f16, bf16 or q8_0.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Orders the training windows.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads of the target's forward pass (0: one per core).
    #[arg(long, short = 't', default_value_t = 0)]
    pub threads: usize,
}

/// Raised by the first Ctrl-C.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

pub fn run(args: DistillArgs) -> Result<()> {
    if let DraftKind::Eagle = args.kind {
        bail!("--kind eagle is not implemented yet; use --kind layers");
    }
    let format = match WeightFormat::from_name(&args.dtype.to_uppercase()) {
        Some(
            f @ (WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::Q8_0),
        ) => f,
        _ => bail!("--dtype takes f32, f16, bf16 or q8_0, not `{}`", args.dtype),
    };
    let path = model_path::resolve(args.model.as_deref())?;
    check_destination(&args.out, &path)?;
    let target =
        tandem_core::model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let layers = match &args.layers {
        Some(spec) => parse_layers(spec, target.config.num_layers)?,
        None => spread_layers(target.config.num_layers),
    };
    let conversations = match &args.instructions {
        Some(path) => answer_instructions(&args, path, &target)?,
        None => Vec::new(),
    };
    let corpus = read_corpus(&args, &target, conversations)?;
    let mut student = Student::from_target(&target, &layers, &Device::Cpu)?;
    if let Some(size) = args.draft_vocab {
        let tokens = vocab::frequent_tokens(&target.tokenizer, &corpus.train, size)?;
        eprint_line!(
            "distill: draft vocabulary of {} of {} tokens: {:.1}% of the training tokens, {:.1}% of the evaluation tokens",
            tokens.len(),
            target.config.vocab_size,
            100.0 * vocab::coverage(&tokens, &corpus.train),
            100.0 * vocab::coverage(&tokens, &corpus.eval)
        );
        student = student.with_output_tokens(tokens)?;
    }
    eprint_line!(
        "distill: student of layers {layers:?} of {}; {} training and {} evaluation windows of {} tokens",
        target.config.num_layers,
        corpus.train.len(),
        corpus.eval.len(),
        args.seq_len
    );
    let options = Options {
        steps: args.steps,
        batch: args.batch,
        lr: args.lr,
        seed: args.seed,
        eval_every: args.eval_every,
        teacher_threads: args.threads,
    };
    catch_interrupt();
    let start = Instant::now();
    let mut checkpoint = |student: &Student, step: usize| {
        let staged = StagedDir::beside(&args.out).map_err(checkpoint_error)?;
        write_student(&target, student, format, staged.path())?;
        staged.commit().map_err(checkpoint_error)?;
        eprint_line!("  checkpoint at step {step}: {}", args.out.display());
        Ok(())
    };
    let summary = distill(
        &target,
        &student,
        &corpus,
        &options,
        &INTERRUPTED,
        &mut report,
        &mut checkpoint,
    )?;
    if summary.interrupted {
        eprint_line!("interrupted after {} steps", summary.steps_done);
    }
    println!(
        "distilled {} in {:.0} s: evaluation KL {:.4} -> {:.4} nats/token, top-1 agreement {:.1}% -> {:.1}%{}",
        args.out.display(),
        start.elapsed().as_secs_f64(),
        summary.before.kl,
        summary.after.kl,
        100.0 * summary.before.agreement,
        100.0 * summary.after.agreement,
        match student.output_tokens() {
            Some(_) => format!(
                " (the target's top-1 token is in the draft's vocabulary at {:.1}%)",
                100.0 * summary.after.coverage
            ),
            None => String::new(),
        }
    );
    Ok(())
}

/// A sixth of `n` layers (at least one), evenly spread from the first to the last.
fn spread_layers(n: usize) -> Vec<usize> {
    let k = n.div_ceil(6).max(1);
    if k == 1 {
        return vec![0];
    }
    (0..k).map(|i| i * (n - 1) / (k - 1)).collect()
}

/// The target's answers to the instructions of the file at `path`, one
/// token list per conversation.
fn answer_instructions(
    args: &DistillArgs,
    path: &PathBuf,
    target: &ModelFiles,
) -> Result<Vec<Vec<u32>>> {
    let text = read_text(path)?;
    let instructions: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if instructions.is_empty() {
        bail!("{} holds no instructions (one per line)", path.display());
    }
    let start = Instant::now();
    let total = instructions.len();
    let conversations = tandem_distill::responses::answer(
        target,
        &instructions,
        args.answer_tokens,
        args.threads,
        &mut |done, generated| {
            eprint!(
                "\ranswering instructions: {done}/{total}, {generated} tokens, {:.0} tokens/s",
                generated as f64 / start.elapsed().as_secs_f64()
            );
        },
    )?;
    eprintln!();
    Ok(conversations)
}

fn read_text(path: &PathBuf) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The training windows: `--corpus`'s text, then the conversations.
fn read_corpus(
    args: &DistillArgs,
    target: &ModelFiles,
    conversations: Vec<Vec<u32>>,
) -> Result<Corpus> {
    let mut tokens = match &args.corpus {
        Some(path) => target.tokenizer.encode(&read_text(path)?, false)?,
        None => Vec::new(),
    };
    tokens.extend(conversations.into_iter().flatten());
    let eval_text = args.eval.as_ref().map(read_text).transpose()?;
    let eval = match &eval_text {
        Some(text) => EvalSource::Text(text),
        None => EvalSource::HeldOutTail {
            tokens: args.eval_tokens,
        },
    };
    let mut corpus = Corpus::from_tokens(&target.tokenizer, tokens, eval, args.seq_len)?;
    corpus.eval.truncate(args.eval_windows.max(1));
    Ok(corpus)
}

fn report(p: &Progress) {
    eprint!(
        "step {:>5}/{}  KL {:.4}  {:.0} tok/s  ETA {}",
        p.step,
        p.steps,
        p.loss,
        p.tokens_per_s,
        minutes(p.eta)
    );
    match p.eval {
        Some(e) => eprint_line!(
            "  | eval KL {:.4}, agreement {:.1}%",
            e.kl,
            100.0 * e.agreement
        ),
        None => eprintln!(),
    }
}

fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

/// A checkpoint's file errors, as the trainer reports them.
fn checkpoint_error(e: anyhow::Error) -> tandem_distill::Error {
    tandem_distill::Error::Checkpoint(format!("{e:#}"))
}

/// The first SIGINT raises [`INTERRUPTED`] and restores the default action,
/// so a second one ends the process.
fn catch_interrupt() {
    #[cfg(unix)]
    {
        extern "C" fn on_interrupt(_: libc::c_int) {
            INTERRUPTED.store(true, Ordering::SeqCst);
            // SAFETY: `signal` is async-signal-safe; SIG_DFL is a valid action.
            unsafe {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
            }
        }
        // SAFETY: the handler only stores an atomic and calls `signal`.
        unsafe {
            libc::signal(
                libc::SIGINT,
                on_interrupt as *const () as libc::sighandler_t,
            );
        }
    }
}
