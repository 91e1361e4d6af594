//! Decode steps recorded once and replayed (CUDA graphs).
//!
//! A small model's decode step is hundreds of short kernels (30 layers ×
//! ~10), and launching them one by one costs more than running them. On a
//! backend that records ([`Backend::can_record`]), [`DecodeRecorder`] runs
//! each decode shape once eagerly, records it, and from then on only
//! rewrites the step's indices and replays the recording: one call instead
//! of hundreds of launches.
//!
//! A recording replays the exact launches it captured: the same kernels,
//! grid sizes, scalar arguments and buffer addresses. Hence:
//! - a recording is keyed by what its launches hold: the number of rows
//!   (one per sequence, each returning logits) and the block-table width
//!   (the engine rounds it up to a power of two, so few widths occur);
//! - every recording uses one set of buffers, sized for the largest batch
//!   and the widest table; before each replay the step's tokens, positions,
//!   slots and block tables are written into them in place (row `i` is
//!   always sequence `i` and logit row `i`, written once). The KV caches
//!   and weights are the engine's, which live as long as the recorder;
//! - the outputs (logits and argmax ids) are lent to the caller by
//!   [`DecodeRecorder::run`] and handed back with `give_back_*`. If one never
//!   comes back (a step dropped halfway), the recordings that wrote to it are
//!   dropped with the other buffers at the next run, and recording starts over;
//! - a shape whose recording fails runs eagerly from then on: the step's
//!   results come from its eager run, so nothing is lost.

use std::collections::{HashMap, HashSet};

use super::forward::{AttentionExtra, ForwardBatch, Model};
use super::step_buffers::{StepBuffers, StepShape};
use crate::backend::{Backend, RecordedStep};
use crate::{Error, Result};

/// How often decode steps were recorded and replayed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordingStats {
    /// Shapes recorded (each after one eager run).
    pub recorded: u64,
    /// Steps run by replaying a recording.
    pub replayed: u64,
    /// Shapes whose recording failed (they run eagerly).
    pub failed: u64,
    /// Why the last recording failed.
    pub last_error: Option<String>,
}

/// The outputs of a step run by [`DecodeRecorder::run`], lent to the caller.
pub struct DecodeOutputs<B: Backend> {
    /// `[rows, vocab]` logits (the buffer may be longer).
    pub logits: B::Tensor,
    /// The argmax of each row.
    pub ids: B::Indices,
    /// Which set of buffers they belong to (handed back with them).
    pub generation: u64,
}

/// Records decode steps and replays them; see the module documentation.
pub struct DecodeRecorder<B: Backend> {
    max_rows: usize,
    max_blocks_per_seq: usize,
    recordings: Option<Recordings<B>>,
    /// Counts the sets of buffers made, so an output lent from an older set
    /// is not taken back into a newer one.
    generation: u64,
    stats: RecordingStats,
}

/// What [`DecodeRecorder`] holds on the device, dropped and rebuilt together.
struct Recordings<B: Backend> {
    /// Declared first: a recording is dropped before the buffers it names.
    steps: HashMap<StepShape, Box<dyn RecordedStep>>,
    unrecordable: HashSet<StepShape>,
    buffers: StepBuffers<B>,
    /// `None` while lent.
    logits: Option<B::Tensor>,
    ids: Option<B::Indices>,
}

impl<B: Backend> DecodeRecorder<B> {
    /// A recorder for batches of up to `max_rows` sequences whose block
    /// tables have up to `max_blocks_per_seq` entries. Allocates nothing
    /// until the first run.
    pub fn new(max_rows: usize, max_blocks_per_seq: usize) -> Self {
        Self {
            max_rows,
            max_blocks_per_seq,
            recordings: None,
            generation: 0,
            stats: RecordingStats::default(),
        }
    }

    pub fn stats(&self) -> &RecordingStats {
        &self.stats
    }

