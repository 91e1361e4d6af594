//! The engine's vocabulary: its configuration, the requests it takes, the
//! tokens it produces, how a failed step is reported and the statistics it
//! reports.

use crate::kv::KvPrecision;
use crate::kv::{EvictionConfig, SeqId, DEFAULT_BLOCK_SIZE};
use crate::model::recorded::RecordingStats;
use crate::parallel::Job;
use crate::sched::{Priority, SamplingParams, SharedConstraintFactory};
use crate::spec::SpeculationStats;
use crate::Error;

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
    /// How each layer's keys and values are stored: one dtype, a plan, or
    /// a plan calibrated once the model is loaded (`--kv-dtype auto`).
    pub kv_precision: KvPrecision,
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
    /// KV eviction for every sequence (`--kv-budget`, `--kv-evict`, ...);
    /// `None` keeps all of a sequence's KV. A request may set its own.
    pub kv_eviction: Option<EvictionConfig>,
    /// Run the unfused kernels even where the backend has fused matmuls
    /// (`bench --unfused`: the reference of the fusion figures).
    pub unfused: bool,
    /// The ranks this model is split over (tensor, pipeline and expert
    /// parallelism); this engine runs on rank 0, the others follow
    /// (`Model::follow`).
    pub parallel: Option<Job>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: 256,
            max_batch_tokens: 512,
            kv_precision: KvPrecision::default(),
            max_context: None,
            max_running: 256,
            max_waiting: 1024,
            max_recorded_batch: DEFAULT_MAX_RECORDED_BATCH,
            kv_eviction: None,
            unfused: false,
            parallel: None,
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

impl TokenLogprobs {
    /// Log-softmax of `row` at `token`, and the `top` most likely tokens.
    pub fn from_logits(row: &[f32], token: u32, top: usize) -> Self {
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
        Self {
            logprob: row
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&l| l - log_sum),
            top: best,
        }
    }
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

/// A step that failed: a kernel, a lost device, a refused allocation, or
/// the host's readback of the step. The engine has already removed the
/// sequences in `failed` (the step's own, with the samples still waiting
/// for their prompt) and freed their KV blocks; every other sequence is as
/// it was before the step, so the caller reports `error` to the owners of
/// `failed` and keeps stepping. `failed` is empty when the step stopped
/// before touching any sequence (every waiting request is blocked: finished
/// sequences hold the whole KV pool).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct StepError {
    /// In increasing order, each once.
    pub failed: Vec<SeqId>,
    pub error: Error,
}

impl From<StepError> for Error {
    fn from(e: StepError) -> Error {
        e.error
    }
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
    /// The grammar every sample's output must follow (structured output);
    /// each sample starts its own state. Sampling, greedy included, then
    /// happens on the host among the allowed tokens; once the grammar is
    /// complete only `stop_tokens` may follow.
    pub constraint: Option<SharedConstraintFactory>,
    /// KV eviction for this request's sequences instead of the engine's.
    pub kv_eviction: Option<EvictionConfig>,
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
            constraint: None,
            kv_eviction: None,
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
