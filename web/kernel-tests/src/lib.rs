//! The cross-backend kernel suite (`tests/src/conformance.rs`, included as
//! it is) in the browser: the wgpu backend on the browser's WebGPU against
//! the CPU backend compiled to wasm. `tests/web/kernels.mjs` opens
//! `tests/web/kernels.html` in headless Chromium, which calls
//! [`run_kernel_conformance`], then times one decode layer fused against
//! unfused (`fusion_bench`).
//!
//! The suite reads every result back with the blocking `download`, which
//! the browser forbids. So it runs twice over [`Replay`], a backend that
//! forwards every call to WebGPU. The first pass keeps each tensor it is
//! asked to download and answers zeros; the kept tensors are then read
//! back asynchronously; the second pass, with the same seeded inputs, gets
//! the real values in the same order, and its report is the result. The
//! suite never feeds a downloaded value back into a kernel, so the first
//! pass's zeros change nothing but its own (discarded) report.

mod fusion_bench;

#[path = "../../../tests/src/conformance.rs"]
#[allow(dead_code)]
mod conformance;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use js_sys::{Array, Object, Reflect};
use wasm_bindgen::prelude::*;

use tandem_core::backend::{
    AttentionIndices, AttentionParams, Backend, BackendInfo, BlockSelectParams, Glu, KvCacheLayout,
    MatmulParams, MoeCombineParams, MoeRouteParams, NormPrologue, RmsNormParams, RopeParams,
    SplitOut,
};
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Error, Result};
use tandem_cpu::CpuBackend;
use tandem_wgpu::{WgpuBackend, WgpuIndices, WgpuKvCache, WgpuOptions, WgpuTensor, WgpuWeight};

/// Runs the suite on WebGPU (with `options.disableSubgroups`,
/// `options.gemvPerRow` as in `WgpuOptions`) and resolves to
/// `{ report: string, problems: string[], adapter: string }`.
#[wasm_bindgen(js_name = runKernelConformance)]
pub async fn run_kernel_conformance(
    options: Option<Object>,
) -> std::result::Result<Object, JsError> {
    let gpu = WgpuBackend::new_async(wgpu_options(options))
        .await
        .map(Rc::new)
        .map_err(|e| JsError::new(&e.to_string()))?;
    let cpu = CpuBackend::new(1);

    let recording = Replay::new(&gpu, Mode::Record(RefCell::default()));
    conformance::compare_backends(&recording, &cpu);
    let Mode::Record(kept) = recording.mode else {
        unreachable!("built in record mode")
    };
    let mut values = VecDeque::new();
    for read in kept.into_inner() {
        values.push_back(match read {
            Kept::Values(t, len) => gpu.download_async(&t, len).await.map(Read::Values),
            Kept::Ids(t, len) => gpu.download_indices_async(&t, len).await.map(Read::Ids),
        });
    }
    let replay = Replay::new(&gpu, Mode::Replay(RefCell::new(values)));
    let report = conformance::compare_backends(&replay, &cpu);

    let result = Object::new();
    let set = |key: &str, value: JsValue| Reflect::set(&result, &key.into(), &value).map(drop);
    let problems: Array = report
        .problems()
        .iter()
        .map(|p| JsValue::from(p.as_str()))
        .collect();
    set("report", report.to_string().into())
        .and_then(|()| set("problems", problems.into()))
        .and_then(|()| set("adapter", gpu.adapter().to_string().into()))
        .map_err(|_| JsError::new("cannot build the result object"))?;
    Ok(result)
}

/// `WgpuOptions` from `{ disableSubgroups, gemvPerRow }`.
fn wgpu_options(options: Option<Object>) -> WgpuOptions {
    let options = options.unwrap_or_default();
    let flag = |key: &str| {
        Reflect::get(&options, &key.into())
            .ok()
            .and_then(|v| v.as_bool())
    };
    WgpuOptions {
        disable_subgroups: flag("disableSubgroups").unwrap_or(false),
        gemv_per_row: flag("gemvPerRow"),
        ..WgpuOptions::default()
    }
}

