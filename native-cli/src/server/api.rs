//! The OpenAI API surface: request fields parsed and checked into an engine
//! [`Request`], error bodies, and response bodies.
//!
//! Bodies are parsed as JSON values and read field by field, so every
//! mistake gets a message naming the field and what it should be; a field
//! the endpoint does not know is refused by name ([`fields`]). Besides
//! OpenAI's fields, vLLM's `top_k`, `min_p`, `repetition_penalty`,
//! `priority` (lower runs first, as in vLLM) and
//! `return_tokens_as_token_ids`, `timeout` (seconds from
//! arrival; the request then ends with `finish_reason: "timeout"`), and
//! the request's own KV eviction (`kv_budget`, ... : [`kv_eviction`]).
//!
//! [`fields`]: crate::fields

use std::time::Duration;

use serde_json::{json, Value};
use tandem_core::engine::Request;
use tandem_core::sched::SharedConstraintFactory;
use tandem_core::tokenizer::Tokenizer;
use tandem_structured::{StructuredError, StructuredOutput};

use crate::fields::{self, Fields};
use crate::kv_eviction;
use crate::prompt;
use crate::sampling;
use crate::token_floor::TokenFloor;
use crate::tools::{self, ToolUse};

/// Most samples one request may ask for (`n`, `best_of`).
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

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// A checked request, ready for the engine.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    /// `samples` is what is generated: `best_of` when it is larger than `n`.
    pub request: Request,
    /// How many choices the response has (`n`).
    pub choices: usize,
    /// The alternatives per token the client asked logprobs with.
    pub logprobs: Option<usize>,
    /// Logprobs name tokens `token_id:ID` (vLLM's `return_tokens_as_token_ids`).
    pub tokens_as_ids: bool,
    /// The prompt's text, put before each choice's (completions' `echo`).
    pub echo: Option<String>,
    /// A chat's tools.
    pub tools: Option<ToolUse>,
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

    /// The samples generated.
    pub fn samples(&self) -> usize {
        self.request.samples
    }
}

/// What the server knows when checking a request.
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub max_context: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    pub tokenizer: &'a Tokenizer,
    /// Refuses text too long for the context before tokenizing it.
    pub token_floor: &'a TokenFloor,
    /// Seed of requests that give none.
    pub default_seed: u64,
    /// Compiles the output formats of requests.
    pub structured: &'a StructuredOutput,
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
    check_model(&f, limits)?;
    fields::check_known(&f, endpoint)?;
    let tools = match endpoint {
        Endpoint::Completions => None,
        Endpoint::ChatCompletions => tools::parse(&f, limits.tokenizer)?,
    };
    let (prompt, param) = match endpoint {
        Endpoint::Completions => (prompt::completion(f.get("prompt"), limits)?, "prompt"),
        Endpoint::ChatCompletions => (
            prompt::chat(f.get("messages"), tools.as_ref(), true, limits)?,
            "messages",
        ),
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request(
            format!("'{param}' is empty"),
            Some(param),
        ));
    }
    let max_tokens = max_tokens(&f, endpoint, prompt.len(), limits.max_context, param)?;
    let params = sampling::params(&f, limits)?;
    let choices = f.integer("n", 1, MAX_SAMPLES)?.unwrap_or(1) as usize;
    let stream = f.boolean("stream")?.unwrap_or(false);
    let samples = match f.integer("best_of", 1, MAX_SAMPLES)? {
        Some(b) if (b as usize) < choices => {
            return Err(Fields::wrong("best_of", &format!("at least n ({choices})")))
        }
        Some(b) if b as usize > choices && stream => {
            return Err(Fields::unsupported(
                "best_of",
                "with 'stream' it must equal n (the best choices are known only at the end)",
            ))
        }
        Some(b) => b as usize,
        None => choices,
    };
    // vLLM's priority: lower runs first; the engine runs higher first.
    let priority = -(f
        .integer("priority", -(i32::MAX as i64), i32::MAX as i64)?
        .unwrap_or(0) as i32);
    let logprobs = logprobs(&f, endpoint)?;
    let echo = match f.boolean("echo")? {
        Some(true) => Some(prompt::completion_text(f.get("prompt"), &prompt, limits)?),
        _ => None,
    };
    let include_usage = match f.get("stream_options") {
        Some(_) if !stream => {
            return Err(ApiError::bad_request(
                "'stream_options' is only allowed with 'stream': true",
                Some("stream_options"),
            ))
        }
        Some(Value::Object(o)) => {
            let options = Fields(o);
            if let Some(name) = o.keys().find(|k| k.as_str() != "include_usage") {
                return Err(ApiError::bad_request(
                    format!("unsupported parameter: 'stream_options.{name}'"),
                    Some("stream_options"),
                ));
            }
            options.boolean("include_usage")?.unwrap_or(false)
        }
        Some(_) => return Err(Fields::wrong("stream_options", "an object")),
        None => false,
    };
    let stops = stop_strings(&f)?;
    let tool_calls = match &tools {
        Some(t) => t.constraint(limits.structured)?,
        None => None,
    };
    let constraint = match (tool_calls, output_constraint(obj, limits)?) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "a 'tool_choice' that forces calls cannot be combined with an output format",
                Some("tool_choice"),
            ))
        }
        (calls, format) => calls.or(format),
    };
    let timeout = f
        .number("timeout", 0.0, f64::MAX)?
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| Fields::wrong("timeout", "a number of seconds greater than 0"))
        })
        .transpose()?;
    Ok(Job {
        endpoint,
        request: Request {
            stop_tokens: limits.tokenizer.eos_tokens().to_vec(),
            priority,
            samples,
            // `best_of` ranks the samples by their tokens' logprobs.
            logprobs: logprobs.or((samples > choices).then_some(0)),
            constraint,
            kv_eviction: kv_eviction::config(&f, limits)?,
            ..Request::new(prompt, params, max_tokens)
        },
        choices,
        logprobs,
        tokens_as_ids: f.boolean("return_tokens_as_token_ids")?.unwrap_or(false),
        echo,
        tools,
        stops,
        stream,
        include_usage,
        timeout,
    })
}

