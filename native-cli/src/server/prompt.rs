//! The prompt of a request as token ids: a completion's `prompt` (text, one
//! text in a list, token ids, or one list of token ids), or a chat's
//! `messages` checked turn by turn, rendered with the model's template (and
//! the request's tools) and tokenized with the messages read as text
//! ([`Tokenizer::encode_chat`]). Tool turns (`role: "tool"` with its
//! `tool_call_id`) and assistant turns with `tool_calls` (content `null`)
//! reach the template as `transformers` passes them: each call's
//! `arguments` parsed from OpenAI's JSON string into an object.
//!
//! Text that cannot fit the context by its length alone ([`TokenFloor`]) is
//! refused before it is tokenized.
//!
//! [`TokenFloor`]: crate::token_floor::TokenFloor
//! [`Tokenizer::encode_chat`]: tandem_core::tokenizer::Tokenizer::encode_chat

use serde_json::Value;
use tandem_core::tokenizer::{Chat, ChatMessage, ToolCall};

use crate::api::{ApiError, Limits};
use crate::tools::ToolUse;

/// Roles a chat message may have (`developer` is read as `system`).
const ROLES: &str = "system, developer, user, assistant or tool";

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
        Some(Value::String(s)) => encode(s, true, limits, "prompt"),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Ok(Vec::new()),
            [Value::String(s)] => encode(s, true, limits, "prompt"),
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

/// The text a completion's `echo` puts before its output: the prompt as
/// written, or the prompt's token ids decoded.
pub fn completion_text(
    prompt: Option<&Value>,
    ids: &[u32],
    limits: &Limits<'_>,
) -> Result<String, ApiError> {
    match prompt {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(items)) if matches!(items.as_slice(), [Value::String(_)]) => {
            Ok(items[0].as_str().unwrap_or_default().to_string())
        }
        _ => limits
            .tokenizer
            .decode(ids)
            .map_err(|e| ApiError::new(500, "server_error", e.to_string())),
    }
}

/// The token ids of a chat request's `messages`, rendered with the chat
/// template and `tools`.
pub fn chat(
    messages: Option<&Value>,
    tools: Option<&ToolUse>,
    add_generation_prompt: bool,
    limits: &Limits<'_>,
) -> Result<Vec<u32>, ApiError> {
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
    let chat = Chat {
        messages: &chat,
        tools: tools.map_or(&[], ToolUse::shown),
        add_generation_prompt,
    };
    // The rendered text's length, to refuse what cannot fit before tokenizing.
    let text = tok.render_chat(&chat).map_err(bad)?;
    check_fits(&text, limits, "messages")?;
    tok.encode_chat_prompt(&chat).map_err(bad)
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
        "user" | "assistant" | "tool" => role,
        "function" => {
            return Err(wrong(
                "role",
                "is 'function', which OpenAI has deprecated: send 'tool' messages with a 'tool_call_id'",
            ))
        }
        other => return Err(wrong("role", &format!("must be {ROLES}, not '{other}'"))),
    };
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(_) if role != "assistant" => {
            return Err(wrong("tool_calls", "is only for assistant messages"))
        }
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(j, call)| tool_call(&field(&format!("tool_calls[{j}]")), call))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong("tool_calls", "must be a list of tool calls")),
    };
    let tool_call_id = match m.get("tool_call_id") {
        Some(Value::String(id)) if role == "tool" => Some(id.clone()),
        None | Some(Value::Null) if role == "tool" => {
            return Err(wrong("tool_call_id", "is required in a tool message"))
        }
        None | Some(Value::Null) => None,
        Some(_) => return Err(wrong("tool_call_id", "must be a string, in a tool message")),
    };
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
        // An assistant turn that only calls tools has no content.
        None | Some(Value::Null) if !tool_calls.is_empty() => String::new(),
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
    let mut message = ChatMessage::new(role, content);
    message.tool_calls = tool_calls;
    message.tool_call_id = tool_call_id;
    Ok(message)
}

/// One of an assistant message's `tool_calls`, `field` naming it.
fn tool_call(field: &str, call: &Value) -> Result<ToolCall, ApiError> {
    let wrong = |what: &str| ApiError::bad_request(format!("'{field}' {what}"), Some(field));
    let shape = "must be {\"id\": ..., \"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": \"...\"}}";
    let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    let function = call.get("function");
    let (Some(id), Some("function"), Some(name), Some(arguments)) = (
        text(call.get("id")),
        call.get("type").and_then(Value::as_str),
        text(function.and_then(|f| f.get("name"))),
        text(function.and_then(|f| f.get("arguments"))),
    ) else {
        return Err(wrong(shape));
    };
    // Templates write the arguments with `tojson`: an object, as
    // `transformers` is given; text that is not JSON stays text.
    let arguments = serde_json::from_str(&arguments).unwrap_or(Value::String(arguments));
    Ok(ToolCall::function(id, name, arguments))
}

/// Tokenizes `text` (with `add_special`, BOS where the model wants it),
/// unless its length alone shows that it cannot fit the context.
pub fn encode(
    text: &str,
    add_special: bool,
    limits: &Limits<'_>,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    check_fits(text, limits, param)?;
    limits
        .tokenizer
        .encode(text, add_special)
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
