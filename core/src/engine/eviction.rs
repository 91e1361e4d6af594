//! KV eviction in the engine (`crate::kv::eviction`): each sequence follows
//! its request's plan or the engine's. A step whose rows feed a policy's
//! scores (every row for H2O; the prompt's last window for SnapKV) runs its
//! forward pass with the attention-score variant and reads the scores back;
//! other steps, and engines without eviction, run exactly as before. When a
//! step is done every sequence in it is cut back to its budget (SnapKV only
//! once its prompt is computed).
//!
//! A sequence under a budget may grow past the KV pool, up to the context
//! limit, when the pool holds its budget plus one step's chunk.

use super::Engine;
use crate::backend::Backend;
use crate::kv::{EvictionConfig, EvictionPlan, EvictionPolicy, SeqId};
use crate::model::forward::{AttentionExtra, ForwardBatch};
use crate::sched::Schedule;
use crate::Result;

/// The rows of one sequence in a step's batch, and the plan that scores them.
pub(super) struct ScoredRows {
    pub seq: SeqId,
    pub first_row: usize,
    pub len: usize,
    pub plan: EvictionPlan,
    /// Leading tokens of the sequence that are its prompt (SnapKV's window ends there).
    pub prompt_len: usize,
}

impl ScoredRows {
    /// The batch rows whose attention feeds the sequence's scores.
    pub(super) fn scored<'a>(
        &'a self,
        batch: &'a ForwardBatch,
    ) -> impl Iterator<Item = usize> + 'a {
        (self.first_row..self.first_row + self.len).filter(|&row| {
            self.plan
                .scores_query(batch.positions[row] as usize, self.prompt_len)
        })
    }
}

impl<B: Backend> Engine<B> {
    /// `config` (or, without one, the engine's) resolved for this engine.
    pub(super) fn eviction_plan(
        &self,
        config: Option<EvictionConfig>,
    ) -> Result<Option<EvictionPlan>> {
        match config {
            Some(c) => Ok(Some(c.plan(self.max_context, self.config.block_size)?)),
            None => Ok(self.eviction),
        }
    }

    /// Tokens one sequence under `plan` may reach: the whole pool without
    /// eviction, the context limit when the pool holds its budget and a
    /// step's chunk.
    pub(super) fn capacity_for(&self, plan: Option<&EvictionPlan>) -> usize {
        let bs = self.kv_manager.block_size();
        let pool = self.kv_manager.num_blocks();
        match plan {
            Some(plan)
                if pool >= plan.budget_blocks + self.config.max_batch_tokens.div_ceil(bs) + 2 =>
            {
                usize::MAX
            }
            _ => pool * bs,
        }
    }

    /// The plan of `seq` and its prompt's length, if it has a plan.
    pub(super) fn plan_of(&self, seq: SeqId) -> Option<(EvictionPlan, usize)> {
        let s = self.scheduler.get(seq)?;
        let prompt_len = s.accepted_tokens().len() - s.data.n_generated;
        s.data.eviction.map(|plan| (plan, prompt_len))
    }

    /// The forward pass of `batch`, with the attention-score variant when
    /// a row of `rows` feeds its sequence's scores; those are read back and
    /// added to the sequences' block tables. Returns the logits, and with
    /// `hidden` every row's final hidden state.
    pub(super) fn forward_scoring(
        &mut self,
        batch: &ForwardBatch,
        rows: &[ScoredRows],
        hidden: bool,
    ) -> Result<(B::Tensor, Option<B::Tensor>)> {
        let (model, backend) = (&self.model, &self.backend);
        let forward = |kv: &mut [B::KvCache], extra| match hidden {
            true => model
                .forward_hidden(backend, batch, kv, extra)
                .map(|(logits, h)| (logits, Some(h))),
            false => Ok((model.forward_with(backend, batch, kv, extra)?, None)),
        };
        if !rows.iter().any(|r| r.scored(batch).next().is_some()) {
            return forward(&mut self.kv, AttentionExtra::None);
        }
        let kv_heads = self.model.config.num_kv_heads;
        let width = batch.max_blocks_per_seq;
        let len = batch.rows() * kv_heads * width;
        let mut scores = self.backend.upload(&vec![0.0; len])?;
        let out = forward(&mut self.kv, AttentionExtra::Scores(&mut scores))?;
        let scores = self.backend.download(&scores, len)?;
        for r in rows {
            let mut mass = vec![0f32; width];
            let mut queries = 0;
            for row in r.scored(batch) {
                queries += 1;
                for head in scores[row * kv_heads * width..][..kv_heads * width].chunks(width) {
                    mass.iter_mut().zip(head).for_each(|(m, s)| *m += s);
                }
            }
            let decay = r.plan.score_decay(queries);
            self.kv_manager.add_block_scores(r.seq, &mass, decay)?;
        }
        Ok(out)
    }

    /// Cuts every sequence of `schedule` back to its budget.
    pub(super) fn evict_after(&mut self, schedule: &Schedule) -> Result<()> {
        for c in &schedule.chunks {
            let Some((plan, prompt_len)) = self.plan_of(c.seq) else {
                continue;
            };
            let computed = self.scheduler.get(c.seq).map_or(0, |s| s.num_computed());
            if self.kv_manager.table(c.seq).is_some() {
                self.evict_computed(c.seq, &plan, computed, prompt_len)?;
            }
        }
        Ok(())
    }

    /// Cuts `seq`, with `computed` tokens computed, back to `plan`'s budget
    /// (SnapKV: once its prompt is computed).
    pub(super) fn evict_computed(
        &mut self,
        seq: SeqId,
        plan: &EvictionPlan,
        computed: usize,
        prompt_len: usize,
    ) -> Result<()> {
        if plan.policy == EvictionPolicy::SnapKv && computed < prompt_len {
            return Ok(());
        }
        self.kv_manager.evict_over_budget(seq, plan)?;
        Ok(())
    }
}
