//! The device buffers of one forward pass and the shape they were sized
//! for: the batch's indices and every intermediate activation.

use super::forward::ForwardBatch;
use super::moe_layer::MoeBuffers;
use super::ModelConfig;
use crate::backend::Backend;
use crate::Result;

/// The sizes of one forward pass: what its kernels' launch parameters hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StepShape {
    pub rows: usize,
    pub logit_rows: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

/// The device buffers of one forward pass: the batch's indices and every
/// intermediate activation. A plain pass allocates them for its batch; a
/// recorded decode step keeps one set for its largest batch and rewrites
/// the indices in place (`super::recorded`).
pub(crate) struct StepBuffers<B: Backend> {
    pub(super) tokens: B::Indices,
    pub(super) positions: B::Indices,
    pub(super) row_seq: B::Indices,
    pub(super) slots: B::Indices,
    pub(super) block_tables: B::Indices,
    pub(super) logit_rows: B::Indices,
    pub(super) residual: B::Tensor,
    pub(super) normed: B::Tensor,
    pub(super) q: B::Tensor,
    pub(super) k: B::Tensor,
    pub(super) v: B::Tensor,
    pub(super) attn: B::Tensor,
    pub(super) delta: B::Tensor,
    pub(super) gate: B::Tensor,
    pub(super) up: B::Tensor,
    pub(super) act: B::Tensor,
    pub(super) final_normed: B::Tensor,
    /// Q and K before their per-head norms (architectures with Q/K norms only).
    pub(super) q_raw: Option<B::Tensor>,
    pub(super) k_raw: Option<B::Tensor>,
    /// An attention or FFN output before its post-norm (architectures with post-norms only).
    pub(super) out_raw: Option<B::Tensor>,
    /// Routing and expert activations (MoE models only).
    pub(super) moe: Option<MoeBuffers<B>>,
    /// The hidden states an EAGLE head reads (`ForwardBatch::input_hidden`).
    pub(super) input_hidden: Option<B::Tensor>,
}

impl<B: Backend> StepBuffers<B> {
    /// Buffers holding `batch`.
    pub(super) fn upload(backend: &B, cfg: &ModelConfig, batch: &ForwardBatch) -> Result<Self> {
        let up = |data: &[u32]| backend.upload_indices(data);
        let mut buffers = Self::with_indices(
            backend,
            cfg,
            batch.rows(),
            batch.logit_rows.len(),
            [
                up(&batch.tokens)?,
                up(&batch.positions)?,
                up(&batch.row_seq)?,
                up(&batch.slots)?,
                up(&batch.block_tables)?,
                // Never an empty buffer (a pipeline micro-batch asks for no logits).
                up(if batch.logit_rows.is_empty() {
                    &[0]
                } else {
                    &batch.logit_rows
                })?,
            ],
        )?;
        if !batch.input_hidden.is_empty() {
            buffers.input_hidden = Some(backend.upload(&batch.input_hidden)?);
        }
        Ok(buffers)
    }

    /// Buffers for decode batches of up to `rows` rows, row `i` the only
    /// row of sequence `i` and logit row `i` (those indices are written
    /// here, once), with block tables of up to `max_blocks_per_seq` entries.
    pub(crate) fn for_decode(
        backend: &B,
        cfg: &ModelConfig,
        rows: usize,
        max_blocks_per_seq: usize,
    ) -> Result<Self> {
        let zeros = |len: usize| backend.upload_indices(&vec![0; len.max(1)]);
        let in_order: Vec<u32> = (0..rows as u32).collect();
        Self::with_indices(
            backend,
            cfg,
            rows,
            rows,
            [
                zeros(rows)?,
                zeros(rows)?,
                backend.upload_indices(&in_order)?,
                zeros(rows)?,
                zeros(rows * max_blocks_per_seq)?,
                backend.upload_indices(&in_order)?,
            ],
        )
    }

    fn with_indices(
        backend: &B,
        cfg: &ModelConfig,
        rows: usize,
        logit_rows: usize,
        [tokens, positions, row_seq, slots, block_tables, logit_rows_ids]: [B::Indices; 6],
    ) -> Result<Self> {
        // A shared expert may be wider than the routed ones.
        let shared_ffn = cfg.moe.and_then(|m| m.shared_ffn).unwrap_or(0);
        let (dim, q_dim, kv_dim, ffn) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size.max(shared_ffn),
        );
        let alloc = |width: usize| backend.alloc(rows * width);
        Ok(Self {
            tokens,
            positions,
            row_seq,
            slots,
            block_tables,
            logit_rows: logit_rows_ids,
            residual: alloc(dim)?,
            normed: alloc(dim)?,
            q: alloc(q_dim)?,
            k: alloc(kv_dim)?,
            v: alloc(kv_dim)?,
            attn: alloc(q_dim)?,
            delta: alloc(dim)?,
            gate: alloc(ffn)?,
            up: alloc(ffn)?,
            act: alloc(ffn)?,
            final_normed: backend.alloc(logit_rows.max(1) * dim)?,
            q_raw: cfg.block.qk_norm.then(|| alloc(q_dim)).transpose()?,
            k_raw: cfg.block.qk_norm.then(|| alloc(kv_dim)).transpose()?,
            out_raw: cfg.block.post_norms.then(|| alloc(dim)).transpose()?,
            moe: cfg
                .moe
                .map(|spec| MoeBuffers::alloc(backend, &spec, rows, dim))
                .transpose()?,
            input_hidden: None,
        })
    }

    /// Overwrites the indices that change from one decode step to the next
    /// with `batch`'s, in place (see [`for_decode`](Self::for_decode)).
    pub(crate) fn write_decode(&mut self, backend: &B, batch: &ForwardBatch) -> Result<()> {
        backend.write_indices(&mut self.tokens, &batch.tokens)?;
        backend.write_indices(&mut self.positions, &batch.positions)?;
        backend.write_indices(&mut self.slots, &batch.slots)?;
        backend.write_indices(&mut self.block_tables, &batch.block_tables)
    }
}
