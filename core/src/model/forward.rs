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

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::arch::Activation;
use super::moe_layer::MoeLayer;
use super::step_buffers::{StepBuffers, StepShape};
use super::{Bytes, ModelConfig, ModelFiles};
use crate::backend::{
    AttentionIndices, AttentionParams, Backend, BlockSelectParams, Glu, KvDtype, MatmulParams,
    MatmulTarget, NormPrologue, RmsNormParams, RopeParams, SplitOut, WeightStorage,
};
use crate::kv::eviction::scoring_layers;
use crate::kv::{KvPlan, KvShape};
use crate::parallel::shard::{shard, ShardView};
use crate::parallel::{Command, Communicator, Job, PipelinePlan, Placement, TensorParallelPlan};
use crate::quant::{concat_rows, WeightFormat, WeightView};
use crate::{Error, Result};

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

/// The host-side description of one batch.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// `[rows, hidden]`: for an EAGLE head (`ModelConfig::reads_hidden`),
    /// the target's hidden state each row reads beside its token; empty
    /// for any other model.
    pub input_hidden: Vec<f32>,
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

    /// The rows `rows` alone (a pipeline micro-batch): every sequence's
    /// block table stays, and no logits are asked for.
    pub fn part(&self, rows: std::ops::Range<usize>) -> Self {
        Self {
            tokens: self.tokens[rows.clone()].to_vec(),
            positions: self.positions[rows.clone()].to_vec(),
            row_seq: self.row_seq[rows.clone()].to_vec(),
            slots: self.slots[rows].to_vec(),
            block_tables: self.block_tables.clone(),
            logit_rows: Vec::new(),
            input_hidden: Vec::new(),
            ..*self
        }
    }
}

/// What `Model::load_with` loads.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions<'a> {
    /// Only these transformer layers, in this order (a self-speculative
    /// draft); `None`: all of them.
    pub layers: Option<&'a [usize]>,
    /// Run the unfused kernels even where the backend has fused matmuls
    /// (the reference for before/after figures).
    pub unfused: bool,
    /// Load this rank's share (when the job has more than one rank): its
    /// stage's layers, and of those its heads and FFN features, sliced as
    /// they are read.
    pub parallel: Option<&'a Job>,
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

/// Weights are uploaded one tensor at a time; the callback sees (done, total) bytes.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

impl<B: Backend> Model<B> {
    pub fn load(backend: &B, files: &ModelFiles, progress: Progress<'_>) -> Result<Self> {
        Self::load_with(backend, files, LoadOptions::default(), progress)
    }

    /// Loads only the transformer layers `layers` (in that order) between the
    /// embedding and the output head: the self-speculative draft of a model.
    pub fn load_layers(
        backend: &B,
        files: &ModelFiles,
        layers: &[usize],
        progress: Progress<'_>,
    ) -> Result<Self> {
        let options = LoadOptions {
            layers: Some(layers),
            ..LoadOptions::default()
        };
        Self::load_with(backend, files, options, progress)
    }

