//! The forward pass, written once over the [`Backend`] trait.
//!
//! A [`ForwardBatch`] flattens the new tokens of several sequences into one
//! list of rows; each row knows its sequence, its position and the KV slot it
//! writes. The same call serves a prompt chunk, a single decode token, or the
//! k+1 rows of a speculative verification, for any mix of sequences.
//!
//! Per layer: RMSNorm fused with the residual add → Q/K/V matmuls → RoPE →
//! paged KV write → paged attention → O matmul → RMSNorm + residual → gate/up
//! matmuls → SwiGLU → down matmul. Logits are computed only for the rows the
//! caller asks for.

use std::borrow::Cow;

use super::{ModelConfig, ModelFiles};
use crate::backend::{
    AttentionIndices, AttentionParams, Backend, KvCacheLayout, KvDtype, MatmulParams,
    RmsNormParams, RopeParams,
};
use crate::quant::{WeightFormat, WeightView};
use crate::{Error, Result};

/// The host-side description of one batch.
#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    /// New tokens of all sequences, flattened.
    pub tokens: Vec<u32>,
    /// Absolute position of each row in its sequence.
    pub positions: Vec<u32>,
    /// Index of each row's sequence in `block_tables`.
    pub row_seq: Vec<u32>,
    /// KV slot each row writes.
    pub slots: Vec<u32>,
    /// `[num_seqs, max_blocks_per_seq]` block ids, row-major, zero-padded.
    pub block_tables: Vec<u32>,
    pub max_blocks_per_seq: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Rows whose logits are wanted, in the order they are returned.
    pub logit_rows: Vec<u32>,
}

impl ForwardBatch {
    pub fn new(block_size: usize, max_blocks_per_seq: usize) -> Self {
        Self {
            block_size,
            max_blocks_per_seq,
            ..Default::default()
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Appends the rows of one sequence; `block_table` is its whole table.
    pub fn push_sequence(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        slots: &[u32],
        block_table: &[u32],
    ) {
        let seq = (self.block_tables.len() / self.max_blocks_per_seq.max(1)) as u32;
        debug_assert_eq!(tokens.len(), slots.len());
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((start_pos..start_pos + tokens.len()).map(|p| p as u32));
        self.row_seq.extend(std::iter::repeat_n(seq, tokens.len()));
        self.slots.extend_from_slice(slots);
        let mut row = block_table.to_vec();
        row.resize(self.max_blocks_per_seq, 0);
        self.block_tables.extend(row);
    }
}

struct LayerWeights<B: Backend> {
    attn_norm: B::Weight,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    bq: Option<B::Weight>,
    bk: Option<B::Weight>,
    bv: Option<B::Weight>,
    wo: B::Weight,
    ffn_norm: B::Weight,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
}

/// A model's weights on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    embed: B::Weight,
    /// `None` with tied embeddings: the embedding table is the output matrix.
    output: Option<B::Weight>,
    output_norm: B::Weight,
    layers: Vec<LayerWeights<B>>,
    inv_freq: B::Tensor,
    /// Bytes of weights read per decoded token (for bandwidth figures).
    pub weight_bytes: usize,
}

/// Weights are uploaded one tensor at a time; the callback sees (done, total) bytes.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

impl<B: Backend> Model<B> {
    pub fn load(backend: &B, files: &ModelFiles, progress: Progress<'_>) -> Result<Self> {
        let all: Vec<usize> = (0..files.config.num_layers).collect();
        Self::load_layers(backend, files, &all, progress)
    }

