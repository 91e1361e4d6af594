//! The parameter structs of the kernels: the sizes each kernel of the
//! [`Backend`] trait takes with its buffers.

// For the documentation's links only.
#[cfg(doc)]
use super::Backend;

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
