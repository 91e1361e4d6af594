//! An EAGLE head as a proposer (Li et al. 2024): a one-layer draft whose
//! row at position `p` reads the token there and the target's final hidden
//! state at `p - 1`, so it drafts from the features the target already
//! computed instead of recomputing the context.
//!
//! The engine hands over the hidden states of every row whose token is
//! accepted ([`Proposer::observe_hidden`]); they wait here until the next
//! call feeds them. Drafting then runs one pass over each sequence's new
//! accepted tokens (the catch-up: the draft's KV of those positions made
//! from the target's hidden states), whose last row gives the first draft,
//! and one pass per further draft, each row reading the head's own hidden
//! state of the row before in place of the target's. Those drafted rows
//! are dropped from the draft's cache afterwards: once the target accepts
//! them, they are fed again from its own hidden states.
//!
//! Position 0 of a sequence has no row before it and reads zeros, as in
//! training. Where the target's hidden states do not reach back to the
//! draft's last fed row (a prefix-cache hit, a long pause), the draft
//! restarts its view of the sequence at the first position it has them for.

use std::collections::HashMap;

use super::draft::{DraftPass, DraftSequence, Work};
use super::{Draft, DraftModelConfig, DraftRequest, Proposer, Target};
use crate::backend::Backend;
use crate::kv::{KvCacheManager, SeqId};
use crate::model::forward::Model;
use crate::model::ModelFiles;
use crate::sched::SamplingParams;
use crate::{Error, Result};

/// Keeps the head's sampling stream apart from the target's.
const EAGLE_SEED_SALT: u64 = 0xea61_e5a1;
/// Most positions of target hidden states kept per sequence (fewer when a
/// draft pass takes fewer rows): after a long pause, or of a long prompt,
/// the head's view starts this far back. The target's hidden states carry
/// the context already, so a short view costs the head little, and a probe
/// after drafting paused (adaptive k) feeds at most this many rows.
const HIDDEN_WINDOW: usize = 64;

/// The target's hidden states of one sequence at positions `start..`, not
/// yet fed to the head.
#[derive(Default)]
struct HiddenRun {
    start: usize,
    values: Vec<f32>,
}

impl HiddenRun {
    fn end(&self, dim: usize) -> usize {
        self.start + self.values.len() / dim
    }

    /// Adds positions `start..`, replacing any from `start` on; a gap
    /// before `start` starts the run over. Keeps the last `window`.
    fn extend(&mut self, start: usize, rows: &[f32], dim: usize, window: usize) {
        if self.values.is_empty() || start < self.start || start > self.end(dim) {
            self.start = start;
            self.values.clear();
        } else {
            self.values.truncate((start - self.start) * dim);
        }
        self.values.extend_from_slice(rows);
        self.keep_from(self.end(dim).saturating_sub(window), dim);
    }

    /// Drops the positions before `position`.
    fn keep_from(&mut self, position: usize, dim: usize) {
        if position > self.start {
            let n = (position - self.start).min(self.values.len() / dim);
            self.values.drain(..n * dim);
            self.start += n;
        }
    }

    fn row(&self, position: usize, dim: usize) -> &[f32] {
        &self.values[(position - self.start) * dim..][..dim]
    }
}

/// See the module documentation.
pub struct EagleDraft<B: Backend> {
    label: String,
    model: Model<B>,
    kv: Vec<B::KvCache>,
    manager: KvCacheManager,
    /// Each sequence's view: its `computed` tokens are those fed with the
    /// target's hidden states.
    sequences: HashMap<SeqId, DraftSequence>,
    hidden: HashMap<SeqId, HiddenRun>,
    config: DraftModelConfig,
}

impl<B: Backend> EagleDraft<B> {
    /// Loads the EAGLE head `files` for a target of `target_hidden` wide
    /// hidden states.
    pub fn load(
        backend: &B,
        files: &ModelFiles,
        target_hidden: usize,
        config: DraftModelConfig,
    ) -> Result<Self> {
        let c = &files.config;
        if !c.reads_hidden {
            return Err(Error::InvalidRequest(format!(
                "{} is not an EAGLE head (its config.json has no tandem_reads_hidden)",
                files.path.display()
            )));
        }
        if c.hidden_size != target_hidden {
            return Err(Error::InvalidRequest(format!(
                "the EAGLE head {} reads hidden states of {} values, its target's have {target_hidden}",
                files.path.display(),
                c.hidden_size
            )));
        }
        if config.cascade.is_some() {
            return Err(Error::Unsupported(
                "an n-gram cascade inside an EAGLE head (each drafted row reads the one before)"
                    .into(),
            ));
        }
        config.check()?;
        let model = Model::load(backend, files, &mut |_, _| {})?;
        let num_blocks = config.capacity_tokens.div_ceil(config.block_size);
        let kv = model.alloc_kv_caches(backend, num_blocks, config.block_size, config.kv_dtype)?;
        let vocab = match &c.output_tokens {
            Some(tokens) => format!(", {} of {} tokens", tokens.len(), c.vocab_size),
            None => String::new(),
        };
        Ok(Self {
            label: format!(
                "EAGLE head {} ({} layers{vocab})",
                files.path.display(),
                c.num_layers
            ),
            model,
            kv,
            manager: KvCacheManager::new(num_blocks, config.block_size),
            sequences: HashMap::new(),
            hidden: HashMap::new(),
            config,
        })
    }

