//! The training loop: AdamW on the KL divergence from the target, batches of
//! windows in a seeded order (every window once per epoch), warm-up then
//! cosine decay of the learning rate, progress after every step, evaluation
//! on the held-apart windows and a checkpoint every `eval_every` steps, at
//! the end, and when asked to stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use tandem_core::model::ModelFiles;
use tandem_core::sched::Rng;

use crate::corpus::Corpus;
use crate::student::Student;
use crate::teacher::{self, TeacherBatch};
use crate::{loss, Error, Result};

#[derive(Clone, Debug)]
pub struct Options {
    /// Optimizer steps.
    pub steps: usize,
    /// Windows per step.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Orders the training windows.
    pub seed: u64,
    /// Steps between evaluations and checkpoints (0: only at the end).
    pub eval_every: usize,
    /// CPU threads for the target's forward pass (0: one per core).
    pub teacher_threads: usize,
}

/// The student on the held-apart windows.
#[derive(Clone, Copy, Debug)]
pub struct Eval {
    /// Mean `KL(target ‖ student)` per token, nats; with a reduced output
    /// vocabulary, the target's distribution among its tokens.
    pub kl: f64,
    /// Fraction of positions where both pick the same most likely token.
    pub agreement: f64,
    /// Fraction of positions where the target's most likely token is one
    /// the student can predict (1 with the whole vocabulary).
    pub coverage: f64,
    /// An EAGLE head's agreement at its second draft (reading its own
    /// hidden state of the row before, not the target's).
    pub second_agreement: Option<f64>,
}

/// One step's report.
pub struct Progress {
    pub step: usize,
    pub steps: usize,
    /// This step's training KL (an EAGLE head's: the mean of its two passes).
    pub loss: f64,
    /// Training tokens per second since the start (target and student).
    pub tokens_per_s: f64,
    pub eta: Duration,
    /// Present on evaluation steps.
    pub eval: Option<Eval>,
}

pub struct Summary {
    pub steps_done: usize,
    pub before: Eval,
    pub after: Eval,
    /// `stop` was raised before the last step.
    pub interrupted: bool,
}

/// Trains `student` towards `target` on `corpus.train`, judged on
/// `corpus.eval`. Calls `checkpoint` after each evaluation (and so at the
/// end); stops early, after a checkpoint, once `stop` is raised.
pub fn distill(
    target: &ModelFiles,
    student: &Student,
    corpus: &Corpus,
    options: &Options,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(&Progress),
    checkpoint: &mut dyn FnMut(&Student, usize) -> Result<()>,
) -> Result<Summary> {
    if options.steps == 0 || options.batch == 0 || options.lr.is_nan() || options.lr <= 0.0 {
        return Err(Error::InvalidInput(format!(
            "steps ({}), windows per step ({}) and learning rate ({}) must be positive",
            options.steps, options.batch, options.lr
        )));
    }
    let len = corpus.train[0].len();
    let mut batches = vec![corpus.eval.clone()];
    batches.extend(schedule(&corpus.train, options));
    std::thread::scope(|scope| {
        let teacher_args = (len, options.teacher_threads, student.reads_hidden());
        let rx = teacher::stream(scope, target, teacher_args, batches);
        let eval_batch = teacher::next(&rx)?;
        let before = evaluate(student, &eval_batch)?;
        let mut optimizer = AdamW::new(
            student.trainable(),
            ParamsAdamW {
                lr: options.lr,
                weight_decay: 0.0,
                ..ParamsAdamW::default()
            },
        )?;
        let start = Instant::now();
        let mut after = before;
        let mut steps_done = 0;
        let mut tokens = 0usize;
        while steps_done < options.steps && !stop.load(Ordering::SeqCst) {
            let batch = teacher::next(&rx)?;
            optimizer.set_learning_rate(learning_rate(options, steps_done));
            let passes =
                student.forward(&batch.tokens, batch.windows, batch.len, hidden(&batch))?;
            let target = student.restrict(&target_tensor(&batch, &passes[0])?)?;
            let mut loss = loss::kl(&passes[0], &target)?;
            for pass in &passes[1..] {
                loss = (loss + loss::kl(pass, &target)?)?;
            }
            let loss = (loss / passes.len() as f64)?;
            optimizer.backward_step(&loss)?;
            steps_done += 1;
            tokens += batch.tokens.len();
            let elapsed = start.elapsed().as_secs_f64();
            let last = steps_done == options.steps;
            let eval = if last || (options.eval_every > 0 && steps_done % options.eval_every == 0) {
                after = evaluate(student, &eval_batch)?;
                Some(after)
            } else {
                None
            };
            progress(&Progress {
                step: steps_done,
                steps: options.steps,
                loss: loss.to_scalar::<f32>()? as f64,
                tokens_per_s: tokens as f64 / elapsed,
                eta: Duration::from_secs_f64(
                    elapsed / steps_done as f64 * (options.steps - steps_done) as f64,
                ),
                eval,
            });
            if eval.is_some() {
                checkpoint(student, steps_done)?;
            }
        }
        let interrupted = steps_done < options.steps;
        if interrupted && steps_done > 0 {
            after = evaluate(student, &eval_batch)?;
            checkpoint(student, steps_done)?;
        }
        drop(rx);
        Ok(Summary {
            steps_done,
            before,
            after,
            interrupted,
        })
    })
}

