//! Speculation: turned on with a proposer and a draft-length controller
//! started from this device's measured step costs; inside a step, drafts
//! proposed before the step is scheduled (provisional tokens), dropped when
//! their sequence is left out of it, and verified against the step's
//! logits in `finish_step`.

use std::collections::HashSet;

use super::api::{StepError, TokenEvent};
use super::step::Pick;
use super::{Engine, Speculation};
use crate::backend::Backend;
use crate::kv::SeqId;
use crate::sched::Schedule;
use crate::spec::{
    verify::try_verify, Draft, DraftLength, DraftLengthController, DraftRequest, Proposer,
    SpeculationStats, Stopwatch, Target,
};
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Turns on speculative decoding with `proposer` for every sequence
    /// (greedy or sampled; sequences that ask for logprobs decode plainly).
    pub fn set_speculation(
        &mut self,
        proposer: Box<dyn Proposer<B>>,
        length: DraftLength,
    ) -> Result<()> {
        if matches!(
            length,
            DraftLength::Fixed(0) | DraftLength::Adaptive { max: 0 }
        ) {
            return Err(Error::InvalidRequest(
                "the draft length must be at least 1".into(),
            ));
        }
        let mut proposer = proposer;
        if proposer.reads_target_hidden() && self.model.placement().is_some() {
            return Err(Error::Unsupported(
                "an EAGLE head on a split model (it reads the target's hidden states)".into(),
            ));
        }
        if proposer.drafts_with_target() {
            if self.model.placement().is_some() {
                return Err(Error::Unsupported(
                    "sparse speculation on a split model".into(),
                ));
            }
            // Key bounds cover the blocks written from now on: no block
            // holding K/V may be read again, neither a sequence's nor a
            // cached prefix.
            if self.scheduler.sequences().next().is_some() {
                return Err(Error::InvalidRequest(
                    "sparse speculation must be set before the engine takes requests".into(),
                ));
            }
            self.kv_manager.clear_prefix_cache();
            for cache in &mut self.kv {
                self.backend.track_key_bounds(cache)?;
            }
            self.key_bounds = true;
        }
        let mut control = DraftLengthController::new(length);
        if let DraftLength::Adaptive { max } = length {
            let decode_step = self.measure_step_costs(&mut control, max)?;
            let draft_cost = match proposer.drafts_with_target() {
                true => Some(decode_step),
                false => proposer.measure_cost(&self.backend)?,
            };
            if let Some(secs) = draft_cost {
                control.observe_drafting(1, secs);
            }
        }
        self.speculation = Some(Speculation {
            proposer,
            control,
            stats: SpeculationStats::default(),
            enabled: true,
        });
        Ok(())
    }

    /// Times forward passes of 1 and `max + 1` rows so the draft-length
    /// controller starts from this device's costs instead of exploring, and
    /// returns the one-row pass's seconds.
    fn measure_step_costs(
        &mut self,
        control: &mut DraftLengthController,
        max: usize,
    ) -> Result<f64> {
        let rows = (max + 1).min(self.max_context.saturating_sub(1)).max(1);
        let tokens = vec![0; rows];
        let mut one_row = 0.0;
        for n in [1, rows] {
            // The first pass warms up; the best of the other two counts.
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let clock = Stopwatch::start();
                self.score(&tokens[..n], n - 1)?;
                best = best.min(clock.seconds());
            }
            control.observe_step(n, best);
            if n == 1 {
                one_row = best;
            }
        }
        Ok(one_row)
    }

    /// Pauses or resumes speculation set by [`Engine::set_speculation`].
    pub fn enable_speculation(&mut self, on: bool) {
        if let Some(spec) = &mut self.speculation {
            spec.enabled = on;
        }
    }

    /// What drafts, e.g. "n-gram"; `None` without speculation.
    pub fn speculation(&self) -> Option<String> {
        self.speculation.as_ref().map(|s| s.proposer.describe())
    }

    /// Asks the proposer for drafts for every decoding sequence, as many as
    /// the controller chooses, and appends them as provisional tokens. If
    /// drafting fails, the sequences it drafted for end.
    pub(super) fn propose_drafts(&mut self) -> Result<(), StepError> {
        let wanted = self.draft_lengths();
        if wanted.is_empty() {
            return Ok(());
        }
        let drafted: Vec<SeqId> = wanted.iter().map(|&(seq, _)| seq).collect();
        self.push_drafts(wanted)
            .map_err(|e| self.fail_sequences(&drafted, e))
    }

    /// How many tokens to draft for each decoding sequence that gets drafts.
    fn draft_lengths(&mut self) -> Vec<(SeqId, usize)> {
        if !self.speculation.as_ref().is_some_and(|s| s.enabled) {
            return Vec::new();
        }
        // The longest each may grow (past the pool under a KV budget).
        let candidates: Vec<(SeqId, usize)> = self
            .scheduler
            .sequences()
            .filter(|(_, s)| {
                s.is_decoding() && s.data.logprobs.is_none() && s.data.forks.is_empty()
            })
            .map(|(id, s)| {
                let capacity = self.capacity_for(s.data.eviction.as_ref());
                (id, self.max_context.min(capacity))
            })
            .collect();
        let spec = self.speculation.as_mut().expect("checked above");
        let mut wanted = Vec::new();
        for &(id, max_len) in &candidates {
            let s = self.scheduler.get_mut(id).expect("listed above");
            let g = &mut s.data;
            // After k accepted drafts and one more token the sequence must still fit.
            let limit = (g.max_new_tokens.saturating_sub(g.n_generated + 1))
                .min(max_len.saturating_sub(s.tokens.len() + 1));
            let k = spec
                .control
                .choose(&mut g.acceptance, candidates.len(), limit);
            if k > 0 {
                wanted.push((id, k));
            }
        }
        wanted
    }

    /// Drafts `k` tokens for each `(sequence, k)` of `wanted` and appends them.
    fn push_drafts(&mut self, wanted: Vec<(SeqId, usize)>) -> Result<()> {
        let spec = self.speculation.as_mut().expect("drafting speculates");
        let requests: Vec<DraftRequest<'_>> = wanted
            .iter()
            .map(|&(seq, k)| {
                let s = self.scheduler.get(seq).expect("listed above");
                DraftRequest {
                    seq,
                    context: &s.tokens,
                    k,
                    params: s.data.sampler.params(),
                }
            })
            .collect();
        let clock = Stopwatch::start();
        let target = Target {
            model: &self.model,
            kv: &mut self.kv,
            kv_manager: &mut self.kv_manager,
        };
        let drafts = spec.proposer.propose(&self.backend, target, &requests)?;
        let secs = clock.seconds();
        let vocab = self.model.config.vocab_size;
        let mut proposed = 0;
        for ((seq, k), mut draft) in wanted.into_iter().zip(drafts) {
            // A draft model with a larger vocabulary must not reach the embedding.
            let valid = draft
                .tokens
                .iter()
                .take(k)
                .take_while(|&&t| (t as usize) < vocab)
                .count();
            draft.tokens.truncate(valid);
            if let Some(d) = &mut draft.dists {
                d.truncate(valid);
            }
            if draft.tokens.is_empty() {
                continue;
            }
            proposed += valid;
            self.scheduler.push_drafts(seq, &draft.tokens)?;
            self.scheduler
                .get_mut(seq)
                .expect("listed above")
                .data
                .drafts = Some(draft);
        }
        spec.control.observe_drafting(proposed, secs);
        spec.stats.draft_seconds += secs;
        Ok(())
    }

    /// Drafts of sequences the scheduler preempted (it dropped their tokens)
    /// or left out of this step are forgotten.
    pub(super) fn drop_unscheduled_drafts(&mut self, schedule: &Schedule) -> Result<()> {
        if self.speculation.is_none() {
            return Ok(());
        }
        let scheduled: HashSet<SeqId> = schedule.chunks.iter().map(|c| c.seq).collect();
        let drafted: Vec<SeqId> = self
            .scheduler
            .sequences()
            .filter(|(_, s)| s.data.drafts.is_some())
            .map(|(id, _)| id)
            .collect();
        for id in drafted {
            if !scheduled.contains(&id) {
                self.scheduler
                    .get_mut(id)
                    .expect("listed above")
                    .data
                    .drafts = None;
                if self.scheduler.get(id).is_some_and(|s| s.num_drafts() > 0) {
                    self.scheduler.settle_drafts(id, 0, &mut self.kv_manager)?;
                }
            }
        }
        Ok(())
    }

    /// Verifies the drafts of `seq` against its logits rows `picks` (one per
    /// covered draft, plus one), keeps the accepted ones and appends the
    /// verifier's next token, stopping early at a stop condition.
    ///
    /// A constrained sequence's target at draft position i is masked by its
    /// grammar after the drafts before it: the constraint advances through
    /// the drafts tentatively, then is settled to the emitted tokens. When
    /// the constraint fails, the drafts are dropped and the sequence takes
    /// no token (it ends at the next step).
    pub(super) fn finish_speculative(
        &mut self,
        seq: SeqId,
        draft: Draft,
        picks: &[Pick<'_>],
        events: &mut Vec<TokenEvent>,
    ) -> Result<()> {
        let plan = self.scheduler.get(seq).and_then(|s| s.data.eviction);
        let max_len = self.max_context.min(self.capacity_for(plan.as_ref()));
        let vocab = self.model.config.vocab_size;
        let covered = picks.len() - 1;
        let s = self.scheduler.get_mut(seq).expect("sampled");
        let mut context = s.accepted_tokens().to_vec();
        let history_len = context.len();
        let g = &mut s.data;
        let shaper = g.sampler.clone();
        let dists = draft.dists.as_deref().map(|d| &d[..covered]);
        // Drafts the constraint has advanced through, and whether the output
        // ends before position i (a stop token, or a complete grammar with no
        // stop token to follow): later positions do not matter.
        let mut reached = 0;
        let mut past_stop = false;
        let verdict = try_verify(
            &mut g.sampler,
            &draft.tokens[..covered],
            dists,
            |i, accepted| {
                let allowed = match &mut g.constraint {
                    Some(c) if !past_stop => {
                        for &t in &accepted[reached..] {
                            if g.stop_tokens.contains(&t) {
                                past_stop = true;
                                break;
                            }
                            c.advance_tentatively(t)?;
                        }
                        reached = i;
                        past_stop |= c.is_finished() && g.stop_tokens.is_empty();
                        match past_stop {
                            true => None,
                            false => Some(c.allowed(vocab, &g.stop_tokens)?),
                        }
                    }
                    _ => None,
                };
                Ok::<_, Error>(match picks[i] {
                    Pick::Logits(row) => {
                        context.truncate(history_len);
                        context.extend_from_slice(accepted);
                        shaper.distribution_allowed(&mut row.to_vec(), &context, allowed.as_ref())
                    }
                    Pick::Argmax(t) => vec![(t, 1.0)],
                })
            },
        );
        let verdict = match verdict {
            Ok(verdict) => verdict,
            Err(e) => {
                if let Some(c) = &mut g.constraint {
                    c.fail(e);
                }
                return self.scheduler.settle_drafts(seq, 0, &mut self.kv_manager);
            }
        };
        g.acceptance.observe(covered, verdict.accepted);
        // Cut the emitted tokens at the first stop condition.
        let emitted: Vec<u32> = draft.tokens[..verdict.accepted]
            .iter()
            .copied()
            .chain([verdict.next])
            .collect();
        let stop = emitted
            .iter()
            .enumerate()
            .position(|(j, t)| {
                g.stop_tokens.contains(t)
                    || g.n_generated + j + 1 >= g.max_new_tokens
                    || history_len + j + 1 >= max_len
            })
            .unwrap_or(emitted.len() - 1);
        let mut emitted = &emitted[..=stop];
        if let Some(c) = &mut g.constraint {
            // Back to the accepted tokens, then on through the emitted ones;
            // a grammar complete with no stop token to follow ends the output.
            let mut complete_at = None;
            let followed = c.settle(0).and_then(|()| {
                for (j, &t) in emitted.iter().enumerate() {
                    if g.stop_tokens.contains(&t) {
                        break;
                    }
                    c.advance(t)?;
                    if c.is_finished() && g.stop_tokens.is_empty() {
                        complete_at = Some(j);
                        break;
                    }
                }
                Ok(())
            });
            if let Err(e) = followed {
                c.fail(e);
            }
            if let Some(j) = complete_at {
                emitted = &emitted[..=j];
            }
        }
        let kept_drafts = emitted.len().min(verdict.accepted);
        if let Some(spec) = &mut self.speculation {
            spec.stats.verified_sequences += 1;
            spec.stats.proposed_tokens += covered as u64;
            spec.stats.accepted_tokens += verdict.accepted as u64;
            spec.stats.emitted_tokens += emitted.len() as u64;
        }
        self.scheduler
            .settle_drafts(seq, kept_drafts, &mut self.kv_manager)?;
        for (j, &token) in emitted.iter().enumerate() {
            let len_after = history_len + j + 1;
            if j >= kept_drafts {
                self.scheduler
                    .get_mut(seq)
                    .expect("sampled")
                    .tokens
                    .push(token);
            }
            events.push(self.record_token(seq, token, None, len_after));
        }
        Ok(())
    }
}
