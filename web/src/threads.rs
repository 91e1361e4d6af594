//! How many threads the CPU backend runs on (`options.threads`), and why
//! fewer than asked when it does (`info().threadsReason`).
//!
//! Only the threaded package (compiled with atomics by a nightly toolchain:
//! `make web`'s `pkg/threads`) has threads, and only once `initThreadPool`
//! started rayon's global pool on Web Workers, which needs a cross-origin
//! isolated page (shared wasm memory is a SharedArrayBuffer). worker.js
//! takes that package and starts the pool where it can; everywhere else the
//! CPU backend runs on one thread, and worker.js says why in place of this
//! package's reason.

use js_sys::Reflect;
use wasm_bindgen::prelude::*;

use tandem_cpu::CpuBackend;

/// `options.threads` (a whole number, at least 1), or by default one per
/// core the browser reports (`navigator.hardwareConcurrency`).
pub fn asked(option: Option<f64>) -> Result<usize, JsError> {
    match option {
        None => Ok(cores()),
        Some(n) if n >= 1.0 && n.fract() == 0.0 => Ok(n as usize),
        Some(_) => Err(JsError::new(
            "option threads must be a whole number of at least 1",
        )),
    }
}

/// The CPU backend on up to `asked` threads (the caller's and the pool's),
/// and why it got fewer, if it did.
pub fn cpu_backend(asked: usize) -> (CpuBackend, Option<String>) {
    let backend = CpuBackend::new(asked);
    let got = backend.threads();
    let reason = (got < asked).then(|| fewer(asked, got));
    (backend, reason)
}

#[cfg(target_feature = "atomics")]
fn fewer(asked: usize, got: usize) -> String {
    format!(
        "{asked} threads were asked for; the engine's thread pool (initThreadPool: \
         navigator.hardwareConcurrency - 1 workers beside the engine's) gives {got}"
    )
}

#[cfg(not(target_feature = "atomics"))]
fn fewer(_asked: usize, _got: usize) -> String {
    "this build of the engine is single-threaded (the threaded one is pkg/threads)".into()
}

fn cores() -> usize {
    let navigator = Reflect::get(&js_sys::global(), &"navigator".into()).unwrap_or_default();
    Reflect::get(&navigator, &"hardwareConcurrency".into())
        .ok()
        .and_then(|n| n.as_f64())
        .filter(|n| *n >= 1.0)
        .map_or(1, |n| n as usize)
}
