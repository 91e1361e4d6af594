//! Tandem's CPU backend: the reference implementation of every fused kernel
//! of the manifest, and a fast multi-threaded fallback that runs anywhere.
//!
//! Each kernel exists twice. [`reference`](mod@reference) holds the obvious scalar code,
//! the ground truth for this crate's tests and for the cross-backend suite.
//! [`CpuBackend`] runs the fast versions: split across the backend's own
//! thread pool and written so the compiler vectorizes them. Where the CPU
//! has them (detected at run time), matmul uses hand-written AVX2 or
//! AVX-512 VNNI micro-kernels, and attention and activation quantization
//! are compiled a second time with AVX2 and FMA enabled. The crate also
//! builds for wasm32 and other targets, with portable code only.
//!
//! Modules, one per kernel family: `rows` (embedding, gather_rows, argmax),
//! `norm`, `matmul` (with activation quantization and the micro-kernels per
//! instruction set), `rope`, `kv` (the KV cache, its writes and block
//! copies), `attention` (and its score variant: attention mass per KV
//! block, for KV eviction), `activation` (SwiGLU, GeGLU, scale), `moe`
//! (expert routing and the weighted combine). `check` holds the size and
//! index checks every kernel runs first, so bad input is an
//! `Error::Backend`, never a panic.

mod activation;
mod attention;
mod buffers;
mod check;
mod fused;
mod isa;
mod key_bounds;
mod kv;
mod math;
mod matmul;
mod moe;
mod norm;
pub mod reference;
mod rope;
mod rows;
#[cfg(not(target_arch = "wasm32"))]
mod spin_pool;
mod workers;

use std::sync::Arc;

pub use buffers::{Indices, Tensor, Weight};
pub use isa::CpuIsa;
pub use kv::KvCache;

use tandem_core::backend::{
    AttentionIndices, AttentionParams, BackendInfo, BlockSelectParams, Glu, KvCacheLayout,
    MatmulParams, MatmulTarget, MoeCombineParams, MoeRouteParams, NormPrologue, RmsNormParams,
    RopeParams, SplitOut, WeightStorage,
};
use tandem_core::model::Bytes;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Backend, Error, Result};

use attention::AttentionInputs;
use isa::Isa;
use workers::Workers;

/// The CPU backend: host memory, its own helper threads, and the best
/// instruction set this CPU has for matmul.
pub struct CpuBackend {
    workers: Workers,
    isa: Isa,
}

impl CpuBackend {
    /// A backend running kernels on `threads` threads (0: one per core).
    pub fn new(threads: usize) -> Self {
        CpuBackend {
            workers: Workers::new(threads),
            isa: Isa::detect(),
        }
    }

    /// A backend on `threads` threads whose kernels use the instruction set
    /// `isa`; an error if this CPU lacks it.
    pub fn with_isa(threads: usize, isa: CpuIsa) -> Result<Self> {
        let chosen = Isa::choose(isa).ok_or_else(|| {
            Error::Unsupported(format!("this CPU cannot run the {} kernels", isa.name()))
        })?;
        Ok(CpuBackend {
            workers: Workers::new(threads),
            isa: chosen,
        })
    }

    /// Threads of the backend's pool.
    pub fn threads(&self) -> usize {
        self.workers.threads()
    }
}

impl Default for CpuBackend {
    /// One thread per core.
    fn default() -> Self {
        CpuBackend::new(0)
    }
}

impl Backend for CpuBackend {
    type Tensor = Tensor;
    type Indices = Indices;
    type Weight = Weight;
    type KvCache = KvCache;

    fn info(&self) -> BackendInfo {
        let threads = self.threads();
        BackendInfo {
            name: check::BACKEND.to_string(),
            device: format!(
                "{threads} thread{}, {}",
                if threads == 1 { "" } else { "s" },
                self.isa.name()
            ),
        }
    }

    fn alloc(&self, len: usize) -> Result<Tensor> {
        buffers::zeroed_vec(len)
            .map(Tensor::from)
            .ok_or_else(|| check::error("alloc", format!("cannot allocate {len} f32 values")))
    }

    fn upload(&self, data: &[f32]) -> Result<Tensor> {
        Ok(Tensor::from(data.to_vec()))
    }

    fn download(&self, t: &Tensor, len: usize) -> Result<Vec<f32>> {
        check::buffer_len("download", "tensor", t.len(), len)?;
        Ok(t.as_slice()[..len].to_vec())
    }

    fn upload_indices(&self, data: &[u32]) -> Result<Indices> {
        Ok(Indices::from(data.to_vec()))
    }

