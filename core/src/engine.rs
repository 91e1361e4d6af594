//! `Engine<B>`: a model on a backend, its paged KV cache, and the sequences
//! being generated. `step()` runs one iteration of continuous batching: the
//! scheduler (`sched::scheduler`) picks prompt chunks and decode tokens of
//! many sequences within a token budget, they share one forward pass, and
//! every sequence whose tokens are all computed samples its next one.
//!
//! Requests with several samples (`n > 1`) compute their prompt once: the
//! extra samples are forked from the first (sharing its KV blocks, copied on
//! write) when its prompt is done, and draw their first token from the same
//! logits.
//!
//! With speculation on ([`Engine::set_speculation`]), decoding sequences
//! get draft tokens before the step is scheduled; they ride in the same
//! forward pass as provisional tokens, every drafted position returns
//! logits, and `finish_step` keeps what the exact acceptance rule accepts
//! (`crate::spec`), rolling the rest back from the block tables.
//!
//! On a backend that records steps (CUDA graphs), small decode batches run
//! through `crate::model::recorded`: recorded once per shape, then replayed.

use std::collections::{HashMap, HashSet};

use crate::backend::{Backend, KvDtype};
use crate::kv::{KvCacheManager, SeqId, DEFAULT_BLOCK_SIZE};
use crate::model::forward::{ForwardBatch, Model, Progress};
use crate::model::recorded::{DecodeOutputs, DecodeRecorder, RecordingStats};
use crate::model::ModelFiles;
use crate::sched::{
    Priority, Sampler, SamplingParams, SchedSeq, Schedule, Scheduler, SchedulerConfig, SeqStatus,
    SubmitError,
};
use crate::spec::{
    verify::verify, Draft, DraftLength, DraftLengthController, DraftRequest, Proposer,
    SequenceAcceptance, SpeculationStats, Stopwatch,
};
use crate::{Error, Result};

/// Up to 8 rows every CUDA matmul is a GEMV kernel: the launch-bound regime
/// recording is for (larger batches would also record cuBLAS calls).
pub const DEFAULT_MAX_RECORDED_BATCH: usize = 8;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool (each holds `block_size` tokens of every layer).
    pub num_blocks: usize,
    /// Most tokens one step feeds through the model (long prompts are chunked).
    pub max_batch_tokens: usize,
    pub kv_dtype: KvDtype,
    /// Longest sequence accepted; defaults to the model's trained context.
    pub max_context: Option<usize>,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting for admission; more are refused.
    pub max_waiting: usize,
    /// Decode batches of at most this many sequences are recorded once per
    /// shape and replayed (CUDA graphs) on backends that record; 0 turns
    /// recording off.
    pub max_recorded_batch: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: 256,
            max_batch_tokens: 512,
            kv_dtype: KvDtype::F32,
            max_context: None,
            max_running: 256,
            max_waiting: 1024,
            max_recorded_batch: DEFAULT_MAX_RECORDED_BATCH,
        }
    }
}

impl EngineConfig {
    /// A pool that holds `tokens` tokens for one sequence.
    pub fn with_capacity_tokens(mut self, tokens: usize) -> Self {
        self.num_blocks = tokens.div_ceil(self.block_size).max(1);
        self
    }
}

/// Why a sequence stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Stop,
    /// `max_new_tokens` or the context length was reached.
    Length,
}

/// The log-probability of a sampled token under the model (before
/// temperature and truncation), and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One token produced by a step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub seq: SeqId,
    pub token: u32,
    pub finished: Option<FinishReason>,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
}

/// A generation request: one prompt, `samples` independent continuations.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Sample `i` draws from seed `params.seed + i`.
    pub params: SamplingParams,
    pub max_new_tokens: usize,
    /// Tokens that end generation (included in the output, like EOS).
    pub stop_tokens: Vec<u32>,
    pub priority: Priority,
    /// How many continuations (OpenAI's `n`); they share the prompt's KV blocks.
    pub samples: usize,
    /// Report each token's logprob and this many top alternatives.
    pub logprobs: Option<usize>,
}

impl Request {
    pub fn new(prompt: Vec<u32>, params: SamplingParams, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            params,
            max_new_tokens,
            stop_tokens: Vec::new(),
            priority: 0,
            samples: 1,
            logprobs: None,
        }
    }
}

