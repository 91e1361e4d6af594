//! A CPU backend that fails on purpose, so the engine's and the server's
//! handling of device failures is tested without a device that fails: the
//! n-th call of a chosen operation (a kernel, an allocation, a download)
//! returns a backend error, as a failing kernel, a lost device or a refused
//! allocation would. Every call, failing or not, is otherwise the CPU
//! backend's.
//!
//! Faults are armed through [`Faults`], shared with the test, so a test can
//! arm one while the backend runs on the server's engine thread. A test can
//! also hold the engine inside a call ([`Faults::hold`]) to arm a fault for
//! a step whose sequences it knows. It also logs the rows of every `matmul`
//! call ([`Faults::matmul_rows`]), so a test can see how the work was cut
//! into calls.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tandem_core::backend::{
    AttentionIndices, AttentionParams, BackendInfo, KvCacheLayout, MatmulParams, MoeCombineParams,
    MoeRouteParams, RmsNormParams, RopeParams,
};
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Backend, Error, Result};
use tandem_cpu::{CpuBackend, Indices, KvCache, Tensor, Weight};

/// The operations a fault can be armed on: the [`Backend`] methods that
/// touch the device.
pub const OPERATIONS: [&str; 19] = [
    "alloc",
    "upload",
    "download",
    "upload_indices",
    "download_indices",
    "write_indices",
    "copy_kv_blocks",
    "embedding",
    "rms_norm",
    "rms_norm_residual",
    "matmul",
    "rope",
    "paged_kv_write",
    "paged_attention",
    "swiglu",
    "geglu",
    "scale",
    "gather_rows",
    "argmax",
];

/// The faults to inject and the calls counted since they were armed.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<FaultState>,
    released: Condvar,
}

#[derive(Debug, Default)]
struct FaultState {
    /// Operation → calls left before the one that fails (0: the next one).
    armed: HashMap<&'static str, u64>,
    /// Faults that fired, in order: the operation of each.
    fired: Vec<&'static str>,
    /// The operation whose next call waits for [`Faults::release`].
    hold_next: Option<&'static str>,
    /// A call is waiting for [`Faults::release`].
    holding: bool,
    /// The rows of every `matmul` call, in order.
    matmul_rows: Vec<usize>,
}

impl Faults {
    pub fn new() -> Arc<Faults> {
        Arc::new(Faults::default())
    }

    /// The `nth` call (1: the next one) of `operation` from now fails, once.
    pub fn arm(&self, operation: &'static str, nth: u64) {
        assert!(
            OPERATIONS.contains(&operation),
            "{operation} is not a backend operation ({OPERATIONS:?})"
        );
        assert!(nth > 0, "calls are counted from 1");
        self.lock().armed.insert(operation, nth - 1);
    }

