//! A CPU backend that records steps the way CUDA graphs do, so the engine's
//! recorded decode (`tandem_core::model::recorded`) is tested without a GPU.
//!
//! While capturing, every kernel call is stored, not run, with weak
//! references to its buffers and its parameters as they were; allocation,
//! upload and download fail. A replay runs the stored calls on whatever the
//! buffers hold then. So the faults a CUDA graph would have show up here:
//! an input not rewritten before a replay gives stale tokens, and a buffer
//! freed while a recording names it fails the replay.

use std::cell::RefCell;
use std::rc::{Rc, Weak};

use tandem_core::backend::{
    AttentionIndices, AttentionParams, BackendInfo, Glu, KvCacheLayout, MatmulParams,
    MoeCombineParams, MoeRouteParams, NormPrologue, RecordedStep, RmsNormParams, RopeParams,
    SplitOut,
};
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Backend, Error, Result};
use tandem_cpu::{CpuBackend, Indices, KvCache, Tensor, Weight};

type Shared<T> = Rc<RefCell<T>>;
type Call = Box<dyn Fn(&CpuBackend) -> Result<()>>;

/// See the module documentation.
pub struct RecordingCpu {
    cpu: Rc<CpuBackend>,
    /// The calls of the capture in progress.
    capture: RefCell<Option<Vec<Call>>>,
    /// Every capture ends in an error (the engine must run such steps eagerly).
    fail_captures: bool,
}

/// A recorded step: the kernel calls of one capture.
struct Recording {
    cpu: Rc<CpuBackend>,
    calls: Vec<Call>,
}

impl RecordedStep for Recording {
    fn replay(&self) -> Result<()> {
        self.calls.iter().try_for_each(|call| call(&self.cpu))
    }
}

impl RecordingCpu {
    pub fn new(threads: usize) -> Self {
        Self {
            cpu: Rc::new(CpuBackend::new(threads)),
            capture: RefCell::new(None),
            fail_captures: false,
        }
    }

    /// A backend whose captures all fail when they end.
    pub fn failing_captures(threads: usize) -> Self {
        Self {
            fail_captures: true,
            ..Self::new(threads)
        }
    }

    /// Runs `call` now, or stores it while capturing.
    fn launch(&self, call: impl Fn(&CpuBackend) -> Result<()> + 'static) -> Result<()> {
        match self.capture.borrow_mut().as_mut() {
            Some(calls) => {
                calls.push(Box::new(call));
                Ok(())
            }
            None => call(&self.cpu),
        }
    }

    fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capture.borrow().is_some() {
            return Err(error(format!("{what} while capturing")));
        }
        Ok(())
    }
}

fn error(message: impl Into<String>) -> Error {
    Error::backend("recording cpu", message)
}

fn weak<T>(rc: &Rc<T>) -> Weak<T> {
    Rc::downgrade(rc)
}

fn live<T>(weak: &Weak<T>) -> Result<Rc<T>> {
    weak.upgrade()
        .ok_or_else(|| error("a recorded step names a buffer that was freed"))
}

fn shared<T>(value: T) -> Shared<T> {
    Rc::new(RefCell::new(value))
}