/// Counters and gauges for monitoring.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_free: usize,
    /// Free blocks that still hold reusable prefix content.
    pub kv_blocks_cached: usize,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Tokens fed through the model (prompt chunks, recomputes and decodes).
    pub computed_tokens: u64,
    pub generated_tokens: u64,
    pub steps: u64,
    /// Zero when speculation is off.
    pub speculation: SpeculationStats,
    /// Zero where the backend does not record or recording is off.
    pub recorded_steps: RecordingStats,
}

/// A step whose forward pass is queued but whose tokens are not sampled
/// yet: made by [`Engine::begin_step`], completed by [`Engine::finish_step`].
pub struct PendingStep<B: Backend> {
    /// The sequences that sample, in the order of the readback's rows, with
    /// how many rows each has (1, or 1 + the drafts to verify).
    seqs: Vec<(SeqId, usize)>,
    readback: Readback<B>,
    /// Rows of the forward pass and when it started (for adaptive k).
    rows: usize,
    started: Stopwatch,
    /// The readback's buffer is lent by the decode recorder (this generation).
    lent_by_recorder: Option<u64>,
}

impl<B: Backend> PendingStep<B> {
    /// What to read back from the device before [`Engine::finish_step`].
    pub fn readback(&self) -> &Readback<B> {
        &self.readback
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
enum Pick<'a> {
    /// Its logits row, read back to the host.
    Logits(&'a [f32]),
    /// The device's argmax (greedy, no logprobs).
    Argmax(u32),
}

/// What the engine keeps per sequence beside its tokens.
#[derive(Debug)]
struct Generation {
    sampler: Sampler,
    max_new_tokens: usize,
    n_generated: usize,
    stop_tokens: Vec<u32>,
    finished: Option<FinishReason>,
    logprobs: Option<usize>,
    /// Further samples of this prompt, forked from it (sharing its blocks)
    /// when its prompt is computed, each with its own sampler.
    forks: Vec<(SeqId, Sampler)>,
    /// The drafts riding in the current step, if any.
    drafts: Option<Draft>,
    acceptance: SequenceAcceptance,
}

impl Generation {
    fn new(
        sampler: Sampler,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        logprobs: Option<usize>,
    ) -> Self {
        Self {
            sampler,
            max_new_tokens,
            n_generated: 0,
            stop_tokens,
            finished: None,
            logprobs,
            forks: Vec::new(),
            drafts: None,
            acceptance: SequenceAcceptance::default(),
        }
    }
}

/// The proposer and the draft-length controller of an engine that speculates.
struct Speculation<B: Backend> {
    proposer: Box<dyn Proposer<B>>,
    control: DraftLengthController,
    stats: SpeculationStats,
    /// Off: the proposer is kept but nothing is drafted (A/B benchmarks).
    enabled: bool,
}

pub struct Engine<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: Vec<B::KvCache>,
    kv_manager: KvCacheManager,
    config: EngineConfig,
    max_context: usize,
    scheduler: Scheduler<Generation>,
    /// Samples waiting for their parent's prompt, and that parent.
    awaiting_fork: HashMap<SeqId, SeqId>,
    next_id: SeqId,
    computed_tokens: u64,
    generated_tokens: u64,
    steps: u64,
    speculation: Option<Speculation<B>>,
    /// Present when the backend records and `max_recorded_batch > 0`.
    recorder: Option<DecodeRecorder<B>>,
    /// Off: the recorder is kept but not used.
    recording: bool,
}

impl<B: Backend> Engine<B> {
    pub fn new(
        backend: B,
        files: &ModelFiles,
        config: EngineConfig,
        progress: Progress<'_>,
    ) -> Result<Self> {
        if config.block_size == 0 || config.num_blocks == 0 || config.max_batch_tokens == 0 {
            return Err(Error::InvalidRequest(
                "block size, KV blocks and batch tokens must all be positive".into(),
            ));
        }
        let scheduler = Scheduler::new(SchedulerConfig {
            max_batch_tokens: config.max_batch_tokens,
            max_running: config.max_running,
            max_waiting: config.max_waiting,
        })?;
        let model = Model::load(&backend, files, progress)?;
        let cfg = &model.config;
        let kv = model.alloc_kv_caches(
            &backend,
            config.num_blocks,
            config.block_size,
            config.kv_dtype,
        )?;
        let max_context = config
            .max_context
            .unwrap_or(cfg.max_context)
            .min(cfg.max_context);
        let mut engine = Self {
            backend,
            kv_manager: KvCacheManager::new(config.num_blocks, config.block_size),
            model,
            kv,
            config,
            max_context,
            scheduler,
            awaiting_fork: HashMap::new(),
            next_id: 0,
            computed_tokens: 0,
            generated_tokens: 0,
            steps: 0,
            speculation: None,
            recorder: None,
            recording: true,
        };
        let max_batch = engine.config.max_recorded_batch;
        if max_batch > 0 && engine.backend.can_record() {
            let longest = engine.max_context.min(engine.kv_capacity());
            let widest = rounded_width(longest.div_ceil(engine.config.block_size));
            engine.recorder = Some(DecodeRecorder::new(max_batch, widest));
        }
        Ok(engine)
    }

