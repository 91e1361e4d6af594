//! One module per subcommand, plus what they share: model options, engine
//! construction and streaming generation.

pub mod bench;
pub mod bench_serve;
pub mod chat;
#[cfg(feature = "distill")]
pub mod distill;
pub mod inspect;
pub mod kv_eviction;
pub mod kv_precision;
pub mod perplexity;
pub mod quantize;
pub mod run;
pub mod serve;
pub mod speculate;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use tandem_core::engine::{Engine, EngineConfig, TokenEvent, DEFAULT_MAX_RECORDED_BATCH};
use tandem_core::kv::{KvPrecision, SeqId, DEFAULT_BLOCK_SIZE};
use tandem_core::model::ModelFiles;
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};
use tandem_core::Backend;

use crate::backend_select::{BackendChoice, CpuIsaChoice, Target};
use crate::model_path;
use crate::progress::LoadProgress;
pub use kv_eviction::KvEvictionArgs;
pub use kv_precision::{KvCalibrationArgs, KvDtypeArg};

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF file, Hugging Face directory, a named model (`tandem inspect
    /// --models`; `default` is smollm2-135m), or `hf:ORG/REPO[:QUANT_OR_FILE]`.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// CPU threads (0: one per core).
    #[arg(long, short = 't', default_value_t = 0)]
    pub threads: usize,
    /// The CPU backend's kernels: `best` for this CPU, or an instruction set
    /// by name, to compare two paths on one machine or run the path of a
    /// machine without the better one.
    #[arg(long, value_enum, default_value = "best")]
    pub cpu_isa: CpuIsaChoice,
    /// Context length (tokens per sequence); defaults to the model's, at most 4096.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Element type of the KV cache: f32, f16, int8, int4 or int2
    /// (quantized per token, head and group of 32 with a scale and zero
    /// point; int4 keys per channel over each block); `auto[:BITS]`: each
    /// layer's keys and values chosen apart by a calibration pass, within
    /// BITS per element (default 4.5); `plan:KEYS/VALUES,...`: a plan as
    /// `inspect --kv-dtype auto` prints it.
    #[arg(long, default_value = "f32", value_parser = kv_precision::parse_kv_dtype)]
    pub kv_dtype: KvDtypeArg,
    #[command(flatten)]
    pub kv_calibration: KvCalibrationArgs,
    /// Tokens per KV cache block, the unit of paging, prefix sharing and
    /// eviction (vLLM's `--block-size`): a power of two from 4 to 256.
    /// INT4 and INT2 keys keep one scale and minimum per channel per
    /// block, so larger blocks store them in fewer bits.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_BLOCK_SIZE, value_parser = kv_precision::parse_kv_block_size)]
    pub kv_block_size: usize,
    /// CUDA: decode batches of up to N sequences are captured once per shape
    /// as CUDA graphs and replayed (0: launch every kernel every step).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_RECORDED_BATCH)]
    pub graph_batch: usize,
    /// Run the unfused kernels (RMSNorm, Q/K/V, gate/up, activation and
    /// residual add one by one) even where the backend has fused matmuls:
    /// the reference of the fusion figures.
    #[arg(long)]
    pub unfused: bool,
    /// Tensor parallelism: split every layer's heads and FFN over N ranks
    /// of each pipeline stage (start as `mpirun -np T×P tandem ... --tp T
    /// --pp P`; needs the `mpi` build).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tp: usize,
    /// Pipeline parallelism: split the layers into N stages of `--tp` ranks each.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub pp: usize,
    /// Expert parallelism: place each MoE layer's experts over N groups of
    /// a stage's ranks (N divides `--tp`; alone it sets `--tp N`).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ep: usize,
    /// A pipelined step's rows go through the stages in N parts, so the
    /// stages overlap (default: as many as stages; 1 turns it off).
    #[arg(long, value_name = "N")]
    pub micro_batches: Option<usize>,
    /// CUDA device ordinal; under `mpirun`, by default the rank's index on its machine.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
}

impl ModelArgs {
    /// The backend, threads and device the command runs on.
    pub fn target(&self) -> Target {
        Target {
            backend: self.backend,
            threads: self.threads,
            cpu_isa: self.cpu_isa,
            device: self.device,
        }
    }

    pub fn load_files(&self) -> Result<ModelFiles> {
        let path = model_path::resolve(self.model.as_deref())?;
        tandem_core::model::load(&path).map_err(anyhow::Error::from)
    }

    /// The engine's KV precision for `files` (`auto` tokenizes its
    /// calibration text here).
    pub fn kv_precision(&self, files: &ModelFiles) -> Result<tandem_core::kv::KvPrecision> {
        self.kv_dtype
            .precision(&self.kv_calibration, files, self.kv_block_size)
    }
}

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtracted from a token's logit per time it was generated (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token generated so far (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub presence_penalty: f32,
    /// Added to a token's logit: TOKEN_ID=BIAS, e.g. 42=-100 bans token 42 (repeatable).
    #[arg(long = "logit-bias", value_name = "TOKEN_ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn parse_logit_bias(text: &str) -> std::result::Result<(u32, f32), String> {
    let (token, bias) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not TOKEN_ID=BIAS"))?;
    let token = token
        .trim()
        .parse()
        .map_err(|_| format!("'{token}' in '{text}' is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("'{bias}' in '{text}' is not a number"))?;
    Ok((token, bias))
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
            ..Default::default()
        }
    }
}