    fn dim(&self) -> usize {
        self.model.config.hidden_size
    }

    /// The head's logits after every position of `tokens` (`[tokens,
    /// vocab]`, the tokens a reduced head never predicts at -inf), each row
    /// reading the target's hidden state of the row before (`hidden`,
    /// `[tokens, hidden]`, as [`Engine::score_hidden`](crate::engine::Engine::score_hidden)
    /// gives them): its first drafts, teacher forced.
    pub fn score(&mut self, backend: &B, tokens: &[u32], hidden: &[f32]) -> Result<Vec<f32>> {
        let dim = self.dim();
        if hidden.len() != tokens.len() * dim {
            return Err(Error::InvalidRequest(format!(
                "{} hidden values for {} tokens of {dim}",
                hidden.len(),
                tokens.len()
            )));
        }
        let mut input = vec![0.0; dim];
        input.extend_from_slice(&hidden[..hidden.len().saturating_sub(dim)]);
        let chunk = self.config.max_batch_tokens;
        let mut out = Vec::new();
        self.pass()
            .score_chunks(backend, tokens, chunk, &input, &mut |l| out.extend(l))?;
        Ok(out)
    }

    fn pass(&mut self) -> DraftPass<'_, B> {
        DraftPass {
            model: &self.model,
            kv: &mut self.kv,
            manager: &mut self.manager,
        }
    }

    /// The rows `seq` must feed before drafting after `context` (its
    /// newest token last), as the first pass of work `work`. `None` when
    /// the target's hidden state of the position before the newest token
    /// has not come.
    fn catch_up(
        &mut self,
        work: usize,
        seq: SeqId,
        context: &[u32],
        params: &SamplingParams,
    ) -> Result<Option<Fed>> {
        let dim = self.dim();
        let newest = context.len() - 1;
        let run = self.hidden.entry(seq).or_default();
        if newest > 0 && (run.values.is_empty() || run.end(dim) < newest) {
            return Ok(None);
        }
        let (sequences, manager) = (&mut self.sequences, &mut self.manager);
        let s = DraftSequence::entry(sequences, manager, seq, params, EAGLE_SEED_SALT)?;
        let view = context.get(s.offset..).unwrap_or_default();
        let mut common = s.common_prefix(context);
        let first = s.offset + common;
        // The first row reads the hidden state before it (zeros at 0).
        if view.is_empty() || (newest > 0 && run.start + 1 > first.max(1)) {
            if run.start >= newest {
                return Ok(None);
            }
            s.offset = run.start + 1;
            common = 0;
        }
        s.computed.truncate(common);
        self.manager.truncate(seq, common)?;
        let first = s.offset + common;
        let mut input = Vec::with_capacity((newest + 1 - first) * dim);
        for p in first..=newest {
            match p {
                0 => input.resize(dim, 0.0),
                _ => input.extend_from_slice(run.row(p - 1, dim)),
            }
        }
        // The next call's first row reads the newest token's hidden state.
        run.keep_from(newest, dim);
        Ok(Some(Fed {
            work,
            position: first,
            tokens: context[first..].to_vec(),
            hidden: input,
        }))
    }

    /// One pass of the head over `rows` (sequence, first position, tokens,
    /// input hidden states), each chunk's last row sampled: extends each
    /// work's drafts and its hidden state.
    fn draft_pass(&mut self, backend: &B, work: &mut [Work], rows: Vec<Fed>) -> Result<()> {
        let dim = self.dim();
        let vocab = self.model.config.vocab_size;
        let mut chunks = Vec::with_capacity(rows.len());
        let mut logit_rows = Vec::with_capacity(rows.len());
        let mut input = Vec::new();
        let mut row = 0;
        for fed in &rows {
            let offset = self.sequences[&work[fed.work].seq].offset;
            chunks.push((
                work[fed.work].seq,
                fed.position - offset,
                fed.tokens.as_slice(),
            ));
            row += fed.tokens.len();
            logit_rows.push(row as u32 - 1);
            input.extend_from_slice(&fed.hidden);
        }
        let (logits, hidden) = self
            .pass()
            .run(backend, &chunks, logit_rows.clone(), input)?;
        for ((fed, logits), &last) in rows.iter().zip(logits.chunks(vocab)).zip(&logit_rows) {
            let w = &mut work[fed.work];
            let s = self.sequences.get_mut(&w.seq).expect("caught up");
            let dist = s.sampler.distribution(&mut logits.to_vec(), &w.history);
            let token = s.sampler.draw(&dist);
            w.drafts.push(token);
            w.dists.push(dist);
            w.history.push(token);
            w.hidden = hidden[last as usize * dim..][..dim].to_vec();
        }
        Ok(())
    }

    fn drafts(&mut self, backend: &B, requests: &[DraftRequest<'_>]) -> Result<Vec<Work>> {
        let mut work = Vec::new();
        let mut first_pass = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let capacity = self.manager.num_blocks() * self.manager.block_size();
            if r.k == 0
                || r.context.is_empty()
                || r.context.len() + r.k > capacity.min(self.model.config.max_context)
            {
                continue;
            }
            let Some(fed) = self.catch_up(work.len(), r.seq, r.context, r.params)? else {
                continue;
            };
            first_pass.push(fed);
            work.push(Work::new(i, r.seq, r.k, r.context.to_vec()));
        }
        if work.is_empty() {
            return Ok(work);
        }
        for fed in &first_pass {
            let s = self
                .sequences
                .get_mut(&work[fed.work].seq)
                .expect("caught up");
            s.computed.extend_from_slice(&fed.tokens);
        }
        self.draft_pass(backend, &mut work, first_pass)?;
        loop {
            let next: Vec<Fed> = (work.iter().enumerate())
                .filter(|(_, w)| w.drafts.len() < w.k)
                .map(|(i, w)| Fed {
                    work: i,
                    position: w.history.len() - 1,
                    tokens: vec![*w.history.last().expect("drafted")],
                    hidden: w.hidden.clone(),
                })
                .collect();
            if next.is_empty() {
                break;
            }
            self.draft_pass(backend, &mut work, next)?;
        }
        // Drafted rows read the head's own hidden states: never kept.
        for w in &work {
            let kept = self.sequences[&w.seq].computed.len();
            self.manager.truncate(w.seq, kept)?;
        }
        Ok(work)
    }
}