    /// Off: decode steps launch every kernel even where they could replay
    /// a recording (A/B benchmarks); the recordings are kept.
    pub fn enable_recording(&mut self, on: bool) {
        self.recording = on;
    }

    /// Turns on speculative decoding with `proposer` for every sequence
    /// (greedy or sampled; sequences that ask for logprobs decode plainly).
    pub fn set_speculation(
        &mut self,
        proposer: Box<dyn Proposer<B>>,
        length: DraftLength,
    ) -> Result<()> {
        if matches!(
            length,
            DraftLength::Fixed(0) | DraftLength::Adaptive { max: 0 }
        ) {
            return Err(Error::InvalidRequest(
                "the draft length must be at least 1".into(),
            ));
        }
        let mut proposer = proposer;
        let mut control = DraftLengthController::new(length);
        if let DraftLength::Adaptive { max } = length {
            self.measure_step_costs(&mut control, max)?;
            if let Some(secs) = proposer.measure_cost(&self.backend)? {
                control.observe_drafting(1, secs);
            }
        }
        self.speculation = Some(Speculation {
            proposer,
            control,
            stats: SpeculationStats::default(),
            enabled: true,
        });
        Ok(())
    }

    /// Times forward passes of 1 and `max + 1` rows so the draft-length
    /// controller starts from this device's costs instead of exploring.
    fn measure_step_costs(
        &mut self,
        control: &mut DraftLengthController,
        max: usize,
    ) -> Result<()> {
        let rows = (max + 1).min(self.max_context.saturating_sub(1)).max(1);
        let tokens = vec![0; rows];
        for n in [1, rows] {
            // The first pass warms up; the best of the other two counts.
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let clock = Stopwatch::start();
                self.score(&tokens[..n], n - 1)?;
                best = best.min(clock.seconds());
            }
            control.observe_step(n, best);
        }
        Ok(())
    }

    /// Pauses or resumes speculation set by [`Engine::set_speculation`].
    pub fn enable_speculation(&mut self, on: bool) {
        if let Some(spec) = &mut self.speculation {
            spec.enabled = on;
        }
    }

    /// What drafts, e.g. "n-gram"; `None` without speculation.
    pub fn speculation(&self) -> Option<String> {
        self.speculation.as_ref().map(|s| s.proposer.describe())
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.kv_manager
    }

