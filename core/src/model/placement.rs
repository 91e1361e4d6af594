//! A [`Model`] split over ranks: rank 0 announces what it does with the
//! model, the other ranks follow (`crate::parallel::link`), and pipeline
//! stages pass the residual stream on.

use super::forward::{AttentionExtra, ForwardBatch, Model};
use super::step_buffers::StepBuffers;
use crate::backend::Backend;
use crate::parallel::{receive, Command, Placement, TensorParallelPlan};
use crate::{Error, Result};

impl<B: Backend> Model<B> {
    /// This rank's place, when the model is split over several ranks.
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// This rank's share of each layer, when the model is split.
    pub fn tensor_parallel_plan(&self) -> Option<&TensorParallelPlan> {
        self.placement.as_ref().map(|p| &p.plan)
    }

    /// Rank 0 sends the other ranks what it is about to do.
    pub(super) fn announce(&self, command: Command) -> Result<()> {
        match &self.placement {
            Some(place) => place.announce(&command),
            None => Ok(()),
        }
    }

    /// Copies KV blocks (`(from, to)` pairs) in every layer's cache, on every rank.
    pub fn copy_kv_blocks(
        &self,
        backend: &B,
        kv: &mut [B::KvCache],
        pairs: &[(u32, u32)],
    ) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        self.announce(Command::CopyBlocks(pairs.to_vec()))?;
        kv.iter_mut()
            .try_for_each(|cache| backend.copy_kv_blocks(cache, pairs))
    }

    /// A follower rank's whole life: runs what rank 0 announces, with its
    /// own shard and KV caches, until rank 0 stops. Returns at once on a
    /// model that is not split.
    pub fn follow(&self, backend: &B) -> Result<()> {
        let Some(place) = &self.placement else {
            return Ok(());
        };
        let mut kv = Vec::new();
        loop {
            match receive(&*place.job.world)? {
                Command::AllocKv {
                    num_blocks,
                    block_size,
                    dtype,
                } => {
                    kv.clear();
                    kv = self.alloc_kv_caches(backend, num_blocks, block_size, dtype)?;
                }
                Command::Forward(batch) => {
                    self.forward(backend, &batch, &mut kv)?;
                }
                Command::CopyBlocks(pairs) => self.copy_kv_blocks(backend, &mut kv, &pairs)?,
                Command::Stop => return Ok(()),
                other => {
                    return Err(Error::Communication(format!(
                        "rank 0 sent {other:?} while a model was loaded"
                    )))
                }
            }
        }
    }

    /// One step of a pipeline stage: the batch's rows go through this
    /// stage's layers in micro-batches, each received from the stage before
    /// (or embedded, on stage 0) and sent on as soon as it is done, so the
    /// stages work on different micro-batches at once. The last stage keeps
    /// the final hidden states and, after the last micro-batch, sends the
    /// rows whose logits are wanted to rank 0, which owns the output head.
    /// Sends go one way along the pipe during the step, so blocking sends
    /// cannot deadlock. Returns the logits on rank 0 (a placeholder elsewhere).
    pub(super) fn forward_pipelined(
        &self,
        backend: &B,
        batch: &ForwardBatch,
        kv: &mut [B::KvCache],
        place: &Placement,
    ) -> Result<B::Tensor> {
        let dim = self.config.hidden_size;
        let (job, stage) = (&place.job, &place.pipeline);
        let (world, me, tp) = (&*job.world, job.world.rank(), job.shape.tp);
        let keeps_final = stage.is_last() && job.stage.rank() == 0;
        let mut finals = vec![0.0; if keeps_final { batch.rows() * dim } else { 0 }];
        let parts = job.shape.micro_batches.clamp(1, batch.rows());
        for i in 0..parts {
            let rows = batch.rows() * i / parts..batch.rows() * (i + 1) / parts;
            let part = batch.part(rows.clone());
            let shape = self.check_batch(&part, kv)?;
            let mut buffers = StepBuffers::upload(backend, &self.config, &part)?;
            let len = rows.len() * dim;
            // An EAGLE head never loads split: embedding leaves nothing pending.
            if stage.is_first() {
                self.embed_into(backend, &mut buffers, rows.len())?;
            } else {
                let mut hidden = vec![0.0; len];
                world.recv(&mut hidden, me - tp)?;
                buffers.residual = backend.upload(&hidden)?;
            }
            let extra = AttentionExtra::None;
            let pending = self.layers_into(backend, &mut buffers, shape, kv, false, extra)?;
            let mut hidden = backend.download(&buffers.residual, len)?;
            if pending {
                let delta = backend.download(&buffers.delta, len)?;
                hidden.iter_mut().zip(delta).for_each(|(h, d)| *h += d);
            }
            if !stage.is_last() {
                world.send(&hidden, me + tp)?;
            } else if keeps_final {
                finals[rows.start * dim..rows.end * dim].copy_from_slice(&hidden);
            }
        }
        let n = batch.logit_rows.len();
        if keeps_final && n > 0 {
            let wanted: Vec<f32> = batch
                .logit_rows
                .iter()
                .flat_map(|&r| finals[r as usize * dim..][..dim].iter().copied())
                .collect();
            world.send(&wanted, 0)?;
        }
        if !place.is_leader() {
            return backend.alloc(1);
        }
        let mut hidden = vec![0.0; n * dim];
        if n > 0 {
            world.recv(&mut hidden, job.world_rank(stage.stages - 1, 0))?;
        }
        self.head_of(backend, &hidden, n)
    }
}
