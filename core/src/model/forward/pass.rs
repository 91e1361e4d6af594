//! The kernels of one forward pass, apart from the host-side work around
//! them (checking the batch, uploading its indices, allocating, dispatching
//! over ranks): a backend records them once and replays them
//! (`crate::model::recorded`), and a pipeline stage runs only its share of
//! them (`crate::model::placement`).

use super::stream::{projection_out, Branch, Stream};
use super::{AttentionExtra, Ffn, Model, Projections};
use crate::backend::{
    AttentionIndices, AttentionParams, Backend, Glu, MatmulParams, NormPrologue, RmsNormParams,
    RopeParams, SplitOut,
};
use crate::kv::eviction::scoring_layers;
use crate::model::arch::Activation;
use crate::model::step_buffers::{StepBuffers, StepShape};
use crate::parallel::Placement;
use crate::{Error, Result};

impl<B: Backend> Model<B> {
    /// The residual stream's first state: the rows' token embeddings, and
    /// for an EAGLE head the projection of the hidden states it reads
    /// (normalised first, as the target's head reads them),
    /// left in `delta` for the first norm to add. Returns whether it did
    /// (the stream's `pending`).
    pub(in crate::model) fn embed_into(
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
    pub(in crate::model) fn layers_into(
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