    /// KV bytes per token over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = &self.model.config;
        c.num_layers
            * self.config.kv_dtype.bytes_per_token(
                c.num_kv_heads,
                c.head_dim,
                self.config.block_size,
            )
    }

    pub fn stats(&self) -> EngineStats {
        let s = self.scheduler.stats();
        EngineStats {
            running: self.scheduler.num_running(),
            waiting: self.scheduler.num_waiting() + self.awaiting_fork.len(),
            kv_blocks_used: self.kv_manager.num_used_blocks(),
            kv_blocks_free: self.kv_manager.num_free_blocks(),
            kv_blocks_cached: self.kv_manager.allocator().num_cached(),
            preemptions: s.preemptions,
            prompt_tokens: s.prompt_tokens,
            prefix_hit_tokens: s.prefix_hit_tokens,
            computed_tokens: self.computed_tokens,
            generated_tokens: self.generated_tokens,
            steps: self.steps,
            speculation: self
                .speculation
                .as_ref()
                .map(|s| s.stats.clone())
                .unwrap_or_default(),
            recorded_steps: self
                .recorder
                .as_ref()
                .map(|r| r.stats().clone())
                .unwrap_or_default(),
        }
    }

    /// Drops the reusable content of free KV blocks (benchmarks start cold with it).
    pub fn clear_prefix_cache(&mut self) {
        self.kv_manager.clear_prefix_cache();
    }

    /// Starts generating after `prompt`; `stop_tokens` end the turn.
    pub fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
    ) -> Result<SeqId> {
        let request = Request {
            stop_tokens,
            ..Request::new(prompt, params, max_new_tokens)
        };
        match self.submit(request) {
            Ok(ids) => Ok(ids[0]),
            Err(SubmitError::Rejected(e)) => Err(e),
            Err(e @ SubmitError::QueueFull(_)) => Err(Error::InvalidRequest(e.to_string())),
        }
    }

    /// Queues a request; returns one sequence per sample. Refused when the
    /// waiting queue is full or the request is malformed.
    pub fn submit(&mut self, request: Request) -> std::result::Result<Vec<SeqId>, SubmitError> {
        let Request {
            prompt,
            params,
            max_new_tokens,
            stop_tokens,
            priority,
            samples,
            logprobs,
        } = request;
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()).into());
        }
        if samples == 0 {
            return Err(Error::InvalidRequest("at least one sample is needed".into()).into());
        }
        self.check_tokens(&prompt)?;
        self.check_fits(prompt.len())?;
        if self.scheduler.queue_full(1) {
            return Err(SubmitError::QueueFull(self.scheduler.num_waiting()));
        }
        let ids: Vec<SeqId> = (0..samples as u64).map(|i| self.next_id + i).collect();
        self.next_id += samples as u64;
        let sampler = |i: usize| {
            Sampler::new(SamplingParams {
                seed: params.seed.wrapping_add(i as u64),
                ..params.clone()
            })
        };
        let generation = Generation {
            forks: ids[1..]
                .iter()
                .enumerate()
                .map(|(i, &id)| (id, sampler(i + 1)))
                .collect(),
            ..Generation::new(sampler(0), max_new_tokens, stop_tokens, logprobs)
        };
        for &child in &ids[1..] {
            self.awaiting_fork.insert(child, ids[0]);
        }
        self.scheduler.add(ids[0], prompt, priority, generation)?;
        Ok(ids)
    }

    /// Continues a finished sequence with more input (the next chat turn),
    /// reusing the K/V of everything before it.
    pub fn extend(&mut self, seq: SeqId, tokens: &[u32], max_new_tokens: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("nothing to continue with".into()));
        }
        self.check_tokens(tokens)?;
        let len = self.sequence(seq)?.tokens.len();
        self.check_fits(len + tokens.len())?;
        self.scheduler.resume(seq)?;
        let s = self.scheduler.get_mut(seq).expect("checked above");
        s.tokens.extend_from_slice(tokens);
        s.data.finished = None;
        s.data.n_generated = 0;
        s.data.max_new_tokens = max_new_tokens;
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(Error::InvalidRequest(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            ))),
            None => Ok(()),
        }
    }

    fn check_fits(&self, len: usize) -> Result<()> {
        if len >= self.max_context {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {len} tokens but the context holds {} (leaving room for at least one new token)",
                self.max_context
            )));
        }
        let capacity = self.kv_capacity();
        if len >= capacity {
            return Err(Error::KvCacheFull(format!(
                "the prompt has {len} tokens but the KV cache holds {capacity}"
            )));
        }
        Ok(())
    }

    /// Tokens the whole KV pool holds: no sequence grows past it, so any
    /// sequence alone always fits.
    fn kv_capacity(&self) -> usize {
        self.kv_manager.num_blocks() * self.kv_manager.block_size()
    }

    fn sequence(&self, seq: SeqId) -> Result<&SchedSeq<Generation>> {
        self.scheduler
            .get(seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))
    }

    pub fn tokens(&self, seq: SeqId) -> Option<&[u32]> {
        self.scheduler.get(seq).map(|s| s.tokens.as_slice())
    }

    pub fn is_finished(&self, seq: SeqId) -> bool {
        !self.awaiting_fork.contains_key(&seq)
            && self
                .scheduler
                .get(seq)
                .is_none_or(|s| s.status() == SeqStatus::Finished)
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    pub fn num_running(&self) -> usize {
        self.scheduler.num_running()
    }

    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    /// Keeps only the first `n_tokens` tokens of a finished sequence, with
    /// their K/V, so it can be continued differently (chat history edits).
    pub fn rewind(&mut self, seq: SeqId, n_tokens: usize) -> Result<()> {
        self.scheduler.rewind(seq, n_tokens)?;
        let computed = self.sequence(seq)?.num_computed();
        self.kv_manager.truncate(seq, computed)
    }

    /// Forgets `seq` and frees its KV blocks at once. Samples still waiting
    /// for its prompt become requests of their own.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(parent) = self.awaiting_fork.remove(&seq) {
            if let Some(p) = self.scheduler.get_mut(parent) {
                p.data.forks.retain(|(id, _)| *id != seq);
            }
            return;
        }
        let Some(s) = self.scheduler.remove(seq) else {
            return;
        };
        self.kv_manager.free(seq);
        if let Some(spec) = &mut self.speculation {
            spec.proposer.forget(seq);
        }
        let priority = s.priority();
        for (child, sampler) in s.data.forks {
            self.awaiting_fork.remove(&child);
            let generation = Generation::new(
                sampler,
                s.data.max_new_tokens,
                s.data.stop_tokens.clone(),
                s.data.logprobs,
            );
            // A parent with pending samples has not sampled yet: its tokens are the prompt.
            self.scheduler
                .add(child, s.tokens.clone(), priority, generation)
                .expect("a fresh id and a non-empty prompt");
        }
    }

    /// Runs one iteration: the scheduler picks decode tokens and prompt
    /// chunks within `max_batch_tokens` (preempting when KV blocks run
    /// out), they run as one forward pass, and every sequence whose tokens
    /// are all computed samples its next one. Returns the sampled tokens.
    ///
    /// The same as [`Engine::begin_step`], a blocking read of its
    /// [`Readback`], then [`Engine::finish_step`].
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        let pending = self.begin_step()?;
        let values = match &pending.readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => {
                ReadValues::Logits(self.backend.download(tensor, *len)?)
            }
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.backend.download_indices(ids, *len)?)
            }
        };
        self.finish_step(pending, values)
    }

    /// The first half of [`Engine::step`]: schedules the batch and queues its
    /// forward pass (and the argmax of greedy batches) without reading
    /// anything back. Read the returned step's [`PendingStep::readback`] (with
    /// an async download where blocking is not allowed, as in the browser)
    /// and hand the values to [`Engine::finish_step`] before anything else
    /// touches the engine.
    pub fn begin_step(&mut self) -> Result<PendingStep<B>> {
        self.propose_drafts()?;
        let started = Stopwatch::start();
        let schedule = self.scheduler.schedule(&mut self.kv_manager)?;
        self.drop_unscheduled_drafts(&schedule)?;
        if schedule.chunks.is_empty() {
            if self.scheduler.num_waiting() > 0 && self.scheduler.num_running() == 0 {
                return Err(Error::KvCacheFull(format!(
                    "{} requests wait but finished sequences hold all {} KV blocks",
                    self.scheduler.num_waiting(),
                    self.kv_manager.num_blocks()
                )));
            }
            return Ok(PendingStep {
                seqs: Vec::new(),
                readback: Readback::Nothing,
                rows: 0,
                started,
                lent_by_recorder: None,
            });
        }
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
        for c in &schedule.chunks {
            if !c.reservation.copies.is_empty() {
                for cache in &mut self.kv {
                    self.backend.copy_kv_blocks(cache, &c.reservation.copies)?;
                }
            }
            let s = self.scheduler.get(c.seq).expect("scheduled");
            let table = self
                .kv_manager
                .table(c.seq)
                .expect("reserved by the scheduler");
            let first_row = batch.rows();
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
        let recording = self.recording;
        let recorder = (self.recorder.as_mut()).filter(|r| recording && r.accepts(&batch));
        let (readback, lent_by_recorder) = match recorder {
            Some(recorder) => {
                let outputs = recorder.run(&self.backend, &self.model, &batch, &mut self.kv)?;
                let generation = outputs.generation;
                (self.lend_readback(outputs, &sampled), Some(generation))
            }
            None => {
                let logits = self.model.forward(&self.backend, &batch, &mut self.kv)?;
                (self.readback_for(logits, &sampled)?, None)
            }
        };
        self.scheduler.complete(&schedule, &mut self.kv_manager)?;
        Ok(PendingStep {
            seqs: sampled,
            readback,
            rows: batch.rows(),
            started,
            lent_by_recorder,
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

    /// Asks the proposer for drafts for every decoding sequence, as many as
    /// the controller chooses, and appends them as provisional tokens.
    fn propose_drafts(&mut self) -> Result<()> {
        let Some(spec) = self.speculation.as_mut().filter(|s| s.enabled) else {
            return Ok(());
        };
        let max_len = self
            .max_context
            .min(self.kv_manager.num_blocks() * self.kv_manager.block_size());
        let candidates: Vec<SeqId> = self
            .scheduler
            .sequences()
            .filter(|(_, s)| {
                s.is_decoding() && s.data.logprobs.is_none() && s.data.forks.is_empty()
            })
            .map(|(id, _)| id)
            .collect();
        let mut wanted = Vec::new();
        for &id in &candidates {
            let s = self.scheduler.get_mut(id).expect("listed above");
            let g = &mut s.data;
            // After k accepted drafts and one more token the sequence must still fit.
            let limit = (g.max_new_tokens.saturating_sub(g.n_generated + 1))
                .min(max_len.saturating_sub(s.tokens.len() + 1));
            let k = spec
                .control
                .choose(&mut g.acceptance, candidates.len(), limit);
            if k > 0 {
                wanted.push((id, k));
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let requests: Vec<DraftRequest<'_>> = wanted
            .iter()
            .map(|&(seq, k)| {
                let s = self.scheduler.get(seq).expect("listed above");
                DraftRequest {
                    seq,
                    context: &s.tokens,
                    k,
                    params: s.data.sampler.params(),
                }
            })
            .collect();
        let clock = Stopwatch::start();
        let drafts = spec.proposer.propose(&self.backend, &requests)?;
        let secs = clock.seconds();
        let vocab = self.model.config.vocab_size;
        let mut proposed = 0;
        for ((seq, k), mut draft) in wanted.into_iter().zip(drafts) {
            // A draft model with a larger vocabulary must not reach the embedding.
            let valid = draft
                .tokens
                .iter()
                .take(k)
                .take_while(|&&t| (t as usize) < vocab)
                .count();
            draft.tokens.truncate(valid);
            if let Some(d) = &mut draft.dists {
                d.truncate(valid);
            }
            if draft.tokens.is_empty() {
                continue;
            }
            proposed += valid;
            self.scheduler.push_drafts(seq, &draft.tokens)?;
            self.scheduler
                .get_mut(seq)
                .expect("listed above")
                .data
                .drafts = Some(draft);
        }
        spec.control.observe_drafting(proposed, secs);
        spec.stats.draft_seconds += secs;
        Ok(())
    }

    /// Drafts of sequences the scheduler preempted (it dropped their tokens)
    /// or left out of this step are forgotten.
    fn drop_unscheduled_drafts(&mut self, schedule: &Schedule) -> Result<()> {
        if self.speculation.is_none() {
            return Ok(());
        }
        let scheduled: HashSet<SeqId> = schedule.chunks.iter().map(|c| c.seq).collect();
        let drafted: Vec<SeqId> = self
            .scheduler
            .sequences()
            .filter(|(_, s)| s.data.drafts.is_some())
            .map(|(id, _)| id)
            .collect();
        for id in drafted {
            if !scheduled.contains(&id) {
                self.scheduler
                    .get_mut(id)
                    .expect("listed above")
                    .data
                    .drafts = None;
                if self.scheduler.get(id).is_some_and(|s| s.num_drafts() > 0) {
                    self.scheduler.settle_drafts(id, 0, &mut self.kv_manager)?;
                }
            }
        }
        Ok(())
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

    /// Whether any of `seqs` samples on the host (or reports logprobs)
    /// rather than taking the device's argmax.
    fn needs_host_logits(&self, seqs: &[(SeqId, usize)]) -> bool {
        seqs.iter().any(|&(id, _)| {
            let g = &self.scheduler.get(id).expect("sampled").data;
            !g.sampler.params().is_greedy() || g.logprobs.is_some()
        })
    }

    /// The second half of [`Engine::step`]: samples the next token of each
    /// sequence of `pending` from the host copy of its readback (verifying
    /// its drafts first, if it has any), forks pending samples off parents
    /// whose prompt is now computed, and applies the stop conditions.
    /// Returns the new tokens.
    pub fn finish_step(
        &mut self,
        pending: PendingStep<B>,
        values: ReadValues,
    ) -> Result<Vec<TokenEvent>> {
        let PendingStep {
            seqs,
            readback,
            rows: step_rows,
            started,
            lent_by_recorder,
        } = pending;
        let vocab = self.model.config.vocab_size;
        let (rows, argmax) = match (&readback, values) {
            (Readback::Nothing, ReadValues::Nothing) => return Ok(Vec::new()),
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
            for (child, sampler) in forks {
                self.awaiting_fork.remove(&child);
                self.kv_manager.fork(id, child)?;
                let parent = &self.scheduler.get(id).expect("sampled").data;
                let generation = Generation::new(
                    sampler,
                    parent.max_new_tokens,
                    parent.stop_tokens.clone(),
                    parent.logprobs,
                );
                self.scheduler.fork(id, child, generation)?;
                events.push(self.take_token(child, picks[0]));
            }
            events.push(self.take_token(id, picks[0]));
        }
        if let Some(spec) = &mut self.speculation {
            let secs = started.seconds();
            spec.control.observe_step(step_rows, secs);
            if verified {
                spec.stats.verify_seconds += secs;
            }
        }
        Ok(events)
    }

    /// Verifies the drafts of `seq` against its logits rows `picks` (one per
    /// covered draft, plus one), keeps the accepted ones and appends the
    /// verifier's next token, stopping early at a stop condition.
    fn finish_speculative(
        &mut self,
        seq: SeqId,
        draft: Draft,
        picks: &[Pick<'_>],
        events: &mut Vec<TokenEvent>,
    ) -> Result<()> {
        let max_len = self.max_context.min(self.kv_capacity());
        let covered = picks.len() - 1;
        let s = self.scheduler.get_mut(seq).expect("sampled");
        let mut context = s.accepted_tokens().to_vec();
        let history_len = context.len();
        let g = &mut s.data;
        let shaper = g.sampler.clone();
        let dists = draft.dists.as_deref().map(|d| &d[..covered]);
        let verdict = verify(
            &mut g.sampler,
            &draft.tokens[..covered],
            dists,
            |i, accepted| match picks[i] {
                Pick::Logits(row) => {
                    context.truncate(history_len);
                    context.extend_from_slice(accepted);
                    shaper.distribution(&mut row.to_vec(), &context)
                }
                Pick::Argmax(t) => vec![(t, 1.0)],
            },
        );
        g.acceptance.observe(covered, verdict.accepted);
        // Cut the emitted tokens at the first stop condition.
        let emitted: Vec<u32> = draft.tokens[..verdict.accepted]
            .iter()
            .copied()
            .chain([verdict.next])
            .collect();
        let stop = emitted
            .iter()
            .enumerate()
            .position(|(j, t)| {
                g.stop_tokens.contains(t)
                    || g.n_generated + j + 1 >= g.max_new_tokens
                    || history_len + j + 1 >= max_len
            })
            .unwrap_or(emitted.len() - 1);
        let emitted = &emitted[..=stop];
        let kept_drafts = emitted.len().min(verdict.accepted);
        if let Some(spec) = &mut self.speculation {
            spec.stats.verified_sequences += 1;
            spec.stats.proposed_tokens += covered as u64;
            spec.stats.accepted_tokens += verdict.accepted as u64;
            spec.stats.emitted_tokens += emitted.len() as u64;
        }
        self.scheduler
            .settle_drafts(seq, kept_drafts, &mut self.kv_manager)?;
        for (j, &token) in emitted.iter().enumerate() {
            let len_after = history_len + j + 1;
            if j >= kept_drafts {
                self.scheduler
                    .get_mut(seq)
                    .expect("sampled")
                    .tokens
                    .push(token);
            }
            events.push(self.record_token(seq, token, None, len_after));
        }
        Ok(())
    }

    /// Appends the next token of `seq`, from its logits row or the device's argmax.
    fn take_token(&mut self, seq: SeqId, pick: Pick<'_>) -> TokenEvent {
        let s = self.scheduler.get_mut(seq).expect("sampled");
        let g = &mut s.data;
        let (token, logprobs) = match pick {
            Pick::Logits(row) => {
                let token = g.sampler.sample(&mut row.to_vec(), &s.tokens);
                (token, g.logprobs.map(|top| token_logprobs(row, token, top)))
            }
            Pick::Argmax(token) => (token, None),
        };
        s.tokens.push(token);
        let len = s.tokens.len();
        self.record_token(seq, token, logprobs, len)
    }

    /// Counts `token`, already in `seq`'s tokens with `len_after` tokens up
    /// to and including it, and applies the stop conditions.
    fn record_token(
        &mut self,
        seq: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        len_after: usize,
    ) -> TokenEvent {
        let max_len = self.max_context.min(self.kv_capacity());
        let g = &mut self.scheduler.get_mut(seq).expect("sampled").data;
        g.n_generated += 1;
        if g.stop_tokens.contains(&token) {
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

    /// Logits of every position from `first_row` on, for `tokens` evaluated
    /// from scratch (perplexity, reference checks). Uses a temporary sequence
    /// whose blocks are freed before returning. Returns `[rows, vocab]`.
    pub fn score(&mut self, tokens: &[u32], first_row: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() || first_row >= tokens.len() {
            return Err(Error::InvalidRequest("nothing to score".into()));
        }
        self.check_tokens(tokens)?;
        self.check_fits(tokens.len() - 1)?;
        let id = self.next_id;
        self.next_id += 1;
        self.kv_manager.add_sequence(id)?;
        let result = self.score_chunks(id, tokens, first_row);
        self.kv_manager.free(id);
        result
    }

    fn score_chunks(&mut self, id: SeqId, tokens: &[u32], first_row: usize) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let bs = self.kv_manager.block_size();
        let mut out = Vec::with_capacity((tokens.len() - first_row) * vocab);
        for (chunk_idx, chunk) in tokens.chunks(self.config.max_batch_tokens).enumerate() {
            let start = chunk_idx * self.config.max_batch_tokens;
            let res = self.kv_manager.reserve(id, chunk.len())?;
            let table = self.kv_manager.table(id).expect("added by caller");
            let mut batch = ForwardBatch::new(bs, table.blocks().len());
            batch.push_sequence(chunk, start, &res.slots, table.blocks());
            batch.logit_rows = (first_row.max(start)..start + chunk.len())
                .map(|p| (p - start) as u32)
                .collect();
            let logits = self.model.forward(&self.backend, &batch, &mut self.kv)?;
            if !batch.logit_rows.is_empty() {
                out.extend(
                    self.backend
                        .download(&logits, batch.logit_rows.len() * vocab)?,
                );
            }
        }
        Ok(out)
    }
}

/// Log-softmax of `row` at `token`, and the `top` most likely tokens.
/// The block-table width of a step whose longest table has `blocks`
/// entries. The width is a launch parameter of attention: rounding it up to
/// a power of two keeps the recorded decode shapes few, and eager steps use
/// the same widths, so both run the same launches.
fn rounded_width(blocks: usize) -> usize {
    blocks.max(1).next_power_of_two()
}

fn token_logprobs(row: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = row
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
        + max;
    let mut best: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l - log_sum))
        .collect();
    let by_logprob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let top = top.min(best.len());
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, by_logprob);
    }
    best.truncate(top);
    best.sort_unstable_by(by_logprob);
    TokenLogprobs {
        logprob: row
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| l - log_sum),
        top: best,
    }
}
