//! Putting a model on a backend: its weights (all layers, a subset for a
//! self-speculative draft, or one rank's share of a split model), fused
//! where the backend's matmuls take concatenated projections, and its
//! paged KV caches.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::{Ffn, LayerWeights, Model, Projections};
use crate::backend::{Backend, KvDtype, WeightStorage};
use crate::kv::{KvPlan, KvShape};
use crate::model::moe_layer::MoeLayer;
use crate::model::{Bytes, ModelFiles};
use crate::parallel::shard::{shard, ShardView};
use crate::parallel::{Command, Job, PipelinePlan, Placement, TensorParallelPlan};
use crate::quant::{concat_rows, WeightFormat, WeightView};
use crate::{Error, Result};

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
        // Counts `bytes` of weights as loaded.
        let loaded = |bytes: usize| {
            done.set(done.get() + bytes);
            weight_bytes.set(weight_bytes.get() + bytes);
            (progress.borrow_mut())(done.get(), total);
        };
        let put = |view: WeightView<'_>, is_vector: bool, name: &str| -> Result<B::Weight> {
            loaded(view.data.len());
            let file = files.tensors.file_of(view.data);
            let (weight, storage) = upload(backend, view, is_vector, name, file)?;
            if storage == WeightStorage::Copied {
                files.tensors.release(view.data);
            }
            Ok(weight)
        };
        // Matrices stacked where they lie in the first one's model file, if
        // the backend reads them there (`Backend::upload_file_stack`, which
        // refuses parts that lie elsewhere).
        let put_stack = |views: &[WeightView<'_>]| -> Result<Option<B::Weight>> {
            let Some(file) = views.first().and_then(|v| files.tensors.file_of(v.data)) else {
                return Ok(None);
            };
            let weight = backend.upload_file_stack(views, file)?;
            if weight.is_some() {
                loaded(views.iter().map(|v| v.data.len()).sum());
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
            let stacked = if !fused {
                None
            } else if let Some(w) = put_stack(&views)? {
                Some(w)
            } else if let Some(data) = concat_rows(&views) {
                let concatenated = WeightView {
                    rows: views.iter().map(|v| v.rows).sum(),
                    data: &data,
                    ..views[0]
                };
                let w = put(concatenated, false, &names.join(" + "))?;
                views.iter().for_each(|v| files.tensors.release(v.data));
                Some(w)
            } else {
                None
            };
            if let Some(w) = stacked {
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
