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
mod stream;

pub use batch::ForwardBatch;
pub use load::{LoadOptions, Progress};

use super::arch::Activation;
use super::moe_layer::MoeLayer;
use super::step_buffers::{StepBuffers, StepShape};
use super::ModelConfig;
use crate::backend::{
    AttentionIndices, AttentionParams, Backend, BlockSelectParams, Glu, MatmulParams, NormPrologue,
    RmsNormParams, RopeParams, SplitOut,
};
use crate::kv::eviction::scoring_layers;
use crate::parallel::{Command, Placement};
use crate::{Error, Result};
use stream::{projection_out, Branch, Stream};

/// What a forward pass's attention does besides attending.
pub enum AttentionExtra<'a, B: Backend> {
    None,
    /// `[rows, kv_heads, max_blocks_per_seq]`: the attention mass per KV
    /// block of the [`scoring_layers`] is added into it
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

    /// The residual stream's first state: the rows' token embeddings, and
    /// for an EAGLE head the projection of the hidden states it reads
    /// (normalised first, as the target's head reads them),
    /// left in `delta` for the first norm to add. Returns whether it did
    /// (the stream's `pending`).
    pub(super) fn embed_into(
        &self,
        backend: &B,
        buffers: &mut StepBuffers<B>,
        rows: usize,
    ) -> Result<bool> {
        let embed = self.embed.as_ref().ok_or_else(|| {
            Error::Unsupported("token embedding on a rank without the embedding table".into())
        })?;
        let residual = &mut buffers.residual;
        backend.embedding(embed, &buffers.tokens, rows, residual)?;
        if let Some(factor) = self.config.embedding_scale() {
            backend.scale(residual, rows * self.config.hidden_size, factor)?;
        }
        let Some((norm, fc)) = &self.eagle else {
            return Ok(false);
        };
        let hidden = buffers.input_hidden.as_ref().ok_or_else(|| {
            Error::InvalidRequest("an EAGLE head's forward pass without hidden states".into())
        })?;
        let cfg = &self.config;
        let p = RmsNormParams {
            rows,
            dim: cfg.hidden_size,
            eps: cfg.rms_eps,
        };
        backend.rms_norm(hidden, norm, p, &mut buffers.normed)?;
        let mm = MatmulParams { rows };
        backend.matmul(&buffers.normed, fc, None, mm, &mut buffers.delta)?;
        Ok(true)
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

    /// The kernels of one forward pass of `shape` over `buffers`, whose
    /// indices already hold the batch; the logits go to `logits`. Allocates
    /// nothing, uploads nothing, reads nothing back: a backend can record it.
    /// With `scores`, the [`scoring_layers`]' attention mass per KV block is
    /// added into it.
    pub(crate) fn forward_into(
        &self,
        backend: &B,
        buffers: &mut StepBuffers<B>,
        shape: StepShape,
        kv: &mut [B::KvCache],
        logits: &mut B::Tensor,
        extra: AttentionExtra<'_, B>,
    ) -> Result<()> {
        let pending = self.embed_into(backend, buffers, shape.rows)?;
        let pending = self.layers_into(backend, buffers, shape, kv, pending, extra)?;
        if self.placement.as_ref().is_some_and(|p| !p.is_leader()) {
            return Ok(());
        }
        self.logits_into(backend, buffers, shape, pending, logits)
    }

    /// This model's layers over the residual stream in `buffers`, `delta`
    /// still to add when `pending`. Returns whether the last branch's
    /// output still waits in `delta`.
    pub(super) fn layers_into(
        &self,
        backend: &B,
        buffers: &mut StepBuffers<B>,
        shape: StepShape,
        kv: &mut [B::KvCache],
        pending: bool,
        mut extra: AttentionExtra<'_, B>,
    ) -> Result<bool> {
        let cfg = &self.config;
        let rows = shape.rows;
        let (dim, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let StepBuffers {
            positions,
            row_seq,
            slots,
            block_tables,
            residual,
            normed,
            q,
            k,
            v,
            attn,
            delta,
            gate,
            up,
            act,
            q_raw,
            k_raw,
            out_raw,
            moe,
            ..
        } = buffers;

        let norm = RmsNormParams {
            rows,
            dim,
            eps: cfg.rms_eps,
        };
        // Q/K norms are the same RMSNorm over each head's row of `head_dim`.
        let head_norm = |heads: usize| match cfg.block.qk_norm_whole {
            true => RmsNormParams {
                rows,
                dim: heads * cfg.head_dim,
                eps: cfg.rms_eps,
            },
            false => RmsNormParams {
                rows: rows * heads,
                dim: cfg.head_dim,
                eps: cfg.rms_eps,
            },
        };
        let mm = MatmulParams { rows };
        let rope = |heads| RopeParams {
            rows,
            heads,
            head_dim: cfg.head_dim,
            rotary_dim: cfg.rotary_dim,
            style: cfg.rope_style,
        };
        let attn_params = |sliding_window| AttentionParams {
            rows,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: shape.block_size,
            max_blocks_per_seq: shape.max_blocks_per_seq,
            scale: cfg.attention_scale,
            sliding_window,
            per_head_tables: false,
        };
        let missing = |what: &str| {
            Error::backend(
                backend.info().name,
                format!("forward pass: no {what} buffer for this architecture"),
            )
        };

        // A branch's output waits in `delta` (pending) until the next norm
        // adds it, unless a fused matmul added it into `residual` itself.
        let comm = self.placement.as_ref().and_then(Placement::reduces_over);
        let mut stream = Stream {
            residual,
            delta,
            normed,
            pending,
            norm,
            comm,
        };
        // A branch output goes straight into the residual stream when
        // nothing stands between the projection and the add: not across
        // ranks, whose partial outputs are summed first.
        let direct = self.fused && cfg.multipliers.residual.is_none() && comm.is_none();
        let scoring = scoring_layers(self.layers.len());
        for (index, (layer, cache)) in self.layers.iter().zip(kv.iter_mut()).enumerate() {
            let widths = [
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            ];
            let q_out = projection_out(layer.q_norm.is_some(), q_raw, q)
                .ok_or_else(|| missing("Q norm"))?;
            let k_out = projection_out(layer.k_norm.is_some(), k_raw, k)
                .ok_or_else(|| missing("K norm"))?;
            stream.project(
                backend,
                &layer.attn_norm,
                &layer.qkv,
                mm,
                [q_out, k_out, &mut *v],
                &widths,
            )?;
            let head_norms = [
                (&layer.q_norm, &*q_raw, &mut *q, cfg.num_heads),
                (&layer.k_norm, &*k_raw, &mut *k, cfg.num_kv_heads),
            ];
            for (weight, raw, out, heads) in head_norms {
                if let Some(weight) = weight {
                    let raw = raw.as_ref().ok_or_else(|| missing("Q/K norm"))?;
                    backend.rms_norm(raw, weight, head_norm(heads), out)?;
                }
            }
            let inv_freq = &self.inv_freqs[layer.rope];
            backend.rope(q, positions, inv_freq, rope(cfg.num_heads))?;
            backend.rope(k, positions, inv_freq, rope(cfg.num_kv_heads))?;
            backend.paged_kv_write(k, v, slots, rows, cache)?;
            let idx = AttentionIndices::<B> {
                row_seq,
                positions,
                block_tables,
            };
            let params = attn_params(layer.sliding_window);
            match &mut extra {
                AttentionExtra::None => backend.paged_attention(q, cache, idx, params, attn)?,
                AttentionExtra::Scores(scores) => {
                    if scoring.contains(&index) {
                        let idx = AttentionIndices::<B> {
                            row_seq,
                            positions,
                            block_tables,
                        };
                        backend.paged_attention_scores(q, cache, idx, params, scores)?;
                    }
                    backend.paged_attention(q, cache, idx, params, attn)?;
                }
                AttentionExtra::Sparse { select, tables } => {
                    backend.select_kv_blocks(q, cache, idx, params, *select, tables)?;
                    let idx = AttentionIndices::<B> {
                        row_seq,
                        positions,
                        block_tables: tables,
                    };
                    let params = AttentionParams {
                        per_head_tables: true,
                        ..params
                    };
                    backend.paged_attention(q, cache, idx, params, attn)?;
                }
            }
            let branch = Branch {
                w: &layer.wo,
                post_norm: &layer.post_attn_norm,
                direct,
                residual_multiplier: cfg.multipliers.residual,
            };
            stream.add_branch(backend, attn, branch, out_raw)?;
            let post_norm = &layer.post_ffn_norm;
            match &layer.ffn {
                Ffn::Dense { gate_up, down } => {
                    let glu = match cfg.block.activation {
                        Activation::Silu => Glu::SwiGlu,
                        Activation::GeluTanh => Glu::GeGlu,
                    };
                    // The whole MLP in one call when its output goes straight
                    // into the stream and gate/up are one weight.
                    let whole = direct && post_norm.is_none() && !stream.pending;
                    match gate_up {
                        Projections::Concatenated { w, .. } if whole => {
                            let norm = NormPrologue {
                                weight: &layer.ffn_norm,
                                eps: cfg.rms_eps,
                            };
                            backend.mlp_residual(stream.residual, norm, w, down, glu, mm, act)?;
                        }
                        _ => {
                            stream.gated(
                                backend,
                                &layer.ffn_norm,
                                gate_up,
                                glu,
                                mm,
                                ffn,
                                [gate, up, act],
                            )?;
                            let branch = Branch {
                                w: down,
                                post_norm,
                                direct,
                                residual_multiplier: cfg.multipliers.residual,
                            };
                            stream.add_branch(backend, act, branch, out_raw)?;
                        }
                    }
                }
                Ffn::Moe(experts) => {
                    let buffers = moe.as_mut().ok_or_else(|| missing("MoE"))?;
                    stream.normalize(backend, &layer.ffn_norm)?;
                    experts.forward(
                        backend,
                        stream.normed,
                        rows,
                        dim,
                        buffers,
                        [&mut *gate, &mut *up, &mut *act],
                        stream.delta,
                    )?;
                    // This rank's experts' part of every row.
                    if let Some(comm) = stream.comm {
                        backend.all_reduce_sum(stream.delta, rows * dim, comm)?;
                    }
                    if let Some(factor) = cfg.multipliers.residual {
                        backend.scale(stream.delta, rows * dim, factor)?;
                    }
                    stream.pending = true;
                }
            }
        }
        Ok(stream.pending)
    }

    /// The logits of the rows `buffers` names, from the final residual
    /// stream (with `delta` still to add when `pending`).
    fn logits_into(
        &self,
        backend: &B,
        buffers: &mut StepBuffers<B>,
        shape: StepShape,
        pending: bool,
        logits: &mut B::Tensor,
    ) -> Result<()> {
        let cfg = &self.config;
        let dim = cfg.hidden_size;
        let StepBuffers {
            residual,
            delta,
            normed,
            logit_rows,
            final_normed,
            ..
        } = buffers;
        let norm = RmsNormParams {
            rows: shape.rows,
            dim,
            eps: cfg.rms_eps,
        };
        let mut stream = Stream {
            residual,
            delta,
            normed,
            pending,
            norm,
            comm: None,
        };
        let n_logits = shape.logit_rows;
        let out_w = self.output_matrix()?;
        let logits_mm = MatmulParams { rows: n_logits };
        if self.fused && !stream.pending {
            // Only the rows whose logits are wanted are normalised, inside the matmul.
            backend.gather_rows(stream.residual, logit_rows, n_logits, dim, final_normed)?;
            let prologue = NormPrologue {
                weight: &self.output_norm,
                eps: cfg.rms_eps,
            };
            let outs = &mut [SplitOut {
                out: &mut *logits,
                width: cfg.logit_width(),
            }];
            backend.matmul_rms_norm(final_normed, Some(prologue), out_w, None, logits_mm, outs)?;
        } else {
            stream.normalize(backend, &self.output_norm)?;
            backend.gather_rows(stream.normed, logit_rows, n_logits, dim, final_normed)?;
            backend.matmul(final_normed, out_w, None, logits_mm, logits)?;
        }
        self.scale_logits(backend, logits, n_logits)
    }
}
