//! Helpers that join jobs while they spin, for threads the backend cannot
//! own: in the browser, rayon's Web Workers (wasm-bindgen-rayon).
//!
//! Handing each kernel to rayon costs a Web Worker wake-up per call, and
//! decode makes some two hundred calls per token: with two threads it was
//! slower than one. Here a helper is a rayon job that stays in a spin loop
//! between kernels and joins each new job it sees; after
//! [`IDLE_SPINS`] rounds without one it returns its thread to rayon, and
//! the next call starts a new one. So no thread is held while the engine is
//! idle, and nothing that also uses rayon can be starved of it for good.
//!
//! The native `SpinPool` counts on its helpers being there; these may not
//! be (rayon may still be busy, a helper may be leaving), so a job is a
//! number of open slots that helpers take by compare-and-swap, and the
//! caller, once its own share is done, closes the slots and waits only for
//! the helpers that took one. The work shares its items out, so it is
//! complete whoever takes part.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::try_dispatch;

/// Idle rounds (an atomic load each) before a helper returns its thread:
/// on the order of a hundred microseconds, longer than the gap between two
/// kernels of a forward pass.
const IDLE_SPINS: u32 = 1 << 17;

/// The caller's closure, type-erased; it lives on the caller's stack, which
/// outlives every helper that took a slot of its job.
type Job<'a> = dyn Fn() + Sync + 'a;

/// Starts a helper loop on some thread.
pub(crate) type Spawn = fn(Box<dyn FnOnce() + Send>);

pub(crate) struct JoinPool {
    shared: Arc<Shared>,
    helpers: usize,
    spawn: Spawn,
    /// Held by the one caller whose job is running.
    dispatch: Mutex<()>,
}

struct Shared {
    /// The job's epoch (high 32 bits) and its open slots (low 32 bits).
    state: AtomicU64,
    /// A `*const &Job`, valid while a helper holds a slot.
    job: AtomicPtr<&'static Job<'static>>,
    /// Helpers inside a job, or about to take a slot.
    running: AtomicUsize,
    /// Helper loops started and not yet ended.
    awake: AtomicUsize,
    panicked: AtomicBool,
}

impl JoinPool {
    /// Up to `helpers` helpers, each started by `spawn` when a job needs it.
    pub(crate) fn new(helpers: usize, spawn: Spawn) -> Self {
        JoinPool {
            shared: Arc::new(Shared {
                state: AtomicU64::new(0),
                job: AtomicPtr::new(std::ptr::null_mut()),
                running: AtomicUsize::new(0),
                awake: AtomicUsize::new(0),
                panicked: AtomicBool::new(false),
            }),
            helpers,
            spawn,
            dispatch: Mutex::new(()),
        }
    }

    pub(crate) fn helpers(&self) -> usize {
        self.helpers
    }

    /// Runs `work` on the caller and on up to `helpers` helpers, returning
    /// when all of them are done. `work` shares its items out (each call
    /// takes items until none is left). A caller that finds the pool busy
    /// runs `work` alone.
    pub(crate) fn run(&self, helpers: usize, work: &Job<'_>) {
        let helpers = helpers.min(self.helpers);
        let Some(_busy) = try_dispatch(&self.dispatch) else {
            return work();
        };
        if helpers == 0 {
            return work();
        }
        let shared = &*self.shared;
        // SAFETY: only helpers holding a slot read the pointer, and `Close`
        // waits for all of them before this frame (and `work`) can go away,
        // even when `work` panics.
        let job: *const &Job<'_> = &work;
        shared
            .job
            .store(job as *mut &'static Job<'static>, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        let epoch = (shared.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        shared
            .state
            .store((epoch << 32) | helpers as u64, Ordering::SeqCst);
        for _ in shared.awake.load(Ordering::SeqCst)..helpers {
            shared.awake.fetch_add(1, Ordering::SeqCst);
            let helper = self.shared.clone();
            (self.spawn)(Box::new(move || helper.helper_loop()));
        }
        let close = Close { shared, epoch };
        work();
        drop(close);
        if shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU backend helper thread panicked");
        }
    }
}

/// On drop: closes the job's open slots and waits for the helpers that
/// took one.
struct Close<'a> {
    shared: &'a Shared,
    epoch: u64,
}

impl Drop for Close<'_> {
    fn drop(&mut self) {
        self.shared.state.store(self.epoch << 32, Ordering::SeqCst);
        while self.shared.running.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
    }
}

