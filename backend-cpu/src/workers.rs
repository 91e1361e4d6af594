//! The backend's own threads, and the one way kernels split work over them.
//!
//! Each backend owns its helper threads, so two backends (or a backend and
//! the application) never fight over one pool. A call with `threads`
//! threads uses the calling thread plus `threads - 1` helpers: the caller
//! is already running, so it starts on the first chunk at once while
//! helpers join, and a kernel costs one hand-off instead of two. Decode
//! runs some two hundred kernels per token, so hand-offs matter: natively
//! the helpers are a [`SpinPool`](crate::spin_pool::SpinPool) that stays awake between kernels; wasm32
//! borrows rayon's threads, which the browser provides, and keeps them
//! spinning between kernels too (`join_pool`).
//!
//! Work is cut into chunks that every participant claims from a shared
//! queue until none is left, which balances uneven chunks and threads
//! slowed by other processes. A call whose output fits in one chunk runs on
//! the caller alone.

use std::sync::{Mutex, PoisonError};
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
use std::sync::{MutexGuard, TryLockError};

#[cfg(not(target_arch = "wasm32"))]
use crate::spin_pool::SpinPool as Pool;
// In the browser: rayon's global pool where the build has atomics and the
// embedder started it, else no helpers.
#[cfg(target_arch = "wasm32")]
use wasm::Pool;

#[cfg(any(test, all(target_arch = "wasm32", target_feature = "atomics")))]
mod join_pool;
#[cfg(target_arch = "wasm32")]
mod wasm;

pub(crate) struct Workers {
    /// The helper threads; `None` with one thread, or where the platform
    /// cannot spawn threads (wasm32 without atomics).
    pool: Option<Pool>,
    threads: usize,
}

impl Workers {
    /// `threads` threads including the caller; 0 means one per available core.
    pub(crate) fn new(threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = (threads > 1).then(|| Pool::new(threads - 1)).flatten();
        let threads = pool.as_ref().map_or(1, |p| p.helpers() + 1);
        Workers { pool, threads }
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(index, chunk)` for each `chunk_len`-element chunk of `data`
    /// (the last may be shorter), in parallel when there is more than one.
    pub(crate) fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunks = data.chunks_mut(chunk_len.max(1)).enumerate();
        self.run_queue(chunks, |(i, chunk)| f(i, chunk));
    }

    /// Like [`Workers::for_each_chunk`] over two slices cut into the same
    /// number of chunks: `f(index, chunk_of_a, chunk_of_b)`, the chunks of
    /// `a` being `chunk_a` long and those of `b` `chunk_b` long.
    pub(crate) fn for_each_chunk_pair<T: Send, U: Send>(
        &self,
        (a, chunk_a): (&mut [T], usize),
        (b, chunk_b): (&mut [U], usize),
        f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
    ) {
        let chunks = a
            .chunks_mut(chunk_a.max(1))
            .zip(b.chunks_mut(chunk_b.max(1)))
            .enumerate();
        self.run_queue(chunks, |(i, (ca, cb))| f(i, ca, cb));
    }

    /// Runs `f` on every item, the caller and the helpers each taking the
    /// next item until none is left.
    fn run_queue<I>(&self, items: I, f: impl Fn(I::Item) + Sync)
    where
        I: ExactSizeIterator + Send,
        I::Item: Send,
    {
        let helpers = match &self.pool {
            Some(pool) if items.len() > 1 => pool.helpers().min(items.len() - 1),
            _ => 0,
        };
        let Some(pool) = self.pool.as_ref().filter(|_| helpers > 0) else {
            items.for_each(f);
            return;
        };
        let queue = Mutex::new(items);
        // The lock is held only to take an item, never while running `f`.
        let next = || queue.lock().unwrap_or_else(PoisonError::into_inner).next();
        pool.run(helpers, &|| {
            while let Some(item) = next() {
                f(item);
            }
        });
    }

    /// Chunk length (a multiple of `unit`) that gives each thread about four
    /// chunks for load balance, but no fewer than `min_units` units per chunk
    /// so scheduling overhead stays small.
    pub(crate) fn chunk_len(&self, total_units: usize, unit: usize, min_units: usize) -> usize {
        let per_chunk = total_units.div_ceil(self.threads * 4).max(min_units).max(1);
        per_chunk * unit
    }
}

/// A pool's dispatch lock, held by the one caller whose job is running;
/// `None` when another caller holds it, and that caller then runs its work
/// alone: a pool never waits on itself (a kernel called from inside a job,
/// or another thread's kernel).
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
pub(crate) fn try_dispatch(dispatch: &Mutex<()>) -> Option<MutexGuard<'_, ()>> {
    match dispatch.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}
