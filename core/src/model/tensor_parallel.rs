//! A tensor-parallel [`Model`]: rank 0 announces what it does with the
//! model, the other ranks follow (`crate::parallel::link`).

use super::forward::Model;
use crate::backend::Backend;
use crate::parallel::{receive, Command, TensorParallelPlan};
use crate::{Error, Result};

impl<B: Backend> Model<B> {
    /// This rank's share, when the model is split over several ranks.
    pub fn tensor_parallel_plan(&self) -> Option<&TensorParallelPlan> {
        self.tp.as_ref().map(|tp| &tp.plan)
    }

    /// Rank 0 sends the other ranks what it is about to do.
    pub(super) fn announce(&self, command: Command) -> Result<()> {
        match &self.tp {
            Some(tp) => tp.announce(&command),
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
        let Some(tp) = &self.tp else {
            return Ok(());
        };
        let mut kv = Vec::new();
        loop {
            match receive(&*tp.comm)? {
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
}
