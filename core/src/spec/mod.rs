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
pub mod self_draft;
pub mod sparse;
pub mod verify;

pub use adaptive::{DraftLength, DraftLengthController, SequenceAcceptance};
pub use draft::{DraftModel, DraftModelConfig};
pub use eagle::EagleDraft;
pub use ngram::NgramProposer;
pub use self_draft::{
    choose_self_draft, estimated_speedup, parse_layers, self_draft_candidates, SelfDraftCandidate,
};
pub use sparse::SparseDraft;
pub use verify::{Distribution, Verdict};

use crate::kv::{KvCacheManager, SeqId};
use crate::model::forward::Model;
use crate::sched::SamplingParams;
use crate::{Backend, Result};

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
