//! A prompt's own logprobs, for completions' `echo` with `logprobs`: the
//! engine scores the prompt between steps (a temporary sequence, freed at
//! once) and each token gets its log-probability after the tokens before
//! it, with the most likely alternatives. The first token has none.
//!
//! Logits come back a window of rows at a time, so a long prompt never
//! holds more than [`WINDOW_FLOATS`] of them; each window re-reads the
//! prompt before it, which costs compute but no memory.

use tandem_core::engine::{Engine, TokenLogprobs};
use tandem_core::{Backend, Result};

use crate::collector::LogprobEntry;

/// Most logits held at once (64 MiB).
const WINDOW_FLOATS: usize = 1 << 24;

/// Each of `tokens`' logprob under the model, with `top` alternatives.
pub fn prompt_logprobs<B: Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
    top: usize,
) -> Result<Vec<LogprobEntry>> {
    let mut entries = Vec::with_capacity(tokens.len());
    let Some(&first) = tokens.first() else {
        return Ok(entries);
    };
    entries.push(LogprobEntry {
        token: first,
        logprob: None,
        top: Vec::new(),
    });
    let vocab = engine.model().config.vocab_size;
    // Row r's logits predict token r + 1.
    let rows = tokens.len() - 1;
    let window = (WINDOW_FLOATS / vocab).max(1);
    let mut start = 0;
    while start < rows {
        let end = (start + window).min(rows);
        let logits = engine.score(&tokens[..end], start)?;
        for (row, logits) in logits.chunks_exact(vocab).enumerate() {
            let token = tokens[start + row + 1];
            let scored = TokenLogprobs::from_logits(logits, token, top);
            entries.push(LogprobEntry {
                token,
                logprob: Some(scored.logprob),
                top: scored.top,
            });
        }
        start = end;
    }
    Ok(entries)
}
