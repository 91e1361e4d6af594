//! `tandem serve`: an OpenAI-compatible HTTP server over the engine.
//!
//! Layers, top-down:
//! - [`http`]: axum routes (`/v1/completions`, `/v1/chat/completions`,
//!   `/v1/models`, `/health`, `/metrics`), authentication, OpenAI error JSON
//!   and server-sent events;
//! - [`api`]: the OpenAI request fields, parsed and validated into engine
//!   requests, and the response bodies;
//! - [`text`]: generated tokens to text per choice, with stop strings;
//! - [`engine_loop`]: the engine on its own thread, fed over channels. It
//!   never waits for a client: each request has a bounded channel, and
//!   tokens a slow client has not taken yet wait in the loop's per-request
//!   backlog (bounded by the request's own `max_tokens`), so the batch keeps
//!   stepping. A request whose receiver is gone (client disconnected, or a
//!   stop string ended it) is removed before the next step, freeing its KV.
//! - [`metrics`]: Prometheus text.
//!
//! [`bench`] drives the engine directly for `tandem bench-serve`.

pub mod api;
pub mod bench;
pub mod engine_loop;
pub mod http;
pub mod metrics;
pub mod text;

pub use engine_loop::{spawn_engine, EngineHandle, EngineInbox};
pub use http::{router, ServerConfig};

use std::future::Future;
use std::net::SocketAddr;
use std::thread;

use anyhow::{Context, Result};
use tokio::sync::oneshot;

/// Serves `app` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
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
        let app = router(engine, config);
        let thread = thread::Builder::new()
            .name("tandem-http".into())
            .spawn(move || {
                let shutdown = async {
                    let _ = stopped.await;
                };
                if let Err(e) = runtime.block_on(serve(listener, app, shutdown)) {
                    eprintln!("server error: {e}");
                }
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
