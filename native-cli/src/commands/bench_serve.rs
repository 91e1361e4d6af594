//! `tandem bench-serve`: continuous against static batching, measured as
//! vLLM's serving benchmark measures a server (`tandem_server::bench`),
//! on the engine directly: Poisson arrivals at each rate of a sweep,
//! log-normal prompt and output lengths, a KV pool that binds. A Markdown
//! table on stdout (or `--json`), and `--plot FILE.svg`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::json;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::Backend;
use tandem_server::bench::{
    self, arrival_times, percentile, LogNormal, Mode, Rate, Summary, WallClock, WorkloadSpec,
};

use super::{context_length, ModelArgs};
use crate::backend_select::{dispatch, WithBackend};

#[derive(Args, Debug)]
pub struct BenchServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Requests per run; every mode and rate serves the same ones.
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Request rates to sweep (requests per second, Poisson arrivals); inf
    /// sends every request at once. The default straddles what either mode
    /// sustains with the default model on a 2-core CPU; scale it to the device.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,2,inf")]
    pub rates: Vec<Rate>,
    /// Batching modes to run at each rate.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "continuous,static"
    )]
    pub modes: Vec<Batching>,
    /// Median of each request's own prompt tokens (log-normal).
    #[arg(long, default_value_t = 32.0)]
    pub prompt_median: f64,
    /// Standard deviation of the logarithm of the prompt tokens.
    #[arg(long, default_value_t = 0.8)]
    pub prompt_sigma: f64,
    /// Median of each request's output tokens (log-normal).
    #[arg(long, default_value_t = 64.0)]
    pub output_median: f64,
    /// Standard deviation of the logarithm of the output tokens.
    #[arg(long, default_value_t = 1.0)]
    pub output_sigma: f64,
    /// Tokens of a system prompt every request starts with (the prefix cache's case).
    #[arg(long, default_value_t = 0)]
    pub system_tokens: usize,
    /// Most sequences running at once, and static batching's batch size.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Most tokens one engine step runs (prompt chunks and decodes together).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// KV blocks of 16 tokens. Default: what --max-running requests of mean
    /// lengths hold, so the long tail of a full batch does not fit.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write throughput against p99 latency for both modes as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Batching {
    Continuous,
    Static,
}

impl From<Batching> for Mode {
    fn from(b: Batching) -> Mode {
        match b {
            Batching::Continuous => Mode::Continuous,
            Batching::Static => Mode::Static,
        }
    }
}

pub fn run(args: BenchServeArgs) -> Result<()> {
    if args.requests == 0 || args.rates.is_empty() || args.modes.is_empty() {
        bail!("--requests, --rates and --modes must not be empty");
    }
    for (name, median, sigma) in [
        ("prompt", args.prompt_median, args.prompt_sigma),
        ("output", args.output_median, args.output_sigma),
    ] {
        if !(median.is_finite() && median > 0.0 && sigma.is_finite() && sigma >= 0.0) {
            bail!("--{name}-median must be positive and --{name}-sigma non-negative");
        }
    }
    dispatch(args.model.target(), args)
}

impl BenchServeArgs {
    fn prompt_lengths(&self) -> LogNormal {
        LogNormal {
            median: self.prompt_median,
            sigma: self.prompt_sigma,
        }
    }

    fn output_lengths(&self) -> LogNormal {
        LogNormal {
            median: self.output_median,
            sigma: self.output_sigma,
        }
    }

    /// The default pool holds `max_running` requests of mean prompt and
    /// output length: a full batch fits on average but not when its members
    /// run long (continuous batching then preempts), and static batches,
    /// padded to their longest member, fit far fewer members.
    fn pool_blocks(&self) -> usize {
        self.kv_blocks.unwrap_or_else(|| {
            let tokens = self.system_tokens as f64
                + self.prompt_lengths().mean()
                + self.output_lengths().mean();
            ((self.max_running as f64 * tokens).ceil() as usize)
                .div_ceil(self.model.kv_block_size)
                .max(1)
        })
    }
}

