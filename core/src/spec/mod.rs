//! Speculative decoding: a cheap proposer drafts k tokens per sequence,
//! the target scores all k+1 positions in the same batched, paged forward
//! pass as any other work, and the exact acceptance rule
//! ([`verify`]) keeps a prefix of the drafts plus one token of its own, so
//! the output is distributed exactly as the target's (greedy: identical).
//!
//! Proposers: [`NgramProposer`] (prompt lookup), [`DraftModel`] (a smaller
//! model, or the target's own first/last layers for self-speculation), the
//! cascade of both (n-gram drafts for the draft model), [`EagleDraft`] (an
//! EAGLE head drafting from the target's hidden states), and [`SparseDraft`]
//! (the target itself over a few selected KV blocks). The engine
//! drives them (`Engine::set_speculation`): drafts enter the scheduler as
//! provisional tokens, rejected ones are rolled back from the block table,
//! and [`adaptive`] picks k from the measured acceptance and step costs.

pub mod adaptive;
pub mod draft;
pub mod eagle;
pub mod ngram;
pub mod sparse;
pub mod verify;

pub use adaptive::{DraftLength, DraftLengthController, SequenceAcceptance};
pub use draft::{choose_self_draft, DraftModel, DraftModelConfig, SelfDraftCandidate};
pub use eagle::EagleDraft;
pub use ngram::NgramProposer;
pub use sparse::SparseDraft;
pub use verify::{Distribution, Verdict};

use crate::kv::{KvCacheManager, SeqId};
use crate::model::forward::Model;
use crate::sched::SamplingParams;
use crate::{Backend, Error, Result};

/// One sequence that wants drafts.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    pub seq: SeqId,
    /// The sequence's accepted tokens (prompt and generated).
    pub context: &'a [u32],
    /// Most tokens to propose.
    pub k: usize,
    /// The target's sampling parameters for the sequence.
    pub params: &'a SamplingParams,
}

/// Proposed tokens for one sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from; `None` when they were
    /// chosen deterministically (n-gram lookup, greedy drafting).
    pub dists: Option<Vec<Distribution>>,
}

/// The target's model and paged KV, lent to a proposer for one call. Only a
/// proposer that drafts with the target itself ([`SparseDraft`]) touches
/// them, and it leaves every block table as it found it.
pub struct Target<'a, B: Backend> {
    pub model: &'a Model<B>,
    pub kv: &'a mut [B::KvCache],
    pub kv_manager: &'a mut KvCacheManager,
}

/// Something that proposes draft tokens.
pub trait Proposer<B: Backend> {
    /// For logs and stats, e.g. "n-gram" or "self-draft (10 of 30 layers)".
    fn describe(&self) -> String;
    /// Drafts for each request, in order (an empty draft where it has none).
    fn propose(
        &mut self,
        backend: &B,
        target: Target<'_, B>,
        requests: &[DraftRequest<'_>],
    ) -> Result<Vec<Draft>>;
    /// Whether it drafts with the target's own forward pass (sparse
    /// attention): the target's caches must then track key bounds, and a
    /// draft token costs about one target decode step.
    fn drafts_with_target(&self) -> bool {
        false
    }
    /// Whether it drafts from the target's final hidden states (an EAGLE
    /// head): the engine then hands it every computed row's hidden state
    /// through [`Proposer::observe_hidden`].
    fn reads_target_hidden(&self) -> bool {
        false
    }
    /// The target's final hidden states of `seq` at positions `start..`
    /// (`[positions, hidden]`), rows of accepted tokens only, in the order
    /// the target computed them.
    fn observe_hidden(&mut self, _seq: SeqId, _start: usize, _hidden: &[f32]) {}
    /// Drops any state kept for `seq` (it was removed from the engine).
    fn forget(&mut self, _seq: SeqId) {}
    /// Seconds it takes to draft one token, measured once up front so the
    /// draft-length controller knows a slow draft before paying for it.
    /// `None` when drafting is (nearly) free.
    fn measure_cost(&mut self, _backend: &B) -> Result<Option<f64>> {
        Ok(None)
    }
}

impl<B: Backend> Proposer<B> for NgramProposer {
    fn describe(&self) -> String {
        "n-gram".into()
    }

    fn propose(
        &mut self,
        _backend: &B,
        _target: Target<'_, B>,
        requests: &[DraftRequest<'_>],
    ) -> Result<Vec<Draft>> {
        Ok(requests
            .iter()
            .map(|r| Draft {
                tokens: NgramProposer::propose(self, r.context, r.k),
                dists: None,
            })
            .collect())
    }
}

/// Counters of speculative decoding since the engine started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationStats {
    /// Verification steps that carried drafts, summed over sequences.
    pub verified_sequences: u64,
    pub proposed_tokens: u64,
    pub accepted_tokens: u64,
    /// Tokens emitted by those verifications (accepted drafts plus one each).
    pub emitted_tokens: u64,
    pub draft_seconds: f64,
    /// Steps that verified drafts, and their wall time (forward pass and sampling).
    pub verify_steps: u64,
    pub verify_seconds: f64,
}

impl SpeculationStats {
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted_tokens as f64 / self.proposed_tokens.max(1) as f64
    }

    /// Mean tokens a sequence gains per verification step.
    pub fn mean_accepted_length(&self) -> f64 {
        self.emitted_tokens as f64 / self.verified_sequences.max(1) as f64
    }

