//! The helper threads in the browser, with the interface of the native
//! `SpinPool`.
//!
//! A wasm32 build has threads only where it was compiled with atomics
//! (shared memory) and the embedder gave rayon's global pool Web Workers
//! (wasm-bindgen-rayon's `initThreadPool`): `std::thread::spawn` cannot
//! start a thread in the browser, so a backend cannot own its helpers as it
//! does natively, and borrows up to `helpers` of the global pool's threads
//! for each call instead. The embedder must start that pool before anything
//! touches rayon; otherwise rayon's fallback makes the caller's thread the
//! pool's only one, and a backend asking for helpers gets none.
//!
//! The borrowed threads join each call while they spin between kernels
//! ([`JoinPool`]), and go back to rayon when the engine is idle.
//!
//! Without atomics there are no helpers: [`Pool`] cannot be built.

#[cfg(target_feature = "atomics")]
use super::join_pool::JoinPool;

#[cfg(target_feature = "atomics")]
pub(super) struct Pool(JoinPool);

#[cfg(target_feature = "atomics")]
impl Pool {
    /// Up to `helpers` threads of rayon's global pool; `None` when it has
    /// none to give.
    pub(super) fn new(helpers: usize) -> Option<Self> {
        // The caller is never one of the pool's threads here (the backend
        // runs on the embedder's thread), so every pool thread can help.
        let helpers = helpers.min(global_helpers());
        (helpers > 0).then(|| Pool(JoinPool::new(helpers, |helper| rayon::spawn(helper))))
    }

    pub(super) fn helpers(&self) -> usize {
        self.0.helpers()
    }

    /// Runs `work` on the caller and on up to `helpers` pool threads;
    /// returns when all of them are done.
    pub(super) fn run(&self, helpers: usize, work: &(dyn Fn() + Sync)) {
        self.0.run(helpers, work)
    }
}

/// The global pool's threads that can help the caller: none when the
/// caller's thread is the pool's only one (rayon's fallback where no
/// embedder started a pool of Web Workers).
#[cfg(target_feature = "atomics")]
fn global_helpers() -> usize {
    let threads = rayon::current_num_threads();
    if rayon::current_thread_index().is_some() {
        threads - 1
    } else {
        threads
    }
}

/// No helpers without atomics: a type that has no values.
#[cfg(not(target_feature = "atomics"))]
pub(super) enum Pool {}

#[cfg(not(target_feature = "atomics"))]
impl Pool {
    pub(super) fn new(_helpers: usize) -> Option<Self> {
        None
    }

    pub(super) fn helpers(&self) -> usize {
        match *self {}
    }

    pub(super) fn run(&self, _helpers: usize, _work: &(dyn Fn() + Sync)) {
        match *self {}
    }
}