/// Context length: the user's, else the model's capped at 4096 to keep the KV pool modest.
pub fn context_length(args: &ModelArgs, files: &ModelFiles) -> usize {
    args.ctx
        .unwrap_or(files.config.max_context.min(4096))
        .min(files.config.max_context)
}

/// An engine whose KV pool holds `sequences` sequences of `ctx` tokens,
/// each within `eviction`'s budget if one is given.
pub fn build_engine<B: Backend>(
    backend: B,
    args: &ModelArgs,
    eviction: &KvEvictionArgs,
    files: &ModelFiles,
    ctx: usize,
    sequences: usize,
) -> Result<Engine<B>> {
    let config = EngineConfig {
        max_context: Some(ctx),
        kv_precision: args.kv_precision(files)?,
        max_recorded_batch: args.graph_batch,
        unfused: args.unfused,
        kv_eviction: eviction.config()?,
        block_size: args.kv_block_size,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(ctx * sequences);
    build_engine_with(backend, files, config)
}

/// An engine on `backend` with `config`, reporting load progress.
pub fn build_engine_with<B: Backend>(
    backend: B,
    files: &ModelFiles,
    mut config: EngineConfig,
) -> Result<Engine<B>> {
    config.parallel = config.parallel.or_else(crate::parallel::job);
    let mut progress = LoadProgress::new(files.path.display().to_string());
    let calibrated = matches!(config.kv_precision, KvPrecision::Auto(_));
    let started = Instant::now();
    let engine = Engine::new(backend, files, config, &mut |d, t| progress.update(d, t))
        .with_context(|| format!("loading {}", files.path.display()))?;
    if calibrated {
        eprintln!(
            "KV plan (calibrated, {:.1} s with the load): {}",
            started.elapsed().as_secs_f64(),
            describe_kv_plan(&engine)
        );
    }
    // The loader's and tokenizer builder's temporaries are freed by now, but
    // glibc keeps freed heap pages resident until asked to return them.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own.
    unsafe {
        libc::malloc_trim(0)
    };
    if engine.model().placement().is_some() {
        eprint_line!(
            "{}",
            crate::parallel::describe_rank(engine.model(), engine.kv_bytes_per_token())
        );
    }
    Ok(engine)
}

/// The engine's KV plan as `--kv-dtype plan:` takes it, with its cost.
pub fn describe_kv_plan<B: Backend>(engine: &Engine<B>) -> String {
    let shape = engine.model().kv_shape(engine.config().block_size);
    let plan = engine.kv_plan();
    format!(
        "plan:{plan} ({} bytes per token, {:.2} bits per element)",
        engine.kv_bytes_per_token(),
        plan.bits_per_element(shape)
    )
}

/// Timings of one generation.
#[derive(Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub decode_time: Duration,
}

impl GenerationStats {
    pub fn report(&self) -> String {
        let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
        format!(
            "prefill: {} tokens in {:.2} s ({:.1} tokens/s) | decode: {} tokens in {:.2} s ({:.1} tokens/s)",
            self.prompt_tokens,
            self.prompt_time.as_secs_f64(),
            rate(self.prompt_tokens, self.prompt_time),
            self.generated_tokens,
            self.decode_time.as_secs_f64(),
            rate(self.generated_tokens.saturating_sub(1), self.decode_time),
        )
    }
}

/// Steps `seq` to the end of its turn, writing text to `out` as it is produced.
/// The first token's time counts as prefill; the rest as decode.
pub fn stream_turn<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: &Tokenizer,
    seq: SeqId,
    prompt_tokens: usize,
    out: &mut dyn Write,
    mut observe: impl FnMut(&TokenEvent),
) -> Result<(Vec<u32>, GenerationStats)> {
    let mut stats = GenerationStats {
        prompt_tokens,
        ..Default::default()
    };
    let mut decoder = StreamDecoder::default();
    let mut generated = Vec::new();
    let started = Instant::now();
    while !engine.is_finished(seq) {
        for ev in engine.step()? {
            if ev.seq != seq {
                continue;
            }
            if generated.is_empty() {
                stats.prompt_time = started.elapsed();
            }
            observe(&ev);
            generated.push(ev.token);
            if ev.finished.is_some() && tokenizer.is_eos(ev.token) {
                continue;
            }
            if let Some(text) = decoder.push(tokenizer, ev.token)? {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
        }
    }
    if let Some(rest) = decoder.finish(tokenizer)? {
        out.write_all(rest.as_bytes())?;
    }
    out.flush()?;
    stats.generated_tokens = generated.len();
    stats.decode_time = started.elapsed().saturating_sub(stats.prompt_time);
    Ok((generated, stats))
}
