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
//!
//! A step that fails on the device ends the sequences in it and no other
//! ([`StepError`]); the engine keeps serving the rest.
//!
//! `api` holds what goes in and out (configuration, requests, token
//! events, step errors, statistics); `step` runs one iteration (scheduling,
//! the forward pass, sampling); `drafts` speculation (turning it on, and
//! proposing, dropping and verifying drafts inside a step); `eviction`
//! keeps each sequence within its KV budget (scores, eviction); `failure`
//! ends the sequences of a failed step; `scoring` evaluates a token
//! sequence from scratch (perplexity, reference checks); this file holds
//! the engine's state and the admission and removal of requests.

mod api;
mod drafts;
mod eviction;
mod failure;
mod scoring;
mod step;

pub use api::{
    EngineConfig, EngineStats, FinishReason, Request, StepError, TokenEvent, TokenLogprobs,
    DEFAULT_MAX_RECORDED_BATCH,
};
pub use step::{PendingStep, ReadValues, Readback};

use std::collections::HashMap;

use crate::backend::Backend;
use crate::kv::{EvictionPlan, EvictionPolicy, KvCacheManager, KvPlan, KvPrecision, SeqId};
use crate::model::forward::{LoadOptions, Model, Progress};
use crate::model::kv_calibration::calibrate_kv;
use crate::model::recorded::DecodeRecorder;
use crate::model::ModelFiles;
use crate::sched::{
    Sampler, SamplingParams, SchedSeq, Scheduler, SchedulerConfig, SeqStatus, SequenceConstraint,
    SubmitError,
};
use crate::spec::{Draft, DraftLengthController, Proposer, SequenceAcceptance, SpeculationStats};
use crate::{Error, Result};
use step::rounded_width;

/// What the engine keeps per sequence beside its tokens.
#[derive(Debug)]
struct Generation {
    sampler: Sampler,
    max_new_tokens: usize,
    n_generated: usize,
    stop_tokens: Vec<u32>,
    finished: Option<FinishReason>,
    logprobs: Option<usize>,
    /// The grammar its output follows, advanced by every emitted token.
    constraint: Option<SequenceConstraint>,
    /// Further samples of this prompt, forked from it (sharing its blocks)
    /// when its prompt is computed, each with its own sampler and constraint.
    forks: Vec<(SeqId, Sample)>,
    /// The drafts riding in the current step, if any.
    drafts: Option<Draft>,
    acceptance: SequenceAcceptance,
    /// Its KV budget, if any (`crate::kv::eviction`).
    eviction: Option<EvictionPlan>,
}

/// What is each sample's own: its random stream and its grammar state.
#[derive(Debug)]
struct Sample {
    sampler: Sampler,
    constraint: Option<SequenceConstraint>,
}

