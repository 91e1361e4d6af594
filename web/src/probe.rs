//! `auto`'s speed test: the same short piece of decoding timed on each
//! backend it could take, so the faster one runs the model.
//!
//! Decoding one token is a few hundred matrix-vector products reading every
//! weight once, then one readback. The probe is one such product, large
//! enough to time (a 2048 × 2048 Q8_0 matrix, 4.25 MiB, the size of a
//! small model's projections), run a few times and read back once, after
//! one untimed run that builds the GPU pipeline and touches the memory.
//! The weights are zeros: neither backend's speed depends on the values.

use tandem_core::backend::MatmulParams;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Backend, Result};
use tandem_cpu::CpuBackend;
use tandem_wgpu::WgpuBackend;

const ROWS: usize = 2048;
const COLS: usize = 2048;
const TIMED_RUNS: usize = 4;

/// A backend that can wait for its queued work without blocking.
pub(crate) trait Probe: Backend + Sized {
    async fn read_one(&self, t: &Self::Tensor) -> Result<()>;
}

impl Probe for CpuBackend {
    async fn read_one(&self, t: &Self::Tensor) -> Result<()> {
        self.download(t, 1).map(drop)
    }
}

impl Probe for WgpuBackend {
    async fn read_one(&self, t: &Self::Tensor) -> Result<()> {
        self.download_async(t, 1).await.map(drop)
    }
}

/// Milliseconds one probe product takes on `backend`.
pub(crate) async fn millis_per_product<B: Probe>(backend: &B) -> Result<f64> {
    let format = WeightFormat::Q8_0;
    // COLS is whole Q8_0 blocks; were it not, the upload would say so.
    let bytes = vec![0u8; format.row_bytes(COLS).map_or(0, |row| ROWS * row)];
    let weight = backend.upload_weight(WeightView {
        format,
        rows: ROWS,
        cols: COLS,
        data: &bytes,
    })?;
    let x = backend.upload(&[0.0; COLS])?;
    let mut out = backend.alloc(ROWS)?;
    let params = MatmulParams { rows: 1 };
    backend.matmul(&x, &weight, None, params, &mut out)?;
    backend.read_one(&out).await?;
    let started = now();
    for _ in 0..TIMED_RUNS {
        backend.matmul(&x, &weight, None, params, &mut out)?;
    }
    backend.read_one(&out).await?;
    Ok((now() - started) / TIMED_RUNS as f64)
}

/// What was timed, for `backendReason`.
pub fn described(webgpu_ms: f64, cpu_ms: f64) -> String {
    format!(
        "a {ROWS} × {COLS} Q8_0 matrix-vector product took {webgpu_ms:.2} ms on WebGPU and \
         {cpu_ms:.2} ms on the CPU backend in wasm"
    )
}

/// Milliseconds from the browser's clock (`performance.now()`, in windows
/// and workers alike).
fn now() -> f64 {
    let performance =
        js_sys::Reflect::get(&js_sys::global(), &"performance".into()).unwrap_or_default();
    js_sys::Reflect::get(&performance, &"now".into())
        .ok()
        .and_then(|f| wasm_bindgen::JsCast::dyn_into::<js_sys::Function>(f).ok())
        .and_then(|f| f.call0(&performance).ok())
        .and_then(|t| t.as_f64())
        .unwrap_or_else(js_sys::Date::now)
}
