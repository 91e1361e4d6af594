//! llguidance's view of a Tandem tokenizer: the bytes of every token (its
//! token trie) and the end-of-sequence ids, built from the tokenizer's
//! `tokenizer.json` form with llguidance's own reader (byte-level BPE and
//! SentencePiece with byte fallback). `toktrie_hf_tokenizers` would do the
//! same from the `tokenizers` crate, but it pins `tokenizers` 0.21 and would
//! build a second copy of it beside the workspace's 0.22.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use serde_json::Value;
use tandem_core::tokenizer::Tokenizer;

use crate::StructuredError;

/// A token trie with Tandem's tokenizer for the text llguidance tokenizes itself.
struct TandemTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TandemTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// The token environment of `tokenizer`, its EOS ids ending the grammar.
pub(crate) fn token_env(tokenizer: Arc<Tokenizer>) -> Result<TokEnv, StructuredError> {
    let unavailable = |why: String| StructuredError::Unavailable(why);
    let json = tokenizer
        .to_hf_json()
        .map_err(|e| unavailable(e.to_string()))?;
    let value: Value = serde_json::from_str(&json)
        .map_err(|e| unavailable(format!("the tokenizer's JSON does not parse: {e}")))?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
        .map_err(|e| unavailable(format!("cannot read the token bytes: {e}")))?;
    words.resize(words.len().max(tokenizer.vocab_size()), Vec::new());
    // Ids without bytes (gaps in the vocabulary) become special tokens no
    // grammar matches, as toktrie_hf_tokenizers pads them.
    for (id, word) in words.iter_mut().enumerate() {
        if word.is_empty() {
            *word = special(&format!("<[{id}]>"));
        }
    }
    let mut eos = tokenizer.eos_tokens().to_vec();
    if eos.is_empty() {
        // llguidance needs an end token; one past the vocabulary is never
        // sampled (masks are cut to the model's vocabulary), so the grammar
        // ends by its own completion.
        eos.push(words.len() as TokenId);
        words.push(special("<[eos]>"));
    }
    let info = TokRxInfo::new(words.len() as u32, eos[0]);
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(&eos);
    }
    Ok(Arc::new(TandemTokEnv { trie, tokenizer }))
}

/// The bytes of a special token named `name` (toktrie's marker first).
fn special(name: &str) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend_from_slice(name.as_bytes());
    bytes
}
