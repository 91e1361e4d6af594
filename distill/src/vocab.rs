//! A reduced output vocabulary for the draft (as FR-Spec does): the output
//! head is the costliest matrix of a small draft (SmolLM2's 49,152 rows
//! are a fifth of its weights), yet most of the probability mass of text
//! falls on a few thousand tokens. The draft keeps the head rows of the
//! training corpus' most frequent tokens, plus every token of the chat
//! template's turn markers and the end-of-sequence tokens, so it can still
//! close a turn. A corpus of a few hundred thousand tokens holds only a few
//! thousand distinct ones; the places left go to the lowest unused ids,
//! which byte-pair vocabularies give to the merges learned first, the most
//! frequent pieces of the tokenizer's own (far larger) training text. A
//! token the draft lacks is never drafted; verification stays exact, since
//! the target decides every token.

use std::collections::{BTreeSet, HashMap};

use tandem_core::tokenizer::{ChatMessage, Tokenizer};

use crate::{Error, Result};

/// The `size` tokens the draft keeps, in increasing order: the special
/// tokens first, then the most frequent tokens of `windows` (ties to the
/// lower id), then the lowest ids not yet kept.
pub fn frequent_tokens(
    tokenizer: &Tokenizer,
    windows: &[Vec<u32>],
    size: usize,
) -> Result<Vec<u32>> {
    let vocab = tokenizer.vocab_size();
    if size == 0 || size >= vocab {
        return Err(Error::InvalidInput(format!(
            "a draft vocabulary of {size} tokens: it must be at least 1 and below the \
             target's {vocab} (without one the draft keeps them all)"
        )));
    }
    let mut kept: BTreeSet<u32> = special_tokens(tokenizer)?.into_iter().collect();
    if kept.len() > size {
        return Err(Error::InvalidInput(format!(
            "a draft vocabulary of {size} tokens cannot hold the {} tokens of the chat \
             template's markers and end-of-sequence",
            kept.len()
        )));
    }
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in windows.iter().flatten() {
        *counts.entry(t).or_default() += 1;
    }
    let mut by_count: Vec<(u32, usize)> = counts.into_iter().collect();
    by_count.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let lowest_ids = (0..vocab as u32).map(|t| (t, 0));
    for (token, _) in by_count.into_iter().chain(lowest_ids) {
        if kept.len() == size {
            break;
        }
        kept.insert(token);
    }
    Ok(kept.into_iter().collect())
}

/// The fraction of the tokens of `windows` that `tokens` holds.
pub fn coverage(tokens: &[u32], windows: &[Vec<u32>]) -> f64 {
    let all = windows.iter().map(Vec::len).sum::<usize>().max(1);
    let held = windows
        .iter()
        .flatten()
        .filter(|t| tokens.binary_search(t).is_ok())
        .count();
    held as f64 / all as f64
}

/// BOS, the end-of-sequence tokens, and the tokens of a short conversation
/// rendered by the chat template (its turn markers and role names).
fn special_tokens(tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let chat = [
        ChatMessage::new("system", "s"),
        ChatMessage::new("user", "u"),
        ChatMessage::new("assistant", "a"),
    ];
    let rendered = tokenizer.apply_chat_template(&chat, true)?;
    let mut tokens = tokenizer.encode(&rendered, false)?;
    tokens.extend(tokenizer.eos_tokens());
    tokens.extend(tokenizer.bos_token());
    Ok(tokens)
}