    pub fn load_with(
        backend: &B,
        files: &ModelFiles,
        options: LoadOptions<'_>,
        progress: Progress<'_>,
    ) -> Result<Self> {
        let placement = match options.parallel {
            Some(job) if job.world.size() > 1 => {
                if files.config.reads_hidden {
                    return Err(Error::Unsupported(
                        "an EAGLE head (a draft reading hidden states) on a split model".into(),
                    ));
                }
                if options.layers.is_some() {
                    return Err(Error::Unsupported(
                        "a layer subset of a split model (a self-speculative draft)".into(),
                    ));
                }
                let (stage, stages) = (job.stage_index(), job.shape.pp);
                let place = Placement {
                    job: job.clone(),
                    plan: TensorParallelPlan::for_model(
                        files,
                        job.stage.rank(),
                        job.stage.size(),
                        job.shape.ep,
                    )?,
                    pipeline: PipelinePlan::for_model(files, stage, stages)?,
                };
                place.announce(&Command::Load {
                    unfused: options.unfused,
                    model: files.path.to_string_lossy().into_owned(),
                })?;
                // After the announcement: followers join in their own load.
                if job.stage.size() > 1 {
                    backend.join_ranks(&*job.stage)?;
                }
                Some(place)
            }
            _ => None,
        };
        let all: Vec<usize> = match &placement {
            Some(place) => place.pipeline.layers.clone().collect(),
            None => (0..files.config.num_layers).collect(),
        };
        let layers = options.layers.unwrap_or(&all);
        let fused = backend.fuses_matmuls() && !options.unfused;
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
        cfg.layers = layers.iter().map(|&l| cfg.layers[l].clone()).collect();
        if let Some(place) = &placement {
            cfg = place.plan.local_config(&cfg);
        }
        let leader = placement.as_ref().is_none_or(Placement::is_leader);
        let embeds = placement.as_ref().is_none_or(|p| p.pipeline.is_first());
        let total = files.tensors.total_bytes();
        // Shared by the uploads by name and those of experts' slices.
        let done = Cell::new(0usize);
        let weight_bytes = Cell::new(0usize);
        let progress = RefCell::new(progress);
        let put = |view: WeightView<'_>, is_vector: bool, name: &str| -> Result<B::Weight> {
            done.set(done.get() + view.data.len());
            weight_bytes.set(weight_bytes.get() + view.data.len());
            (progress.borrow_mut())(done.get(), total);
            let file = files.tensors.file_of(view.data);
            let (weight, storage) = upload(backend, view, is_vector, name, file)?;
            if storage == WeightStorage::Copied {
                files.tensors.release(view.data);
            }
            Ok(weight)
        };
        // A tensor, or this rank's slice of it.
        let view = |name: &str| -> Result<ShardView<'_>> {
            let whole = files
                .tensors
                .view(name)
                .ok_or_else(|| Error::bad_file(&files.path, format!("tensor {name} is missing")))?;
            match &placement {
                Some(place) => shard(whole, &place.plan.split(name), name),
                None => Ok(ShardView::whole(whole)),
            }
        };
        let mut get = |name: &str, is_vector: bool| -> Result<B::Weight> {
            put(view(name)?.view(), is_vector, name)
        };
        // Matrices that read one input, with their biases: concatenated
        // where the fused matmuls can take them, else one by one.
        let projections = |names: &[String], biases: bool| -> Result<Projections<B>> {
            let shards = names.iter().map(|n| view(n)).collect::<Result<Vec<_>>>()?;
            let views: Vec<WeightView<'_>> = shards.iter().map(ShardView::view).collect();
            let bias_names = || names.iter().map(|n| n.replace(".weight", ".bias"));
            if let (true, Some(data)) = (fused, concat_rows(&views)) {
                let concatenated = WeightView {
                    rows: views.iter().map(|v| v.rows).sum(),
                    data: &data,
                    ..views[0]
                };
                let w = put(concatenated, false, &names.join(" + "))?;
                views.iter().for_each(|v| files.tensors.release(v.data));
                let bias = match biases {
                    true => {
                        let parts = bias_names().map(|n| view(&n)).collect::<Result<Vec<_>>>()?;
                        let values: Vec<u8> = parts
                            .iter()
                            .flat_map(|v| v.view().to_f32())
                            .flat_map(f32::to_le_bytes)
                            .collect();
                        let len = values.len() / 4;
                        Some(put(
                            WeightView {
                                format: WeightFormat::F32,
                                rows: 1,
                                cols: len,
                                data: &values,
                            },
                            true,
                            "biases",
                        )?)
                    }
                    false => None,
                };
                return Ok(Projections::Concatenated { w, bias });
            }
            views
                .iter()
                .zip(names.iter().zip(bias_names()))
                .map(|(&v, (name, bias))| {
                    let b = biases
                        .then(|| put(view(&bias)?.view(), true, &bias))
                        .transpose()?;
                    Ok((put(v, false, name)?, b))
                })
                .collect::<Result<Vec<_>>>()
                .map(Projections::Separate)
        };
        let embed = embeds
            .then(|| get("token_embd.weight", false))
            .transpose()?;
        let output_norm = get("output_norm.weight", true)?;
        let eagle = match cfg.reads_hidden {
            true => Some((
                get("eagle_norm.weight", true)?,
                get("eagle_fc.weight", false)?,
            )),
            false => None,
        };
        // Only rank 0 computes logits.
        let output = if cfg.tied_embeddings || !leader {
            None
        } else {
            Some(get("output.weight", false)?)
        };
        let (bias, qk_norm, post_norms) = (cfg.qkv_bias, cfg.block.qk_norm, cfg.block.post_norms);
        let mut ropes = Vec::new();
        let mut inv_freqs = Vec::new();
        let mut layer_weights = Vec::with_capacity(cfg.num_layers);
        for (&i, spec) in layers.iter().zip(&cfg.layers) {
            let n = |s: &str| format!("blk.{i}.{s}");
            let vector_if =
                |get: &mut dyn FnMut(&str, bool) -> Result<B::Weight>, present: bool, s: &str| {
                    present.then(|| get(&n(s), true)).transpose()
                };
            let rope = match ropes.iter().position(|r| r == &spec.rope) {
                Some(index) => index,
                None => {
                    inv_freqs.push(backend.upload(&spec.rope.inv_freq(cfg.rotary_dim))?);
                    ropes.push(spec.rope.clone());
                    ropes.len() - 1
                }
            };
            layer_weights.push(LayerWeights {
                attn_norm: get(&n("attn_norm.weight"), true)?,
                qkv: projections(
                    &[n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight")],
                    bias,
                )?,
                q_norm: vector_if(&mut get, qk_norm, "attn_q_norm.weight")?,
                k_norm: vector_if(&mut get, qk_norm, "attn_k_norm.weight")?,
                wo: get(&n("attn_output.weight"), false)?,
                post_attn_norm: vector_if(&mut get, post_norms, "post_attention_norm.weight")?,
                ffn_norm: get(&n("ffn_norm.weight"), true)?,
                ffn: match cfg.moe {
                    None => Ffn::Dense {
                        gate_up: projections(&[n("ffn_gate.weight"), n("ffn_up.weight")], false)?,
                        down: get(&n("ffn_down.weight"), false)?,
                    },
                    Some(spec) => {
                        let mut put_matrix =
                            |view: WeightView<'_>, name: &str| put(view, false, name);
                        let share = placement.as_ref().map(|p| &p.plan);
                        let (layer, unread) =
                            MoeLayer::load(backend, files, spec, i, share, &mut put_matrix)?;
                        weight_bytes.set(weight_bytes.get() - unread);
                        Ffn::Moe(layer)
                    }
                },
                post_ffn_norm: vector_if(&mut get, post_norms, "post_ffw_norm.weight")?,
                rope,
                sliding_window: spec.sliding_window,
            });
        }
        // The embedding table is read one row per token; only as the tied
        // output matrix (on rank 0) does all of it count.
        let embed_bytes = files.tensors.info("token_embd.weight").map_or(0, |t| t.len);
        if embeds && !(cfg.tied_embeddings && leader) {
            weight_bytes.set(weight_bytes.get() - embed_bytes);
        }
        Ok(Self {
            config: cfg,
            embed,
            output,
            output_norm,
            eagle,
            layers: layer_weights,
            inv_freqs,
            weight_bytes: weight_bytes.get(),
            loaded_bytes: done.get(),
            fused,
            placement,
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
        let plan = KvPlan::uniform(dtype, self.config.num_layers);
        self.alloc_planned_kv_caches(backend, num_blocks, block_size, &plan)
    }

    /// One cache per layer, each layer's keys and values at the plan's
    /// dtypes (`--kv-dtype auto`). A split model takes uniform dtypes only.
    pub fn alloc_planned_kv_caches(
        &self,
        backend: &B,
        num_blocks: usize,
        block_size: usize,
        plan: &KvPlan,
    ) -> Result<Vec<B::KvCache>> {
        plan.check_layers(self.config.num_layers)?;
        match plan.uniform_dtype() {
            Some(dtype) => self.announce(Command::AllocKv {
                num_blocks,
                block_size,
                dtype,
            })?,
            None if self.placement.is_some() => {
                return Err(Error::Unsupported(
                    "a per-layer KV plan (--kv-dtype auto or plan:) on a split model".into(),
                ))
            }
            None => {}
        }
        let shape = self.kv_shape(block_size);
        (0..self.config.num_layers)
            .map(|layer| backend.alloc_kv_cache(plan.layout(layer, shape, num_blocks)))
            .collect()
    }

    /// The shape every layer's KV cache shares.
    pub fn kv_shape(&self, block_size: usize) -> KvShape {
        self.config.kv_shape(block_size)
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

/// The residual stream of one forward pass, with the branch output that
/// may still wait to be added.
struct Stream<'a, B: Backend> {
    residual: &'a mut B::Tensor,
    /// A branch's output not yet in `residual` (when `pending`).
    delta: &'a mut B::Tensor,
    /// The normalised stream, for consumers without a norm prologue.
    normed: &'a mut B::Tensor,
    pending: bool,
    norm: RmsNormParams,
    /// The other ranks of a tensor-parallel model: branch outputs are
    /// partial sums until reduced.
    comm: Option<&'a dyn Communicator>,
}

/// A fused matmul's input and the norm it applies first, if any.
type FusedInput<'x, 'w, B> = (
    &'x <B as Backend>::Tensor,
    Option<NormPrologue<'w, <B as Backend>::Weight>>,
);

/// A branch's output projection and what stands between it and the residual add.
struct Branch<'a, B: Backend> {
    w: &'a B::Weight,
    post_norm: &'a Option<B::Weight>,
    /// The backend adds the projection into the stream (`matmul_residual`).
    direct: bool,
    residual_multiplier: Option<f32>,
}

impl<B: Backend> Stream<'_, B> {
    /// `normed` = the stream (with any pending branch added) normalised by `weight`.
    fn normalize(&mut self, backend: &B, weight: &B::Weight) -> Result<()> {
        if std::mem::take(&mut self.pending) {
            backend.rms_norm_residual(self.residual, self.delta, weight, self.norm, self.normed)
        } else {
            backend.rms_norm(self.residual, weight, self.norm, self.normed)
        }
    }

    /// The input of a fused matmul normalised by `weight`: the stream
    /// itself with the norm as prologue, or `normed` when a pending branch
    /// must be added first.
    fn fused_input<'w>(
        &mut self,
        backend: &B,
        weight: &'w B::Weight,
    ) -> Result<FusedInput<'_, 'w, B>> {
        if self.pending {
            self.normalize(backend, weight)?;
            return Ok((&*self.normed, None));
        }
        let eps = self.norm.eps;
        Ok((&*self.residual, Some(NormPrologue { weight, eps })))
    }

    /// Q, K and V (`outs`, of `widths`) of the stream normalised by `norm_weight`.
    fn project(
        &mut self,
        backend: &B,
        norm_weight: &B::Weight,
        projections: &Projections<B>,
        mm: MatmulParams,
        outs: [&mut B::Tensor; 3],
        widths: &[usize; 3],
    ) -> Result<()> {
        match projections {
            Projections::Concatenated { w, bias } => {
                let (x, prologue) = self.fused_input(backend, norm_weight)?;
                let mut outs = outs
                    .into_iter()
                    .zip(widths)
                    .map(|(out, &width)| SplitOut { out, width })
                    .collect::<Vec<_>>();
                backend.matmul_rms_norm(x, prologue, w, bias.as_ref(), mm, &mut outs)
            }
            Projections::Separate(parts) => {
                self.normalize(backend, norm_weight)?;
                // One call for all: the CPU backend quantizes `normed` once.
                let mut targets = parts
                    .iter()
                    .zip(outs)
                    .map(|((w, bias), out)| MatmulTarget {
                        w,
                        bias: bias.as_ref(),
                        out,
                    })
                    .collect::<Vec<_>>();
                backend.matmuls(self.normed, &mut targets, mm)
            }
        }
    }

    /// The gated activation of the FFN (`ffn` features) into `act`, from
    /// the stream normalised by `norm_weight` (`gate` and `up` hold the
    /// unfused halves).
    #[allow(clippy::too_many_arguments)]
    fn gated(
        &mut self,
        backend: &B,
        norm_weight: &B::Weight,
        gate_up: &Projections<B>,
        glu: Glu,
        mm: MatmulParams,
        ffn: usize,
        [gate, up, act]: [&mut B::Tensor; 3],
    ) -> Result<()> {
        let len = mm.rows * ffn;
        match gate_up {
            Projections::Concatenated { w, .. } => {
                let (x, prologue) = self.fused_input(backend, norm_weight)?;
                backend.matmul_glu(x, prologue, w, glu, mm, act)
            }
            Projections::Separate(parts) => {
                self.normalize(backend, norm_weight)?;
                let mut targets = parts
                    .iter()
                    .zip([gate, up])
                    .map(|((w, _), out)| MatmulTarget { w, bias: None, out })
                    .collect::<Vec<_>>();
                backend.matmuls(self.normed, &mut targets, mm)?;
                let [gate, up] = [&*targets[0].out, &*targets[1].out];
                match glu {
                    Glu::SwiGlu => backend.swiglu(gate, up, len, act),
                    Glu::GeGlu => backend.geglu(gate, up, len, act),
                }
            }
        }
    }

    /// Adds `x · branch.w` into the stream: at once when the branch is
    /// direct and has no post-norm, else through `delta` (post-normed and
    /// scaled where the architecture says), left pending. A norm always
    /// stands between two branches, so nothing is pending here.
    fn add_branch(
        &mut self,
        backend: &B,
        x: &B::Tensor,
        branch: Branch<'_, B>,
        scratch: &mut Option<B::Tensor>,
    ) -> Result<()> {
        let mm = MatmulParams {
            rows: self.norm.rows,
        };
        if branch.direct && branch.post_norm.is_none() {
            return backend.matmul_residual(x, branch.w, mm, self.residual);
        }
        post_normed(
            backend,
            x,
            branch.w,
            branch.post_norm,
            self.norm,
            scratch,
            self.delta,
            self.comm,
        )?;
        if let Some(factor) = branch.residual_multiplier {
            backend.scale(self.delta, self.norm.rows * self.norm.dim, factor)?;
        }
        self.pending = true;
        Ok(())
    }
}

