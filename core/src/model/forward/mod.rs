//! The forward pass, written once over the [`Backend`] trait.
//!
//! A [`ForwardBatch`] flattens the new tokens of several sequences into one
//! list of rows; each row knows its sequence, its position and the KV slot it
//! writes. The same call serves a prompt chunk, a single decode token, or the
//! k+1 rows of a speculative verification, for any mix of sequences.
//!
//! Per layer: RMSNorm fused with the residual add → Q/K/V matmuls →
//! [per-head Q/K RMSNorm] → RoPE → paged KV write → paged attention → O
//! matmul → [post-attention RMSNorm] → RMSNorm + residual → gate/up matmuls →
//! SwiGLU or GeGLU → down matmul → [post-FFN RMSNorm], or the routed experts
//! of a Mixture-of-Experts layer (`super::moe_layer`). The bracketed steps,
//! the embedding scale, each layer's attention window and RoPE frequencies
//! come from the architecture as data (`super::arch`), so Llama runs exactly
//! the kernels it always did. Logits are computed only for the rows the
//! caller asks for.
//!
//! On a backend with fused matmuls (`Backend::fuses_matmuls`) the loader
//! concatenates Q/K/V and gate/up by rows when their formats match, and a
//! layer becomes: `matmul_rms_norm` (the attention norm as prologue, Q, K
//! and V split out) → [Q/K norms] → RoPE → KV write → attention →
//! `matmul_residual` (O, added into the residual stream) → `mlp_residual`
//! (the FFN norm as prologue, gate/up, SwiGLU or GeGLU, down, the residual
//! add: one kernel where the backend keeps the intermediate on chip, else
//! `matmul_glu` then `matmul_residual`). What cannot fuse falls back step
//! by step, as data: a post-norm
//! or a residual multiplier keeps the branch in `delta` (pending) and the
//! next norm adds it (`rms_norm_residual`); separate weights (formats that
//! differ, as Q4_K_M's Q6_K value rows) keep the unfused matmuls.

mod batch;
mod load;
mod pass;
mod stream;

pub use batch::ForwardBatch;
pub use load::{LoadOptions, Progress};

use super::moe_layer::MoeLayer;
use super::step_buffers::{StepBuffers, StepShape};
use super::ModelConfig;
use crate::backend::{Backend, BlockSelectParams, MatmulParams, RmsNormParams};
use crate::parallel::{Command, Placement};
use crate::{Error, Result};

/// What a forward pass's attention does besides attending.
pub enum AttentionExtra<'a, B: Backend> {
    None,
    /// `[rows, kv_heads, max_blocks_per_seq]`: the attention mass per KV
    /// block of the [`scoring_layers`](crate::kv::eviction::scoring_layers) is added into it
    /// (`Backend::paged_attention_scores`, KV eviction by score).
    Scores(&'a mut B::Tensor),
    /// Every layer attends only over the blocks `Backend::select_kv_blocks`
    /// picks, each KV head through its own table in `tables`
    /// (`[num_seqs, kv_heads, max_blocks_per_seq]`, scratch): sparse
    /// self-speculation's drafting pass.
    Sparse {
        select: BlockSelectParams,
        tables: &'a mut B::Indices,
    },
}

/// Projections that read one input (Q, K, V; gate, up): one weight with the
/// parts' rows concatenated in order, for the fused matmuls, or one weight
/// per part.
enum Projections<B: Backend> {
    Concatenated {
        w: B::Weight,
        bias: Option<B::Weight>,
    },
    Separate(Vec<(B::Weight, Option<B::Weight>)>),
}

struct LayerWeights<B: Backend> {
    attn_norm: B::Weight,
    qkv: Projections<B>,
    /// Per-head norms of Q and K (`BlockSpec::qk_norm`).
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    wo: B::Weight,
    /// Norms of the attention and FFN outputs (`BlockSpec::post_norms`).
    post_attn_norm: Option<B::Weight>,
    ffn_norm: B::Weight,
    ffn: Ffn<B>,
    post_ffn_norm: Option<B::Weight>,
    /// Index of this layer's RoPE table in `Model::inv_freqs`.
    rope: usize,
    sliding_window: Option<usize>,
}

/// A layer's feed-forward: one FFN (gate and up, then down), or routed experts.
enum Ffn<B: Backend> {
    Dense {
        gate_up: Projections<B>,
        down: B::Weight,
    },
    Moe(MoeLayer<B>),
}

/// A model's weights on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    /// `None` past the first pipeline stage, which alone embeds tokens.
    embed: Option<B::Weight>,
    /// `None` with tied embeddings: the embedding table is the output matrix.
    output: Option<B::Weight>,
    output_norm: B::Weight,
    /// An EAGLE head's norm and projection of the target's hidden states.
    eagle: Option<(B::Weight, B::Weight)>,
    layers: Vec<LayerWeights<B>>,
    /// One RoPE table per distinct [`Rope`](super::Rope) of the layers.
    inv_freqs: Vec<B::Tensor>,
    /// Bytes of weights read per decoded token (for bandwidth figures):
    /// of a MoE model, the experts one token is routed to.
    pub weight_bytes: usize,
    /// Bytes of weights this model put on the backend (a rank's shard only).
    pub loaded_bytes: usize,
    /// The backend's fused matmuls run this model (`LoadOptions::unfused` off).
    fused: bool,
    /// This rank's place when the model is split over several ranks.
    pub(super) placement: Option<Placement>,
}

impl<B: Backend> Model<B> {
    /// Runs `batch` through the model, writing its K/V into `kv` (one cache
    /// per layer), and returns the logits of `batch.logit_rows` as a
    /// `[logit_rows, vocab]` tensor on the device.
    pub fn forward(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
    ) -> Result<B::Tensor> {
        self.forward_with(backend, batch, kv, AttentionExtra::None)
    }

