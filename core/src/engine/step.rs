//! One iteration of the engine: the scheduler's pick, one forward pass
//! (or the replay of a recorded decode step), then sampling every sequence
//! whose tokens are computed, verifying drafts where there were any
//! (`drafts`). A step that fails ends its own sequences only (`failure`).

use super::eviction::ScoredRows;
use super::{Engine, Generation};

use super::api::{FinishReason, StepError, TokenEvent, TokenLogprobs};
use crate::backend::Backend;
use crate::kv::SeqId;
use crate::model::forward::ForwardBatch;
use crate::model::recorded::DecodeOutputs;
use crate::sched::Schedule;
use crate::spec::Stopwatch;
use crate::{Error, Result};

/// A step whose forward pass is queued but whose tokens are not sampled
/// yet: made by [`Engine::begin_step`], completed by [`Engine::finish_step`].
pub struct PendingStep<B: Backend> {
    /// The plan that ran. Its chunks count as computed (their full blocks
    /// enter the prefix cache) in `finish_step`, once the device's results
    /// have come back: on an asynchronous device a failed kernel shows only
    /// there.
    schedule: Schedule,
    /// The sequences that sample, in the order of the readback's rows, with
    /// how many rows each has (1, or 1 + the drafts to verify).
    seqs: Vec<(SeqId, usize)>,
    readback: Readback<B>,
    /// Rows of the forward pass and when it started (for adaptive k).
    rows: usize,
    started: Stopwatch,
    /// The readback's buffer is lent by the decode recorder (this generation).
    lent_by_recorder: Option<u64>,
    /// Every row's final hidden state, for a proposer that reads them.
    hidden: Option<HiddenRows<B>>,
}

/// A step's final hidden states (`[rows, hidden]` on the device) and the
/// rows of each chunk, handed to an EAGLE proposer once the step's drafts
/// are settled.
struct HiddenRows<B: Backend> {
    tensor: B::Tensor,
    rows: usize,
    /// Per chunk: its sequence, first row in the batch, first position, rows.
    chunks: Vec<(SeqId, usize, usize, usize)>,
}

impl<B: Backend> PendingStep<B> {
    /// What to read back from the device before [`Engine::finish_step`].
    pub fn readback(&self) -> &Readback<B> {
        &self.readback
    }

    pub(super) fn schedule(&self) -> &Schedule {
        &self.schedule
    }
}

/// The device data a [`PendingStep`] needs on the host.
pub enum Readback<B: Backend> {
    /// Nothing: no sequence samples in this step (prompt chunks only, or no work).
    Nothing,
    /// `len` logits (one vocabulary row per sampling sequence), sampled on the host.
    Logits { tensor: B::Tensor, len: usize },
    /// `len` token ids, the device's argmax (batches that are all greedy).
    TokenIds { ids: B::Indices, len: usize },
}

/// The host's copy of a [`Readback`], of the same variant and length.
#[derive(Clone, Debug, PartialEq)]
pub enum ReadValues {
    Nothing,
    Logits(Vec<f32>),
    TokenIds(Vec<u32>),
}

/// Where a sampled sequence's next token comes from.
#[derive(Clone, Copy)]
pub(super) enum Pick<'a> {
    /// Its logits row, read back to the host.
    Logits(&'a [f32]),
    /// The device's argmax (greedy, no logprobs).
    Argmax(u32),
}

impl<B: Backend> Engine<B> {
    /// Runs one iteration: the scheduler picks decode tokens and prompt
    /// chunks within `max_batch_tokens` (preempting when KV blocks run
    /// out), they run as one forward pass, and every sequence whose tokens
    /// are all computed samples its next one. Returns the sampled tokens.
    /// When the step fails, its sequences are removed and named in the
    /// [`StepError`]; the others carry on at the next step.
    ///
    /// The same as [`Engine::begin_step`], a blocking read of its
    /// [`Readback`], then [`Engine::finish_step`] (or [`Engine::fail_step`]
    /// when the read fails).
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, StepError> {
        let pending = self.begin_step()?;
        match self.read_back(&pending.readback) {
            Ok(values) => self.finish_step(pending, values),
            Err(e) => Err(self.fail_step(pending, e)),
        }
    }

