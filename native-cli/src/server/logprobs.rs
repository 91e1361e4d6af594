//! Logprobs in each endpoint's shape: completions' parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`; a prompt's
//! first token, echoed, has `null` for both logprob fields, as OpenAI
//! writes it), and chat's `content` list of `{token, logprob, bytes,
//! top_logprobs}`. Tokens are named by their bytes as text (U+FFFD for
//! part of a character, whose `bytes` hold the real ones), or, with vLLM's
//! `return_tokens_as_token_ids`, as `token_id:ID`.

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
            String::from_utf8_lossy(&self.bytes(id)).into_owned()
        }
    }

    /// The token's bytes (part of a character, for some tokens).
    fn bytes(&self, id: u32) -> Vec<u8> {
        (self.tokenizer.token_bytes(id)).unwrap_or_else(|| {
            self.tokenizer
                .decode(&[id])
                .unwrap_or_default()
                .into_bytes()
        })
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
    let item = |id: u32, lp: f32| json!({"token": names.name(id), "logprob": lp, "bytes": names.bytes(id)});
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