    /// The operations whose faults fired, in order.
    pub fn fired(&self) -> Vec<&'static str> {
        self.lock().fired.clone()
    }

    /// The rows of every `matmul` call so far, in order.
    pub fn matmul_rows(&self) -> Vec<usize> {
        self.lock().matmul_rows.clone()
    }

    /// Whether an armed fault has not fired yet.
    pub fn pending(&self) -> bool {
        !self.lock().armed.is_empty()
    }

    /// The next call of `operation` waits, before its fault check, until
    /// [`Faults::release`].
    pub fn hold(&self, operation: &'static str) {
        assert!(
            OPERATIONS.contains(&operation),
            "{operation} is not a backend operation"
        );
        self.lock().hold_next = Some(operation);
    }

    /// Waits (at most 10 s) until a held call is waiting.
    pub fn wait_until_holding(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.lock().holding {
            assert!(Instant::now() < deadline, "no call was held");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets the held call go on.
    pub fn release(&self) {
        self.lock().holding = false;
        self.released.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a call of `operation` (after holding it, if asked); the error
    /// if it is the one armed to fail.
    fn call(&self, operation: &'static str) -> Result<()> {
        let mut state = self.lock();
        if state.hold_next == Some(operation) {
            state.hold_next = None;
            state.holding = true;
            while state.holding {
                state =
                    (self.released.wait(state)).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
        match state.armed.get_mut(operation) {
            Some(0) => {
                state.armed.remove(operation);
                state.fired.push(operation);
                Err(Error::backend(
                    "faulty cpu",
                    format!("injected fault in {operation}"),
                ))
            }
            Some(left) => {
                *left -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// The CPU backend with [`Faults`]; see the module documentation.
pub struct FaultyCpu {
    cpu: CpuBackend,
    faults: Arc<Faults>,
}

impl FaultyCpu {
    pub fn new(threads: usize, faults: Arc<Faults>) -> Self {
        Self {
            cpu: CpuBackend::new(threads),
            faults,
        }
    }
}

impl Backend for FaultyCpu {
    type Tensor = Tensor;
    type Indices = Indices;
    type Weight = Weight;
    type KvCache = KvCache;

    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "faulty-cpu".into(),
            device: self.cpu.info().device,
        }
    }

    fn alloc(&self, len: usize) -> Result<Tensor> {
        self.faults.call("alloc")?;
        self.cpu.alloc(len)
    }

    fn upload(&self, data: &[f32]) -> Result<Tensor> {
        self.faults.call("upload")?;
        self.cpu.upload(data)
    }

    fn download(&self, t: &Tensor, len: usize) -> Result<Vec<f32>> {
        self.faults.call("download")?;
        self.cpu.download(t, len)
    }

    fn upload_indices(&self, data: &[u32]) -> Result<Indices> {
        self.faults.call("upload_indices")?;
        self.cpu.upload_indices(data)
    }

    fn download_indices(&self, t: &Indices, len: usize) -> Result<Vec<u32>> {
        self.faults.call("download_indices")?;
        self.cpu.download_indices(t, len)
    }

    fn write_indices(&self, dst: &mut Indices, data: &[u32]) -> Result<()> {
        self.faults.call("write_indices")?;
        self.cpu.write_indices(dst, data)
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<Weight> {
        self.cpu.upload_weight(w)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<KvCache> {
        self.cpu.alloc_kv_cache(layout)
    }

    fn copy_kv_blocks(&self, cache: &mut KvCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.faults.call("copy_kv_blocks")?;
        self.cpu.copy_kv_blocks(cache, pairs)
    }

    fn supports_format(&self, format: WeightFormat) -> bool {
        self.cpu.supports_format(format)
    }

    fn embedding(
        &self,
        table: &Weight,
        tokens: &Indices,
        rows: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("embedding")?;
        self.cpu.embedding(table, tokens, rows, out)
    }

    fn rms_norm(
        &self,
        x: &Tensor,
        weight: &Weight,
        p: RmsNormParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("rms_norm")?;
        self.cpu.rms_norm(x, weight, p, out)
    }

    fn rms_norm_residual(
        &self,
        residual: &mut Tensor,
        delta: &Tensor,
        weight: &Weight,
        p: RmsNormParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("rms_norm_residual")?;
        self.cpu.rms_norm_residual(residual, delta, weight, p, out)
    }

    fn matmul(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Weight>,
        p: MatmulParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("matmul")?;
        self.faults.lock().matmul_rows.push(p.rows);
        self.cpu.matmul(x, w, bias, p, out)
    }

    fn rope(
        &self,
        x: &mut Tensor,
        positions: &Indices,
        inv_freq: &Tensor,
        p: RopeParams,
    ) -> Result<()> {
        self.faults.call("rope")?;
        self.cpu.rope(x, positions, inv_freq, p)
    }

    fn paged_kv_write(
        &self,
        k: &Tensor,
        v: &Tensor,
        slots: &Indices,
        rows: usize,
        cache: &mut KvCache,
    ) -> Result<()> {
        self.faults.call("paged_kv_write")?;
        self.cpu.paged_kv_write(k, v, slots, rows, cache)
    }

    fn paged_attention(
        &self,
        q: &Tensor,
        cache: &KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("paged_attention")?;
        let idx = AttentionIndices::<CpuBackend> {
            row_seq: idx.row_seq,
            positions: idx.positions,
            block_tables: idx.block_tables,
        };
        self.cpu.paged_attention(q, cache, idx, p, out)
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor, len: usize, out: &mut Tensor) -> Result<()> {
        self.faults.call("swiglu")?;
        self.cpu.swiglu(gate, up, len, out)
    }

    fn geglu(&self, gate: &Tensor, up: &Tensor, len: usize, out: &mut Tensor) -> Result<()> {
        self.faults.call("geglu")?;
        self.cpu.geglu(gate, up, len, out)
    }

    fn scale(&self, x: &mut Tensor, len: usize, factor: f32) -> Result<()> {
        self.faults.call("scale")?;
        self.cpu.scale(x, len, factor)
    }

    fn gather_rows(
        &self,
        x: &Tensor,
        rows: &Indices,
        n: usize,
        width: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("gather_rows")?;
        self.cpu.gather_rows(x, rows, n, width, out)
    }

    fn moe_route(
        &self,
        logits: &Tensor,
        p: MoeRouteParams,
        ids: &mut Indices,
        weights: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("moe_route")?;
        self.cpu.moe_route(logits, p, ids, weights)
    }

    fn moe_combine(
        &self,
        y: &Tensor,
        rows: &Indices,
        ids: &Indices,
        weights: &Tensor,
        p: MoeCombineParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.faults.call("moe_combine")?;
        self.cpu.moe_combine(y, rows, ids, weights, p, out)
    }

    fn argmax(&self, x: &Tensor, rows: usize, width: usize, out: &mut Indices) -> Result<()> {
        self.faults.call("argmax")?;
        self.cpu.argmax(x, rows, width, out)
    }
}