/// A tensor kept by the first pass until its download.
enum Kept {
    Values(Rc<WgpuTensor>, usize),
    Ids(Rc<WgpuIndices>, usize),
}

/// A download's result, handed out by the second pass.
enum Read {
    Values(Vec<f32>),
    Ids(Vec<u32>),
}

enum Mode {
    Record(RefCell<Vec<Kept>>),
    Replay(RefCell<VecDeque<Result<Read>>>),
}

/// The wgpu backend with downloads recorded (first pass) or replayed (second).
struct Replay {
    gpu: Rc<WgpuBackend>,
    mode: Mode,
}

impl Replay {
    fn new(gpu: &Rc<WgpuBackend>, mode: Mode) -> Self {
        Replay {
            gpu: gpu.clone(),
            mode,
        }
    }

    fn next_read(&self) -> Result<Read> {
        match &self.mode {
            Mode::Replay(reads) => reads
                .borrow_mut()
                .pop_front()
                .unwrap_or_else(|| Err(error("the second pass downloaded more than the first"))),
            Mode::Record(_) => Err(error("no reads in the first pass")),
        }
    }
}

fn error(message: &str) -> Error {
    Error::backend("webgpu replay", message)
}

/// The tensor a kernel writes: it must not be shared with a kept download,
/// which would then read the later value.
fn exclusive<T>(t: &mut Rc<T>) -> Result<&mut T> {
    Rc::get_mut(t).ok_or_else(|| error("a tensor was written after it was downloaded"))
}

impl Backend for Replay {
    type Tensor = Rc<WgpuTensor>;
    type Indices = Rc<WgpuIndices>;
    type Weight = WgpuWeight;
    type KvCache = WgpuKvCache;

    fn info(&self) -> BackendInfo {
        self.gpu.info()
    }

    fn alloc(&self, len: usize) -> Result<Self::Tensor> {
        self.gpu.alloc(len).map(Rc::new)
    }

    fn upload(&self, data: &[f32]) -> Result<Self::Tensor> {
        self.gpu.upload(data).map(Rc::new)
    }

    fn download(&self, t: &Self::Tensor, len: usize) -> Result<Vec<f32>> {
        if let Mode::Record(kept) = &self.mode {
            kept.borrow_mut().push(Kept::Values(t.clone(), len));
            return Ok(vec![0.0; len]);
        }
        match self.next_read()? {
            Read::Values(v) if v.len() == len => Ok(v),
            _ => Err(error("the passes' downloads differ")),
        }
    }

    fn upload_indices(&self, data: &[u32]) -> Result<Self::Indices> {
        self.gpu.upload_indices(data).map(Rc::new)
    }

    fn download_indices(&self, t: &Self::Indices, len: usize) -> Result<Vec<u32>> {
        if let Mode::Record(kept) = &self.mode {
            kept.borrow_mut().push(Kept::Ids(t.clone(), len));
            return Ok(vec![0; len]);
        }
        match self.next_read()? {
            Read::Ids(v) if v.len() == len => Ok(v),
            _ => Err(error("the passes' downloads differ")),
        }
    }

    fn write_indices(&self, dst: &mut Self::Indices, data: &[u32]) -> Result<()> {
        self.gpu.write_indices(exclusive(dst)?, data)
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<Self::Weight> {
        self.gpu.upload_weight(w)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<Self::KvCache> {
        self.gpu.alloc_kv_cache(layout)
    }

    fn copy_kv_blocks(&self, cache: &mut Self::KvCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.gpu.copy_kv_blocks(cache, pairs)
    }

    fn supports_format(&self, format: WeightFormat) -> bool {
        self.gpu.supports_format(format)
    }

    fn embedding(
        &self,
        table: &Self::Weight,
        tokens: &Self::Indices,
        rows: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.embedding(table, tokens, rows, exclusive(out)?)
    }

    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.rms_norm(x, weight, p, exclusive(out)?)
    }

    fn rms_norm_residual(
        &self,
        residual: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu
            .rms_norm_residual(exclusive(residual)?, delta, weight, p, exclusive(out)?)
    }

    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.matmul(x, w, bias, p, exclusive(out)?)
    }

