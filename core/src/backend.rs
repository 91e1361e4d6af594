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

/// Element type of the paged KV cache. INT8, INT4 and INT2 store codes
/// with per-token, per-head, per-group scales and zero points, except INT4
/// and INT2 keys, which are quantized per channel over each block; their
/// block layouts are documented in [`crate::kv::quant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    Int8,
    Int4,
    Int2,
}

impl KvDtype {
    /// Every dtype, in the order the CLI lists them.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Int8,
        KvDtype::Int4,
        KvDtype::Int2,
    ];

    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
            KvDtype::Int2 => "int2",
        }
    }

    /// Bits per code of a quantized dtype; `None` for F32 and F16.
    pub fn code_bits(self) -> Option<usize> {
        match self {
            KvDtype::F32 | KvDtype::F16 => None,
            KvDtype::Int8 => Some(8),
            KvDtype::Int4 => Some(4),
            KvDtype::Int2 => Some(2),
        }
    }

    /// Bytes of one token's V row of `kv_heads * head_dim` elements (and of
    /// its K row, except for INT4, whose keys are quantized per block).
    fn row_bytes(self, kv_heads: usize, head_dim: usize) -> usize {
        match crate::kv::quant::KvQuantLayout::new(self, kv_heads, head_dim) {
            Some(quant) => 4 * quant.slot_words(),
            None if self == KvDtype::F16 => 2 * kv_heads * head_dim,
            None => 4 * kv_heads * head_dim,
        }
    }

    /// Bytes of the keys of one KV block of `block_size` tokens.
    pub fn key_block_bytes(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        match crate::kv::quant::KeyBlockLayout::new(self, kv_heads, head_dim, block_size) {
            Some(keys) => 4 * keys.block_words(),
            None => block_size * self.row_bytes(kv_heads, head_dim),
        }
    }

    /// Bytes of the values of one KV block of `block_size` tokens.
    pub fn value_block_bytes(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        block_size * self.row_bytes(kv_heads, head_dim)
    }

    /// Bytes of K plus V per token in one layer, with block-wide
    /// parameters (INT4 keys) spread over the block's tokens, rounded up.
    pub fn bytes_per_token(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        (self.key_block_bytes(kv_heads, head_dim, block_size)
            + self.value_block_bytes(kv_heads, head_dim, block_size))
        .div_ceil(block_size.max(1))
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<_> = KvDtype::ALL.iter().map(|d| d.name()).collect();
                crate::Error::InvalidRequest(format!(
                    "unknown KV dtype `{s}` (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// Shape of one layer's paged KV storage. Both K and V are
/// `[num_blocks, block_size]` slots; a slot holds one token's K (or V) for
/// all heads: `kv_heads * head_dim` elements (F32, F16) as one contiguous
/// row at slot `block * block_size + offset`, or the quantized slot of
/// [`crate::kv::quant`] (INT8, INT4, INT2). INT4 keys are stored per block
/// ([`crate::kv::quant::KeyBlockLayout`]).
///
/// Keys and values have a dtype each (`--kv-dtype auto` chooses them
/// apart): the same float dtype, or two quantized ones
/// ([`KvCacheLayout::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub keys: KvDtype,
    pub values: KvDtype,
}

impl KvCacheLayout {
    /// Keys and values of one dtype.
    pub fn uniform(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        KvCacheLayout {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            keys: dtype,
            values: dtype,
        }
    }

    /// Refuses a pair of dtypes no backend stores: keys and values are one
    /// float dtype, or both quantized (each at its own bits). Every
    /// backend's kernels read a float cache through one element type and a
    /// quantized one through words, so a float/quantized pair would need a
    /// kernel variant per pair for no gain (INT8 is as good as F16).
    pub fn check(&self) -> Result<()> {
        let quantized = (self.keys.code_bits(), self.values.code_bits());
        match quantized {
            (Some(_), Some(_)) => Ok(()),
            _ if self.keys == self.values => Ok(()),
            _ => Err(Error::InvalidRequest(format!(
                "KV keys {} with values {}: a layer's keys and values are one float dtype \
                 or both quantized (int8, int4, int2)",
                self.keys, self.values
            ))),
        }
    }

    pub fn row_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The quantized slot layout of the values, `None` for float caches.
    pub fn value_quant(&self) -> Option<crate::kv::quant::KvQuantLayout> {
        crate::kv::quant::KvQuantLayout::new(self.values, self.kv_heads, self.head_dim)
    }

    /// The quantized slot layout of INT8 keys, `None` for float keys and
    /// for INT4 and INT2 keys, which are stored per block ([`Self::key_blocks`]).
    pub fn key_quant(&self) -> Option<crate::kv::quant::KvQuantLayout> {
        match self.key_blocks() {
            Some(_) => None,
            None => crate::kv::quant::KvQuantLayout::new(self.keys, self.kv_heads, self.head_dim),
        }
    }

    /// The per-channel block layout of INT4 and INT2 keys, `None` for other dtypes.
    pub fn key_blocks(&self) -> Option<crate::kv::quant::KeyBlockLayout> {
        crate::kv::quant::KeyBlockLayout::new(
            self.keys,
            self.kv_heads,
            self.head_dim,
            self.block_size,
        )
    }

    /// Bytes of one block's keys.
    pub fn key_block_bytes(&self) -> usize {
        self.keys
            .key_block_bytes(self.kv_heads, self.head_dim, self.block_size)
    }

    /// Bytes of one block's values.
    pub fn value_block_bytes(&self) -> usize {
        self.values
            .value_block_bytes(self.kv_heads, self.head_dim, self.block_size)
    }

    /// Bytes of K plus V for one token in one layer (block parameters spread
    /// over the block, rounded up).
    pub fn bytes_per_token(&self) -> usize {
        (self.key_block_bytes() + self.value_block_bytes()).div_ceil(self.block_size.max(1))
    }
}

/// How RoPE pairs the dimensions it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF Llama files (their Q/K rows are permuted for it).
    Interleaved,
    /// Halves `(i, i + rotary_dim/2)`: Hugging Face checkpoints, Qwen2, GPT-NeoX.
    NeoX,
}

#[derive(Clone, Copy, Debug)]
pub struct RmsNormParams {
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

#[derive(Clone, Copy, Debug)]
pub struct MatmulParams {
    /// Rows of the activation matrix (tokens).
    pub rows: usize,
}

/// One weight of [`Backend::matmuls`], its optional bias and its output.
pub struct MatmulTarget<'a, W, T> {
    pub w: &'a W,
    pub bias: Option<&'a W>,
    pub out: &'a mut T,
}

/// The RMSNorm a fused matmul applies to each input row before multiplying
/// (its prologue): `x / rms(x) * weight`, the row's norm computed once
/// inside the kernel and never written out.
pub struct NormPrologue<'a, W> {
    pub weight: &'a W,
    pub eps: f32,
}

