//! Prompt-lookup drafting: when the last few tokens of a sequence occurred
//! earlier in it, propose the tokens that followed them then. Free to run
//! and very effective on repetitive text (code, lists, quoting the prompt);
//! proposals are deterministic, so the verifier treats them as one-hot.

/// Finds n-gram continuations in a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramProposer {
    /// Longest suffix tried first.
    pub max_ngram: usize,
    /// Shortest suffix accepted as a match.
    pub min_ngram: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self {
            max_ngram: 4,
            min_ngram: 2,
        }
    }
}

impl NgramProposer {
    /// Up to `k` tokens that followed the most recent earlier occurrence of
    /// the longest matching suffix of `context` (empty when none matches).
    pub fn propose(&self, context: &[u32], k: usize) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Most recent occurrence first: recent text predicts best.
            if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                let from = start + n;
                return context[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let p = NgramProposer::default();
        let ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3];
        assert_eq!(p.propose(&ctx, 2), vec![7, 8]);
        assert_eq!(p.propose(&ctx, 10), vec![7, 8, 5, 1, 2, 3]);
    }

    #[test]
    fn nothing_without_a_match_or_budget() {
        let p = NgramProposer::default();
        assert!(p.propose(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(p.propose(&[1, 2, 1, 2], 0).is_empty());
        assert!(p.propose(&[], 3).is_empty());
        assert!(p.propose(&[7], 3).is_empty());
    }

    #[test]
    fn falls_back_to_shorter_suffixes() {
        let p = NgramProposer {
            max_ngram: 3,
            min_ngram: 1,
        };
        assert_eq!(p.propose(&[4, 6, 5, 4], 2), vec![6, 5]);
    }
}