/// A 404 for a model this server does not serve.
fn check_model(f: &Fields<'_>, limits: &Limits<'_>) -> Result<(), ApiError> {
    let model = f
        .string("model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required", Some("model")))?;
    if model != limits.model_id {
        return Err(model_not_found(model, limits));
    }
    Ok(())
}

/// The 404 for a `model` this server does not serve.
pub fn model_not_found(model: &str, limits: &Limits<'_>) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        format!(
            "The model '{model}' does not exist; this server serves '{}'",
            limits.model_id
        ),
    )
    .with_code("model_not_found")
}

/// The tokens to generate at most, within the context's room after the prompt.
fn max_tokens(
    f: &Fields<'_>,
    endpoint: Endpoint,
    prompt_len: usize,
    max_context: usize,
    param: &str,
) -> Result<usize, ApiError> {
    let room = max_context.saturating_sub(prompt_len);
    if room == 0 {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_context} tokens, but the prompt has {prompt_len} tokens"
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"));
    }
    let asked = match f.get("max_completion_tokens") {
        Some(_) => f.integer("max_completion_tokens", 1, i64::MAX)?,
        None => f.integer("max_tokens", 1, i64::MAX)?,
    };
    let max_tokens = match (asked, endpoint) {
        (Some(n), _) => n as usize,
        (None, Endpoint::Completions) => DEFAULT_COMPLETION_TOKENS.min(room),
        (None, Endpoint::ChatCompletions) => room,
    };
    if max_tokens > room {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_context} tokens; you requested {} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)",
                prompt_len + max_tokens,
            ),
            Some("max_tokens"),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(max_tokens)
}

/// The alternatives per token logprobs are asked with: completions'
/// `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N`.
fn logprobs(f: &Fields<'_>, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    Ok(match endpoint {
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
    })
}

/// The constraint of the output format the request asks for
/// (`response_format`, vLLM's `guided_*` and `structured_outputs`), compiled
/// for the model's tokenizer; a malformed one is a 400 naming its field.
fn output_constraint(
    body: &serde_json::Map<String, Value>,
    limits: &Limits<'_>,
) -> Result<Option<SharedConstraintFactory>, ApiError> {
    let refused = |e: StructuredError| ApiError::bad_request(e.to_string(), e.param());
    match tandem_structured::from_request(body).map_err(refused)? {
        Some(requested) => limits.structured.compile(&requested).map_err(refused),
        None => Ok(None),
    }
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