impl WithBackend for BenchServeArgs {
    type Output = ();
    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let files = self.model.load_files()?;
        let ctx = context_length(&self.model, &files);
        let config = EngineConfig {
            num_blocks: self.pool_blocks(),
            max_batch_tokens: self.max_batch_tokens,
            max_context: Some(ctx),
            max_running: self.max_running,
            max_waiting: self.requests,
            kv_precision: self.model.kv_precision(&files)?,
            max_recorded_batch: self.model.graph_batch,
            unfused: self.model.unfused,
            parallel: crate::parallel::job(),
            ..EngineConfig::default()
        };
        let info = backend.info();
        let mut engine = Engine::new(backend, &files, config, &mut |_, _| {})
            .with_context(|| format!("loading {}", files.path.display()))?;
        let kv = engine.kv_manager();
        let (pool_blocks, block_size) = (kv.num_blocks(), kv.block_size());
        let spec = WorkloadSpec {
            requests: self.requests,
            prompt_tokens: self.prompt_lengths(),
            output_tokens: self.output_lengths(),
            system_tokens: self.system_tokens,
            max_len: engine.max_context().min(pool_blocks * block_size),
            vocab: files.config.vocab_size,
            seed: self.seed,
        };
        let work = spec.requests()?;
        let lengths = |f: fn(&bench::BenchRequest) -> usize| {
            let v: Vec<f64> = work.iter().map(|r| f(r) as f64).collect();
            json!({
                "mean": v.iter().sum::<f64>() / v.len() as f64,
                "p50": percentile(&v, 50.0),
                "p99": percentile(&v, 99.0),
                "max": v.iter().copied().fold(0.0, f64::max),
            })
        };
        let setup = json!({
            "model": files.path.display().to_string(),
            "backend": info.name,
            "device": info.device,
            "requests": self.requests,
            "seed": self.seed,
            "prompt_tokens": {
                "distribution": "log-normal",
                "median": self.prompt_median,
                "sigma": self.prompt_sigma,
                "system_tokens": self.system_tokens,
                "drawn": lengths(|r| r.prompt.len()),
            },
            "output_tokens": {
                "distribution": "log-normal",
                "median": self.output_median,
                "sigma": self.output_sigma,
                "drawn": lengths(|r| r.output_tokens),
            },
            "max_len": spec.max_len,
            "max_running": self.max_running,
            "max_batch_tokens": self.max_batch_tokens,
            "kv_pool_blocks": pool_blocks,
            "kv_block_size": block_size,
            "kv_dtype": self.model.kv_dtype.to_string(),
        });
        if !self.json {
            let drawn = |v: &serde_json::Value| {
                format!(
                    "mean {:.0}, p50 {:.0}, p99 {:.0}, max {:.0}",
                    v["mean"].as_f64().unwrap_or(f64::NAN),
                    v["p50"].as_f64().unwrap_or(f64::NAN),
                    v["p99"].as_f64().unwrap_or(f64::NAN),
                    v["max"].as_f64().unwrap_or(f64::NAN)
                )
            };
            let system = if self.system_tokens > 0 {
                format!(" after a shared {}-token system prompt", self.system_tokens)
            } else {
                String::new()
            };
            println!(
                "{} on {} ({}), {} requests (seed {}).\n\
                 Prompts: log-normal, median {}, sigma {}{system}; drawn {}.\n\
                 Outputs: log-normal, median {}, sigma {}; drawn {}. Requests clipped to {} tokens.\n\
                 Engine: at most {} running (the static batch size), {} tokens per step, KV pool of {} blocks of {} tokens ({}).\n",
                files.path.display(),
                info.name,
                info.device,
                self.requests,
                self.seed,
                self.prompt_median,
                self.prompt_sigma,
                drawn(&setup["prompt_tokens"]["drawn"]),
                self.output_median,
                self.output_sigma,
                drawn(&setup["output_tokens"]["drawn"]),
                spec.max_len,
                self.max_running,
                self.max_batch_tokens,
                pool_blocks,
                block_size,
                self.model.kv_dtype,
            );
        }

        // Warm-up (first touches of the KV pool and the thread pool), not reported.
        let warm = &work[..work.len().min(4)];
        bench::run(
            &mut engine,
            warm,
            &vec![0.0; warm.len()],
            Mode::Continuous,
            &mut WallClock::start(),
        )?;
        let mut summaries = Vec::new();
        for &rate in &self.rates {
            let arrivals = arrival_times(work.len(), rate, self.seed);
            for &mode in &self.modes {
                let mode = Mode::from(mode);
                // Each run starts cold: no prefix cached by the one before.
                engine.clear_prefix_cache();
                let outcome =
                    bench::run(&mut engine, &work, &arrivals, mode, &mut WallClock::start())?;
                eprint_line!(
                    "{} batching at rate {rate}: {} requests in {:.1} s",
                    mode.name(),
                    outcome.served.len(),
                    outcome.duration
                );
                summaries.push(Summary::new(&outcome, rate));
            }
        }

        if self.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&bench::json_document(setup, &summaries))?
            );
        } else {
            print!("{}", bench::table(&summaries));
        }
        if let Some(path) = &self.plot {
            let name = files
                .path
                .file_name()
                .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            let title = format!(
                "{name} on {} ({}), {} requests",
                info.name, info.device, self.requests
            );
            std::fs::write(path, bench::plot::svg(&summaries, &title))
                .with_context(|| format!("writing {}", path.display()))?;
            eprint_line!("plot written to {}", path.display());
        }
        Ok(())
    }
}
