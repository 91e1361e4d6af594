//! The `Backend` trait: device memory and one method per fused kernel of the
//! manifest (`crate::kernels`). The forward pass calls nothing else, so a new
//! backend is exactly an implementation of this trait.
//!
//! Shapes are not carried by the buffers; each kernel takes a small parameter
//! struct with the sizes it needs. Activations are f32 row-major
//! `[rows, width]` matrices. A GPU backend may record kernels into a queue and
//! run them later: only the `download*` methods must wait for results.
//!
//! A backend may also record a whole step once and replay it
//! ([`Backend::begin_capture`], CUDA graphs): the replay runs the same
//! kernels with the same shapes on the same buffers, so the caller updates
//! the inputs in place ([`Backend::write_indices`]) and keeps every buffer
//! alive while the recording exists (`crate::model::recorded`).

use std::sync::Arc;

use crate::model::Bytes;
use crate::quant::{WeightFormat, WeightView};
use crate::{Error, Result};

mod kv_layout;
mod params;

pub use kv_layout::{KvCacheLayout, KvDtype};
pub use params::*;

/// What a backend says about itself (for `inspect`, `bench` and logs).
#[derive(Clone, Debug, Default)]
pub struct BackendInfo {
    /// Short name used on the command line: `cpu`, `wgpu`, `cuda`.
    pub name: String,
    /// The device in words, e.g. "2 threads" or an adapter name.
    pub device: String,
}

/// Where an uploaded weight's bytes live ([`Backend::upload_file_weight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightStorage {
    /// The backend holds its own copy.
    Copied,
    /// The backend reads the weight in the model file.
    InFile,
}

/// [`Backend::mlp_residual`] as two fused matmuls: `matmul_glu` into `act`,
/// then `matmul_residual` (what a backend runs where one kernel cannot).
#[allow(clippy::too_many_arguments)]
pub fn mlp_composed<B: Backend + ?Sized>(
    backend: &B,
    residual: &mut B::Tensor,
    norm: NormPrologue<'_, B::Weight>,
    gate_up: &B::Weight,
    down: &B::Weight,
    glu: Glu,
    p: MatmulParams,
    act: &mut B::Tensor,
) -> Result<()> {
    backend.matmul_glu(residual, Some(norm), gate_up, glu, p, act)?;
    backend.matmul_residual(act, down, p, residual)
}

/// The per-token and per-sequence index data of one batch, on the device.
pub struct AttentionIndices<'a, B: Backend + ?Sized> {
    /// Per query row: index of its sequence in the block-table matrix.
    pub row_seq: &'a B::Indices,
    /// Per query row: its absolute position; it attends to positions `0..=pos`.
    pub positions: &'a B::Indices,
    /// `[num_seqs, max_blocks_per_seq]` physical block ids (unused tail
    /// entries are 0; evicted ones [`crate::kv::EVICTED_BLOCK`], skipped).
    pub block_tables: &'a B::Indices,
}

/// A recorded step (a CUDA graph): its kernel launches, queued again with one call.
pub trait RecordedStep {
    fn replay(&self) -> Result<()>;
}

