//! Constrained decoding: which tokens a sequence may take next.
//!
//! A [`TokenConstraint`] is one sequence's state in a grammar (a JSON
//! schema, a regex): the mask of tokens allowed next, advanced by every
//! emitted token, rolled back when speculative drafts are not kept. A
//! [`ConstraintFactory`] starts a fresh state, so a [`crate::engine::Request`]
//! stays `Clone` and each of its samples gets its own. The core names no
//! grammar library: an adapter (the `tandem-structured` crate, on
//! llguidance) implements both traits.
//!
//! [`SequenceConstraint`] is the engine's side: the rule that a finished
//! constraint allows only the stop tokens, the check that some token is
//! allowed, and the error kept for the caller when the constraint fails.

use std::fmt;
use std::sync::Arc;

use crate::{Error, Result};

/// A set of token ids: bit `t % 32` of word `t / 32` (llguidance's layout,
/// so an adapter copies its words in).
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

/// One sequence's position in a grammar.
pub trait TokenConstraint: Send {
    /// Sets in `mask` (empty, one bit per vocabulary entry) the tokens the
    /// grammar allows next, its end-of-sequence tokens included when the
    /// output may end here. Ids past the mask's length are left out.
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()>;
    /// Moves past `token`, one the last mask allowed.
    fn advance(&mut self, token: u32) -> Result<()>;
    /// Takes back the last `n` tokens advanced by.
    fn rollback(&mut self, n: usize) -> Result<()>;
    /// The grammar is complete and nothing may follow.
    fn is_finished(&self) -> bool;
}

/// Starts a [`TokenConstraint`] for each sample of a request.
pub trait ConstraintFactory: Send + Sync {
    fn start(&self) -> Result<Box<dyn TokenConstraint>>;
    /// What the constraint is, for logs and `Debug`, e.g. "JSON schema".
    fn describe(&self) -> String;
}

/// A request's constraint, shared by its samples.
pub type SharedConstraintFactory = Arc<dyn ConstraintFactory>;

impl fmt::Debug for dyn ConstraintFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConstraintFactory({})", self.describe())
    }
}

impl TokenMask {
    /// No token of a `len`-token vocabulary.
    pub fn none(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// Every token of a `len`-token vocabulary.
    pub fn all(len: usize) -> Self {
        let mut mask = Self {
            words: vec![u32::MAX; len.div_ceil(32)],
            len,
        };
        mask.clear_tail();
        mask
    }

    /// The vocabulary size the mask covers.
    pub fn vocab_size(&self) -> usize {
        self.len
    }

    /// No token is allowed.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn allows(&self, token: u32) -> bool {
        let t = token as usize;
        t < self.len && self.words[t / 32] & (1 << (t % 32)) != 0
    }

    /// Adds `token`; ids past the vocabulary are ignored.
    pub fn allow(&mut self, token: u32) {
        let t = token as usize;
        if t < self.len {
            self.words[t / 32] |= 1 << (t % 32);
        }
    }

    /// Sets the words from `words` (same layout; a vocabulary of another
    /// size is cut or padded with nothing allowed).
    pub fn copy_from_words(&mut self, words: &[u32]) {
        let n = words.len().min(self.words.len());
        self.words[..n].copy_from_slice(&words[..n]);
        self.words[n..].fill(0);
        self.clear_tail();
    }

    /// The allowed ids, in increasing order.
    pub fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len as u32).filter(|&t| self.allows(t))
    }

    /// Sets every disallowed logit to -inf.
    pub fn restrict(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if !self.allows(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Bits past `len` in the last word stay clear.
    fn clear_tail(&mut self) {
        if !self.len.is_multiple_of(32) {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u32 << (self.len % 32)) - 1;
            }
        }
    }
}

impl fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<u32> = self.tokens().take(16).collect();
        write!(f, "TokenMask({} of {}: {shown:?}", self.count(), self.len)?;
        if self.count() > shown.len() {
            write!(f, "...")?;
        }
        write!(f, ")")
    }
}

/// A sequence's constraint as the engine drives it.
pub struct SequenceConstraint {
    state: Box<dyn TokenConstraint>,
    /// Tokens advanced by beyond the accepted ones (speculative verification).
    tentative: usize,
    /// Why the constraint failed; the sequence then ends with this error.
    failure: Option<String>,
}

impl fmt::Debug for SequenceConstraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SequenceConstraint")
            .field("finished", &self.state.is_finished())
            .field("tentative", &self.tentative)
            .field("failure", &self.failure)
            .finish()
    }
}

