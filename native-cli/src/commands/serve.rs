//! `tandem serve`: the OpenAI-compatible server (`tandem_server`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_core::engine::EngineConfig;
use tandem_core::model::ModelFiles;
use tandem_core::Backend;
use tandem_server::connections::connection_cap;
use tandem_server::{spawn_engine, ServerConfig};

use super::speculate::{Speculation, SpeculationArgs};
use super::{context_length, KvEvictionArgs, ModelArgs};
use crate::backend_select::{dispatch, WithBackend};

/// How the engine is sized and scheduled.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Most tokens one engine step runs (prompt chunks and decodes together).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// KV cache blocks of `--kv-block-size` tokens (overrides --kv-memory).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// KV memory, e.g. 512MiB or 2GiB: the KV cache, and with `--speculate`
    /// sparse drafting's key bounds or a draft model's own cache.
    #[arg(long, default_value = "1GiB")]
    pub kv_memory: String,
    /// Most sequences generating at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Most requests waiting for admission; more get 503.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
}

/// How `--kv-memory` was divided: blocks of the target's KV cache, and
/// what speculation keeps beside each of them.
struct KvSizing {
    blocks: usize,
    block_bytes: usize,
    speculation_block_bytes: usize,
}

impl EngineArgs {
    /// The engine's configuration, with `--kv-memory` shared between the
    /// target's KV blocks and what `speculation` keeps beside each of them.
    fn config(
        &self,
        files: &ModelFiles,
        ctx: usize,
        model: &ModelArgs,
        speculation: Option<&Speculation>,
    ) -> Result<(EngineConfig, KvSizing)> {
        let base = EngineConfig {
            block_size: model.kv_block_size,
            ..EngineConfig::default()
        };
        let kv_precision = model.kv_precision(files)?;
        // A calibrated plan costs at most its budget per element.
        let block_bytes = model.kv_dtype.max_bytes_per_block(files, base.block_size);
        let speculation_block_bytes = speculation.map_or(0, |s| {
            s.kv_bytes_per_target_block(files, base.block_size, kv_precision.representative_dtype())
        });
        let num_blocks = match self.kv_blocks {
            Some(n) => n,
            None => parse_bytes(&self.kv_memory)? / (block_bytes + speculation_block_bytes).max(1),
        };
        if num_blocks == 0 {
            bail!(
                "the KV cache holds no block of {block_bytes} bytes (and {speculation_block_bytes} beside it for speculation)"
            );
        }
        let config = EngineConfig {
            num_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_context: Some(ctx),
            max_running: self.max_running,
            max_waiting: self.max_queue,
            kv_precision,
            max_recorded_batch: model.graph_batch,
            unfused: model.unfused,
            parallel: crate::parallel::job(),
            ..base
        };
        let sizing = KvSizing {
            blocks: num_blocks,
            block_bytes,
            speculation_block_bytes,
        };
        Ok((config, sizing))
    }
}

impl KvSizing {
    /// For the line printed once the server listens.
    fn describe(&self) -> String {
        let mut text = format!("{} KV blocks of {} bytes", self.blocks, self.block_bytes);
        if self.speculation_block_bytes > 0 {
            text += &format!(
                " and {} bytes beside each for speculation",
                self.speculation_block_bytes
            );
        }
        text
    }
}