    /// [`Model::forward`] with an attention variant (see [`AttentionExtra`]).
    pub fn forward_with(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
        extra: AttentionExtra<'_, B>,
    ) -> Result<B::Tensor> {
        let shape = self.check_batch(batch, kv)?;
        let Some(place) = &self.placement else {
            return Ok(self.forward_local(backend, batch, shape, kv, extra)?.0);
        };
        match extra {
            AttentionExtra::None => {}
            AttentionExtra::Scores(_) => {
                return Err(Error::Unsupported(
                    "KV eviction by attention score on a split model (use --kv-evict streaming)"
                        .into(),
                ))
            }
            AttentionExtra::Sparse { .. } => {
                return Err(Error::Unsupported(
                    "sparse speculation on a split model".into(),
                ))
            }
        }
        place.announce(&Command::Forward(batch.clone()))?;
        let result = match place.pipeline.stages {
            1 => StepBuffers::upload(backend, &self.config, batch).and_then(|mut buffers| {
                // Followers compute no logits.
                let vocab = self.config.logit_width();
                let len = if place.is_leader() {
                    shape.logit_rows.max(1) * vocab
                } else {
                    1
                };
                let mut logits = backend.alloc(len)?;
                let extra = AttentionExtra::None;
                self.forward_into(backend, &mut buffers, shape, kv, &mut logits, extra)?;
                Ok(logits)
            }),
            _ => self.forward_pipelined(backend, batch, kv, place),
        };
        if let Err(e) = &result {
            // The other ranks may wait in a collective this one never reaches.
            let world = &place.job.world;
            world.abort_job(&format!(
                "rank {}: a forward pass failed part-way, leaving the ranks out of step: {e}",
                world.rank()
            ));
        }
        result
    }

    /// [`Model::forward_with`] that also returns the final hidden state of
    /// every row (`[rows, hidden]`, the residual stream before the output
    /// norm): what an EAGLE head drafts from. Not on a split model.
    pub fn forward_hidden(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
        extra: AttentionExtra<'_, B>,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let shape = self.check_batch(batch, kv)?;
        if self.placement.is_some() {
            return Err(Error::Unsupported(
                "hidden states of a split model (for an EAGLE head)".into(),
            ));
        }
        self.forward_local(backend, batch, shape, kv, extra)
    }

    /// The forward pass of a model on one rank: logits, and the final
    /// hidden states left in the residual stream.
    fn forward_local(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        shape: StepShape,
        kv: &mut [B::KvCache],
        extra: AttentionExtra<'_, B>,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let mut buffers = StepBuffers::upload(backend, &self.config, batch)?;
        let mut logits = backend.alloc(shape.logit_rows.max(1) * self.config.logit_width())?;
        self.forward_into(backend, &mut buffers, shape, kv, &mut logits, extra)?;
        Ok((logits, buffers.residual))
    }

    /// The logits of `n` final hidden states (`[n, hidden]` on the host).
    pub(super) fn head_of(&self, backend: &B, hidden: &[f32], n: usize) -> Result<B::Tensor> {
        let cfg = &self.config;
        let mut logits = backend.alloc(n.max(1) * cfg.logit_width())?;
        if n == 0 {
            return Ok(logits);
        }
        let x = backend.upload(hidden)?;
        let mut normed = backend.alloc(n * cfg.hidden_size)?;
        let norm = RmsNormParams {
            rows: n,
            dim: cfg.hidden_size,
            eps: cfg.rms_eps,
        };
        backend.rms_norm(&x, &self.output_norm, norm, &mut normed)?;
        let mm = MatmulParams { rows: n };
        backend.matmul(&normed, self.output_matrix()?, None, mm, &mut logits)?;
        self.scale_logits(backend, &mut logits, n)?;
        Ok(logits)
    }

    /// Divides `n` rows of logits by the architecture's logit divisor, if any.
    fn scale_logits(&self, backend: &B, logits: &mut B::Tensor, n: usize) -> Result<()> {
        match self.config.multipliers.logits {
            Some(divisor) => backend.scale(logits, n * self.config.logit_width(), 1.0 / divisor),
            None => Ok(()),
        }
    }

    /// The output head: its own matrix, or the embedding table when tied.
    fn output_matrix(&self) -> Result<&B::Weight> {
        self.output
            .as_ref()
            .or(self.embed.as_ref())
            .ok_or_else(|| Error::Unsupported("logits on a rank without the output head".into()))
    }

    /// The shape of `batch`, once it is known to fit this model and `kv`.
    pub(crate) fn check_batch(&self, batch: &ForwardBatch, kv: &[B::KvCache]) -> Result<StepShape> {
        if batch.rows() == 0 {
            return Err(Error::InvalidRequest("empty batch".into()));
        }
        let hidden_len = match self.config.reads_hidden {
            true => batch.rows() * self.config.hidden_size,
            false => 0,
        };
        if batch.input_hidden.len() != hidden_len {
            return Err(Error::InvalidRequest(format!(
                "{} input hidden values for {} rows of a model that reads {} per row",
                batch.input_hidden.len(),
                batch.rows(),
                hidden_len / batch.rows()
            )));
        }
        if kv.len() != self.config.num_layers {
            return Err(Error::InvalidRequest(format!(
                "{} KV caches for {} layers",
                kv.len(),
                self.config.num_layers
            )));
        }
        Ok(StepShape {
            rows: batch.rows(),
            logit_rows: batch.logit_rows.len(),
            block_size: batch.block_size,
            max_blocks_per_seq: batch.max_blocks_per_seq,
        })
    }
}
