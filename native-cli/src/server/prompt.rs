//! The prompt of a request as token ids: a completion's `prompt` (text, one
//! text in a list, token ids, or one list of token ids), or a chat's
//! `messages` checked turn by turn, rendered with the model's template and
//! tokenized with the messages read as text ([`Tokenizer::encode_chat`]).
//!
//! Text that cannot fit the context by its length alone ([`TokenFloor`]) is
//! refused before it is tokenized.
//!
//! [`TokenFloor`]: crate::token_floor::TokenFloor
//! [`Tokenizer::encode_chat`]: tandem_core::tokenizer::Tokenizer::encode_chat

use serde_json::Value;
use tandem_core::tokenizer::ChatMessage;

use crate::api::{ApiError, Limits};

/// Roles a chat message may have (`developer` is read as `system`).
const ROLES: &str = "system, developer, user or assistant";

/// The token ids of a completion request's `prompt`.
pub fn completion(prompt: Option<&Value>, limits: &Limits<'_>) -> Result<Vec<u32>, ApiError> {
    let wrong = || {
        ApiError::bad_request(
            "'prompt' must be a string, a list of token ids, or a list of one of those",
            Some("prompt"),
        )
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        let vocab = limits.tokenizer.vocab_size() as u64;
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&id| id < vocab)
                    .map(|id| id as u32)
                    .ok_or_else(wrong)
            })
            .collect()
    };
    match prompt {
        None => Err(ApiError::bad_request(
            "'prompt' is required",
            Some("prompt"),
        )),
        Some(Value::String(s)) => encode(s, limits, "prompt"),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Ok(Vec::new()),
            [Value::String(s)] => encode(s, limits, "prompt"),
            [Value::Array(one)] => ids(one),
            [Value::String(_) | Value::Array(_), ..] => Err(ApiError::bad_request(
                format!(
                    "'prompt' holds {} prompts; this server takes one per request (send several requests, or use 'n' for several samples)",
                    items.len()
                ),
                Some("prompt"),
            )),
            _ => ids(items),
        },
        Some(_) => Err(wrong()),
    }
}

/// The token ids of a chat request's `messages`, rendered with the chat template.
pub fn chat(messages: Option<&Value>, limits: &Limits<'_>) -> Result<Vec<u32>, ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::bad_request(
            "'messages' is required",
            Some("messages"),
        ));
    };
    let messages = messages.as_array().ok_or_else(|| {
        ApiError::bad_request(
            "'messages' must be a list of {role, content} objects",
            Some("messages"),
        )
    })?;
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let chat = messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    if !chat.iter().any(|m| m.role == "user") {
        return Err(ApiError::bad_request(
            "'messages' has no 'user' message",
            Some("messages"),
        ));
    }
    let tok = limits.tokenizer;
    let bad = |e: tandem_core::Error| ApiError::bad_request(e.to_string(), Some("messages"));
    // The rendered text's length, to refuse what cannot fit before tokenizing.
    let text = tok.apply_chat_template(&chat, true).map_err(bad)?;
    check_fits(&text, limits, "messages")?;
    tok.encode_chat(&chat, true).map_err(bad)
}

/// One checked chat message.
fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let field = |name: &str| format!("messages[{i}].{name}");
    let wrong = |name: &str, what: &str| {
        let field = field(name);
        ApiError::bad_request(format!("'{field}' {what}"), Some(&field))
    };
    let m = m.as_object().ok_or_else(|| {
        let field = format!("messages[{i}]");
        ApiError::bad_request(
            format!("'{field}' must be an object with 'role' and 'content'"),
            Some(&field),
        )
    })?;
    let role = match m.get("role") {
        Some(Value::String(role)) => role.as_str(),
        None | Some(Value::Null) => return Err(wrong("role", "is required")),
        Some(_) => return Err(wrong("role", "must be a string")),
    };
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" => role,
        "tool" | "function" => {
            return Err(wrong(
                "role",
                &format!("is '{role}': this server does not support tool calling"),
            ))
        }
        other => return Err(wrong("role", &format!("must be {ROLES}, not '{other}'"))),
    };
    if m.get("tool_calls").is_some_and(|v| !v.is_null()) {
        return Err(wrong(
            "tool_calls",
            "is not supported: this server does not support tool calling",
        ));
    }
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t),
                    _ => Err(wrong(
                        &format!("content[{j}]"),
                        "must be a text part {\"type\": \"text\", \"text\": \"...\"} (only text is supported)",
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()?
            .concat(),
        None | Some(Value::Null) => {
            return Err(wrong(
                "content",
                "is required: a string or a list of text parts",
            ))
        }
        Some(_) => {
            return Err(wrong(
                "content",
                "must be a string or a list of text parts",
            ))
        }
    };
    Ok(ChatMessage::new(role, content))
}

/// Tokenizes `text` (with BOS where the model wants it), unless its length
/// alone shows that it cannot fit the context.
fn encode(text: &str, limits: &Limits<'_>, param: &str) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    check_fits(text, limits, param)?;
    limits
        .tokenizer
        .encode(text, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some(param)))
}

/// Refuses `text` when its length alone shows that it cannot fit the context.
fn check_fits(text: &str, limits: &Limits<'_>, param: &str) -> Result<(), ApiError> {
    let floor = limits.token_floor.min_tokens(text);
    if floor >= limits.max_context {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens, but the prompt has at least {floor} tokens ({} bytes)",
                limits.max_context,
                text.len()
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}