/// `2GiB`, `512MiB`, `1.5GB`, `1000000` (bytes).
fn parse_bytes(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .trim()
        .parse()
        .with_context(|| format!("'{text}' is not a size like 2GiB"))?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => bail!("unknown size unit in '{text}' (use B, KiB, MiB, GiB, KB, MB or GB)"),
    };
    Ok((number * scale) as usize)
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The default of requests without `kv_budget`; a request's own
    /// `kv_budget`, `kv_evict`, `kv_sinks`, `kv_recent` replace it.
    #[command(flatten)]
    pub kv_eviction: KvEvictionArgs,
    #[command(flatten)]
    pub speculation: SpeculationArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model name clients use; defaults to the model file's name.
    #[arg(long)]
    pub model_id: Option<String>,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a connection has to send a whole request head (also how long
    /// an idle keep-alive connection stays open).
    #[arg(long, default_value = "10", value_parser = seconds)]
    pub header_read_timeout: Duration,
    /// Seconds a request has to send its body once its head is in; later: 408.
    #[arg(long, default_value = "30", value_parser = seconds)]
    pub body_read_timeout: Duration,
    /// Most connections open at once; more wait in the accept backlog. The
    /// open-file limit is raised to fit where the hard limit allows.
    #[arg(long, default_value_t = 2048)]
    pub max_connections: usize,
    /// Seconds running requests get to finish after SIGTERM or SIGINT; then
    /// they end with finish_reason "abort".
    #[arg(long, default_value = "30", value_parser = seconds)]
    pub shutdown_grace: Duration,
    /// Seconds from arrival after which a request ends with finish_reason
    /// "timeout" (its `timeout` field may ask for less). Default: no limit.
    #[arg(long, value_parser = seconds)]
    pub request_timeout: Option<Duration>,
    /// Read control tokens written in chat messages (`<|im_start|>`) as
    /// control tokens, as the template's own. By default they are plain
    /// text, so a message cannot forge turns of the chat template.
    #[arg(long)]
    pub allow_special_tokens_in_content: bool,
}

/// A duration given in seconds (`10`, `0.5`).
fn seconds(text: &str) -> std::result::Result<Duration, String> {
    text.parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("'{text}' is not a number of seconds greater than 0"))
}

/// Builds the engine on the engine thread and serves it.
struct EngineThread {
    files: ModelFiles,
    config: EngineConfig,
    speculation: Option<Speculation>,
    inbox: tandem_server::EngineInbox,
}

impl WithBackend for EngineThread {
    type Output = ();
    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let mut engine = super::build_engine_with(backend, &self.files, self.config)?;
        if let Some(speculation) = self.speculation {
            speculation.attach(&mut engine, &self.files)?;
        }
        let ModelFiles { tokenizer, .. } = self.files;
        self.inbox.run(engine, tokenizer)
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let mut files = args.model.load_files()?;
    let allow = args.allow_special_tokens_in_content;
    files.tokenizer.set_special_tokens_in_content(allow);
    let ctx = context_length(&args.model, &files);
    let speculation = args.speculation.parse(&files)?;
    let (config, sizing) = args
        .engine
        .config(&files, ctx, &args.model, speculation.as_ref())?;
    let config = EngineConfig {
        kv_eviction: args.kv_eviction.config()?,
        ..config
    };
    let model_id = args.model_id.clone().unwrap_or_else(|| {
        files
            .path
            .file_stem()
            .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned())
    });
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("'{}:{}' is not an address", args.host, args.port))?;
    let target = args.model.target();
    let engine = spawn_engine(move |inbox| {
        dispatch(
            target,
            EngineThread {
                files,
                config,
                speculation,
                inbox,
            },
        )
    })?;
    let server = ServerConfig {
        model_id: model_id.clone(),
        api_key: args.api_key,
        max_body_bytes: args.max_body_bytes,
        header_read_timeout: args.header_read_timeout,
        body_read_timeout: args.body_read_timeout,
        max_connections: connection_cap(args.max_connections),
        shutdown_grace: args.shutdown_grace,
        request_timeout: args.request_timeout,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let signal = shutdown_signal()?;
        eprint_line!(
            "serving '{model_id}' on http://{} (context {ctx}, {}, up to {} connections); SIGTERM or Ctrl-C stops",
            listener.local_addr()?,
            sizing.describe(),
            server.max_connections
        );
        let grace = server.shutdown_grace;
        let shutdown = async move {
            signal.await;
            eprint_line!(
                "shutting down: no new connections, {} s for the requests in flight",
                grace.as_secs_f64()
            );
        };
        tandem_server::serve(listener, engine, server, shutdown).await;
        Ok(())
    })
}

/// Completes on the first SIGTERM or SIGINT (Ctrl-C).
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