impl Backend for RecordingCpu {
    type Tensor = Shared<Tensor>;
    type Indices = Shared<Indices>;
    type Weight = Rc<Weight>;
    type KvCache = Shared<KvCache>;

    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "recording-cpu".into(),
            device: self.cpu.info().device,
        }
    }

    fn alloc(&self, len: usize) -> Result<Self::Tensor> {
        self.refuse_while_capturing("alloc")?;
        self.cpu.alloc(len).map(shared)
    }

    fn upload(&self, data: &[f32]) -> Result<Self::Tensor> {
        self.refuse_while_capturing("upload")?;
        self.cpu.upload(data).map(shared)
    }

    fn download(&self, t: &Self::Tensor, len: usize) -> Result<Vec<f32>> {
        self.refuse_while_capturing("download")?;
        self.cpu.download(&t.borrow(), len)
    }

    fn upload_indices(&self, data: &[u32]) -> Result<Self::Indices> {
        self.refuse_while_capturing("upload_indices")?;
        self.cpu.upload_indices(data).map(shared)
    }

    fn download_indices(&self, t: &Self::Indices, len: usize) -> Result<Vec<u32>> {
        self.refuse_while_capturing("download_indices")?;
        self.cpu.download_indices(&t.borrow(), len)
    }

    fn write_indices(&self, dst: &mut Self::Indices, data: &[u32]) -> Result<()> {
        self.refuse_while_capturing("write_indices")?;
        self.cpu.write_indices(&mut dst.borrow_mut(), data)
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<Self::Weight> {
        self.refuse_while_capturing("upload_weight")?;
        self.cpu.upload_weight(w).map(Rc::new)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<Self::KvCache> {
        self.refuse_while_capturing("alloc_kv_cache")?;
        self.cpu.alloc_kv_cache(layout).map(shared)
    }

    fn copy_kv_blocks(&self, cache: &mut Self::KvCache, pairs: &[(u32, u32)]) -> Result<()> {
        let (cache, pairs) = (weak(cache), pairs.to_vec());
        self.launch(move |cpu| cpu.copy_kv_blocks(&mut live(&cache)?.borrow_mut(), &pairs))
    }

    fn supports_format(&self, format: WeightFormat) -> bool {
        self.cpu.supports_format(format)
    }

    fn can_record(&self) -> bool {
        true
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.capture.borrow_mut();
        if capture.is_some() {
            return Err(error("a capture is already in progress"));
        }
        *capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<Box<dyn RecordedStep>> {
        let calls = self
            .capture
            .borrow_mut()
            .take()
            .ok_or_else(|| error("end_capture without begin_capture"))?;
        if self.fail_captures {
            return Err(error("this backend fails every capture"));
        }
        Ok(Box::new(Recording {
            cpu: self.cpu.clone(),
            calls,
        }))
    }

    fn embedding(
        &self,
        table: &Self::Weight,
        tokens: &Self::Indices,
        rows: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (table, tokens, out) = (weak(table), weak(tokens), weak(out));
        self.launch(move |cpu| {
            cpu.embedding(
                &*live(&table)?,
                &live(&tokens)?.borrow(),
                rows,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (x, weight, out) = (weak(x), weak(weight), weak(out));
        self.launch(move |cpu| {
            cpu.rms_norm(
                &live(&x)?.borrow(),
                &*live(&weight)?,
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn rms_norm_residual(
        &self,
        residual: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (residual, delta, weight, out) = (weak(residual), weak(delta), weak(weight), weak(out));
        self.launch(move |cpu| {
            cpu.rms_norm_residual(
                &mut live(&residual)?.borrow_mut(),
                &live(&delta)?.borrow(),
                &*live(&weight)?,
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (x, w, bias, out) = (weak(x), weak(w), bias.map(weak), weak(out));
        self.launch(move |cpu| {
            let bias = bias.as_ref().map(live).transpose()?;
            cpu.matmul(
                &live(&x)?.borrow(),
                &*live(&w)?,
                bias.as_deref(),
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &Self::Indices,
        inv_freq: &Self::Tensor,
        p: RopeParams,
    ) -> Result<()> {
        let (x, positions, inv_freq) = (weak(x), weak(positions), weak(inv_freq));
        self.launch(move |cpu| {
            cpu.rope(
                &mut live(&x)?.borrow_mut(),
                &live(&positions)?.borrow(),
                &live(&inv_freq)?.borrow(),
                p,
            )
        })
    }

    fn paged_kv_write(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        slots: &Self::Indices,
        rows: usize,
        cache: &mut Self::KvCache,
    ) -> Result<()> {
        let (k, v, slots, cache) = (weak(k), weak(v), weak(slots), weak(cache));
        self.launch(move |cpu| {
            cpu.paged_kv_write(
                &live(&k)?.borrow(),
                &live(&v)?.borrow(),
                &live(&slots)?.borrow(),
                rows,
                &mut live(&cache)?.borrow_mut(),
            )
        })
    }

    fn paged_attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (q, cache, out) = (weak(q), weak(cache), weak(out));
        let (row_seq, positions, tables) = (
            weak(idx.row_seq),
            weak(idx.positions),
            weak(idx.block_tables),
        );
        self.launch(move |cpu| {
            let (row_seq, positions, tables) = (live(&row_seq)?, live(&positions)?, live(&tables)?);
            let (row_seq, positions, block_tables) =
                (&*row_seq.borrow(), &*positions.borrow(), &*tables.borrow());
            cpu.paged_attention(
                &live(&q)?.borrow(),
                &live(&cache)?.borrow(),
                AttentionIndices::<CpuBackend> {
                    row_seq,
                    positions,
                    block_tables,
                },
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &Self::Tensor,
        norm: Option<NormPrologue<'_, Self::Weight>>,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, Self::Tensor>],
    ) -> Result<()> {
        let (x, w, bias) = (weak(x), weak(w), bias.map(weak));
        let norm = norm.map(|n| (weak(n.weight), n.eps));
        let outs: Vec<_> = outs.iter().map(|o| (weak(o.out), o.width)).collect();
        self.launch(move |cpu| {
            let bias = bias.as_ref().map(live).transpose()?;
            let norm_weight = norm.as_ref().map(|(w, _)| live(w)).transpose()?;
            let prologue = norm_weight.as_deref().map(|weight| NormPrologue {
                weight,
                eps: norm.as_ref().map_or(0.0, |n| n.1),
            });
            let live_outs = outs
                .iter()
                .map(|(o, width)| Ok((live(o)?, *width)))
                .collect::<Result<Vec<_>>>()?;
            let mut borrowed: Vec<_> = live_outs
                .iter()
                .map(|(o, w)| (o.borrow_mut(), *w))
                .collect();
            let mut parts: Vec<SplitOut<'_, Tensor>> = borrowed
                .iter_mut()
                .map(|(out, width)| SplitOut {
                    out: &mut **out,
                    width: *width,
                })
                .collect();
            cpu.matmul_rms_norm(
                &live(&x)?.borrow(),
                prologue,
                &*live(&w)?,
                bias.as_deref(),
                p,
                &mut parts,
            )
        })
    }

    fn matmul_glu(
        &self,
        x: &Self::Tensor,
        norm: Option<NormPrologue<'_, Self::Weight>>,
        w: &Self::Weight,
        glu: Glu,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (x, w, out) = (weak(x), weak(w), weak(out));
        let norm = norm.map(|n| (weak(n.weight), n.eps));
        self.launch(move |cpu| {
            let norm_weight = norm.as_ref().map(|(w, _)| live(w)).transpose()?;
            let prologue = norm_weight.as_deref().map(|weight| NormPrologue {
                weight,
                eps: norm.as_ref().map_or(0.0, |n| n.1),
            });
            cpu.matmul_glu(
                &live(&x)?.borrow(),
                prologue,
                &*live(&w)?,
                glu,
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn matmul_residual(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (x, w, out) = (weak(x), weak(w), weak(out));
        self.launch(move |cpu| {
            cpu.matmul_residual(
                &live(&x)?.borrow(),
                &*live(&w)?,
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn mlp_residual(
        &self,
        residual: &mut Self::Tensor,
        norm: NormPrologue<'_, Self::Weight>,
        gate_up: &Self::Weight,
        down: &Self::Weight,
        glu: Glu,
        p: MatmulParams,
        act: &mut Self::Tensor,
    ) -> Result<()> {
        let (residual, gate_up, down, act) = (weak(residual), weak(gate_up), weak(down), weak(act));
        let (norm_weight, eps) = (weak(norm.weight), norm.eps);
        self.launch(move |cpu| {
            let weight = &*live(&norm_weight)?;
            cpu.mlp_residual(
                &mut live(&residual)?.borrow_mut(),
                NormPrologue { weight, eps },
                &*live(&gate_up)?,
                &*live(&down)?,
                glu,
                p,
                &mut live(&act)?.borrow_mut(),
            )
        })
    }

    fn swiglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (gate, up, out) = (weak(gate), weak(up), weak(out));
        self.launch(move |cpu| {
            cpu.swiglu(
                &live(&gate)?.borrow(),
                &live(&up)?.borrow(),
                len,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn geglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (gate, up, out) = (weak(gate), weak(up), weak(out));
        self.launch(move |cpu| {
            cpu.geglu(
                &live(&gate)?.borrow(),
                &live(&up)?.borrow(),
                len,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn scale(&self, x: &mut Self::Tensor, len: usize, factor: f32) -> Result<()> {
        let x = weak(x);
        self.launch(move |cpu| cpu.scale(&mut live(&x)?.borrow_mut(), len, factor))
    }

    fn gather_rows(
        &self,
        x: &Self::Tensor,
        rows: &Self::Indices,
        n: usize,
        width: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (x, rows, out) = (weak(x), weak(rows), weak(out));
        self.launch(move |cpu| {
            cpu.gather_rows(
                &live(&x)?.borrow(),
                &live(&rows)?.borrow(),
                n,
                width,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn moe_route(
        &self,
        logits: &Self::Tensor,
        p: MoeRouteParams,
        ids: &mut Self::Indices,
        weights: &mut Self::Tensor,
    ) -> Result<()> {
        let (logits, ids, weights) = (weak(logits), weak(ids), weak(weights));
        self.launch(move |cpu| {
            cpu.moe_route(
                &live(&logits)?.borrow(),
                p,
                &mut live(&ids)?.borrow_mut(),
                &mut live(&weights)?.borrow_mut(),
            )
        })
    }

    fn moe_combine(
        &self,
        y: &Self::Tensor,
        rows: &Self::Indices,
        ids: &Self::Indices,
        weights: &Self::Tensor,
        p: MoeCombineParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let (y, rows, ids) = (weak(y), weak(rows), weak(ids));
        let (weights, out) = (weak(weights), weak(out));
        self.launch(move |cpu| {
            cpu.moe_combine(
                &live(&y)?.borrow(),
                &live(&rows)?.borrow(),
                &live(&ids)?.borrow(),
                &live(&weights)?.borrow(),
                p,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }

    fn argmax(
        &self,
        x: &Self::Tensor,
        rows: usize,
        width: usize,
        out: &mut Self::Indices,
    ) -> Result<()> {
        let (x, out) = (weak(x), weak(out));
        self.launch(move |cpu| {
            cpu.argmax(
                &live(&x)?.borrow(),
                rows,
                width,
                &mut live(&out)?.borrow_mut(),
            )
        })
    }
}
