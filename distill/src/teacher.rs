//! The target's next-token logits, computed by Tandem's own engine on the
//! CPU backend, one window per scoring pass, and streamed to the trainer:
//! a thread scores the batches in order and hands each over through a
//! bounded channel, so the target runs ahead of the trainer by at most
//! [`AHEAD`] batches and never holds more than that in memory.

use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::Scope;

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_cpu::CpuBackend;

use crate::{Error, Result};

/// Batches the target may compute before the trainer takes them.
pub const AHEAD: usize = 2;

/// Windows of equal length and the target's logits at every position.
pub struct TeacherBatch {
    /// The windows' tokens, one after the other.
    pub tokens: Vec<u32>,
    pub windows: usize,
    pub len: usize,
    /// `[windows × len, vocab]`: row `i` is the distribution of token `i + 1`.
    pub logits: Vec<f32>,
    /// `[windows × len, hidden]`: the target's final hidden state of each
    /// row, for an EAGLE head; empty otherwise.
    pub hidden: Vec<f32>,
}

/// The target model on a CPU engine sized for one window at a time.
pub struct Teacher {
    engine: Engine<CpuBackend>,
    /// Whether to keep the hidden states too.
    hidden: bool,
}

impl Teacher {
    /// An engine for `files` that scores windows of up to `len` tokens on
    /// `threads` CPU threads (0: one per core), keeping the final hidden
    /// states too with `hidden`.
    pub fn new(files: &ModelFiles, len: usize, threads: usize, hidden: bool) -> Result<Self> {
        let config = EngineConfig {
            max_context: Some(len + 1),
            max_batch_tokens: len,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(len + 1);
        let engine = Engine::new(CpuBackend::new(threads), files, config, &mut |_, _| {})?;
        Ok(Self { engine, hidden })
    }

    /// The target's logits at every position of each of `windows`.
    pub fn score(&mut self, windows: &[Vec<u32>]) -> Result<TeacherBatch> {
        let len = windows.first().map_or(0, Vec::len);
        if windows.iter().any(|w| w.len() != len) {
            return Err(Error::InvalidInput(
                "a batch's windows differ in length".into(),
            ));
        }
        let (mut logits, mut hidden) = (Vec::new(), Vec::new());
        for window in windows {
            match self.hidden {
                true => {
                    let (l, h) = self.engine.score_hidden(window)?;
                    logits.extend(l);
                    hidden.extend(h);
                }
                false => logits.extend(self.engine.score(window, 0)?),
            }
        }
        Ok(TeacherBatch {
            tokens: windows.concat(),
            windows: windows.len(),
            len,
            logits,
            hidden,
        })
    }
}

/// Scores `batches` in order on a thread of `scope`, the engine built there
/// (a [`Teacher::new`] of these arguments); the receiver yields each
/// batch's result. Dropping the receiver stops the thread after the batch
/// it is computing.
pub fn stream<'scope, 'env>(
    scope: &'scope Scope<'scope, 'env>,
    files: &'env ModelFiles,
    (len, threads, hidden): (usize, usize, bool),
    batches: Vec<Vec<Vec<u32>>>,
) -> Receiver<Result<TeacherBatch>> {
    let (tx, rx) = sync_channel(AHEAD);
    scope.spawn(move || {
        let mut teacher = match Teacher::new(files, len, threads, hidden) {
            Ok(t) => t,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        for batch in batches {
            let result = teacher.score(&batch);
            let failed = result.is_err();
            if tx.send(result).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// The next batch from a [`stream`], or why there is none.
pub fn next(rx: &Receiver<Result<TeacherBatch>>) -> Result<TeacherBatch> {
    rx.recv()
        .map_err(|_| Error::Teacher("it ended before the trainer did".into()))?
}