/// One part of a split matmul output ([`Backend::matmul_rms_norm`]): the
/// next `width` output features go to `out`, `[rows, width]`.
pub struct SplitOut<'a, T> {
    pub out: &'a mut T,
    pub width: usize,
}

/// Most parts [`Backend::matmul_rms_norm`] splits its output into (Q, K, V).
pub const MAX_SPLIT: usize = 3;

/// What is wrong with splitting a weight of `n` rows into parts of
/// `widths` ([`Backend::matmul_rms_norm`]): there must be 1 to
/// [`MAX_SPLIT`] parts whose widths sum to the rows.
pub fn split_error(widths: impl ExactSizeIterator<Item = usize>, n: usize) -> Option<String> {
    let parts = widths.len();
    let total: usize = widths.sum();
    (parts == 0 || parts > MAX_SPLIT || total != n).then(|| {
        format!(
            "{parts} output parts of {total} columns for a weight of {n} rows \
             (1 to {MAX_SPLIT} parts, widths summing to the rows)"
        )
    })
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

/// The activation of a gated linear unit ([`Backend::matmul_glu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// `silu(gate) * up` (Llama, Qwen).
    SwiGlu,
    /// `gelu(gate) * up` with GELU's tanh approximation (Gemma).
    GeGlu,
}

#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that are rotated (`<= head_dim`, even).
    pub rotary_dim: usize,
    pub style: RopeStyle,
}

#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    /// Query rows (tokens of all sequences in the batch, flattened).
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Width of each row of the block-table matrix.
    pub max_blocks_per_seq: usize,
    pub scale: f32,
    /// Mistral-style sliding window: a query at position p sees keys at
    /// positions `> p - window`. `None` sees the whole prefix.
    pub sliding_window: Option<usize>,
    /// The block tables hold one table per sequence and KV head
    /// (`[seqs, kv_heads, max_blocks_per_seq]`, as
    /// [`Backend::select_kv_blocks`] writes them): KV head `g` of sequence
    /// `s` reads table `s * kv_heads + g`. `false`: one table per sequence,
    /// read by all of its KV heads. Only [`Backend::paged_attention`] takes
    /// per-head tables.
    pub per_head_tables: bool,
}

impl AttentionParams {
    /// Block tables per sequence: `kv_heads` with [`Self::per_head_tables`],
    /// else 1.
    pub fn tables_per_seq(&self) -> usize {
        if self.per_head_tables {
            self.kv_heads
        } else {
            1
        }
    }

    /// The index of the table KV head `kv_head` of sequence `seq` reads.
    pub fn table_of(&self, seq: usize, kv_head: usize) -> usize {
        if self.per_head_tables {
            seq * self.kv_heads + kv_head
        } else {
            seq
        }
    }
}

/// Which KV blocks a sparse attention reads ([`Backend::select_kv_blocks`]):
/// per sequence, its first `sink_blocks` and last `recent_blocks` visible
/// table entries, and for each KV head the `top_blocks` others whose keys
/// could score highest against the sequence's queries (Quest's bound).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSelectParams {
    pub top_blocks: usize,
    pub sink_blocks: usize,
    pub recent_blocks: usize,
}

/// Routing of a Mixture-of-Experts layer ([`Backend::moe_route`]).
#[derive(Clone, Copy, Debug)]
pub struct MoeRouteParams {
    pub rows: usize,
    /// Routed experts: the first `experts` logits of each row.
    pub experts: usize,
    /// Experts chosen per row.
    pub k: usize,
    /// Divide the chosen weights by their sum.
    pub normalize: bool,
    /// Each logits row ends with one more value, the shared expert's gate:
    /// routed to as expert `experts` with weight `sigmoid(gate)` in a last slot.
    pub shared_gate: bool,
}

impl MoeRouteParams {
    /// Values per logits row.
    pub fn width(&self) -> usize {
        self.experts + usize::from(self.shared_gate)
    }

    /// Routing slots per row: `k`, plus one for the shared expert.
    pub fn slots(&self) -> usize {
        self.k + usize::from(self.shared_gate)
    }
}

/// The weighted add of one expert's outputs ([`Backend::moe_combine`]).
#[derive(Clone, Copy, Debug)]
pub struct MoeCombineParams {
    /// Rows the expert computed.
    pub count: usize,
    pub width: usize,
    pub expert: u32,
    /// Routing slots per row (`MoeRouteParams::slots`).
    pub slots: usize,
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
