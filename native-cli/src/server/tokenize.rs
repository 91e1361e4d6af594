//! vLLM's `/tokenize` and `/detokenize`: text (or a chat, rendered with the
//! model's template) to token ids, and token ids to text, with the same
//! tokenizer and checks as generation requests.
//!
//! `/tokenize` takes `{"prompt": "...", "add_special_tokens": true}` or
//! `{"messages": [...], "add_generation_prompt": true}` and answers
//! `{"count": N, "max_model_len": CONTEXT, "tokens": [...]}`;
//! `/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": "..."}`.
//! `model` may be given; unknown fields are refused by name.

use serde_json::{json, Value};

use crate::api::{self, ApiError, Limits};
use crate::fields::Fields;
use crate::prompt;

const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
];
const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// The answer to a `/tokenize` body.
pub fn tokenize(body: &[u8], limits: &Limits<'_>) -> Result<Value, ApiError> {
    let value = object(body)?;
    let f = checked(&value, TOKENIZE_FIELDS, "/tokenize", limits)?;
    let tokens = match (f.get("prompt"), f.get("messages")) {
        (Some(_), None) => {
            if f.get("add_generation_prompt").is_some() {
                return Err(ApiError::bad_request(
                    "'add_generation_prompt' goes with 'messages'",
                    Some("add_generation_prompt"),
                ));
            }
            let text = f.string("prompt")?.unwrap_or_default();
            let add_special = f.boolean("add_special_tokens")?.unwrap_or(true);
            prompt::encode(text, add_special, limits, "prompt")?
        }
        (None, Some(messages)) => {
            if f.get("add_special_tokens").is_some() {
                return Err(ApiError::bad_request(
                    "'add_special_tokens' goes with 'prompt' (a chat's special tokens come from its template)",
                    Some("add_special_tokens"),
                ));
            }
            let add_generation_prompt = f.boolean("add_generation_prompt")?.unwrap_or(true);
            prompt::chat(Some(messages), None, add_generation_prompt, limits)?
        }
        _ => {
            return Err(ApiError::bad_request(
                "give either 'prompt' or 'messages'",
                None,
            ))
        }
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": limits.max_context,
        "tokens": tokens,
    }))
}

/// The answer to a `/detokenize` body.
pub fn detokenize(body: &[u8], limits: &Limits<'_>) -> Result<Value, ApiError> {
    let value = object(body)?;
    let f = checked(&value, DETOKENIZE_FIELDS, "/detokenize", limits)?;
    let vocab = limits.tokenizer.vocab_size();
    let wrong = || {
        Fields::wrong(
            "tokens",
            &format!("a list of token ids below the vocabulary size {vocab}"),
        )
    };
    let ids = f
        .get("tokens")
        .ok_or_else(|| ApiError::bad_request("'tokens' is required", Some("tokens")))?
        .as_array()
        .ok_or_else(wrong)?
        .iter()
        .map(|v| {
            v.as_u64()
                .filter(|&id| id < vocab as u64)
                .map(|id| id as u32)
                .ok_or_else(wrong)
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = limits
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
    Ok(json!({"prompt": text}))
}

fn object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the request body is not valid JSON: {e}"), None)
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(value)
}

/// The body's fields, once every one is known and `model`, if given, is this server's.
fn checked<'a>(
    value: &'a Value,
    known: &[&str],
    path: &str,
    limits: &Limits<'_>,
) -> Result<Fields<'a>, ApiError> {
    let f = Fields(value.as_object().expect("checked by object()"));
    if let Some(name) = f.0.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::bad_request(
            format!("unsupported parameter: '{name}' (this server does not support it on {path})"),
            Some(name),
        ));
    }
    if let Some(model) = f.string("model")? {
        if model != limits.model_id {
            return Err(api::model_not_found(model, limits));
        }
    }
    Ok(f)
}
