//! The fields of a request body: typed access with errors that name the
//! field, and the list of fields each endpoint knows. A field outside the
//! list is refused with a 400 naming it, as OpenAI refuses unknown
//! arguments, so nothing a client asks for is silently dropped.
//!
//! Some fields are metadata and accepted as long as they ask for nothing
//! the server does not do: `user`, `safety_identifier`, `prompt_cache_key`
//! (every prompt uses the prefix cache), `metadata`, `store: false`,
//! `service_tier: "auto"` or `"default"`, `modalities: ["text"]`.

use serde_json::{Map, Value};

use crate::api::{ApiError, Endpoint};

/// Fields both endpoints take; `top_k`, `min_p`, `repetition_penalty`,
/// `priority`, `return_tokens_as_token_ids`, `timeout` and the `kv_*`
/// eviction fields are extensions (vLLM's, and the server's own).
const COMMON: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "priority",
    "return_tokens_as_token_ids",
    "timeout",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "kv_budget",
    "kv_evict",
    "kv_sinks",
    "kv_recent",
];

/// Fields only `/v1/completions` takes.
const COMPLETIONS: &[&str] = &["prompt", "echo", "best_of", "suffix"];

/// Fields only `/v1/chat/completions` takes.
const CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "prompt_cache_key",
    "safety_identifier",
];

/// Field access with errors that name the field.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The field's value; absent and `null` are the same.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn wrong(name: &str, what: &str) -> ApiError {
        ApiError::bad_request(format!("'{name}' must be {what}"), Some(name))
    }

    /// A 400 for a field whose value asks for something the server does not do.
    pub fn unsupported(name: &str, why: &str) -> ApiError {
        ApiError::bad_request(format!("'{name}' is not supported: {why}"), Some(name))
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(name, "a string")))
            .transpose()
    }

    pub fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(name, "true or false"))
            })
            .transpose()
    }

    pub fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let what = format!("an integer from {min} to {max}");
        self.get(name)
            .map(|v| match v.as_i64() {
                Some(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err(Self::wrong(name, &what)),
            })
            .transpose()
    }

    pub fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let what = format!("a number from {min} to {max}");
        self.get(name)
            .map(|v| match v.as_f64() {
                Some(x) if (min..=max).contains(&x) => Ok(x),
                _ => Err(Self::wrong(name, &what)),
            })
            .transpose()
    }
}

/// Refuses the first field `endpoint` does not know, and metadata fields
/// that ask for something the server does not do.
pub fn check_known(f: &Fields<'_>, endpoint: Endpoint) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Completions => COMPLETIONS,
        Endpoint::ChatCompletions => CHAT,
    };
    if let Some(name) =
        f.0.keys()
            .find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        return Err(ApiError::bad_request(
            format!(
                "unsupported parameter: '{name}' (this server does not support it on {})",
                endpoint.path()
            ),
            Some(name),
        ));
    }
    for name in ["user", "safety_identifier", "prompt_cache_key"] {
        f.string(name)?;
    }
    match f.get("metadata") {
        Some(Value::Object(entries)) if entries.values().all(Value::is_string) => {}
        Some(_) => return Err(Fields::wrong("metadata", "an object of strings")),
        None => {}
    }
    if f.boolean("store")? == Some(true) {
        return Err(Fields::unsupported(
            "store",
            "this server does not store completions",
        ));
    }
    if let Some(tier) = f.string("service_tier")? {
        if !matches!(tier, "auto" | "default") {
            return Err(Fields::unsupported(
                "service_tier",
                &format!("this server has one tier ('auto' or 'default'), not '{tier}'"),
            ));
        }
    }
    match f.get("modalities") {
        None => {}
        Some(v) if v == &serde_json::json!(["text"]) => {}
        Some(_) => {
            return Err(Fields::unsupported(
                "modalities",
                "this server generates text only (['text'])",
            ))
        }
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(Fields::unsupported(
            "suffix",
            "this server does not do fill-in-the-middle",
        ));
    }
    Ok(())
}
