//! The OpenAI API surface: request fields parsed and checked into an engine
//! [`Request`], error bodies, and response bodies.
//!
//! Bodies are parsed as JSON values and read field by field, so every
//! mistake gets a message naming the field and what it should be. Besides
//! OpenAI's fields, `priority` (higher first) and `timeout` (seconds from
//! arrival; the request then ends with `finish_reason: "timeout"`).

use std::time::Duration;

use serde_json::{json, Map, Value};
use tandem_core::engine::Request;
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::Tokenizer;

use crate::prompt;
use crate::token_floor::TokenFloor;

/// Most samples one request may ask for.
pub const MAX_SAMPLES: i64 = 16;
/// Most alternatives per token in logprobs.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// `max_tokens` of a completion request that gives none (OpenAI's default).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// An OpenAI error: HTTP status and the JSON body's fields.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// A checked request, ready for the engine.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub request: Request,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The request's own deadline, from its `timeout` field.
    pub timeout: Option<Duration>,
}

impl Job {
    pub fn prompt_tokens(&self) -> usize {
        self.request.prompt.len()
    }

    pub fn samples(&self) -> usize {
        self.request.samples
    }
}

/// Field access with errors that name the field.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The field's value; absent and `null` are the same.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn wrong(name: &str, what: &str) -> ApiError {
        ApiError::bad_request(format!("'{name}' must be {what}"), Some(name))
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(name, "a string")))
            .transpose()
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(name, "true or false"))
            })
            .transpose()
    }

    fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let what = format!("an integer from {min} to {max}");
        self.get(name)
            .map(|v| match v.as_i64() {
                Some(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err(Self::wrong(name, &what)),
            })
            .transpose()
    }

    fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let what = format!("a number from {min} to {max}");
        self.get(name)
            .map(|v| match v.as_f64() {
                Some(x) if (min..=max).contains(&x) => Ok(x),
                _ => Err(Self::wrong(name, &what)),
            })
            .transpose()
    }
}

/// What the server knows when checking a request.
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub max_context: usize,
    pub tokenizer: &'a Tokenizer,
    /// Refuses text too long for the context before tokenizing it.
    pub token_floor: &'a TokenFloor,
    /// Seed of requests that give none.
    pub default_seed: u64,
}

/// Parses and checks a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8], limits: &Limits<'_>) -> Result<Job, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the request body is not valid JSON: {e}"), None)
    })?;
    let obj = value
        .as_object()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object", None))?;
    let f = Fields(obj);
    let model = f
        .string("model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required", Some("model")))?;
    if model != limits.model_id {
        return Err(ApiError::new(
            404,
            "invalid_request_error",
            format!(
                "The model '{model}' does not exist; this server serves '{}'",
                limits.model_id
            ),
        )
        .with_code("model_not_found"));
    }
    if endpoint == Endpoint::ChatCompletions && f.get("tools").is_some_and(|t| t != &json!([])) {
        return Err(ApiError::bad_request(
            "'tools' is not supported: this server does not support tool calling",
            Some("tools"),
        ));
    }
    let (prompt, param) = match endpoint {
        Endpoint::Completions => (prompt::completion(f.get("prompt"), limits)?, "prompt"),
        Endpoint::ChatCompletions => (prompt::chat(f.get("messages"), limits)?, "messages"),
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request(
            format!("'{param}' is empty"),
            Some(param),
        ));
    }
    let room = limits.max_context.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens, but the prompt has {} tokens",
                limits.max_context,
                prompt.len()
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"));
    }
    let max_tokens = match f.get("max_completion_tokens") {
        Some(_) => f.integer("max_completion_tokens", 1, i64::MAX)?,
        None => f.integer("max_tokens", 1, i64::MAX)?,
    };
    let max_tokens = match (max_tokens, endpoint) {
        (Some(n), _) => n as usize,
        (None, Endpoint::Completions) => DEFAULT_COMPLETION_TOKENS.min(room),
        (None, Endpoint::ChatCompletions) => room,
    };
    if max_tokens > room {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens; you requested {} tokens ({} in the prompt, {max_tokens} for the completion)",
                limits.max_context,
                prompt.len() + max_tokens,
                prompt.len()
            ),
            Some("max_tokens"),
        )
        .with_code("context_length_exceeded"));
    }
    let temperature = f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    if top_p <= 0.0 {
        return Err(Fields::wrong("top_p", "greater than 0"));
    }
    let samples = f.integer("n", 1, MAX_SAMPLES)?.unwrap_or(1) as usize;
    let seed = match f.get("seed") {
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| Fields::wrong("seed", "an integer"))?,
        None => limits.default_seed,
    };
    let priority = f
        .integer("priority", i32::MIN as i64, i32::MAX as i64)?
        .unwrap_or(0) as i32;
    let logprobs = match endpoint {
        Endpoint::Completions => f
            .integer("logprobs", 0, MAX_TOP_LOGPROBS)?
            .map(|n| n as usize),
        Endpoint::ChatCompletions => {
            let top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
            match f.boolean("logprobs")? {
                Some(true) => Some(top.unwrap_or(0) as usize),
                _ if top.is_some() => {
                    return Err(ApiError::bad_request(
                        "'top_logprobs' needs 'logprobs': true",
                        Some("top_logprobs"),
                    ))
                }
                _ => None,
            }
        }
    };
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        Some(Value::Object(o)) => Fields(o).boolean("include_usage")?.unwrap_or(false),
        Some(_) => return Err(Fields::wrong("stream_options", "an object")),
        None => false,
    };
    let stops = stop_strings(&f)?;
    let timeout = f
        .number("timeout", 0.0, f64::MAX)?
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| Fields::wrong("timeout", "a number of seconds greater than 0"))
        })
        .transpose()?;
    let params = SamplingParams {
        temperature,
        top_p,
        seed,
        ..SamplingParams::default()
    };
    Ok(Job {
        endpoint,
        request: Request {
            prompt,
            params,
            max_new_tokens: max_tokens,
            stop_tokens: limits.tokenizer.eos_tokens().to_vec(),
            priority,
            samples,
            logprobs,
            constraint: None,
        },
        stops,
        stream,
        include_usage,
        timeout,
    })
}

fn stop_strings(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let wrong = || {
        Fields::wrong(
            "stop",
            "a non-empty string or a list of up to 4 non-empty strings",
        )
    };
    let stops: Vec<String> = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.len() <= 4 => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(wrong))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong()),
    };
    if stops.iter().any(String::is_empty) {
        return Err(wrong());
    }
    Ok(stops)
}

/// `usage` of a response.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}