    fn fuses_matmuls(&self) -> bool {
        self.gpu.fuses_matmuls()
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
        let mut parts = Vec::with_capacity(outs.len());
        for part in outs.iter_mut() {
            parts.push(SplitOut {
                out: exclusive(&mut *part.out)?,
                width: part.width,
            });
        }
        self.gpu.matmul_rms_norm(x, norm, w, bias, p, &mut parts)
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
        self.gpu.matmul_glu(x, norm, w, glu, p, exclusive(out)?)
    }

    fn matmul_residual(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.matmul_residual(x, w, p, exclusive(out)?)
    }

    fn kernel_launches(&self) -> Option<u64> {
        self.gpu.kernel_launches()
    }

    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &Self::Indices,
        inv_freq: &Self::Tensor,
        p: RopeParams,
    ) -> Result<()> {
        self.gpu.rope(exclusive(x)?, positions, inv_freq, p)
    }

    fn paged_kv_write(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        slots: &Self::Indices,
        rows: usize,
        cache: &mut Self::KvCache,
    ) -> Result<()> {
        self.gpu.paged_kv_write(k, v, slots, rows, cache)
    }

    fn paged_attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let idx = AttentionIndices {
            row_seq: &**idx.row_seq,
            positions: &**idx.positions,
            block_tables: &**idx.block_tables,
        };
        self.gpu.paged_attention(q, cache, idx, p, exclusive(out)?)
    }

    fn paged_attention_scores(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut Self::Tensor,
    ) -> Result<()> {
        let idx = AttentionIndices {
            row_seq: &**idx.row_seq,
            positions: &**idx.positions,
            block_tables: &**idx.block_tables,
        };
        self.gpu
            .paged_attention_scores(q, cache, idx, p, exclusive(scores)?)
    }

    fn track_key_bounds(&self, cache: &mut Self::KvCache) -> Result<()> {
        self.gpu.track_key_bounds(cache)
    }

    fn select_kv_blocks(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut Self::Indices,
    ) -> Result<()> {
        let idx = AttentionIndices {
            row_seq: &**idx.row_seq,
            positions: &**idx.positions,
            block_tables: &**idx.block_tables,
        };
        self.gpu
            .select_kv_blocks(q, cache, idx, p, select, exclusive(out)?)
    }

    fn swiglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.swiglu(gate, up, len, exclusive(out)?)
    }

    fn geglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.geglu(gate, up, len, exclusive(out)?)
    }

    fn scale(&self, x: &mut Self::Tensor, len: usize, factor: f32) -> Result<()> {
        self.gpu.scale(exclusive(x)?, len, factor)
    }

    fn gather_rows(
        &self,
        x: &Self::Tensor,
        rows: &Self::Indices,
        n: usize,
        width: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu.gather_rows(x, rows, n, width, exclusive(out)?)
    }

    fn moe_route(
        &self,
        logits: &Self::Tensor,
        p: MoeRouteParams,
        ids: &mut Self::Indices,
        weights: &mut Self::Tensor,
    ) -> Result<()> {
        self.gpu
            .moe_route(logits, p, exclusive(ids)?, exclusive(weights)?)
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
        self.gpu
            .moe_combine(y, rows, ids, weights, p, exclusive(out)?)
    }

    fn argmax(
        &self,
        x: &Self::Tensor,
        rows: usize,
        width: usize,
        out: &mut Self::Indices,
    ) -> Result<()> {
        self.gpu.argmax(x, rows, width, exclusive(out)?)
    }
}