    /// Mean drafts proposed per verification.
    pub fn mean_draft_length(&self) -> f64 {
        self.proposed_tokens as f64 / self.verified_sequences.max(1) as f64
    }

    pub fn draft_time_share(&self) -> f64 {
        self.draft_seconds / (self.draft_seconds + self.verify_seconds).max(1e-12)
    }

    /// One line for logs and stderr.
    pub fn summary(&self) -> String {
        format!(
            "speculation: acceptance {:.1}% | mean draft {:.2} tokens | mean accepted length {:.2} tokens/step | draft time {:.1}% | {:.2} ms per draft token, {:.2} ms per verification step",
            100.0 * self.acceptance_rate(),
            self.mean_draft_length(),
            self.mean_accepted_length(),
            100.0 * self.draft_time_share(),
            1e3 * self.draft_seconds / self.proposed_tokens.max(1) as f64,
            1e3 * self.verify_seconds / self.verify_steps.max(1) as f64,
        )
    }
}

/// Measures wall time for the draft-length controller. The browser's wasm
/// has no clock in `std`; there every reading is zero and the controller
/// keeps exploring moderate draft lengths.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch {
    #[cfg(not(target_arch = "wasm32"))]
    start: std::time::Instant,
}

impl Stopwatch {
    pub fn start() -> Self {
        Self {
            #[cfg(not(target_arch = "wasm32"))]
            start: std::time::Instant::now(),
        }
    }

    pub fn seconds(&self) -> f64 {
        #[cfg(not(target_arch = "wasm32"))]
        return self.start.elapsed().as_secs_f64();
        #[cfg(target_arch = "wasm32")]
        0.0
    }
}

/// Parses a layer list such as `0-9,28,29` (for `--speculate self:LAYERS`).
pub fn parse_layers(spec: &str, num_layers: usize) -> Result<Vec<usize>> {
    let bad = |why: String| Error::InvalidRequest(format!("layer list `{spec}`: {why}"));
    let mut layers = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| bad(format!("`{s}` is not a layer number")))
        };
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            return Err(bad(format!("range {lo}-{hi} is reversed")));
        }
        if hi >= num_layers {
            return Err(bad(format!("the model has layers 0-{}", num_layers - 1)));
        }
        layers.extend(lo..=hi);
    }
    if layers.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad("layers must be increasing and distinct".into()));
    }
    if layers.len() == num_layers {
        return Err(bad("a draft with every layer is the model itself".into()));
    }
    Ok(layers)
}

/// Candidate self-drafts for `self:auto`: the model without a block of
/// middle layers (a quarter, a third, half of them), or without every other
/// layer of its middle half. Early layers build the representation and the
/// last ones map it to the head's space, so drafts that skip the middle
/// agree with the full model far more often than early exits do.
pub fn self_draft_candidates(num_layers: usize) -> Vec<Vec<usize>> {
    let l = num_layers;
    let mut out: Vec<Vec<usize>> = [4, 3, 2]
        .iter()
        .map(|&div| {
            let skip = l / div;
            let from = (l - skip) / 2;
            (0..l)
                .filter(|&i| i < from || i >= from + skip)
                .collect::<Vec<_>>()
        })
        .collect();
    out.push(
        (0..l)
            .filter(|&i| i < l / 4 || i >= 3 * l / 4 || i % 2 == 0)
            .collect(),
    );
    out.retain(|c| !c.is_empty() && c.len() < l);
    out.dedup();
    out
}

/// Estimated speedup of greedy self-speculation with a draft that agrees
/// with the target on a fraction `agreement` of teacher-forced positions
/// and costs `cost` of a target decode per token, at the best fixed k,
/// assuming verification of k+1 rows costs `1 + verify_row_cost * k`.
pub fn estimated_speedup(
    agreement: f64,
    cost: f64,
    verify_row_cost: f64,
    max_k: usize,
) -> (usize, f64) {
    (1..=max_k)
        .map(|k| {
            let time = cost * k as f64 + 1.0 + verify_row_cost * k as f64;
            (k, adaptive::expected_tokens(agreement, k) / time)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists_parse_and_refuse_nonsense() {
        assert_eq!(parse_layers("0-3,7", 8).unwrap(), vec![0, 1, 2, 3, 7]);
        for bad in ["", "3-1", "0-8", "a", "1,1", "0-7", "2,1"] {
            let e = parse_layers(bad, 8).unwrap_err().to_string();
            assert!(e.contains("layer list"), "{bad}: {e}");
        }
    }

    #[test]
    fn self_draft_candidates_keep_the_first_and_last_layers() {
        let c = self_draft_candidates(30);
        assert_eq!(c.len(), 4);
        for l in &c {
            assert_eq!((l[0], *l.last().unwrap()), (0, 29));
            assert!(l.len() < 30 && l.len() >= 15);
            assert!(l.windows(2).all(|w| w[0] < w[1]));
        }
        assert!(self_draft_candidates(1).is_empty());
    }

    #[test]
    fn speedup_estimate_prefers_long_drafts_when_cheap_and_accurate() {
        let (k, s) = estimated_speedup(0.9, 0.05, 0.05, 8);
        assert!(k >= 4 && s > 2.0);
        let (_, s) = estimated_speedup(0.1, 0.5, 0.5, 8);
        assert!(s < 1.0);
    }
}