impl SequenceConstraint {
    pub fn new(state: Box<dyn TokenConstraint>) -> Self {
        Self {
            state,
            tentative: 0,
            failure: None,
        }
    }

    /// The tokens allowed next in a `vocab`-token vocabulary: the grammar's,
    /// or once it is finished only `stop_tokens`. An empty set is an error
    /// (nothing could be sampled).
    pub fn allowed(&mut self, vocab: usize, stop_tokens: &[u32]) -> Result<TokenMask> {
        let mut mask = TokenMask::none(vocab);
        if self.state.is_finished() {
            stop_tokens.iter().for_each(|&t| mask.allow(t));
        } else {
            self.state.fill_mask(&mut mask)?;
        }
        if mask.is_empty() {
            return Err(Error::Constraint(if self.state.is_finished() {
                "the output is complete but the request has no stop token in the vocabulary".into()
            } else {
                "the grammar allows no token of the model's vocabulary here".into()
            }));
        }
        Ok(mask)
    }

    /// Moves past an emitted `token` for good.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.state.advance(token)
    }

    /// Moves past a draft `token` that may yet be taken back ([`Self::settle`]).
    pub fn advance_tentatively(&mut self, token: u32) -> Result<()> {
        self.state.advance(token)?;
        self.tentative += 1;
        Ok(())
    }

    /// Keeps the first `kept` tentative tokens and takes back the rest.
    pub fn settle(&mut self, kept: usize) -> Result<()> {
        let dropped = self.tentative.saturating_sub(kept);
        self.tentative = 0;
        self.state.rollback(dropped)
    }

    pub fn is_finished(&self) -> bool {
        self.state.is_finished()
    }

    /// Records that the constraint failed: the engine ends the sequence with it.
    pub fn fail(&mut self, error: Error) {
        self.failure.get_or_insert_with(|| match error {
            Error::Constraint(message) => message,
            other => other.to_string(),
        });
    }

    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_hold_ids_in_llguidance_words() {
        let mut m = TokenMask::none(40);
        assert!(m.is_empty());
        m.allow(0);
        m.allow(33);
        m.allow(40); // past the vocabulary: ignored
        assert_eq!(m.tokens().collect::<Vec<_>>(), vec![0, 33]);
        assert!(m.allows(33) && !m.allows(32) && !m.allows(40));
        assert_eq!(TokenMask::all(40).count(), 40);
        let mut copied = TokenMask::none(40);
        copied.copy_from_words(&[1, 2 | (1 << 31)]);
        assert_eq!(copied, m);
        let mut logits = vec![1.0f32; 40];
        m.restrict(&mut logits);
        assert_eq!(logits[0], 1.0);
        assert_eq!(logits[1], f32::NEG_INFINITY);
        assert_eq!(logits[33], 1.0);
    }

    /// Allows `seq[i]` at step i, then is finished; counts rollbacks.
    struct Fixed {
        seq: Vec<u32>,
        at: usize,
    }

    impl TokenConstraint for Fixed {
        fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()> {
            mask.allow(self.seq[self.at]);
            Ok(())
        }
        fn advance(&mut self, token: u32) -> Result<()> {
            if self.seq.get(self.at) != Some(&token) {
                return Err(Error::Constraint(format!("token {token} not allowed")));
            }
            self.at += 1;
            Ok(())
        }
        fn rollback(&mut self, n: usize) -> Result<()> {
            self.at -= n;
            Ok(())
        }
        fn is_finished(&self) -> bool {
            self.at == self.seq.len()
        }
    }

    #[test]
    fn finished_constraints_allow_only_stop_tokens_and_drafts_roll_back() {
        let mut c = SequenceConstraint::new(Box::new(Fixed {
            seq: vec![3, 4],
            at: 0,
        }));
        assert_eq!(
            c.allowed(8, &[7]).unwrap().tokens().collect::<Vec<_>>(),
            [3]
        );
        c.advance_tentatively(3).unwrap();
        c.advance_tentatively(4).unwrap();
        assert!(c.is_finished());
        assert_eq!(
            c.allowed(8, &[7]).unwrap().tokens().collect::<Vec<_>>(),
            [7]
        );
        assert!(c.allowed(8, &[]).is_err(), "nothing to sample");
        c.settle(1).unwrap();
        assert_eq!(
            c.allowed(8, &[7]).unwrap().tokens().collect::<Vec<_>>(),
            [4]
        );
        assert!(c.advance(5).is_err());
    }
}