impl Shared {
    fn helper_loop(&self) {
        let mut last_epoch = None;
        let mut idle = 0u32;
        loop {
            let state = self.state.load(Ordering::Acquire);
            let (epoch, slots) = (state >> 32, state & u64::from(u32::MAX));
            if slots > 0 && last_epoch != Some(epoch) {
                if self.take_slot(state) {
                    last_epoch = Some(epoch);
                    idle = 0;
                }
                continue;
            }
            idle += 1;
            if idle < IDLE_SPINS {
                std::hint::spin_loop();
                continue;
            }
            // Leaving: a job published after the caller counted this helper
            // awake would find one helper fewer, so look once more.
            self.awake.fetch_sub(1, Ordering::SeqCst);
            let state = self.state.load(Ordering::SeqCst);
            if state & u64::from(u32::MAX) == 0 || last_epoch == Some(state >> 32) {
                return;
            }
            self.awake.fetch_add(1, Ordering::SeqCst);
            idle = 0;
        }
    }

    /// Takes one slot of the job in `state` and runs it; false when the
    /// slots changed first (taken, or closed by the caller).
    fn take_slot(&self, state: u64) -> bool {
        // Counted before taking the slot, so a caller that closes the slots
        // after the swap below succeeded waits for this helper.
        self.running.fetch_add(1, Ordering::SeqCst);
        let taken = self
            .state
            .compare_exchange(state, state - 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if taken {
            let job = self.job.load(Ordering::Relaxed);
            // SAFETY: this helper holds a slot, so the caller keeps the job
            // alive until `running` drops below.
            let work: &Job<'_> = unsafe { *job };
            if panic::catch_unwind(AssertUnwindSafe(work)).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_spawn(f: Box<dyn FnOnce() + Send>) {
        std::thread::spawn(f);
    }

    /// Runs `items` items over the pool `calls` times; every item runs
    /// exactly once per call.
    fn share_out(pool: &JoinPool, helpers: usize, items: usize, calls: usize) {
        for _ in 0..calls {
            let next = AtomicUsize::new(0);
            let done: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            pool.run(helpers, &|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(d) = done.get(i) else { break };
                // A little work, so helpers really take part.
                std::hint::black_box((0..200).sum::<u64>());
                d.fetch_add(1, Ordering::Relaxed);
            });
            assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn every_item_runs_once_per_call_whoever_joins() {
        for helpers in [1, 2, 3, 7] {
            let pool = JoinPool::new(helpers, thread_spawn);
            assert_eq!(pool.helpers(), helpers);
            share_out(&pool, helpers, 37, 300);
        }
    }

    #[test]
    fn helpers_take_part_and_leave_when_idle() {
        let pool = JoinPool::new(2, thread_spawn);
        let seen = Mutex::new(std::collections::HashSet::new());
        for _ in 0..200 {
            pool.run(2, &|| {
                seen.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(std::time::Duration::from_micros(200));
            });
        }
        assert!(seen.lock().unwrap().len() > 1, "no helper ever joined");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pool.shared.awake.load(Ordering::SeqCst) > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "idle helpers never left"
            );
            std::thread::yield_now();
        }
        // A new call after they left starts new ones.
        share_out(&pool, 2, 11, 20);
    }

    #[test]
    fn helpers_that_never_start_do_not_block_the_caller() {
        fn never(_: Box<dyn FnOnce() + Send>) {}
        let pool = JoinPool::new(3, never);
        share_out(&pool, 3, 9, 5);
    }

    #[test]
    fn a_busy_pool_runs_other_callers_alone() {
        let pool = Arc::new(JoinPool::new(2, thread_spawn));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || share_out(&pool, 2, 23, 100))
            })
            .collect();
        for caller in callers {
            caller.join().unwrap();
        }
    }

    #[test]
    fn a_panicking_helper_is_reported_and_the_pool_survives() {
        let pool = JoinPool::new(1, thread_spawn);
        let caller = std::thread::current().id();
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            for _ in 0..1000 {
                pool.run(1, &|| {
                    assert_eq!(std::thread::current().id(), caller, "helper fails");
                    std::thread::sleep(std::time::Duration::from_micros(100));
                });
            }
        }));
        assert!(result.is_err(), "a helper's panic was lost");
        share_out(&pool, 1, 5, 10);
    }
}