/// Rows fed for one work in one pass.
struct Fed {
    work: usize,
    /// The sequence's position of the first row.
    position: usize,
    tokens: Vec<u32>,
    /// `[tokens, hidden]`: what each row reads.
    hidden: Vec<f32>,
}

impl<B: Backend> Proposer<B> for EagleDraft<B> {
    fn describe(&self) -> String {
        self.label.clone()
    }

    fn propose(
        &mut self,
        backend: &B,
        _target: Target<'_, B>,
        requests: &[DraftRequest<'_>],
    ) -> Result<Vec<Draft>> {
        let work = match self.drafts(backend, requests) {
            Ok(work) => work,
            // A full pool drops every sequence's cache; the next calls start over.
            Err(Error::KvCacheFull(_)) => {
                let seqs: Vec<SeqId> = self.sequences.keys().copied().collect();
                for seq in seqs {
                    self.sequences.remove(&seq);
                    self.manager.free(seq);
                }
                return Ok(requests.iter().map(|_| Draft::default()).collect());
            }
            Err(e) => return Err(e),
        };
        Ok(Work::into_drafts(work, requests))
    }

    fn reads_target_hidden(&self) -> bool {
        true
    }

    fn observe_hidden(&mut self, seq: SeqId, start: usize, hidden: &[f32]) {
        let dim = self.dim();
        // The catch-up of a sequence then fits one pass.
        let window = HIDDEN_WINDOW.min(self.config.max_batch_tokens);
        self.hidden
            .entry(seq)
            .or_default()
            .extend(start, hidden, dim, window);
    }

    fn forget(&mut self, seq: SeqId) {
        self.sequences.remove(&seq);
        self.hidden.remove(&seq);
        self.manager.free(seq);
    }

    fn measure_cost(&mut self, backend: &B) -> Result<Option<f64>> {
        // One-row passes; the first one warms up.
        let zeros = vec![0.0; self.dim()];
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let clock = super::Stopwatch::start();
            self.score(backend, &[0], &zeros)?;
            best = best.min(clock.seconds());
        }
        Ok(Some(best))
    }
}

#[cfg(test)]
mod tests {
    use super::HiddenRun;

    /// Rows of width 2 whose values are their positions.
    fn rows(positions: std::ops::Range<usize>) -> Vec<f32> {
        positions.flat_map(|p| [p as f32, p as f32]).collect()
    }

    fn positions(run: &HiddenRun) -> Vec<usize> {
        run.values.chunks(2).map(|r| r[0] as usize).collect()
    }

    #[test]
    fn hidden_runs_append_replace_restart_and_keep_a_window() {
        let mut run = HiddenRun::default();
        run.extend(3, &rows(3..7), 2, 10);
        run.extend(7, &rows(7..9), 2, 10);
        assert_eq!((run.start, run.end(2)), (3, 9));
        // A recomputed stretch (preemption) replaces what it covers and after.
        run.extend(5, &rows(5..6), 2, 10);
        assert_eq!(positions(&run), [3, 4, 5]);
        // A gap starts over.
        run.extend(9, &rows(9..11), 2, 10);
        assert_eq!(positions(&run), [9, 10]);
        assert_eq!(run.row(10, 2), [10.0, 10.0]);
        // Only the last `window` positions stay.
        run.extend(11, &rows(11..20), 2, 4);
        assert_eq!(positions(&run), [16, 17, 18, 19]);
        run.keep_from(18, 2);
        assert_eq!(positions(&run), [18, 19]);
        run.keep_from(30, 2);
        assert_eq!((run.start, run.end(2)), (20, 20));
    }
}