/// A compute device. Implementations: `tandem-cpu`, `tandem-wgpu`, `tandem-cuda`.
pub trait Backend: 'static {
    /// f32 activations on the device.
    type Tensor;
    /// u32 indices (tokens, positions, block tables) on the device.
    type Indices;
    /// A weight matrix (or vector) in its storage format.
    type Weight;
    /// One layer's paged K and V storage.
    type KvCache;

    fn info(&self) -> BackendInfo;

    // ---- memory ----
    fn alloc(&self, len: usize) -> Result<Self::Tensor>;
    fn upload(&self, data: &[f32]) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor, len: usize) -> Result<Vec<f32>>;
    fn upload_indices(&self, data: &[u32]) -> Result<Self::Indices>;
    fn download_indices(&self, t: &Self::Indices, len: usize) -> Result<Vec<u32>>;
    /// Overwrites the start of `dst` with `data`, in place: a recorded step
    /// reads the buffers it was recorded with.
    fn write_indices(&self, dst: &mut Self::Indices, data: &[u32]) -> Result<()>;
    fn upload_weight(&self, w: WeightView<'_>) -> Result<Self::Weight>;
    /// [`Backend::upload_weight`] for a weight whose bytes lie in `file`, a
    /// model file the loader holds (mapped natively). A backend that
    /// computes on host memory may keep `file` and read the weight where it
    /// lies, as llama.cpp reads its mmap: no copy to make, no second copy
    /// resident while loading, and processes that map the same file share
    /// its pages. It says which it did; the loader releases the file's
    /// pages only under a copy. By default: a copy.
    fn upload_file_weight(
        &self,
        w: WeightView<'_>,
        file: &Arc<Bytes>,
    ) -> Result<(Self::Weight, WeightStorage)> {
        let _ = file;
        Ok((self.upload_weight(w)?, WeightStorage::Copied))
    }
    /// The matrices `parts` (one format, one width) stacked row after row
    /// as one weight, read where each lies in `file`, if the backend can
    /// (a fused projection such as Q, K and V). `None` (the default) leaves
    /// it to the loader, which concatenates them into a copy: on a backend
    /// that reads host memory the copy would be a second resident image of
    /// those weights beside the file's pages, which the kernel maps again
    /// around every page it faults in.
    fn upload_file_stack(
        &self,
        parts: &[WeightView<'_>],
        file: &Arc<Bytes>,
    ) -> Result<Option<Self::Weight>> {
        let _ = (parts, file);
        Ok(None)
    }
    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<Self::KvCache>;
    /// Copies whole KV blocks `src -> dst` (copy-on-write of shared blocks).
    fn copy_kv_blocks(&self, cache: &mut Self::KvCache, pairs: &[(u32, u32)]) -> Result<()>;
    /// Joins the other ranks of `comm` for device-side collectives (NCCL),
    /// once; by default collectives go through the host (`all_reduce_sum`).
    fn join_ranks(&self, _comm: &dyn crate::parallel::Communicator) -> Result<()> {
        Ok(())
    }

    /// `t`'s first `len` elements become their sum over the ranks of `comm`
    /// (tensor parallelism's one collective per branch). By default through
    /// the host, after which `t` holds exactly `len` elements; a backend
    /// with host tensors or device collectives (NCCL) does it in place.
    fn all_reduce_sum(
        &self,
        t: &mut Self::Tensor,
        len: usize,
        comm: &dyn crate::parallel::Communicator,
    ) -> Result<()> {
        let mut host = self.download(t, len)?;
        comm.all_reduce_sum(&mut host)?;
        *t = self.upload(&host)?;
        Ok(())
    }

    /// Weight formats `matmul` accepts; the loader refuses others with a clear error.
    fn supports_format(&self, format: WeightFormat) -> bool;

    // ---- recorded steps ----

    /// Whether [`begin_capture`](Self::begin_capture) works here.
    fn can_record(&self) -> bool {
        false
    }

    /// Starts recording: kernels called until [`end_capture`](Self::end_capture)
    /// are recorded, not run, and memory operations fail.
    fn begin_capture(&self) -> Result<()> {
        Err(Error::Unsupported(format!(
            "backend {} cannot record steps",
            self.info().name
        )))
    }

    /// Stops recording. Called after every `begin_capture`, also when a
    /// kernel failed while recording (the recording is then discarded).
    fn end_capture(&self) -> Result<Box<dyn RecordedStep>> {
        Err(Error::Unsupported(format!(
            "backend {} cannot record steps",
            self.info().name
        )))
    }

    // ---- fused kernels (one per manifest entry) ----

    /// `out[t] = table[tokens[t]]` as f32; `table` is `[vocab, dim]` in any format.
    fn embedding(
        &self,
        table: &Self::Weight,
        tokens: &Self::Indices,
        rows: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// `out = x / rms(x) * weight`, per row.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// `residual += delta; out = residual / rms(residual) * weight`, per row.
    fn rms_norm_residual(
        &self,
        residual: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Weight,
        p: RmsNormParams,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// `out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r])`; `x` is `[rows, w.cols]`.
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// [`Backend::matmul`] of one input `x` by several weights (Q, K and V;
    /// gate and up), each into its own output. One by one unless a backend
    /// shares work across them: the CPU backend quantizes `x` once.
    fn matmuls(
        &self,
        x: &Self::Tensor,
        targets: &mut [MatmulTarget<'_, Self::Weight, Self::Tensor>],
        p: MatmulParams,
    ) -> Result<()> {
        for t in targets.iter_mut() {
            self.matmul(x, t.w, t.bias, p, t.out)?;
        }
        Ok(())
    }

    /// Whether this backend has the fused matmuls ([`Backend::matmul_rms_norm`],
    /// [`Backend::matmul_glu`], [`Backend::matmul_residual`],
    /// [`Backend::mlp_residual`]). The loader
    /// concatenates Q/K/V and gate/up only for backends that do; the others
    /// run the unfused kernels.
    fn fuses_matmuls(&self) -> bool {
        false
    }

    /// `y = norm(x) · wᵀ (+ bias)` with the optional RMSNorm prologue, the
    /// columns of `y` split in order into `outs` (their widths sum to the
    /// rows of `w`; at most [`MAX_SPLIT`] parts): Q, K and V from one
    /// concatenated weight, or the logits from the unnormalised residual.
    fn matmul_rms_norm(
        &self,
        x: &Self::Tensor,
        norm: Option<NormPrologue<'_, Self::Weight>>,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, Self::Tensor>],
    ) -> Result<()> {
        let _ = (x, norm, w, bias, p, outs);
        Err(self.no_fused_matmuls())
    }

    /// A gated linear unit from one matmul: `w` is `[gate; up]` (`2f` rows)
    /// and `out[t, i] = act(y[t, i]) * y[t, f + i]` for `y = norm(x) · wᵀ`,
    /// with the optional RMSNorm prologue. `out` is `[rows, f]`.
    fn matmul_glu(
        &self,
        x: &Self::Tensor,
        norm: Option<NormPrologue<'_, Self::Weight>>,
        w: &Self::Weight,
        glu: Glu,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let _ = (x, norm, w, glu, p, out);
        Err(self.no_fused_matmuls())
    }

    /// `out[t, r] += x[t] · w[r]`: a projection whose epilogue adds it into
    /// the residual stream (O and down).
    fn matmul_residual(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        p: MatmulParams,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let _ = (x, w, p, out);
        Err(self.no_fused_matmuls())
    }

    /// A layer's whole dense MLP added into the residual stream:
    /// `residual += down · glu(norm(residual) · gate_upᵀ)`, `gate_up` as in
    /// [`Backend::matmul_glu`] (`2f` rows) and `down` `[dim, f]`. A backend
    /// that can keep the intermediate on chip runs it as one kernel for
    /// decode; the others, and shapes the one kernel does not take, run
    /// `matmul_glu` into `act` (`[rows, f]`, scratch) then `matmul_residual`.
    #[allow(clippy::too_many_arguments)]
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
        mlp_composed(self, residual, norm, gate_up, down, glu, p, act)
    }

    /// The error of a fused matmul on a backend without them.
    fn no_fused_matmuls(&self) -> Error {
        Error::Unsupported(format!("backend {} has no fused matmuls", self.info().name))
    }

    /// Kernel launches (GPU dispatches; on the CPU, kernel calls) since the
    /// backend was created, for `bench`'s launches per token; `None` where
    /// the backend does not count them.
    fn kernel_launches(&self) -> Option<u64> {
        None
    }

    /// Rotates each head of `x` (`[rows, heads * head_dim]`) in place by the
    /// angle `positions[t] * inv_freq[i]` for pair `i`; `inv_freq` has
    /// `rotary_dim / 2` entries (any rope scaling is folded into it).
    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &Self::Indices,
        inv_freq: &Self::Tensor,
        p: RopeParams,
    ) -> Result<()>;

    /// Writes row `t` of `k` and `v` (`[rows, kv_heads * head_dim]`) to slot `slots[t]`.
    fn paged_kv_write(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        slots: &Self::Indices,
        rows: usize,
        cache: &mut Self::KvCache,
    ) -> Result<()>;

    /// Causal attention of each query row over its sequence's cached K/V, read
    /// through the block table (or, with [`AttentionParams::per_head_tables`],
    /// each KV head through its own); grouped-query heads share KV heads.
    /// `q` and `out` are `[rows, heads * head_dim]`.
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// The attention mass each KV block gets (KV eviction by score): with
    /// the inputs of [`Backend::paged_attention`], adds to
    /// `scores[(t * kv_heads + g) * max_blocks_per_seq + b]` the softmax
    /// weights that query row `t`'s heads reading KV head `g` give the keys
    /// of table entry `b`, summed over those heads (each head adds 1 over its
    /// visible blocks). Evicted entries ([`crate::kv::EVICTED_BLOCK`]) get
    /// nothing. A variant of the attention kernel that reads the keys only
    /// and never materialises the attention matrix; the plain kernel pays
    /// nothing for it. One table per sequence: per-head tables are refused.
    fn paged_attention_scores(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut Self::Tensor,
    ) -> Result<()> {
        let _ = (q, cache, idx, p, scores);
        Err(Error::Unsupported(format!(
            "backend {} has no attention-score kernel (KV eviction by h2o or snapkv)",
            self.info().name
        )))
    }

    /// From now on `cache` keeps, per block and KV head, each key
    /// channel's minimum and maximum over the block's written slots (a
    /// block's bounds restart when its first slot is written, and block
    /// copies carry them), which [`Backend::select_kv_blocks`] reads.
    /// Blocks written before the call have no bounds until they are filled
    /// again from their first slot: call it before the cache holds K/V that
    /// will be read.
    fn track_key_bounds(&self, cache: &mut Self::KvCache) -> Result<()> {
        let _ = cache;
        Err(Error::Unsupported(format!(
            "backend {} keeps no key bounds (sparse speculation)",
            self.info().name
        )))
    }

    /// Sparse attention's block selection: with the inputs of
    /// [`Backend::paged_attention`] (a cache that tracks key bounds; one
    /// table per sequence), writes to `out` one table per sequence and KV
    /// head (`[num_seqs, kv_heads, max_blocks_per_seq]`, read by
    /// [`Backend::paged_attention`] with
    /// [`AttentionParams::per_head_tables`]): KV head `g`'s is the
    /// sequence's table with the entries `g` does not select made holes
    /// ([`crate::kv::EVICTED_BLOCK`]). An entry's bound for KV head `g` is
    /// the sum, over the sequence's rows and the query heads reading `g`, of
    /// `Σ_c max(q_c · min_c, q_c · max_c)` over the block's key bounds: no
    /// key of the block scores higher. Each KV head keeps its `top_blocks`
    /// highest entries (ties to the earlier entry) among the visible ones
    /// that are neither sinks nor recent, and the sinks and recent ones.
    /// Only the entries up to the sequence's last row's position are
    /// visible; the rest are copied as they are.
    fn select_kv_blocks(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut Self::Indices,
    ) -> Result<()> {
        let _ = (q, cache, idx, p, select, out);
        Err(Error::Unsupported(format!(
            "backend {} has no block-selection kernel (sparse speculation)",
            self.info().name
        )))
    }

    /// `out = silu(gate) * up`, elementwise over `len` elements.
    fn swiglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// `out = gelu(gate) * up` with GELU's tanh approximation, elementwise
    /// over `len` elements (GeGLU: Gemma's feed-forward gate).
    fn geglu(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        len: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// `x *= factor` over the first `len` elements, in place (Gemma's
    /// embedding scale; models without one never call it).
    fn scale(&self, x: &mut Self::Tensor, len: usize, factor: f32) -> Result<()>;

    /// `out[i] = x[rows[i]]` for rows of width `width`.
    fn gather_rows(
        &self,
        x: &Self::Tensor,
        rows: &Self::Indices,
        n: usize,
        width: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Mixture-of-Experts routing, per row of `logits` (`[rows, p.width()]`):
    /// softmax over the first `experts` values, the `k` largest in
    /// descending order (the lower index first among equals), divided by
    /// their sum when `normalize`; with `shared_gate`, a last slot routes to
    /// expert `experts` with weight `sigmoid(logits[row, experts])`.
    /// `ids` and `weights` are `[rows, p.slots()]`.
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        p: MoeRouteParams,
        ids: &mut Self::Indices,
        weights: &mut Self::Tensor,
    ) -> Result<()>;

    /// Adds one expert's outputs into the rows routed to it: for each `i`
    /// below `count`, `out[rows[i]] += w * y[i]` over `width` values, where
    /// `w` is `weights[rows[i], j]` for the slot `j` with
    /// `ids[rows[i], j] == expert` (0 if none). `rows` holds no row twice.
    #[allow(clippy::too_many_arguments)]
    fn moe_combine(
        &self,
        y: &Self::Tensor,
        rows: &Self::Indices,
        ids: &Self::Indices,
        weights: &Self::Tensor,
        p: MoeCombineParams,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Index of the largest value of each of `rows` rows of width `width`
    /// (the lowest index among equal maxima).
    fn argmax(
        &self,
        x: &Self::Tensor,
        rows: usize,
        width: usize,
        out: &mut Self::Indices,
    ) -> Result<()>;
}