    fn download_indices(&self, t: &Indices, len: usize) -> Result<Vec<u32>> {
        check::buffer_len("download_indices", "indices", t.len(), len)?;
        Ok(t.as_slice()[..len].to_vec())
    }

    fn write_indices(&self, dst: &mut Indices, data: &[u32]) -> Result<()> {
        check::buffer_len("write_indices", "destination", dst.len(), data.len())?;
        dst.as_mut_slice()[..data.len()].copy_from_slice(data);
        Ok(())
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<Weight> {
        Weight::from_view(w)
    }

    fn upload_file_weight(
        &self,
        w: WeightView<'_>,
        file: &Arc<Bytes>,
    ) -> Result<(Weight, WeightStorage)> {
        Weight::from_file(w, file)
    }

    fn upload_file_stack(
        &self,
        parts: &[WeightView<'_>],
        file: &Arc<Bytes>,
    ) -> Result<Option<Weight>> {
        Weight::from_file_stack(parts, file)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<KvCache> {
        KvCache::new(layout)
    }

    fn copy_kv_blocks(&self, cache: &mut KvCache, pairs: &[(u32, u32)]) -> Result<()> {
        kv::copy_kv_blocks(cache, pairs)
    }

    fn all_reduce_sum(
        &self,
        t: &mut Tensor,
        len: usize,
        comm: &dyn tandem_core::parallel::Communicator,
    ) -> Result<()> {
        check::buffer_len("all_reduce_sum", "tensor", t.len(), len)?;
        comm.all_reduce_sum(&mut t.as_mut_slice()[..len])
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn embedding(
        &self,
        table: &Weight,
        tokens: &Indices,
        rows: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        rows::embedding(
            &self.workers,
            table,
            tokens.as_slice(),
            rows,
            out.as_mut_slice(),
        )
    }

    fn rms_norm(
        &self,
        x: &Tensor,
        weight: &Weight,
        p: RmsNormParams,
        out: &mut Tensor,
    ) -> Result<()> {
        norm::rms_norm(&self.workers, x.as_slice(), weight, p, out.as_mut_slice())
    }

    fn rms_norm_residual(
        &self,
        residual: &mut Tensor,
        delta: &Tensor,
        weight: &Weight,
        p: RmsNormParams,
        out: &mut Tensor,
    ) -> Result<()> {
        norm::rms_norm_residual(
            &self.workers,
            residual.as_mut_slice(),
            delta.as_slice(),
            weight,
            p,
            out.as_mut_slice(),
        )
    }

    fn matmul(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Weight>,
        p: MatmulParams,
        out: &mut Tensor,
    ) -> Result<()> {
        matmul::matmul(
            &self.workers,
            self.isa,
            x.as_slice(),
            w,
            bias,
            p.rows,
            out.as_mut_slice(),
        )
    }

    fn matmuls(
        &self,
        x: &Tensor,
        targets: &mut [MatmulTarget<'_, Weight, Tensor>],
        p: MatmulParams,
    ) -> Result<()> {
        let mut targets: Vec<matmul::Target<'_>> = targets
            .iter_mut()
            .map(|t| (t.w, t.bias, t.out.as_mut_slice()))
            .collect();
        matmul::matmuls(&self.workers, self.isa, x.as_slice(), p.rows, &mut targets)
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &Tensor,
        norm: Option<NormPrologue<'_, Weight>>,
        w: &Weight,
        bias: Option<&Weight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, Tensor>],
    ) -> Result<()> {
        let mut outs: Vec<(&mut [f32], usize)> = outs
            .iter_mut()
            .map(|o| (o.out.as_mut_slice(), o.width))
            .collect();
        let input = fused::NormedInput {
            x: x.as_slice(),
            rows: p.rows,
            norm: norm.map(|n| (n.weight, n.eps)),
        };
        fused::matmul_rms_norm(&self.workers, self.isa, input, w, bias, &mut outs)
    }

    fn matmul_glu(
        &self,
        x: &Tensor,
        norm: Option<NormPrologue<'_, Weight>>,
        w: &Weight,
        glu: Glu,
        p: MatmulParams,
        out: &mut Tensor,
    ) -> Result<()> {
        let input = fused::NormedInput {
            x: x.as_slice(),
            rows: p.rows,
            norm: norm.map(|n| (n.weight, n.eps)),
        };
        fused::matmul_glu(&self.workers, self.isa, input, w, glu, out.as_mut_slice())
    }

    fn matmul_residual(
        &self,
        x: &Tensor,
        w: &Weight,
        p: MatmulParams,
        out: &mut Tensor,
    ) -> Result<()> {
        fused::matmul_residual(
            &self.workers,
            self.isa,
            x.as_slice(),
            w,
            p.rows,
            out.as_mut_slice(),
        )
    }

    fn mlp_residual(
        &self,
        residual: &mut Tensor,
        norm: NormPrologue<'_, Weight>,
        gate_up: &Weight,
        down: &Weight,
        glu: Glu,
        p: MatmulParams,
        act: &mut Tensor,
    ) -> Result<()> {
        fused::mlp_residual(
            &self.workers,
            self.isa,
            residual.as_mut_slice(),
            p.rows,
            (norm.weight, norm.eps),
            [gate_up, down],
            glu,
            act.as_mut_slice(),
        )
    }

    fn rope(
        &self,
        x: &mut Tensor,
        positions: &Indices,
        inv_freq: &Tensor,
        p: RopeParams,
    ) -> Result<()> {
        rope::rope(
            &self.workers,
            x.as_mut_slice(),
            positions.as_slice(),
            inv_freq.as_slice(),
            p,
        )
    }

    fn paged_kv_write(
        &self,
        k: &Tensor,
        v: &Tensor,
        slots: &Indices,
        rows: usize,
        cache: &mut KvCache,
    ) -> Result<()> {
        kv::paged_kv_write(k.as_slice(), v.as_slice(), slots.as_slice(), rows, cache)
    }

    fn paged_attention(
        &self,
        q: &Tensor,
        cache: &KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        let inputs = attention_inputs(q, idx);
        attention::paged_attention(
            &self.workers,
            self.isa,
            cache,
            inputs,
            p,
            out.as_mut_slice(),
        )
    }

    fn paged_attention_scores(
        &self,
        q: &Tensor,
        cache: &KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut Tensor,
    ) -> Result<()> {
        let inputs = attention_inputs(q, idx);
        attention::paged_attention_scores(
            &self.workers,
            self.isa,
            cache,
            &inputs,
            p,
            scores.as_mut_slice(),
        )
    }

    fn track_key_bounds(&self, cache: &mut KvCache) -> Result<()> {
        cache.track_key_bounds();
        Ok(())
    }

    fn select_kv_blocks(
        &self,
        q: &Tensor,
        cache: &KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut Indices,
    ) -> Result<()> {
        let inputs = attention_inputs(q, idx);
        attention::select_kv_blocks(
            &self.workers,
            self.isa,
            cache,
            &inputs,
            p,
            select,
            out.as_mut_slice(),
        )
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor, len: usize, out: &mut Tensor) -> Result<()> {
        activation::swiglu(
            &self.workers,
            gate.as_slice(),
            up.as_slice(),
            len,
            out.as_mut_slice(),
        )
    }

    fn geglu(&self, gate: &Tensor, up: &Tensor, len: usize, out: &mut Tensor) -> Result<()> {
        activation::geglu(
            &self.workers,
            gate.as_slice(),
            up.as_slice(),
            len,
            out.as_mut_slice(),
        )
    }

    fn scale(&self, x: &mut Tensor, len: usize, factor: f32) -> Result<()> {
        activation::scale(&self.workers, x.as_mut_slice(), len, factor)
    }

    fn gather_rows(
        &self,
        x: &Tensor,
        rows: &Indices,
        n: usize,
        width: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        rows::gather_rows(x.as_slice(), rows.as_slice(), n, width, out.as_mut_slice())
    }

    fn moe_route(
        &self,
        logits: &Tensor,
        p: MoeRouteParams,
        ids: &mut Indices,
        weights: &mut Tensor,
    ) -> Result<()> {
        moe::moe_route(
            logits.as_slice(),
            p,
            ids.as_mut_slice(),
            weights.as_mut_slice(),
        )
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
        moe::moe_combine(
            y.as_slice(),
            rows.as_slice(),
            ids.as_slice(),
            weights.as_slice(),
            p,
            out.as_mut_slice(),
        )
    }

    fn argmax(&self, x: &Tensor, rows: usize, width: usize, out: &mut Indices) -> Result<()> {
        rows::argmax(&self.workers, x.as_slice(), rows, width, out.as_mut_slice())
    }
}

/// The host slices behind one attention call's buffers.
fn attention_inputs<'a>(
    q: &'a Tensor,
    idx: AttentionIndices<'a, CpuBackend>,
) -> AttentionInputs<'a> {
    AttentionInputs {
        q: q.as_slice(),
        row_seq: idx.row_seq.as_slice(),
        positions: idx.positions.as_slice(),
        block_tables: idx.block_tables.as_slice(),
    }
}