    /// Whether `batch` is a decode step this recorder runs: at most
    /// `max_rows` rows, each the only row of its own sequence and a logit
    /// row, in order, with a block table no wider than the recorder's.
    pub fn accepts(&self, batch: &ForwardBatch) -> bool {
        let rows = batch.rows();
        let in_order = |v: &[u32]| v.iter().enumerate().all(|(i, &r)| r as usize == i);
        (1..=self.max_rows).contains(&rows)
            && batch.max_blocks_per_seq <= self.max_blocks_per_seq
            && batch.block_tables.len() == rows * batch.max_blocks_per_seq
            && batch.logit_rows.len() == rows
            && in_order(&batch.logit_rows)
            && in_order(&batch.row_seq)
            && batch.input_hidden.is_empty()
    }

    /// Runs `batch` (which [`accepts`](Self::accepts) must take): replays
    /// its shape's recording, or runs it eagerly and records it. Returns the
    /// logits and argmax ids, lent until `give_back_*`.
    pub fn run(
        &mut self,
        backend: &B,
        model: &Model<B>,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
    ) -> Result<DecodeOutputs<B>> {
        if !self.accepts(batch) {
            return Err(Error::InvalidRequest(format!(
                "a recorded decode step takes 1 to {} rows, one per sequence, each a logit row",
                self.max_rows
            )));
        }
        let shape = model.check_batch(batch, kv)?;
        let complete = self
            .recordings
            .as_ref()
            .is_some_and(|r| r.logits.is_some() && r.ids.is_some());
        if !complete {
            // Freed before the new set is allocated: device memory may not hold both.
            self.recordings = None;
            self.generation += 1;
            self.recordings = Some(Recordings {
                steps: HashMap::new(),
                unrecordable: HashSet::new(),
                buffers: StepBuffers::for_decode(
                    backend,
                    &model.config,
                    self.max_rows,
                    self.max_blocks_per_seq,
                )?,
                logits: Some(backend.alloc(self.max_rows * model.config.logit_width())?),
                ids: Some(backend.upload_indices(&vec![0; self.max_rows])?),
            });
        }
        let r = self.recordings.as_mut().expect("allocated above");
        r.buffers.write_decode(backend, batch)?;
        if let Some(step) = r.steps.get(&shape) {
            step.replay()?;
            self.stats.replayed += 1;
        } else {
            let (logits, ids) = (
                r.logits.as_mut().expect("complete"),
                r.ids.as_mut().expect("complete"),
            );
            let vocab = model.config.logit_width();
            let mut step = |backend: &B| {
                model.forward_into(
                    backend,
                    &mut r.buffers,
                    shape,
                    kv,
                    logits,
                    AttentionExtra::None,
                )?;
                backend.argmax(logits, shape.rows, vocab, ids)
            };
            step(backend)?;
            if !r.unrecordable.contains(&shape) {
                match record(backend, step) {
                    Ok(recording) => {
                        r.steps.insert(shape, recording);
                        self.stats.recorded += 1;
                    }
                    Err(e) => {
                        r.unrecordable.insert(shape);
                        self.stats.failed += 1;
                        self.stats.last_error = Some(e.to_string());
                    }
                }
            }
        }
        Ok(DecodeOutputs {
            logits: r.logits.take().expect("complete"),
            ids: r.ids.take().expect("complete"),
            generation: self.generation,
        })
    }

    /// Takes back the logits lent by [`run`](Self::run) with `generation`.
    pub fn give_back_logits(&mut self, logits: B::Tensor, generation: u64) {
        if let Some(r) = self.current(generation) {
            r.logits = Some(logits);
        }
    }

    /// Takes back the argmax ids lent by [`run`](Self::run) with `generation`.
    pub fn give_back_ids(&mut self, ids: B::Indices, generation: u64) {
        if let Some(r) = self.current(generation) {
            r.ids = Some(ids);
        }
    }

    fn current(&mut self, generation: u64) -> Option<&mut Recordings<B>> {
        self.recordings
            .as_mut()
            .filter(|_| generation == self.generation)
    }
}

/// Records `step`'s kernels. The capture is always ended, so a kernel that
/// fails while recording leaves the backend ready for eager work.
fn record<B: Backend>(
    backend: &B,
    step: impl FnOnce(&B) -> Result<()>,
) -> Result<Box<dyn RecordedStep>> {
    backend.begin_capture()?;
    let kernels = step(backend);
    let recording = backend.end_capture();
    kernels?;
    recording
}
