//! Accepting connections, HTTP/1.1 on hyper, with the limits that keep one
//! client from holding the server:
//!
//! - at most `max_connections` open at once: beyond that the server stops
//!   accepting, and new connections wait in the kernel's accept backlog
//!   (connected but unanswered) until one closes. The process's open-file
//!   limit is raised to fit (within its hard limit), or the cap lowered, so
//!   accepting never fails for want of descriptors;
//! - a request head not complete within `header_read_timeout` closes the
//!   connection; this is also how long an idle keep-alive connection stays.
//!   So a half-sent request holds its slot for that long at most;
//! - a graceful stop: the listener closes (new connections are refused),
//!   idle connections close, busy ones after their current response.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Descriptors kept for everything but connections (model files, drivers, the runtime).
const RESERVED_FDS: usize = 256;

/// Pause after a failed `accept` (a connection reset before it was taken, say).
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

/// The open connections: a slot each, and the signal that asks them to close.
pub struct Connections {
    slots: Arc<Semaphore>,
    max: u32,
    stop: watch::Sender<bool>,
}

impl Connections {
    /// Room for [`connection_cap`]`(wanted)` connections.
    pub fn new(wanted: usize) -> Self {
        let max = connection_cap(wanted);
        Self {
            slots: Arc::new(Semaphore::new(max)),
            max: max as u32,
            stop: watch::channel(false).0,
        }
    }

    /// Serves connections from `listener` with `app` until `until` completes,
    /// then closes the listener.
    pub async fn accept(
        &self,
        listener: TcpListener,
        app: Router,
        header_read_timeout: Duration,
        until: impl Future<Output = ()>,
    ) {
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout);
        let mut until = pin!(until);
        loop {
            let slot = tokio::select! {
                _ = &mut until => break,
                slot = self.slots.clone().acquire_owned() => slot.expect("the slots are never closed"),
            };
            let stream = tokio::select! {
                _ = &mut until => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(ACCEPT_RETRY).await;
                        continue;
                    }
                },
            };
            // Server-sent events are small writes that should leave at once.
            let _ = stream.set_nodelay(true);
            let connection =
                http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
            let mut stop = self.stop.subscribe();
            tokio::spawn(async move {
                let mut connection = pin!(connection);
                let stopping = tokio::select! {
                    _ = connection.as_mut() => false,
                    stop = stop.wait_for(|stop| *stop) => stop.is_ok(),
                };
                if stopping {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
                drop(slot);
            });
        }
    }

    /// Asks every connection to close: idle ones now, busy ones after their response.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Waits up to `limit` for every connection to close; whether they all did.
    pub async fn all_closed_within(&self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.slots.acquire_many(self.max))
            .await
            .is_ok()
    }
}

/// `wanted`, or as many connections as the process's open-file limit allows
/// once raised as far as it goes.
pub fn connection_cap(wanted: usize) -> usize {
    let fd_limit = raise_fd_limit(wanted.saturating_add(RESERVED_FDS));
    wanted
        .min(fd_limit.saturating_sub(RESERVED_FDS))
        .clamp(1, u32::MAX as usize)
}

/// Raises the process's soft limit on open files towards `wanted`, as far as
/// the hard limit allows; returns the soft limit now in force.
#[cfg(unix)]
pub fn raise_fd_limit(wanted: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the one `rlimit` it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return wanted;
    }
    let wanted = wanted as libc::rlim_t;
    if limit.rlim_cur >= wanted {
        return limit.rlim_cur as usize;
    }
    let raised = libc::rlimit {
        rlim_cur: wanted.min(limit.rlim_max),
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads the one `rlimit` it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        raised.rlim_cur as usize
    } else {
        limit.rlim_cur as usize
    }
}

#[cfg(not(unix))]
pub fn raise_fd_limit(wanted: usize) -> usize {
    wanted
}