/// The training batches in order: each epoch visits every window once, in
/// an order drawn from `seed`; a batch never spans two epochs.
fn schedule(windows: &[Vec<u32>], options: &Options) -> Vec<Vec<Vec<u32>>> {
    let mut rng = Rng::new(options.seed);
    let batch = options.batch.min(windows.len());
    let mut batches = Vec::with_capacity(options.steps);
    while batches.len() < options.steps {
        let mut order: Vec<usize> = (0..windows.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        for chunk in order.chunks_exact(batch) {
            batches.push(chunk.iter().map(|&i| windows[i].clone()).collect());
        }
    }
    batches.truncate(options.steps);
    batches
}

/// A short linear warm-up, then cosine decay to a tenth of the peak.
fn learning_rate(options: &Options, step: usize) -> f64 {
    let warmup = (options.steps / 10).clamp(1, 20);
    if step < warmup {
        return options.lr * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (options.steps - warmup).max(1) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    options.lr * (0.1 + 0.9 * cosine)
}

/// The batch's target logits, `[rows, vocab]`.
fn target_tensor(batch: &TeacherBatch, like: &Tensor) -> Result<Tensor> {
    let rows = batch.windows * batch.len;
    let vocab = batch.logits.len() / rows.max(1);
    Ok(Tensor::from_slice(
        &batch.logits,
        (rows, vocab),
        like.device(),
    )?)
}

/// The target's hidden states of `batch`, where it kept them.
fn hidden(batch: &TeacherBatch) -> Option<&[f32]> {
    (!batch.hidden.is_empty()).then_some(batch.hidden.as_slice())
}

/// The student against the target on `eval`'s windows, one window at a
/// time: KL, agreement and coverage of its first (or only) pass.
pub fn evaluate(student: &Student, eval: &TeacherBatch) -> Result<Eval> {
    let (mut kl, mut agreement, mut coverage, mut second) = (0.0, 0.0, 0.0, 0.0);
    let per_window = eval.logits.len() / eval.windows.max(1);
    let hidden_per_window = eval.hidden.len() / eval.windows.max(1);
    for w in 0..eval.windows {
        let tokens = &eval.tokens[w * eval.len..(w + 1) * eval.len];
        let rows = hidden(eval).map(|h| &h[w * hidden_per_window..(w + 1) * hidden_per_window]);
        let passes = student.forward(tokens, 1, eval.len, rows)?;
        let logits = passes[0].detach();
        let target = Tensor::from_slice(
            &eval.logits[w * per_window..(w + 1) * per_window],
            (eval.len, per_window / eval.len.max(1)),
            logits.device(),
        )?;
        kl += loss::kl(&logits, &student.restrict(&target)?)?.to_scalar::<f32>()? as f64;
        let top = loss::top_one(&logits, student.output_tokens(), &target)?;
        agreement += top.agreement;
        coverage += top.coverage;
        if let Some(pass) = passes.get(1) {
            second += loss::top_one(&pass.detach(), student.output_tokens(), &target)?.agreement;
        }
    }
    let n = eval.windows as f64;
    Ok(Eval {
        kl: kl / n,
        agreement: agreement / n,
        coverage: coverage / n,
        second_agreement: student.reads_hidden().then_some(second / n),
    })
}