/// Where a Q or K projection's matmul writes: its raw buffer when a per-head
/// norm follows (`None` when the architecture allocated none), else its output.
fn projection_out<'a, T>(
    head_norm: bool,
    raw: &'a mut Option<T>,
    out: &'a mut T,
) -> Option<&'a mut T> {
    if head_norm {
        raw.as_mut()
    } else {
        Some(out)
    }
}

/// `out = x·w` (summed over the ranks of `comm`), then RMSNorm by
/// `post_norm` when the architecture has one (through `scratch`, which such
/// architectures allocate).
#[allow(clippy::too_many_arguments)]
fn post_normed<B: Backend>(
    backend: &B,
    x: &B::Tensor,
    w: &B::Weight,
    post_norm: &Option<B::Weight>,
    norm: RmsNormParams,
    scratch: &mut Option<B::Tensor>,
    out: &mut B::Tensor,
    comm: Option<&dyn Communicator>,
) -> Result<()> {
    let mm = MatmulParams { rows: norm.rows };
    let len = norm.rows * norm.dim;
    let reduce = |t: &mut B::Tensor| match comm {
        Some(comm) => backend.all_reduce_sum(t, len, comm),
        None => Ok(()),
    };
    match (post_norm, scratch) {
        (None, _) => {
            backend.matmul(x, w, None, mm, out)?;
            reduce(out)
        }
        (Some(weight), Some(raw)) => {
            backend.matmul(x, w, None, mm, raw)?;
            reduce(raw)?;
            backend.rms_norm(raw, weight, norm, out)
        }
        (Some(_), None) => Err(Error::backend(
            backend.info().name,
            "forward pass: no post-norm buffer for this architecture",
        )),
    }
}

/// Puts a weight on the backend. Norm and bias vectors are converted to F32
/// on the host (kernels take them as f32); matrices keep their format, and
/// one that lies in a model `file` may stay there (`upload_file_weight`).
fn upload<B: Backend>(
    backend: &B,
    view: WeightView<'_>,
    is_vector: bool,
    name: &str,
    file: Option<&Arc<Bytes>>,
) -> Result<(B::Weight, WeightStorage)> {
    if is_vector {
        let data: Cow<[u8]> = if view.format == WeightFormat::F32 {
            Cow::Borrowed(view.data)
        } else {
            Cow::Owned(view.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect())
        };
        let cols = view.rows * view.cols;
        let weight = backend.upload_weight(WeightView {
            format: WeightFormat::F32,
            rows: 1,
            cols,
            data: &data,
        })?;
        return Ok((weight, WeightStorage::Copied));
    }
    if !backend.supports_format(view.format) {
        return Err(Error::Unsupported(format!(
            "{name}: backend {} cannot multiply {} weights",
            backend.info().name,
            view.format
        )));
    }
    match file {
        Some(file) => backend.upload_file_weight(view, file),
        None => Ok((backend.upload_weight(view)?, WeightStorage::Copied)),
    }
}
