//! `tandem serve`: an OpenAI-compatible HTTP server over the engine.
//!
//! Layers, top-down:
//! - [`serve`] here: connections until the shutdown signal, then a graceful
//!   stop (below);
//! - [`connections`]: the accept loop, the connection cap, the request-head
//!   timeout;
//! - [`http`]: axum routes (`/v1/completions`, `/v1/chat/completions`,
//!   `/v1/models`, `/tokenize` and `/detokenize` ([`tokenize`]), `/health`,
//!   `/metrics`), the body timeout, parsing off the async runtime, OpenAI
//!   error JSON; [`auth`]: the API key;
//! - [`api`]: the OpenAI request fields, parsed and validated into engine
//!   requests: [`fields`] (typed access, unknown fields refused by name),
//!   [`sampling`] (the sampling parameters), [`tools`] (`tools` and
//!   `tool_choice`), [`kv_eviction`] (a request's own KV budget); [`prompt`]: the prompt or chat messages as token ids,
//!   a prompt that cannot fit refused before tokenizing ([`token_floor`]);
//!   [`scoring`]: a prompt's own logprobs (`echo`);
//! - [`response`]: JSON bodies and server-sent events, from [`collector`]
//!   (updates to output per choice) and [`logprobs`] (their two shapes);
//! - [`text`]: generated tokens to text per choice, with stop strings;
//!   [`tool_parser`]: tool calls read from that text;
//! - [`engine_loop`]: the engine on its own thread, fed over channels. It
//!   never waits for a client: each request has a bounded channel, and
//!   tokens a slow client has not taken yet wait in the loop's per-request
//!   backlog (bounded by the request's own `max_tokens`), so the batch keeps
//!   stepping. A request whose receiver is gone (client disconnected, or a
//!   stop string ended it) is removed before the next step, freeing its KV;
//!   so is a request whose deadline has passed.
//! - [`metrics`]: Prometheus text.
//!
//! Shutdown (SIGTERM or SIGINT for `tandem serve`): the listener closes, so
//! new connections are refused; idle connections close; requests in flight
//! have `shutdown_grace` to finish. Any still running then end: each
//! unfinished choice gets `finish_reason: "abort"` with the text it had, a
//! stream its `usage` (when asked) and `[DONE]`, a non-streaming request its
//! complete JSON body (503 if it had no token yet). After a few seconds for
//! those last writes, [`serve`] returns.
//!
//! [`bench`](mod@bench) drives the engine directly for `tandem bench-serve`.

pub mod api;
pub mod auth;
pub mod bench;
pub mod collector;
pub mod connections;
pub mod engine_loop;
pub mod fields;
pub mod http;
pub mod kv_eviction;
pub mod logprobs;
pub mod metrics;
pub mod prompt;
pub mod response;
pub mod sampling;
pub mod scoring;
pub mod text;
pub mod token_floor;
pub mod tokenize;
pub mod tool_parser;
pub mod tools;

pub use engine_loop::{spawn_engine, EngineHandle, EngineInbox};
pub use http::{router, ServerConfig};

use std::future::Future;
use std::net::SocketAddr;
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::oneshot;

use connections::Connections;

/// How long ended requests get to write their last events after the grace period.
const FINAL_WRITES: Duration = Duration::from_secs(5);

/// Serves the engine on `listener` until `shutdown` completes, then stops
/// gracefully (see the module documentation).
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Connections::new(config.max_connections);
    let (header_read_timeout, grace) = (config.header_read_timeout, config.shutdown_grace);
    let app = router(engine.clone(), config);
    connections
        .accept(listener, app, header_read_timeout, shutdown)
        .await;
    connections.stop();
    if !connections.all_closed_within(grace).await {
        engine.end_all();
        connections.all_closed_within(FINAL_WRITES).await;
    }
}

/// A server on its own runtime thread (tests, embedding); stops when dropped.
pub struct BackgroundServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl BackgroundServer {
    /// Binds `addr` (port 0: any free port) and serves there.
    pub fn start(engine: EngineHandle, config: ServerConfig, addr: SocketAddr) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(addr))
            .with_context(|| format!("binding {addr}"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = thread::Builder::new()
            .name("tandem-http".into())
            .spawn(move || {
                let shutdown = async {
                    let _ = stopped.await;
                };
                runtime.block_on(serve(listener, engine, config, shutdown));
            })
            .context("starting the server thread")?;
        Ok(Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
