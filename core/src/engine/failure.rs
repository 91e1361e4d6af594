//! What a failed step leaves behind. A step mutates the engine before the
//! device runs it (drafts appended, KV slots reserved, blocks copied on
//! write) and the device may fail anywhere in it (a kernel, a lost device,
//! a refused allocation, the readback). The sequences the step touched are
//! then in an unknown state, so they are removed: their KV blocks go back
//! to the pool, drafts and all. Nothing else is touched: only the step's
//! own slots were written, and its blocks become computed (enter the prefix
//! cache) only in `finish_step`, after the device's results arrived, so no
//! block another request could reuse holds what a failed step wrote.

use super::api::StepError;
use super::{Engine, PendingStep};
use crate::backend::Backend;
use crate::kv::SeqId;
use crate::sched::{Schedule, SeqStatus};
use crate::Error;

impl<B: Backend> Engine<B> {
    /// Ends a step whose readback failed (`error`), as [`Engine::finish_step`]
    /// would have ended it had the device's results been wrong: its
    /// sequences are removed and reported in the returned [`StepError`].
    pub fn fail_step(&mut self, pending: PendingStep<B>, error: Error) -> StepError {
        let involved = self.step_sequences(pending.schedule());
        self.fail_sequences(&involved, error)
    }

    /// The sequences a failure of the step planned as `schedule` ends: its
    /// chunks' sequences and their samples still to be forked (or forked in
    /// this very step).
    pub(super) fn step_sequences(&self, schedule: &Schedule) -> Vec<SeqId> {
        let mut ids = Vec::with_capacity(schedule.chunks.len());
        for c in &schedule.chunks {
            ids.push(c.seq);
            if let Some(s) = self.scheduler.get(c.seq) {
                ids.extend(s.data.forks.iter().map(|&(child, _)| child));
            }
        }
        ids
    }

    /// Removes `seqs` (and the samples waiting for their prompt) after
    /// `error`, freeing their KV blocks, and reports them. Ids the engine no
    /// longer knows are skipped.
    pub(super) fn fail_sequences(&mut self, seqs: &[SeqId], error: Error) -> StepError {
        let mut failed = Vec::with_capacity(seqs.len());
        for &id in seqs {
            if let Some(parent) = self.awaiting_fork.remove(&id) {
                if let Some(p) = self.scheduler.get_mut(parent) {
                    p.data.forks.retain(|&(child, _)| child != id);
                }
                failed.push(id);
                continue;
            }
            let Some(s) = self.scheduler.remove(id) else {
                continue;
            };
            self.kv_manager.free(id);
            if let Some(spec) = &mut self.speculation {
                spec.proposer.forget(id);
            }
            failed.push(id);
            for (child, _) in s.data.forks {
                if self.awaiting_fork.remove(&child).is_some() {
                    failed.push(child);
                }
            }
        }
        failed.sort_unstable();
        failed.dedup();
        StepError { failed, error }
    }

    /// Ends a sequence whose constraint failed in an earlier step (its mask
    /// or its advance by a token): it took no token since, and now ends with
    /// the constraint's error, alone, before anything else of the step runs.
    /// One per call; the next step ends the next one.
    pub(super) fn end_failed_constraints(&mut self) -> Result<(), StepError> {
        let failed = self.scheduler.sequences().find_map(|(id, s)| {
            let c = s.data.constraint.as_ref()?;
            let message = c.failure()?;
            (s.status() != SeqStatus::Finished).then(|| (id, message.to_string()))
        });
        match failed {
            Some((id, message)) => Err(self.fail_sequences(&[id], Error::Constraint(message))),
            None => Ok(()),
        }
    }

    /// Removes every sequence still generating, after an `error` that left
    /// the scheduler's plan unknown (a failure while planning the step).
    /// Finished sequences keep their blocks: planning never touches them.
    pub(super) fn fail_unfinished(&mut self, error: Error) -> StepError {
        let unfinished: Vec<SeqId> = self
            .scheduler
            .sequences()
            .filter(|(_, s)| s.status() != SeqStatus::Finished)
            .map(|(id, _)| id)
            .chain(self.awaiting_fork.keys().copied())
            .collect();
        self.fail_sequences(&unfinished, error)
    }
}
