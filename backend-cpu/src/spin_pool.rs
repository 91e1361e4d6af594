//! The native helper threads: a pool that spins between kernels.
//!
//! Decode calls a kernel a couple of hundred times per token, each a few
//! microseconds of work. A helper that parks between kernels costs a futex
//! wake and a reschedule per call, often longer than the kernel's share
//! (llama.cpp's threadpool spins for the same reason). Here a helper spins
//! for a short while after its last job and only then parks, so the
//! kernels of one forward pass meet awake helpers, and an idle engine still
//! gives its cores back within a fraction of a millisecond.
//!
//! One job runs at a time. A caller that finds the pool busy (another
//! thread's kernel, or a kernel called from inside a job) runs its work
//! alone instead of waiting, so the pool can never deadlock on itself.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::workers::try_dispatch;

/// How long an idle helper spins before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(200);

/// A job as the helpers see it: the caller's closure, type-erased. It lives
/// on the caller's stack; the caller does not return before every helper
/// that took part has finished with it.
type Job<'a> = dyn Fn() + Sync + 'a;

pub(crate) struct SpinPool {
    shared: Arc<Shared>,
    /// Held by the one caller whose job is running.
    dispatch: Mutex<()>,
    helpers: Vec<JoinHandle<()>>,
}

struct Shared {
    /// The job's epoch (high 32 bits) and how many helpers take part (low
    /// 32 bits), in one word so a helper never pairs an epoch with another
    /// job's count.
    state: AtomicU64,
    /// A `*const &Job`, valid while its helpers are running.
    job: AtomicPtr<&'static Job<'static>>,
    /// Helpers of the current job that have not finished it.
    running: AtomicUsize,
    /// Set when a helper's part of the job panicked.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Parked helpers wait here for the next epoch.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

impl SpinPool {
    /// A pool of `helpers` threads; `None` where threads cannot be spawned.
    pub(crate) fn new(helpers: usize) -> Option<Self> {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            running: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = SpinPool {
            shared: shared.clone(),
            dispatch: Mutex::new(()),
            helpers: Vec::with_capacity(helpers),
        };
        for index in 0..helpers {
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("tandem-cpu-{}", index + 1))
                .spawn(move || shared.helper_loop(index))
                .ok()?;
            pool.helpers.push(handle);
        }
        Some(pool)
    }

    pub(crate) fn helpers(&self) -> usize {
        self.helpers.len()
    }

    /// Runs `work` on the caller and on `helpers` helper threads at once,
    /// returning when all of them are done. `work` is expected to share its
    /// items out (each call takes items until none is left).
    pub(crate) fn run(&self, helpers: usize, work: &Job<'_>) {
        let helpers = helpers.min(self.helpers.len());
        let Some(_busy) = try_dispatch(&self.dispatch) else {
            return work();
        };
        if helpers == 0 {
            return work();
        }
        let shared = &*self.shared;
        // SAFETY: the pointer is only read by the helpers this call counts
        // in `running`, and `Finish` waits for all of them before this
        // frame (and `work`) can go away, even when `work` panics.
        let job: *const &Job<'_> = &work;
        shared
            .job
            .store(job as *mut &'static Job<'static>, Ordering::Relaxed);
        shared.running.store(helpers, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        let epoch = (shared.state.load(Ordering::Relaxed) >> 32).wrapping_add(1);
        shared
            .state
            .store((epoch << 32) | helpers as u64, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _parked = shared.park.lock().unwrap_or_else(PoisonError::into_inner);
            shared.wake.notify_all();
        }
        let finish = Finish(shared);
        work();
        drop(finish);
        if shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU backend helper thread panicked");
        }
    }
}

/// Waits, on drop, for the current job's helpers to finish.
struct Finish<'a>(&'a Shared);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let started = Instant::now();
        let mut spins = 0u32;
        while self.0.running.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            // A helper descheduled by another process may take a while:
            // stop burning the core it needs.
            if spins.is_multiple_of(64) && started.elapsed() > SPIN_BEFORE_PARK {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Shared {
    fn helper_loop(&self, index: usize) {
        let mut seen = 0u64;
        loop {
            let state = self.next_state(seen);
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            seen = state >> 32;
            if index < (state & u64::from(u32::MAX)) as usize {
                let job = self.job.load(Ordering::Relaxed);
                // SAFETY: this helper is counted in `running`, so the
                // caller keeps the job alive until the decrement below.
                let work: &Job<'_> = unsafe { *job };
                if panic::catch_unwind(AssertUnwindSafe(work)).is_err() {
                    self.panicked.store(true, Ordering::Relaxed);
                }
                self.running.fetch_sub(1, Ordering::Release);
            }
        }
    }

    /// The state of the first epoch after `seen` (or of shutdown): spins
    /// for a while, then parks.
    fn next_state(&self, seen: u64) -> u64 {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let state = self.state.load(Ordering::Acquire);
            if state >> 32 != seen || self.shutdown.load(Ordering::Relaxed) {
                return state;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && started.elapsed() > SPIN_BEFORE_PARK {
                break;
            }
            std::hint::spin_loop();
        }
        let mut parked = self.park.lock().unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            let state = self.state.load(Ordering::SeqCst);
            if state >> 32 != seen || self.shutdown.load(Ordering::SeqCst) {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                return state;
            }
            parked = self
                .wake
                .wait(parked)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _parked = self
                .shared
                .park
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_participant_runs_the_job_once_per_call() {
        let pool = SpinPool::new(3).unwrap();
        for helpers in [0, 1, 2, 3, 7] {
            for _ in 0..200 {
                let calls = AtomicUsize::new(0);
                pool.run(helpers, &|| {
                    calls.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(calls.load(Ordering::Relaxed), helpers.min(3) + 1);
            }
        }
    }

    #[test]
    fn parked_helpers_wake_for_the_next_job() {
        let pool = SpinPool::new(2).unwrap();
        for _ in 0..3 {
            std::thread::sleep(SPIN_BEFORE_PARK * 10);
            let calls = AtomicUsize::new(0);
            pool.run(2, &|| {
                calls.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(calls.load(Ordering::Relaxed), 3);
        }
    }

    #[test]
    fn a_busy_pool_runs_other_callers_alone() {
        let pool = SpinPool::new(2).unwrap();
        let inner_calls = AtomicUsize::new(0);
        pool.run(2, &|| {
            // Nested: the pool is taken, so this runs on this thread only.
            pool.run(2, &|| {
                inner_calls.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(inner_calls.load(Ordering::Relaxed), 3);
        let pool = Arc::new(pool);
        let total = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        pool.run(2, &|| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.join().unwrap();
        }
        // Every call ran its work at least once (alone) and at most three times.
        let total = total.load(Ordering::Relaxed);
        assert!((400..=1200).contains(&total), "{total}");
    }

    #[test]
    fn a_panicking_helper_is_reported_and_the_pool_survives() {
        let pool = SpinPool::new(1).unwrap();
        let caller = std::thread::current().id();
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(1, &|| {
                if std::thread::current().id() != caller {
                    panic!("helper fails");
                }
            })
        }));
        assert!(result.is_err());
        let calls = AtomicUsize::new(0);
        pool.run(1, &|| {
            calls.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }
}
