//! `tandem bench`: prefill and decode throughput, measured like llama-bench
//! (pp512: one 512-token prompt; tg128: 128 tokens decoded one at a time from
//! an empty context, or both after a `--depth` of context), repeated and
//! reported as mean ± standard deviation. `--batch` instead decodes several
//! sequences at once, like llama-batched-bench ([`batch`]).
//! Where the backend records decode steps (CUDA graphs), each decode
//! repetition also runs with recording off, on the same prompt, and the
//! speedup of replaying over launching is reported with it. With `--tp T`
//! and/or `--pp P` (rank 0 of an MPI job) the bytes and time of the ranks'
//! all-reduces and stage-to-stage sends are reported too (`comm`).

mod batch;
mod comm;

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use tandem_core::engine::Engine;
use tandem_core::kv::SeqId;
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::{Rng, SamplingParams};
use tandem_core::Backend;

use super::speculate::SpeculationArgs;
use super::{build_engine, KvEvictionArgs, ModelArgs};
use crate::backend_select::{dispatch, WithBackend};
use comm::{Collectives, Phase};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv_eviction: KvEvictionArgs,
    /// Prompt tokens for the prefill test.
    #[arg(long, short = 'p', default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode test.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub gen_tokens: usize,
    #[arg(long, short = 'r', default_value_t = 3)]
    pub repetitions: usize,
    /// Run both tests after a context of this many tokens (llama-bench's
    /// `-d`): the prompt is prefilled, and the tokens decoded, at this depth.
    #[arg(long, short = 'd', default_value_t = 0)]
    pub depth: usize,
    /// Instead of pp/tg, run this many sequences at once, for each count
    /// given (`--batch 1,2,4,8`): each has a `-p`-token prompt and generates
    /// `-n` tokens (llama-batched-bench's `-npl`, `-npp` and `-ntg`).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "N,...",
        conflicts_with = "depth",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub batch: Vec<u16>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Benchmark a model of this shape with random weights instead of a file:
    /// `smollm2-135m`, `llama3-8b`, `tiny`, the MoE shapes `olmoe-1b-7b`
    /// (and `olmoe-1b-7b-dense`, its active parameters as one dense FFN),
    /// `qwen1.5-moe-a2.7b`, `mixtral-8x7b`.
    #[arg(long, value_name = "SHAPE")]
    pub random_weights: Option<String>,
    /// Run each MoE expert on one row at a time instead of on all the rows
    /// routed to it together (the ungrouped baseline of prefill).
    #[arg(long)]
    pub ungrouped_experts: bool,
    /// Only the first N layers of the random-weights shape (a large MoE
    /// shape at reduced depth).
    #[arg(long, value_name = "N", requires = "random_weights")]
    pub layers: Option<usize>,
    /// Storage format of the random weights' matrices.
    #[arg(long, value_enum, default_value = "q4_1", requires = "random_weights")]
    pub weight_format: RandomWeightFormat,
    /// With `--speculate`/`--cascade`: also decode these prompts with and without
    /// speculation and compare (greedy; the outputs must be identical).
    #[command(flatten)]
    pub speculation: SpeculationArgs,
    /// Tokens generated per prompt in the speculation comparison.
    #[arg(long, default_value_t = 128)]
    pub spec_tokens: usize,
}

