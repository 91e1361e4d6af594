//! A compiled llguidance grammar as Tandem's token constraint: the factory
//! keeps the grammar's matcher at its start, and every sample starts from a
//! clone of it (the clones share llguidance's lexer caches).

use std::sync::Mutex;

use llguidance::Matcher;
use tandem_core::sched::{ConstraintFactory, TokenConstraint, TokenMask};
use tandem_core::{Error, Result};

/// A grammar compiled once per request.
pub struct GrammarConstraint {
    start: Mutex<Matcher>,
    what: String,
}

impl GrammarConstraint {
    pub(crate) fn new(start: Matcher, what: String) -> Self {
        Self {
            start: Mutex::new(start),
            what,
        }
    }
}

impl ConstraintFactory for GrammarConstraint {
    fn start(&self) -> Result<Box<dyn TokenConstraint>> {
        let matcher = self
            .start
            .lock()
            .map_err(|_| Error::Constraint(format!("{}: a sample failed to start", self.what)))?
            .clone();
        Ok(Box::new(GrammarState { matcher }))
    }

    fn describe(&self) -> String {
        self.what.clone()
    }
}

/// One sample's position in the grammar.
struct GrammarState {
    matcher: Matcher,
}

fn failed(e: impl std::fmt::Display) -> Error {
    Error::Constraint(e.to_string())
}

impl TokenConstraint for GrammarState {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()> {
        let allowed = self.matcher.compute_mask().map_err(failed)?;
        mask.copy_from_words(allowed.as_slice());
        Ok(())
    }

    fn advance(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(failed)
    }

    fn rollback(&mut self, n: usize) -> Result<()> {
        self.matcher.rollback(n).map_err(failed)
    }

    fn is_finished(&self) -> bool {
        // An error also stops the matcher; it surfaces at the next mask.
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}
