//! `auto`'s speed test: the same short piece of decoding timed on each
//! backend it could take, so the faster one runs the model.
//!
//! Decoding one token is a few hundred matrix-vector products reading every
//! weight once, then one readback. The probe is one such product, large
//! enough to time (a 2048 × 2048 Q8_0 matrix, 4.25 MiB, the size of a
//! small model's projections), after one untimed run that builds the GPU
//! pipeline and touches the memory. The weights are zeros: neither
//! backend's speed depends on the values.
//!
//! One average over a few products moved by tens of percent from load to
//! load on a busy machine. So the backends are timed in alternating rounds
//! (a few products and one readback each), and each backend's figure is
//! its median round: a hiccup in one round, or a machine that slows down
//! part-way, weighs on both alike and decides nothing.

use tandem_core::backend::MatmulParams;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Backend, Result};
use tandem_cpu::CpuBackend;
use tandem_wgpu::WgpuBackend;

const ROWS: usize = 2048;
const COLS: usize = 2048;
/// Products per timed round, each round ending with a readback.
const PRODUCTS_PER_ROUND: usize = 2;
/// Timed rounds per backend.
pub(crate) const ROUNDS: usize = 5;

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

/// The probe product on one backend, uploaded and run once.
pub(crate) struct ProbeProduct<'a, B: Probe> {
    backend: &'a B,
    weight: B::Weight,
    x: B::Tensor,
    out: B::Tensor,
}

impl<'a, B: Probe> ProbeProduct<'a, B> {
    pub(crate) async fn new(backend: &'a B) -> Result<Self> {
        let format = WeightFormat::Q8_0;
        // COLS is whole Q8_0 blocks; were it not, the upload would say so.
        let bytes = vec![0u8; format.row_bytes(COLS).map_or(0, |row| ROWS * row)];
        let weight = backend.upload_weight(WeightView {
            format,
            rows: ROWS,
            cols: COLS,
            data: &bytes,
        })?;
        let mut probe = ProbeProduct {
            backend,
            weight,
            x: backend.upload(&[0.0; COLS])?,
            out: backend.alloc(ROWS)?,
        };
        probe.run(1).await?;
        Ok(probe)
    }

    /// Milliseconds per product over one round.
    pub(crate) async fn time_round(&mut self) -> Result<f64> {
        let started = now();
        self.run(PRODUCTS_PER_ROUND).await?;
        Ok((now() - started) / PRODUCTS_PER_ROUND as f64)
    }

    async fn run(&mut self, products: usize) -> Result<()> {
        let params = MatmulParams { rows: 1 };
        for _ in 0..products {
            self.backend
                .matmul(&self.x, &self.weight, None, params, &mut self.out)?;
        }
        self.backend.read_one(&self.out).await
    }
}

/// The median of `rounds` (the mean of the middle two when even).
pub(crate) fn median(rounds: &mut [f64]) -> f64 {
    rounds.sort_by(f64::total_cmp);
    match rounds.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => rounds[n / 2],
        n => (rounds[n / 2 - 1] + rounds[n / 2]) / 2.0,
    }
}

/// What was timed, for `backendReason`.
pub fn described(webgpu_ms: f64, cpu_ms: f64) -> String {
    format!(
        "a {ROWS} × {COLS} Q8_0 matrix-vector product took {webgpu_ms:.2} ms on WebGPU and \
         {cpu_ms:.2} ms on the CPU backend in wasm, medians of {ROUNDS} alternating rounds"
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

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn one_slow_round_does_not_move_the_median() {
        assert_eq!(median(&mut [1.0, 1.2, 40.0, 1.1, 0.9]), 1.1);
        assert_eq!(median(&mut [3.0, 1.0, 2.0, 100.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