/// Prompts of the speculation comparison: repetitive ones (where n-gram
/// drafting shines) and free prose.
const SPEC_PROMPTS: [(&str, &str); 3] = [
    (
        "code",
        "Here is a Python class:\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __add__(self, other):\n        return Point(self.x + other.x, self.y + other.y)\n\nRewrite it with a third coordinate z, keeping the same style.",
    ),
    (
        "list",
        "Write the days of the week, then the same list again in reverse order, one per line.",
    ),
    ("prose", "Tell me a short story about a lighthouse keeper."),
];

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum RandomWeightFormat {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

impl From<RandomWeightFormat> for WeightFormat {
    fn from(f: RandomWeightFormat) -> Self {
        match f {
            RandomWeightFormat::F32 => WeightFormat::F32,
            RandomWeightFormat::F16 => WeightFormat::F16,
            RandomWeightFormat::Bf16 => WeightFormat::BF16,
            RandomWeightFormat::Q8_0 => WeightFormat::Q8_0,
            RandomWeightFormat::Q4_0 => WeightFormat::Q4_0,
            RandomWeightFormat::Q4_1 => WeightFormat::Q4_1,
        }
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    dispatch(args.model.target(), args)
}

/// Mean and sample standard deviation.
fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Seconds to run `prompt` and generate `n` tokens (a prefill test is
/// `n = 1`), and the tokens generated.
fn time_request<B: Backend>(
    engine: &mut Engine<B>,
    prompt: Vec<u32>,
    n: usize,
) -> Result<(f64, Vec<u32>)> {
    let seq = engine.add_request(prompt, SamplingParams::default(), n, Vec::new())?;
    time_to_end(engine, seq)
}

/// Steps `seq` until it finishes and removes it: the seconds that took and
/// the tokens it generated meanwhile.
fn time_to_end<B: Backend>(engine: &mut Engine<B>, seq: SeqId) -> Result<(f64, Vec<u32>)> {
    let before = engine.tokens(seq).map_or(0, <[u32]>::len);
    let t = Instant::now();
    while !engine.is_finished(seq) {
        engine.step()?;
    }
    let secs = t.elapsed().as_secs_f64();
    let tokens = engine.tokens(seq).unwrap_or_default()[before..].to_vec();
    engine.remove(seq);
    Ok((secs, tokens))
}

/// Seconds to prefill `prompt` after `context` (llama-bench's pp at a
/// depth), and the tokens fed through the model meanwhile. The context runs
/// first, untimed, and the timed request finds its KV in the prefix cache.
fn time_prefill<B: Backend>(
    engine: &mut Engine<B>,
    context: &[u32],
    prompt: &[u32],
) -> Result<(f64, usize)> {
    if !context.is_empty() {
        time_request(engine, context.to_vec(), 1)?;
    }
    let before = engine.stats().computed_tokens;
    let (secs, _) = time_request(engine, [context, prompt].concat(), 1)?;
    let computed = (engine.stats().computed_tokens - before) as usize;
    // Only full blocks are shared: the context's partial last block is fed again.
    if computed >= prompt.len() + engine.config().block_size {
        anyhow::bail!(
            "--depth {}: the context's KV was not reused but computed again ({computed} tokens fed for a {}-token prompt)",
            context.len(),
            prompt.len()
        );
    }
    Ok((secs, computed))
}

/// Adds `prompt` to generate `n` tokens after its first, and steps until
/// that first token: from there on the request only decodes.
fn prefilled_request<B: Backend>(
    engine: &mut Engine<B>,
    prompt: Vec<u32>,
    n: usize,
) -> Result<SeqId> {
    let len = prompt.len();
    let seq = engine.add_request(prompt, SamplingParams::default(), n + 1, Vec::new())?;
    while awaits_first_token(engine, seq, len) {
        engine.step()?;
    }
    Ok(seq)
}

/// Whether `seq`, of a `prompt_len`-token prompt, runs without a generated
/// token yet.
fn awaits_first_token<B: Backend>(engine: &Engine<B>, seq: SeqId, prompt_len: usize) -> bool {
    !engine.is_finished(seq) && engine.tokens(seq).is_some_and(|t| t.len() == prompt_len)
}

/// Mean and standard deviation, zeros for no samples.
fn summary(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        (0.0, 0.0)
    } else {
        mean_sd(xs)
    }
}

impl BenchArgs {
    /// The model benchmarked: the file, or the random-weights shape.
    pub fn model_files(&self) -> Result<ModelFiles> {
        match &self.random_weights {
            Some(shape) => {
                let model = SyntheticModel::preset(shape, self.weight_format.into(), 0)?;
                match self.layers {
                    Some(n) => model.with_layers(n)?,
                    None => model,
                }
                .files()
                .map_err(anyhow::Error::from)
            }
            None => self.model.load_files(),
        }
    }
}

impl WithBackend for BenchArgs {
    type Output = ();

    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let mut files = self.model_files()?;
        if let Some(moe) = files.config.moe.as_mut() {
            moe.group_rows = !self.ungrouped_experts;
        }
        // The speculation prompts are chat-templated and under 256 tokens.
        let spec_ctx = if self.speculation.is_on() {
            256 + self.spec_tokens
        } else {
            0
        };
        let per_sequence = if self.batch.is_empty() {
            self.depth + self.prompt_tokens.max(self.gen_tokens + 1)
        } else {
            self.prompt_tokens.max(1) + self.gen_tokens
        };
        let ctx = (per_sequence.max(spec_ctx) + 2).min(files.config.max_context);
        let sequences = self.batch.iter().max().map_or(1, |&n| n as usize);
        let mut engine = build_engine(
            backend,
            &self.model,
            &self.kv_eviction,
            &files,
            ctx,
            sequences,
        )?;
        let vocab = files.config.vocab_size;
        let mut rng = Rng::new(42);
        // Warm-up: first-touch of weights and buffers is not what we measure.
        let warmup = random_tokens(&mut rng, 16.min(self.prompt_tokens).max(1), vocab);
        time_request(&mut engine, warmup, 1)?;
        if self.batch.is_empty() {
            self.bench_one_sequence(&mut engine, &files, &mut rng)?;
        } else {
            batch::bench(&mut engine, &self, &mut rng)?;
        }
        if self.speculation.is_on() {
            self.compare_speculation(&mut engine, &files)?;
        }
        Ok(())
    }
}

impl BenchArgs {
    /// pp and tg, each request alone: the figures llama-bench reports.
    fn bench_one_sequence<B: Backend>(
        &self,
        engine: &mut Engine<B>,
        files: &ModelFiles,
        rng: &mut Rng,
    ) -> Result<()> {
        let info = engine.backend().info();
        let vocab = files.config.vocab_size;
        // The A/B of recorded decode: only where the backend records.
        let graph_batch = self.model.graph_batch;
        let compare_graphs = graph_batch > 0 && engine.backend().can_record();
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        let mut decode_eager = Vec::new();
        let mut launches_per_token = None;
        let mut collectives = Collectives::of_job();
        for _ in 0..self.repetitions.max(1) {
            if self.prompt_tokens > 0 {
                let context = random_tokens(rng, self.depth, vocab);
                let prompt = random_tokens(rng, self.prompt_tokens, vocab);
                let mark = collectives.mark(engine);
                let (secs, computed) = time_prefill(engine, &context, &prompt)?;
                collectives.add(Phase::Prefill, mark, engine, secs);
                prefill.push(computed as f64 / secs);
            }
            if self.gen_tokens > 0 {
                // The context (one token without `--depth`), then `gen_tokens`
                // single-token forward passes.
                let prompt = random_tokens(rng, self.depth.max(1), vocab);
                let seq = prefilled_request(engine, prompt.clone(), self.gen_tokens)?;
                let before = engine.backend().kernel_launches();
                let mark = collectives.mark(engine);
                let (secs, tokens) = time_to_end(engine, seq)?;
                collectives.add(Phase::Decode, mark, engine, secs);
                decode.push(tokens.len() as f64 / secs);
                // Every generated token is one single-row forward pass.
                if let (Some(a), Some(b)) = (before, engine.backend().kernel_launches()) {
                    launches_per_token = Some((b - a) as f64 / tokens.len().max(1) as f64);
                }
                if compare_graphs {
                    engine.enable_recording(false);
                    let seq = prefilled_request(engine, prompt, self.gen_tokens)?;
                    let (secs, eager_tokens) = time_to_end(engine, seq)?;
                    engine.enable_recording(true);
                    decode_eager.push(eager_tokens.len() as f64 / secs);
                    if eager_tokens != tokens {
                        anyhow::bail!(
                            "decoding with recorded steps gave other tokens than without"
                        );
                    }
                }
            }
        }
        let (pp, pp_sd) = summary(&prefill);
        let (tg, tg_sd) = summary(&decode);
        let (tg_eager, tg_eager_sd) = summary(&decode_eager);
        let recorded = engine.stats().recorded_steps;
        let weight_bytes = engine.model().weight_bytes;
        let (total_params, active_params) = engine.model().config.parameter_counts();
        let layers = engine.model().config.num_layers.max(1) as f64;
        if self.json {
            let mut obj = serde_json::json!({
                "model": files.path.display().to_string(),
                "backend": info.name,
                "device": info.device,
                "prompt_tokens": self.prompt_tokens,
                "gen_tokens": self.gen_tokens,
                "repetitions": self.repetitions,
                "prefill_tokens_per_s": pp,
                "prefill_tokens_per_s_sd": pp_sd,
                "decode_tokens_per_s": tg,
                "decode_tokens_per_s_sd": tg_sd,
                "weight_bytes": weight_bytes,
                "parameters": total_params,
                "active_parameters": active_params,
                "kv_dtype": self.model.kv_dtype.to_string(),
                "kv_plan": engine.kv_plan().to_string(),
                "kv_bytes_per_token": engine.kv_bytes_per_token(),
                "kv_eviction": self.kv_eviction.describe(),
                "unfused": self.model.unfused,
                "launches_per_token": launches_per_token,
                "launches_per_layer": launches_per_token.map(|l| l / layers),
                "decode_weight_bandwidth_gb_per_s": tg * weight_bytes as f64 / 1e9,
                "graph_batch": if compare_graphs { graph_batch } else { 0 },
                "decode_eager_tokens_per_s": tg_eager,
                "decode_eager_tokens_per_s_sd": tg_eager_sd,
                "graph_speedup": if tg_eager > 0.0 { tg / tg_eager } else { 0.0 },
                "graphs_recorded": recorded.recorded,
                "graph_replays": recorded.replayed,
                "graph_failures": recorded.failed,
                "graph_last_error": recorded.last_error,
            });
            if let Some(parallel) = collectives.json(&engine.model().config) {
                obj["parallel"] = parallel;
            }
            println!("{obj}");
        } else {
            println!("model:   {}", files.path.display());
            println!("backend: {} ({})", info.name, info.device);
            println!(
                "params:  {:.1} M active per token of {:.1} M",
                active_params as f64 / 1e6,
                total_params as f64 / 1e6
            );
            println!(
                "KV:      {} = {}, eviction {}",
                self.model.kv_dtype,
                super::describe_kv_plan(engine),
                self.kv_eviction.describe()
            );
            println!(
                "pp{:<5} {:10.1} ± {:.1} tokens/s",
                self.prompt_tokens, pp, pp_sd
            );
            println!(
                "tg{:<5} {:10.1} ± {:.1} tokens/s  ({:.1} GB/s of weights)",
                self.gen_tokens,
                tg,
                tg_sd,
                tg * weight_bytes as f64 / 1e9
            );
            if let Some(launches) = launches_per_token {
                println!(
                    "launches: {launches:.1} per decoded token, {:.1} per layer ({}; head and embedding shared out)",
                    launches / layers,
                    if self.model.unfused { "unfused" } else { "fused where the backend can" }
                );
            }
            if compare_graphs {
                println!(
                    "tg{:<5} {:10.1} ± {:.1} tokens/s  launching every kernel: graphs {:.2}x ({} recorded, {} replays, {} failed{})",
                    self.gen_tokens,
                    tg_eager,
                    tg_eager_sd,
                    tg / tg_eager.max(1e-12),
                    recorded.recorded,
                    recorded.replayed,
                    recorded.failed,
                    recorded
                        .last_error
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default(),
                );
            }
            collectives.print(&engine.model().config);
        }
        Ok(())
    }

    /// Decodes each of [`SPEC_PROMPTS`] without and with speculation in the
    /// same process and prints tokens/s, the speedup and the speculation stats.
    fn compare_speculation<B: Backend>(
        &self,
        engine: &mut Engine<B>,
        files: &tandem_core::model::ModelFiles,
    ) -> Result<()> {
        self.speculation.attach(engine, files)?;
        let tokenizer = &files.tokenizer;
        for (name, text) in SPEC_PROMPTS {
            let msg = tandem_core::tokenizer::ChatMessage::new("user", text);
            let rendered = tokenizer
                .apply_chat_template(&[msg], true)
                .unwrap_or_else(|_| text.to_string());
            let prompt = tokenizer.encode(&rendered, true)?;
            let mut rates = [0.0; 2];
            let mut outputs = [Vec::new(), Vec::new()];
            let before = engine.stats().speculation;
            for (i, on) in [false, true].into_iter().enumerate() {
                engine.enable_speculation(on);
                engine.clear_prefix_cache();
                let seq = engine.add_request(
                    prompt.clone(),
                    SamplingParams::default(),
                    self.spec_tokens,
                    Vec::new(),
                )?;
                // Prefill first, so the rate is decode only.
                engine.step()?;
                let t = Instant::now();
                while !engine.is_finished(seq) {
                    engine.step()?;
                }
                let secs = t.elapsed().as_secs_f64();
                let tokens = engine.tokens(seq).unwrap_or_default()[prompt.len()..].to_vec();
                rates[i] = (tokens.len() - 1) as f64 / secs;
                outputs[i] = tokens;
                engine.remove(seq);
            }
            let after = engine.stats().speculation;
            let proposed = after.proposed_tokens - before.proposed_tokens;
            let accepted = after.accepted_tokens - before.accepted_tokens;
            let verified = after.verified_sequences - before.verified_sequences;
            let emitted = after.emitted_tokens - before.emitted_tokens;
            let draft_s = after.draft_seconds - before.draft_seconds;
            let verify_s = after.verify_seconds - before.verify_seconds;
            let verify_steps = after.verify_steps - before.verify_steps;
            let mean_k = proposed as f64 / verified.max(1) as f64;
            let accepted_length = emitted as f64 / verified.max(1) as f64;
            let draft_ms = 1e3 * draft_s / proposed.max(1) as f64;
            // Where a step of k + 1 rows costs what one row does (a GPU at
            // small batch), only drafting adds to a decode step; without
            // drafts it is plain decoding.
            let decode_ms = 1e3 / rates[0];
            let free_verification = match verified {
                0 => 1.0,
                _ => accepted_length * decode_ms / (mean_k * draft_ms + decode_ms),
            };
            println!(
                "spec {name:<6} plain {:7.1} tokens/s | speculative {:7.1} tokens/s | {:.2}x | acceptance {:5.1}% | mean k {:.2} | accepted length {:.2} | draft time {:4.1}% | {:.2} ms per draft token, {:.2} ms per verification | {:.2}x if verifying cost one decode step | same output: {}",
                rates[0],
                rates[1],
                rates[1] / rates[0],
                100.0 * accepted as f64 / proposed.max(1) as f64,
                mean_k,
                accepted_length,
                100.0 * draft_s / (draft_s + verify_s).max(1e-12),
                draft_ms,
                1e3 * verify_s / verify_steps.max(1) as f64,
                free_verification,
                if outputs[0] == outputs[1] { "yes" } else { "NO" },
            );
            if outputs[0] != outputs[1] {
                anyhow::bail!("speculative greedy output differs from plain decoding on `{name}`");
            }
        }
        Ok(())
    }
}