impl Generation {
    fn new(
        sample: Sample,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        logprobs: Option<usize>,
        eviction: Option<EvictionPlan>,
    ) -> Self {
        Self {
            sampler: sample.sampler,
            max_new_tokens,
            n_generated: 0,
            stop_tokens,
            finished: None,
            logprobs,
            constraint: sample.constraint,
            forks: Vec::new(),
            drafts: None,
            acceptance: SequenceAcceptance::default(),
            eviction,
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
    /// The dtypes of `kv`, layer by layer.
    kv_plan: KvPlan,
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
    /// The KV budget of requests that set none.
    eviction: Option<EvictionPlan>,
    /// Whether the caches keep key bounds (sparse drafting).
    key_bounds: bool,
}

/// The plan `config.kv_precision` asks for: a uniform one, the one given
/// (checked against the model when its caches are allocated), or one
/// calibrated on the model now.
fn resolve_kv_plan<B: Backend>(
    model: &Model<B>,
    backend: &B,
    config: &EngineConfig,
) -> Result<KvPlan> {
    let layers = model.config.num_layers;
    match &config.kv_precision {
        KvPrecision::Uniform(dtype) => Ok(KvPlan::uniform(*dtype, layers)),
        KvPrecision::Plan(plan) => Ok(plan.clone()),
        KvPrecision::Auto(auto) => {
            let tokens = &auto.calibration[..auto.calibration.len().min(config.max_batch_tokens)];
            Ok(calibrate_kv(
                model,
                backend,
                tokens,
                config.block_size,
                auto.bits_per_element,
            )?
            .plan)
        }
    }
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
        if files.config.reads_hidden {
            return Err(Error::InvalidRequest(format!(
                "{} is an EAGLE head: it drafts from its target's hidden states \
                 (--speculate draft:DIR) and does not run alone",
                files.path.display()
            )));
        }
        if let Some(tokens) = &files.config.output_tokens {
            return Err(Error::InvalidRequest(format!(
                "{} predicts {} of its {} tokens (a draft with a reduced output vocabulary): \
                 it drafts for its target (--speculate draft:DIR) and does not run alone",
                files.path.display(),
                tokens.len(),
                files.config.vocab_size
            )));
        }
        let scheduler = Scheduler::new(SchedulerConfig {
            max_batch_tokens: config.max_batch_tokens,
            max_running: config.max_running,
            max_waiting: config.max_waiting,
        })?;
        let options = LoadOptions {
            layers: None,
            unfused: config.unfused,
            parallel: config.parallel.as_ref(),
        };
        let model = Model::load_with(&backend, files, options, progress)?;
        let cfg = &model.config;
        let kv_plan = resolve_kv_plan(&model, &backend, &config)?;
        let kv = model.alloc_planned_kv_caches(
            &backend,
            config.num_blocks,
            config.block_size,
            &kv_plan,
        )?;
        let max_context = config
            .max_context
            .unwrap_or(cfg.max_context)
            .min(cfg.max_context);
        let eviction = config
            .kv_eviction
            .map(|c| c.plan(max_context, config.block_size))
            .transpose()?;
        let mut engine = Self {
            backend,
            kv_manager: KvCacheManager::new(config.num_blocks, config.block_size),
            model,
            kv,
            kv_plan,
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
            eviction,
            key_bounds: false,
        };
        let max_batch = engine.config.max_recorded_batch;
        // A MoE layer reads its routing back to group rows by expert, which
        // a recording cannot do: MoE models decode eagerly.
        let routed = engine.model.config.moe.is_some();
        // Nor do the collectives of a split model.
        let split = engine.model.placement().is_some();
        if split && engine.eviction.is_some_and(|e| e.policy.needs_scores()) {
            return Err(Error::Unsupported(
                "KV eviction by attention score on a split model (use --kv-evict streaming)".into(),
            ));
        }
        if max_batch > 0 && engine.backend.can_record() && !routed && !split {
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
        self.kv_plan
            .bytes_per_token(self.model.kv_shape(self.config.block_size))
    }

    /// Bytes per token of the key bounds sparse drafting keeps beside the
    /// KV cache over all layers (0 without it), rounded up.
    pub fn key_bounds_bytes_per_token(&self) -> usize {
        if !self.key_bounds {
            return 0;
        }
        let block_size = self.config.block_size;
        self.model
            .config
            .key_bounds_block_bytes(block_size)
            .div_ceil(block_size)
    }

    /// Each layer's KV dtypes, as configured or calibrated.
    pub fn kv_plan(&self) -> &KvPlan {
        &self.kv_plan
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
        self.add(Request {
            stop_tokens,
            ..Request::new(prompt, params, max_new_tokens)
        })
    }

    /// Starts generating after a one-sample request: [`Engine::submit`]
    /// with a full queue an invalid request.
    pub fn add(&mut self, request: Request) -> Result<SeqId> {
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
            constraint,
            kv_eviction,
        } = request;
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()).into());
        }
        if samples == 0 {
            return Err(Error::InvalidRequest("at least one sample is needed".into()).into());
        }
        self.check_tokens(&prompt)?;
        let biased: Vec<u32> = params.logit_bias.iter().map(|&(t, _)| t).collect();
        self.check_tokens(&biased)
            .map_err(|e| Error::InvalidRequest(format!("logit_bias: {e}")))?;
        let eviction = self.eviction_plan(kv_eviction)?;
        self.check_fits(prompt.len(), eviction.as_ref())?;
        if self.scheduler.queue_full(1) {
            return Err(SubmitError::QueueFull(self.scheduler.num_waiting()));
        }
        let mut started = Vec::with_capacity(samples);
        for i in 0..samples {
            let sampler = Sampler::new(SamplingParams {
                seed: params.seed.wrapping_add(i as u64),
                ..params.clone()
            })
            .with_prompt_len(prompt.len());
            let constraint = match &constraint {
                Some(factory) => Some(SequenceConstraint::new(factory.start()?)),
                None => None,
            };
            started.push(Sample {
                sampler,
                constraint,
            });
        }
        let ids: Vec<SeqId> = (0..samples as u64).map(|i| self.next_id + i).collect();
        self.next_id += samples as u64;
        let mut samples = started.into_iter();
        let first = samples.next().expect("at least one sample");
        let generation = Generation {
            forks: ids[1..].iter().copied().zip(samples).collect(),
            ..Generation::new(first, max_new_tokens, stop_tokens, logprobs, eviction)
        };
        for &child in &ids[1..] {
            self.awaiting_fork.insert(child, ids[0]);
        }
        self.scheduler.add(ids[0], prompt, priority, generation)?;
        Ok(ids)
    }

    /// Continues a finished sequence with more input (the next chat turn),
    /// reusing the K/V of everything before it. The continuation is not
    /// constrained: the request's grammar described its own output only.
    pub fn extend(&mut self, seq: SeqId, tokens: &[u32], max_new_tokens: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("nothing to continue with".into()));
        }
        self.check_tokens(tokens)?;
        let s = self.sequence(seq)?;
        let (len, eviction) = (s.tokens.len(), s.data.eviction);
        self.check_fits(len + tokens.len(), eviction.as_ref())?;
        self.scheduler.resume(seq)?;
        let s = self.scheduler.get_mut(seq).expect("checked above");
        s.tokens.extend_from_slice(tokens);
        s.data.finished = None;
        s.data.n_generated = 0;
        s.data.max_new_tokens = max_new_tokens;
        s.data.constraint = None;
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

    fn check_fits(&self, len: usize, eviction: Option<&EvictionPlan>) -> Result<()> {
        if len >= self.max_context {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {len} tokens but the context holds {} (leaving room for at least one new token)",
                self.max_context
            )));
        }
        // SnapKV holds a prompt whole until it is computed.
        let capacity = match eviction {
            Some(plan) if plan.policy == EvictionPolicy::SnapKv => self.capacity_for(None),
            plan => self.capacity_for(plan),
        };
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
    /// Refused, changing nothing, when the cut lands in an evicted KV block
    /// (a KV budget): the caller then starts a new sequence.
    pub fn rewind(&mut self, seq: SeqId, n_tokens: usize) -> Result<()> {
        let computed = self.sequence(seq)?.num_computed().min(n_tokens);
        if !self.kv_manager.can_truncate(seq, computed) {
            return Err(Error::InvalidRequest(format!(
                "cannot rewind sequence {seq} to {n_tokens} tokens: that KV was evicted"
            )));
        }
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
        for (child, sample) in s.data.forks {
            self.awaiting_fork.remove(&child);
            let generation = Generation::new(
                sample,
                s.data.max_new_tokens,
                s.data.stop_tokens.clone(),
                s.data.logprobs,
                s.data.eviction,
            );
            // A parent with pending samples has not sampled yet: its tokens are the prompt.
            self.scheduler
                .add(child, s.tokens.clone(), priority, generation)
                .expect("a fresh id and a non-empty prompt");
        }
    }
}