    /// Loads only the transformer layers `layers` (in that order) between the
    /// embedding and the output head: the self-speculative draft of a model.
    pub fn load_layers(
        backend: &B,
        files: &ModelFiles,
        layers: &[usize],
        progress: Progress<'_>,
    ) -> Result<Self> {
        let mut cfg = files.config.clone();
        if layers.is_empty() {
            return Err(Error::InvalidRequest(
                "a model needs at least one layer".into(),
            ));
        }
        if let Some(bad) = layers.iter().find(|&&l| l >= cfg.num_layers) {
            return Err(Error::InvalidRequest(format!(
                "layer {bad} does not exist: the model has {} layers",
                cfg.num_layers
            )));
        }
        cfg.num_layers = layers.len();
        let total = files.tensors.total_bytes();
        let mut done = 0usize;
        let mut weight_bytes = 0usize;
        let mut get = |name: &str, is_vector: bool| -> Result<B::Weight> {
            let view = files
                .tensors
                .view(name)
                .ok_or_else(|| Error::bad_file(&files.path, format!("tensor {name} is missing")))?;
            done += view.data.len();
            weight_bytes += view.data.len();
            progress(done, total);
            upload(backend, view, is_vector, name)
        };
        let embed = get("token_embd.weight", false)?;
        let output_norm = get("output_norm.weight", true)?;
        let output = if cfg.tied_embeddings {
            None
        } else {
            Some(get("output.weight", false)?)
        };
        let source_layers = layers;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for &i in source_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |get: &mut dyn FnMut(&str, bool) -> Result<B::Weight>, s: &str| {
                if cfg.qkv_bias {
                    get(&n(s), true).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: get(&n("attn_norm.weight"), true)?,
                wq: get(&n("attn_q.weight"), false)?,
                wk: get(&n("attn_k.weight"), false)?,
                wv: get(&n("attn_v.weight"), false)?,
                bq: bias(&mut get, "attn_q.bias")?,
                bk: bias(&mut get, "attn_k.bias")?,
                bv: bias(&mut get, "attn_v.bias")?,
                wo: get(&n("attn_output.weight"), false)?,
                ffn_norm: get(&n("ffn_norm.weight"), true)?,
                w_gate: get(&n("ffn_gate.weight"), false)?,
                w_up: get(&n("ffn_up.weight"), false)?,
                w_down: get(&n("ffn_down.weight"), false)?,
            });
        }
        // The embedding table is read one row per token; only as the tied output matrix does all of it count.
        let embed_bytes = files.tensors.info("token_embd.weight").map_or(0, |t| t.len);
        if !cfg.tied_embeddings {
            weight_bytes -= embed_bytes;
        }
        let inv_freq = backend.upload(&cfg.inv_freq())?;
        Ok(Self {
            config: cfg,
            embed,
            output,
            output_norm,
            layers,
            inv_freq,
            weight_bytes,
        })
    }