    /// A blocking read of `readback`.
    fn read_back(&self, readback: &Readback<B>) -> Result<ReadValues> {
        Ok(match readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => {
                ReadValues::Logits(self.backend.download(tensor, *len)?)
            }
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.backend.download_indices(ids, *len)?)
            }
        })
    }

    /// The first half of [`Engine::step`]: schedules the batch and queues its
    /// forward pass (and the argmax of greedy batches) without reading
    /// anything back. Read the returned step's [`PendingStep::readback`] (with
    /// an async download where blocking is not allowed, as in the browser)
    /// and hand the values to [`Engine::finish_step`] (or, if the read
    /// fails, the step to [`Engine::fail_step`]) before anything else
    /// touches the engine.
    pub fn begin_step(&mut self) -> Result<PendingStep<B>, StepError> {
        self.end_failed_constraints()?;
        self.propose_drafts()?;
        let started = Stopwatch::start();
        let schedule = self.plan_step()?;
        if schedule.chunks.is_empty() {
            if self.scheduler.num_waiting() > 0 && self.scheduler.num_running() == 0 {
                return Err(StepError {
                    failed: Vec::new(),
                    error: Error::KvCacheFull(format!(
                        "{} requests wait but finished sequences hold all {} KV blocks",
                        self.scheduler.num_waiting(),
                        self.kv_manager.num_blocks()
                    )),
                });
            }
            return Ok(PendingStep {
                schedule,
                seqs: Vec::new(),
                readback: Readback::Nothing,
                rows: 0,
                started,
                lent_by_recorder: None,
                hidden: None,
            });
        }
        let involved = self.step_sequences(&schedule);
        self.launch(schedule, started)
            .map_err(|e| self.fail_sequences(&involved, e))
    }

    /// The scheduler's plan for this step, drafts left out of it dropped.
    /// A failure here leaves the plan unknown: every unfinished sequence ends.
    fn plan_step(&mut self) -> Result<Schedule, StepError> {
        let planned = self
            .scheduler
            .schedule(&mut self.kv_manager)
            .and_then(|schedule| {
                self.drop_unscheduled_drafts(&schedule)?;
                Ok(schedule)
            });
        planned.map_err(|e| self.fail_unfinished(e))
    }

    /// Queues the forward pass of the non-empty `schedule` (and the argmax
    /// of greedy batches).
    fn launch(&mut self, schedule: Schedule, started: Stopwatch) -> Result<PendingStep<B>> {
        self.steps += 1;
        self.computed_tokens += schedule.num_tokens() as u64;
        let bs = self.kv_manager.block_size();
        let longest = schedule
            .chunks
            .iter()
            .map(|c| self.kv_manager.table(c.seq).map_or(0, |t| t.blocks().len()))
            .max()
            .unwrap_or(1);
        let mut batch = ForwardBatch::new(bs, rounded_width(longest));
        let mut sampled: Vec<(SeqId, usize)> = Vec::new();
        let mut scoring: Vec<ScoredRows> = Vec::new();
        let wants_hidden =
            (self.speculation.as_ref()).is_some_and(|s| s.proposer.reads_target_hidden());
        let mut hidden_chunks = Vec::new();
        for c in &schedule.chunks {
            self.model
                .copy_kv_blocks(&self.backend, &mut self.kv, &c.reservation.copies)?;
            let s = self.scheduler.get(c.seq).expect("scheduled");
            let table = self
                .kv_manager
                .table(c.seq)
                .expect("reserved by the scheduler");
            let first_row = batch.rows();
            if wants_hidden {
                hidden_chunks.push((c.seq, first_row, c.start, c.len));
            }
            if let Some((plan, prompt_len)) = self.plan_of(c.seq) {
                scoring.push(ScoredRows {
                    seq: c.seq,
                    first_row,
                    len: c.len,
                    plan,
                    prompt_len,
                });
            }
            batch.push_sequence(
                &s.tokens[c.start..c.start + c.len],
                c.start,
                &c.reservation.slots,
                table.blocks(),
            );
            // The row of the last accepted token predicts the first draft;
            // each drafted row predicts the next one.
            let accepted_end = s.tokens.len() - s.num_drafts();
            if c.start + c.len >= accepted_end {
                let from = accepted_end - 1 - c.start;
                batch
                    .logit_rows
                    .extend((first_row + from..first_row + c.len).map(|r| r as u32));
                sampled.push((c.seq, c.len - from));
            }
        }
        // Scores come from the eager pass only.
        // Scores and hidden states come from the eager pass only.
        let recording = self.recording
            && !wants_hidden
            && !scoring.iter().any(|r| r.scored(&batch).next().is_some());
        let recorder = (self.recorder.as_mut()).filter(|r| recording && r.accepts(&batch));
        let (readback, lent_by_recorder, hidden) = match recorder {
            Some(recorder) => {
                let outputs = recorder.run(&self.backend, &self.model, &batch, &mut self.kv)?;
                let generation = outputs.generation;
                (
                    self.lend_readback(outputs, &sampled),
                    Some(generation),
                    None,
                )
            }
            None => {
                let (logits, hidden) = self.forward_scoring(&batch, &scoring, wants_hidden)?;
                let hidden = hidden.map(|tensor| HiddenRows {
                    tensor,
                    rows: batch.rows(),
                    chunks: hidden_chunks,
                });
                (self.readback_for(logits, &sampled)?, None, hidden)
            }
        };
        Ok(PendingStep {
            schedule,
            seqs: sampled,
            readback,
            rows: batch.rows(),
            started,
            lent_by_recorder,
            hidden,
        })
    }

    /// The readback of a recorded decode step of the sequences `seqs`
    /// (one row each): its logits or its ids, lent by the recorder, which
    /// takes the other back now.
    fn lend_readback(&mut self, outputs: DecodeOutputs<B>, seqs: &[(SeqId, usize)]) -> Readback<B> {
        let host_logits = self.needs_host_logits(seqs);
        let recorder = self.recorder.as_mut().expect("the step was recorded");
        let (rows, vocab) = (seqs.len(), self.model.config.vocab_size);
        if host_logits {
            recorder.give_back_ids(outputs.ids, outputs.generation);
            Readback::Logits {
                tensor: outputs.logits,
                len: rows * vocab,
            }
        } else {
            recorder.give_back_logits(outputs.logits, outputs.generation);
            Readback::TokenIds {
                ids: outputs.ids,
                len: rows,
            }
        }
    }

    /// What the host needs to sample the sequences `seqs` (`rows` logits
    /// rows each): greedy batches take the device's argmax, so only token
    /// ids come back; any other batch reads its logits.
    fn readback_for(&self, logits: B::Tensor, seqs: &[(SeqId, usize)]) -> Result<Readback<B>> {
        let rows: usize = seqs.iter().map(|s| s.1).sum();
        if rows == 0 {
            return Ok(Readback::Nothing);
        }
        let vocab = self.model.config.vocab_size;
        if self.needs_host_logits(seqs) {
            return Ok(Readback::Logits {
                tensor: logits,
                len: rows * vocab,
            });
        }
        let mut ids = self.backend.upload_indices(&vec![0; rows])?;
        self.backend.argmax(&logits, rows, vocab, &mut ids)?;
        Ok(Readback::TokenIds { ids, len: rows })
    }

    /// Whether any of `seqs` samples on the host (or reports logprobs, or
    /// follows a constraint) rather than taking the device's argmax.
    fn needs_host_logits(&self, seqs: &[(SeqId, usize)]) -> bool {
        seqs.iter().any(|&(id, _)| {
            let g = &self.scheduler.get(id).expect("sampled").data;
            !g.sampler.params().is_greedy() || g.logprobs.is_some() || g.constraint.is_some()
        })
    }

    /// The second half of [`Engine::step`]: samples the next token of each
    /// sequence of `pending` from the host copy of its readback (verifying
    /// its drafts first, if it has any), forks pending samples off parents
    /// whose prompt is now computed, and applies the stop conditions.
    /// Returns the new tokens. When `values` do not fit the step, or the
    /// host's side of it fails, the step's sequences end as in
    /// [`Engine::fail_step`].
    pub fn finish_step(
        &mut self,
        pending: PendingStep<B>,
        values: ReadValues,
    ) -> Result<Vec<TokenEvent>, StepError> {
        let involved = self.step_sequences(&pending.schedule);
        self.complete_step(pending, values)
            .map_err(|e| self.fail_sequences(&involved, e))
    }

    fn complete_step(
        &mut self,
        pending: PendingStep<B>,
        values: ReadValues,
    ) -> Result<Vec<TokenEvent>> {
        let PendingStep {
            schedule,
            seqs,
            readback,
            rows: step_rows,
            started,
            lent_by_recorder,
            hidden,
        } = pending;
        let vocab = self.model.config.vocab_size;
        let (rows, argmax) = match (&readback, values) {
            (Readback::Nothing, ReadValues::Nothing) => (Vec::new(), Vec::new()),
            (Readback::Logits { len, .. }, ReadValues::Logits(rows)) if rows.len() == *len => {
                (rows, Vec::new())
            }
            (Readback::TokenIds { len, .. }, ReadValues::TokenIds(ids)) if ids.len() == *len => {
                (Vec::new(), ids)
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "finish_step: the values read back do not match the step's readback".into(),
                ))
            }
        };
        self.scheduler.complete(&schedule, &mut self.kv_manager)?;
        if seqs.is_empty() {
            if let Some(hidden) = hidden {
                self.hand_hidden_states(hidden)?;
            }
            self.evict_after(&schedule)?;
            return Ok(Vec::new());
        }
        // A buffer not given back (the error above) only costs the recorder
        // its recordings: it starts over at its next run.
        if let (Some(generation), Some(recorder)) = (lent_by_recorder, &mut self.recorder) {
            match readback {
                Readback::Logits { tensor, .. } => recorder.give_back_logits(tensor, generation),
                Readback::TokenIds { ids, .. } => recorder.give_back_ids(ids, generation),
                Readback::Nothing => {}
            }
        }
        let pick = |r: usize| match rows.get(r * vocab..(r + 1) * vocab) {
            Some(row) => Pick::Logits(row),
            None => Pick::Argmax(argmax[r]),
        };
        let mut events = Vec::with_capacity(seqs.len());
        let mut row = 0;
        let mut verified = false;
        for &(id, n_rows) in &seqs {
            let picks: Vec<Pick<'_>> = (row..row + n_rows).map(pick).collect();
            row += n_rows;
            let data = &mut self.scheduler.get_mut(id).expect("sampled").data;
            if let Some(draft) = data.drafts.take() {
                verified = true;
                self.finish_speculative(id, draft, &picks, &mut events)?;
                continue;
            }
            let forks = std::mem::take(&mut data.forks);
            for (child, sample) in forks {
                self.awaiting_fork.remove(&child);
                self.kv_manager.fork(id, child)?;
                let parent = &self.scheduler.get(id).expect("sampled").data;
                let generation = Generation::new(
                    sample,
                    parent.max_new_tokens,
                    parent.stop_tokens.clone(),
                    parent.logprobs,
                    parent.eviction,
                );
                self.scheduler.fork(id, child, generation)?;
                events.extend(self.take_token(child, picks[0]));
            }
            events.extend(self.take_token(id, picks[0]));
        }
        if let Some(spec) = &mut self.speculation {
            let secs = started.seconds();
            // Only steps whose every row was sampled (decoding and
            // verification) fit the cost of drafts: a prompt chunk's many
            // rows would set the slope per row for long after.
            let sampled_rows: usize = seqs.iter().map(|&(_, n)| n).sum();
            if sampled_rows == step_rows {
                spec.control.observe_step(step_rows, secs);
            }
            if verified {
                spec.stats.verify_steps += 1;
                spec.stats.verify_seconds += secs;
            }
        }
        if let Some(hidden) = hidden {
            self.hand_hidden_states(hidden)?;
        }
        // After the drafts are settled: a rollback never reaches an evicted block.
        self.evict_after(&schedule)?;
        Ok(events)
    }

    /// Gives the proposer the hidden states of each chunk's rows that now
    /// hold accepted tokens: rejected drafts' rows are left out, and so is
    /// the row of a token sampled in this step (the target computes it next).
    fn hand_hidden_states(&mut self, hidden: HiddenRows<B>) -> Result<()> {
        let dim = self.model.config.hidden_size;
        let values = self.backend.download(&hidden.tensor, hidden.rows * dim)?;
        let Some(spec) = &mut self.speculation else {
            return Ok(());
        };
        for (seq, first_row, start, len) in hidden.chunks {
            let Some(s) = self.scheduler.get(seq) else {
                continue;
            };
            let kept = len.min(s.tokens.len().saturating_sub(1 + start));
            if kept > 0 {
                let rows = &values[first_row * dim..(first_row + kept) * dim];
                spec.proposer.observe_hidden(seq, start, rows);
            }
        }
        Ok(())
    }

    /// Appends the next token of `seq`, from its logits row or the device's
    /// argmax, among the tokens its constraint allows. `None` when the
    /// constraint failed: the sequence takes no token and ends at the next step.
    fn take_token(&mut self, seq: SeqId, pick: Pick<'_>) -> Option<TokenEvent> {
        let vocab = self.model.config.vocab_size;
        let s = self.scheduler.get_mut(seq).expect("sampled");
        let g = &mut s.data;
        let allowed = match &mut g.constraint {
            Some(c) => match c.allowed(vocab, &g.stop_tokens) {
                Ok(mask) => Some(mask),
                Err(e) => {
                    c.fail(e);
                    return None;
                }
            },
            None => None,
        };
        let (token, logprobs) = match pick {
            Pick::Logits(row) => {
                let token =
                    g.sampler
                        .sample_allowed(&mut row.to_vec(), &s.tokens, allowed.as_ref());
                (
                    token,
                    g.logprobs
                        .map(|top| TokenLogprobs::from_logits(row, token, top)),
                )
            }
            // Constrained sequences read their logits back (`needs_host_logits`).
            Pick::Argmax(token) => (token, None),
        };
        if let Some(c) = &mut g.constraint {
            if !g.stop_tokens.contains(&token) {
                if let Err(e) = c.advance(token) {
                    c.fail(e);
                }
            }
        }
        s.tokens.push(token);
        let len = s.tokens.len();
        Some(self.record_token(seq, token, logprobs, len))
    }

    /// Counts `token`, already in `seq`'s tokens with `len_after` tokens up
    /// to and including it, and applies the stop conditions.
    pub(super) fn record_token(
        &mut self,
        seq: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        len_after: usize,
    ) -> TokenEvent {
        let plan = self.scheduler.get(seq).and_then(|s| s.data.eviction);
        let max_len = self.max_context.min(self.capacity_for(plan.as_ref()));
        let g = &mut self.scheduler.get_mut(seq).expect("sampled").data;
        g.n_generated += 1;
        // A complete grammar allows only stop tokens; without any, it ends here.
        let complete =
            g.stop_tokens.is_empty() && g.constraint.as_ref().is_some_and(|c| c.is_finished());
        if g.stop_tokens.contains(&token) || complete {
            g.finished = Some(FinishReason::Stop);
        } else if g.n_generated >= g.max_new_tokens || len_after >= max_len {
            g.finished = Some(FinishReason::Length);
        }
        let finished = g.finished;
        self.generated_tokens += 1;
        if finished.is_some() {
            self.scheduler.finish(seq);
        }
        TokenEvent {
            seq,
            token,
            finished,
            logprobs,
        }
    }
}

/// The block-table width of a step whose longest table has `blocks`
/// entries. The width is a launch parameter of attention: rounding it up to
/// a power of two keeps the recorded decode shapes few, and eager steps use
/// the same widths, so both run the same launches.
pub(super) fn rounded_width(blocks: usize) -> usize {
    blocks.max(1).next_power_of_two()
}
