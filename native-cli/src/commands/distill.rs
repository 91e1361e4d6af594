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
    /// An EAGLE head: one of the target's layers reading each token's
    /// embedding plus a trained projection of the target's final hidden
    /// state at the position before; it drafts from the hidden states the
    /// target already computed.
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
    /// `0-3,29`; by default a sixth of them, evenly spread, first and last
    /// included (for an EAGLE head too: `--layers 29` makes a one-layer head).
    #[arg(long, conflicts_with = "budget_params")]
    pub layers: Option<String>,
    /// Most parameters the draft may have (its embedding and output head
    /// included), e.g. `40M` or `45000000`: it takes as many of the
    /// target's layers as fit, evenly spread, first and last included.
    #[arg(long, value_parser = parse_params)]
    pub budget_params: Option<usize>,
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
    let n = target.config.num_layers;
    let layers = match (&args.layers, args.budget_params) {
        (Some(spec), _) => parse_layers(spec, n)?,
        (None, Some(budget)) => layers_within(&args, &target, budget)?,
        (None, None) => spread_layers(n, n.div_ceil(6)),
    };
    let conversations = match &args.instructions {
        Some(path) => answer_instructions(&args, path, &target)?,
        None => Vec::new(),
    };
    let corpus = read_corpus(&args, &target, conversations)?;
    let mut student = match args.kind {
        DraftKind::Layers => Student::from_target(&target, &layers, &Device::Cpu)?,
        DraftKind::Eagle => Student::eagle_from_target(&target, &layers, &Device::Cpu)?,
    };
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
        "distilled {} in {:.0} s: evaluation KL {:.4} -> {:.4} nats/token, top-1 agreement {:.1}% -> {:.1}%{}{}",
        args.out.display(),
        start.elapsed().as_secs_f64(),
        summary.before.kl,
        summary.after.kl,
        100.0 * summary.before.agreement,
        100.0 * summary.after.agreement,
        second_draft(&summary.after),
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

/// An EAGLE head's agreement at its second draft, for the reports.
fn second_draft(eval: &tandem_distill::train::Eval) -> String {
    match eval.second_agreement {
        Some(a) => format!(" ({:.1}% at the second draft)", 100.0 * a),
        None => String::new(),
    }
}

/// `k` of `n` layers (at least one), evenly spread from the first to the last.
fn spread_layers(n: usize, k: usize) -> Vec<usize> {
    let k = k.clamp(1, n);
    if k == 1 {
        return vec![0];
    }
    (0..k).map(|i| i * (n - 1) / (k - 1)).collect()
}

/// The most evenly spread layers whose draft, as `args` shapes it (output
/// vocabulary, EAGLE input), has at most `budget` parameters.
fn layers_within(args: &DistillArgs, target: &ModelFiles, budget: usize) -> Result<Vec<usize>> {
    let c = &target.config;
    let reduced = args
        .draft_vocab
        .map(|v| (0..v.min(c.vocab_size) as u32).collect());
    let params = |k: usize| {
        let draft = tandem_core::model::ModelConfig {
            num_layers: k,
            layers: c.layers[..k].to_vec(),
            tied_embeddings: c.tied_embeddings && reduced.is_none(),
            output_tokens: reduced.clone(),
            reads_hidden: matches!(args.kind, DraftKind::Eagle),
            ..c.clone()
        };
        draft.parameter_counts().0
    };
    match (1..=c.num_layers).rev().find(|&k| params(k) <= budget) {
        Some(k) => Ok(spread_layers(c.num_layers, k)),
        None => bail!(
            "--budget-params {budget}: a draft of one layer already has {} parameters",
            params(1)
        ),
    }
}

/// A parameter count: a number, or one with a `K`, `M` or `B` suffix.
fn parse_params(text: &str) -> std::result::Result<usize, String> {
    let (digits, scale) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1e3),
        Some((i, 'M' | 'm')) => (&text[..i], 1e6),
        Some((i, 'B' | 'b')) => (&text[..i], 1e9),
        _ => (text, 1.0),
    };
    match digits.parse::<f64>() {
        Ok(x) if x > 0.0 && (x * scale).is_finite() => Ok((x * scale) as usize),
        _ => Err(format!(
            "`{text}` is not a parameter count such as 40M or 45000000"
        )),
    }
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
            "  | eval KL {:.4}, agreement {:.1}%{}",
            e.kl,
            100.0 * e.agreement,
            second_draft(&e)
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
