//! Logprobs in each endpoint's shape: completions' parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`; a prompt's
//! first token, echoed, has `null` for both logprob fields, as OpenAI
//! writes it), and chat's `content` list of `{token, logprob, bytes,
//! top_logprobs}`. Tokens are named by their text, or, with vLLM's
//! `return_tokens_as_token_ids`, as `token_id:ID` (a byte of a multi-byte
//! character has no text of its own).

use serde_json::{json, Map, Value};
use tandem_core::tokenizer::Tokenizer;

use crate::collector::LogprobEntry;

/// How tokens are named.
#[derive(Clone, Copy)]
pub struct TokenNames<'a> {
    pub tokenizer: &'a Tokenizer,
    /// `token_id:ID` instead of the token's text.
    pub as_ids: bool,
}

impl TokenNames<'_> {
    fn name(&self, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            self.tokenizer.decode(&[id]).unwrap_or_default()
        }
    }
}

/// Completions' `logprobs` object; `text_offset` counts from `first_offset`.
pub fn completion(names: TokenNames<'_>, entries: &[LogprobEntry], first_offset: usize) -> Value {
    let mut offset = first_offset;
    let mut offsets = Vec::with_capacity(entries.len());
    let mut tokens = Vec::with_capacity(entries.len());
    for e in entries {
        let text = names.name(e.token);
        offsets.push(offset);
        offset += names.tokenizer.decode(&[e.token]).map_or(0, |t| t.len());
        tokens.push(text);
    }
    let top = |e: &LogprobEntry| match e.logprob {
        None => Value::Null,
        Some(_) => Value::Object(
            (e.top.iter())
                .map(|&(id, lp)| (names.name(id), json!(lp)))
                .collect::<Map<_, _>>(),
        ),
    };
    json!({
        "tokens": tokens,
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(top).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// Chat's `logprobs` object.
pub fn chat(names: TokenNames<'_>, entries: &[LogprobEntry]) -> Value {
    let item = |id: u32, lp: f32| {
        let text = names.name(id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = item(e.token, e.logprob.unwrap_or(0.0));
            v["top_logprobs"] = e.top.iter().map(|&(id, lp)| item(id, lp)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}