    /// One paged KV cache per layer, `num_blocks` blocks of `block_size` tokens.
    pub fn alloc_kv_caches(
        &self,
        backend: &B,
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Result<Vec<B::KvCache>> {
        let layout = KvCacheLayout {
            num_blocks,
            block_size,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            dtype,
        };
        (0..self.config.num_layers)
            .map(|_| backend.alloc_kv_cache(layout))
            .collect()
    }

    /// Runs `batch` through the model, writing its K/V into `kv` (one cache
    /// per layer), and returns the logits of `batch.logit_rows` as a
    /// `[logit_rows, vocab]` tensor on the device.
    pub fn forward(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
    ) -> Result<B::Tensor> {
        let shape = self.check_batch(batch, kv)?;
        let mut buffers = StepBuffers::upload(backend, &self.config, batch)?;
        let mut logits = backend.alloc(shape.logit_rows.max(1) * self.config.vocab_size)?;
        self.forward_into(backend, &mut buffers, shape, kv, &mut logits)?;
        Ok(logits)
    }

    /// The shape of `batch`, once it is known to fit this model and `kv`.
    pub(crate) fn check_batch(&self, batch: &ForwardBatch, kv: &[B::KvCache]) -> Result<StepShape> {
        if batch.rows() == 0 {
            return Err(Error::InvalidRequest("empty batch".into()));
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
    pub(crate) fn forward_into(
        &self,
        backend: &B,
        buffers: &mut StepBuffers<B>,
        shape: StepShape,
        kv: &mut [B::KvCache],
        logits: &mut B::Tensor,
    ) -> Result<()> {
        let cfg = &self.config;
        let rows = shape.rows;
        let (dim, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let StepBuffers {
            tokens,
            positions,
            row_seq,
            slots,
            block_tables,
            logit_rows,
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
            final_normed,
        } = buffers;

        let norm = RmsNormParams {
            rows,
            dim,
            eps: cfg.rms_eps,
        };
        let mm = MatmulParams { rows };
        let rope = |heads| RopeParams {
            rows,
            heads,
            head_dim: cfg.head_dim,
            rotary_dim: cfg.rotary_dim,
            style: cfg.rope_style,
        };
        let attn_params = AttentionParams {
            rows,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: shape.block_size,
            max_blocks_per_seq: shape.max_blocks_per_seq,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            sliding_window: cfg.sliding_window,
        };

        backend.embedding(&self.embed, tokens, rows, residual)?;
        for (i, (layer, cache)) in self.layers.iter().zip(kv.iter_mut()).enumerate() {
            if i == 0 {
                backend.rms_norm(residual, &layer.attn_norm, norm, normed)?;
            } else {
                backend.rms_norm_residual(residual, delta, &layer.attn_norm, norm, normed)?;
            }
            backend.matmul(normed, &layer.wq, layer.bq.as_ref(), mm, q)?;
            backend.matmul(normed, &layer.wk, layer.bk.as_ref(), mm, k)?;
            backend.matmul(normed, &layer.wv, layer.bv.as_ref(), mm, v)?;
            backend.rope(q, positions, &self.inv_freq, rope(cfg.num_heads))?;
            backend.rope(k, positions, &self.inv_freq, rope(cfg.num_kv_heads))?;
            backend.paged_kv_write(k, v, slots, rows, cache)?;
            let idx = AttentionIndices::<B> {
                row_seq,
                positions,
                block_tables,
            };
            backend.paged_attention(q, cache, idx, attn_params, attn)?;
            backend.matmul(attn, &layer.wo, None, mm, delta)?;
            backend.rms_norm_residual(residual, delta, &layer.ffn_norm, norm, normed)?;
            backend.matmul(normed, &layer.w_gate, None, mm, gate)?;
            backend.matmul(normed, &layer.w_up, None, mm, up)?;
            backend.swiglu(gate, up, rows * ffn, act)?;
            backend.matmul(act, &layer.w_down, None, mm, delta)?;
        }
        let n_logits = shape.logit_rows;
        backend.rms_norm_residual(residual, delta, &self.output_norm, norm, normed)?;
        backend.gather_rows(normed, logit_rows, n_logits, dim, final_normed)?;
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        backend.matmul(
            final_normed,
            out_w,
            None,
            MatmulParams { rows: n_logits },
            logits,
        )
    }
}

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
    tokens: B::Indices,
    positions: B::Indices,
    row_seq: B::Indices,
    slots: B::Indices,
    block_tables: B::Indices,
    logit_rows: B::Indices,
    residual: B::Tensor,
    normed: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    delta: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    final_normed: B::Tensor,
}

impl<B: Backend> StepBuffers<B> {
    /// Buffers holding `batch`.
    fn upload(backend: &B, cfg: &ModelConfig, batch: &ForwardBatch) -> Result<Self> {
        let up = |data: &[u32]| backend.upload_indices(data);
        Self::with_indices(
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
                up(&batch.logit_rows)?,
            ],
        )
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
        let (dim, q_dim, kv_dim, ffn) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
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

/// Puts a weight on the backend. Norm and bias vectors are converted to F32
/// on the host (kernels take them as f32); matrices keep their format.
fn upload<B: Backend>(
    backend: &B,
    view: WeightView<'_>,
    is_vector: bool,
    name: &str,
) -> Result<B::Weight> {
    if is_vector {
        let data: Cow<[u8]> = if view.format == WeightFormat::F32 {
            Cow::Borrowed(view.data)
        } else {
            Cow::Owned(view.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect())
        };
        let cols = view.rows * view.cols;
        return backend.upload_weight(WeightView {
            format: WeightFormat::F32,
            rows: 1,
            cols,
            data: &data,
        });
    }
    if !backend.supports_format(view.format) {
        return Err(Error::Unsupported(format!(
            "{name}: backend {} cannot multiply {} weights",
            backend.info().name,
            view.format
        )));
    }
    backend.upload_weight(view)
}
