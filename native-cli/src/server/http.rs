//! The HTTP routes: OpenAI-compatible completions and chat completions
//! (JSON or server-sent events), models, health and metrics.
//!
//! Every failure is an OpenAI error body with a fitting status: 400 for bad
//! fields or a prompt too long for the context, 401 for a wrong API key, 404
//! for an unknown model or path, 413 for an oversized body, 503 when the
//! waiting queue is full, 500 when generation itself fails.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tandem_core::sched::SubmitError;
use tandem_core::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::api::{self, ApiError, Endpoint, Job, Limits};
use crate::engine_loop::{ChoiceToken, EngineHandle, Update};
use crate::metrics::{Metrics, Outcome};
use crate::text::ChoiceText;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients pass as `model` (and `/v1/models` lists).
    pub model_id: String,
    /// When set, `/v1/*` requests must carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    config: Arc<ServerConfig>,
    /// Request ids, and the seeds of requests that give none.
    counter: Arc<AtomicU64>,
    started: u64,
}

pub fn router(engine: EngineHandle, config: ServerConfig) -> Router {
    let body_limit = config.max_body_bytes;
    let state = AppState {
        engine,
        config: Arc::new(config),
        counter: Arc::new(AtomicU64::new(0)),
        started: unix_time(),
    };
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, e.body())
}

fn json_response(status: StatusCode, body: Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.engine.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(&ApiError::new(
        404,
        "invalid_request_error",
        "no such endpoint",
    ))
}

fn check_key(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.config.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(
            ApiError::new(401, "invalid_request_error", "Incorrect API key provided")
                .with_code("invalid_api_key"),
        )
    }
}

async fn models(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = check_key(&s, &headers) {
        return error_response(&e);
    }
    json_response(
        StatusCode::OK,
        json!({"object": "list", "data": [{
            "id": s.config.model_id, "object": "model", "created": s.started, "owned_by": "tandem",
        }]}),
    )
}

async fn completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, headers, body, Endpoint::Completions).await
}

async fn chat_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, headers, body, Endpoint::ChatCompletions).await
}

async fn generate(
    s: AppState,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    let started = Instant::now();
    match start(&s, &headers, body, endpoint).await {
        Ok((job, updates)) => {
            let n = s.counter.fetch_add(1, Ordering::Relaxed);
            let prefix = if endpoint == Endpoint::Completions {
                "cmpl"
            } else {
                "chatcmpl"
            };
            let reply = Reply {
                id: format!("{prefix}-{n}"),
                created: unix_time(),
                model: s.config.model_id.clone(),
                endpoint,
                prompt_tokens: job.prompt_tokens(),
                logprobs: job.request.logprobs.is_some(),
                include_usage: job.include_usage,
            };
            let collector = Collector::new(
                &job,
                s.engine.tokenizer.clone(),
                s.engine.metrics.clone(),
                started,
            );
            if job.stream {
                stream(reply, collector, updates)
            } else {
                complete(reply, collector, updates).await
            }
        }
        Err(e) => {
            s.engine.metrics.request_done(Outcome::Rejected);
            error_response(&e)
        }
    }
}

/// Checks the request and queues it in the engine.
async fn start(
    s: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<(Job, mpsc::Receiver<Update>), ApiError> {
    check_key(s, headers)?;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                413,
                "invalid_request_error",
                format!(
                    "the request body is larger than {} bytes",
                    s.config.max_body_bytes
                ),
            )
        } else {
            ApiError::bad_request(rejection.body_text(), None)
        }
    })?;
    let limits = Limits {
        model_id: &s.config.model_id,
        max_context: s.engine.max_context,
        tokenizer: &s.engine.tokenizer,
        default_seed: s.counter.fetch_add(1, Ordering::Relaxed) ^ s.started.rotate_left(32),
    };
    let job = api::parse(endpoint, &body, &limits)?;
    let updates = s
        .engine
        .submit(job.request.clone())
        .await
        .map_err(|e| match e {
            SubmitError::QueueFull(_) => ApiError::new(503, "server_error", e.to_string()),
            SubmitError::Rejected(e) => ApiError::bad_request(e.to_string(), None),
        })?;
    Ok((job, updates))
}

/// The fixed fields of a response.
struct Reply {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    prompt_tokens: usize,
    logprobs: bool,
    include_usage: bool,
}

/// One token's logprobs, as the engine reported them.
struct LogprobEntry {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

/// New output of one choice.
struct Delta {
    index: usize,
    text: String,
    logprobs: Vec<LogprobEntry>,
    finish_reason: Option<&'static str>,
}

struct Choice {
    text: ChoiceText,
    last_token_at: Option<Instant>,
}

/// Turns a request's updates into text per choice and records latencies.
struct Collector {
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    choices: Vec<Choice>,
    started: Instant,
    saw_first_token: bool,
    failed: bool,
}

impl Collector {
    fn new(job: &Job, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>, started: Instant) -> Self {
        Self {
            tokenizer,
            metrics,
            choices: (0..job.samples())
                .map(|_| Choice {
                    text: ChoiceText::new(job.stops.clone()),
                    last_token_at: None,
                })
                .collect(),
            started,
            saw_first_token: false,
            failed: false,
        }
    }

    fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.text.is_done())
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.text.completion_tokens).sum()
    }

    fn apply(&mut self, tokens: Vec<ChoiceToken>) -> Result<Vec<Delta>, ApiError> {
        let now = Instant::now();
        if !self.saw_first_token {
            self.saw_first_token = true;
            self.metrics.time_to_first_token(now - self.started);
        }
        let mut deltas = Vec::with_capacity(tokens.len());
        for t in tokens {
            let Some(choice) = self.choices.get_mut(t.index) else {
                continue;
            };
            if choice.text.is_done() {
                continue;
            }
            if let Some(last) = choice.last_token_at.replace(now) {
                self.metrics.inter_token_latency(now - last);
            }
            let text = choice
                .text
                .push(&self.tokenizer, t.token, t.finished)
                .map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
            deltas.push(Delta {
                index: t.index,
                text,
                logprobs: t
                    .logprobs
                    .map(|lp| LogprobEntry {
                        token: t.token,
                        logprob: lp.logprob,
                        top: lp.top,
                    })
                    .into_iter()
                    .collect(),
                finish_reason: choice.text.finish_reason,
            });
        }
        Ok(deltas)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let outcome = if self.all_done() && !self.failed {
            Outcome::Completed
        } else {
            Outcome::Cancelled
        };
        self.metrics.request_done(outcome);
    }
}

impl Reply {
    fn token_text(tok: &Tokenizer, id: u32) -> String {
        tok.decode(&[id]).unwrap_or_default()
    }

    /// The `logprobs` object of a choice (or chunk), in the endpoint's format.
    fn logprobs(&self, tok: &Tokenizer, entries: &[LogprobEntry], text_offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Completions => {
                let mut offset = text_offset;
                let mut offsets = Vec::with_capacity(entries.len());
                let mut tokens = Vec::with_capacity(entries.len());
                for e in entries {
                    let text = Self::token_text(tok, e.token);
                    offsets.push(offset);
                    offset += text.len();
                    tokens.push(text);
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                    "top_logprobs": entries.iter().map(|e| {
                        e.top.iter().map(|&(id, lp)| (Self::token_text(tok, id), json!(lp))).collect::<serde_json::Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
            Endpoint::ChatCompletions => {
                let item = |id: u32, lp: f32| {
                    let text = Self::token_text(tok, id);
                    json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
                };
                json!({"content": entries.iter().map(|e| {
                    let mut v = item(e.token, e.logprob);
                    v["top_logprobs"] = e.top.iter().map(|&(id, lp)| item(id, lp)).collect();
                    v
                }).collect::<Vec<_>>()})
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// Non-streaming: waits for every choice, then answers once.
async fn complete(
    reply: Reply,
    mut collector: Collector,
    mut updates: mpsc::Receiver<Update>,
) -> Response {
    let n = collector.choices.len();
    let mut texts = vec![String::new(); n];
    let mut logprobs: Vec<Vec<LogprobEntry>> = (0..n).map(|_| Vec::new()).collect();
    while !collector.all_done() {
        let deltas = match updates.recv().await {
            Some(Update::Tokens(tokens)) => collector.apply(tokens),
            Some(Update::Failed(message)) => Err(ApiError::new(500, "server_error", message)),
            None => Err(ApiError::new(500, "server_error", "the engine stopped")),
        };
        match deltas {
            Ok(deltas) => {
                for d in deltas {
                    texts[d.index].push_str(&d.text);
                    logprobs[d.index].extend(d.logprobs);
                }
            }
            Err(e) => {
                collector.failed = true;
                return error_response(&e);
            }
        }
    }
    let tok = collector.tokenizer.clone();
    let choices = (0..n)
        .map(|i| {
            let finish_reason = collector.choices[i].text.finish_reason;
            let lp = reply.logprobs(&tok, &logprobs[i], 0);
            match reply.endpoint {
                Endpoint::Completions => json!({
                    "index": i, "text": texts[i], "logprobs": lp, "finish_reason": finish_reason,
                }),
                Endpoint::ChatCompletions => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }),
            }
        })
        .collect();
    let mut body = reply.envelope(false, choices);
    body["usage"] = api::usage(reply.prompt_tokens, collector.completion_tokens());
    json_response(StatusCode::OK, body)
}

/// Where a stream is.
struct StreamState {
    reply: Reply,
    collector: Collector,
    updates: mpsc::Receiver<Update>,
    /// Events ready to go out.
    queue: VecDeque<Event>,
    /// Bytes of text sent per choice (completions logprobs' `text_offset`).
    sent: Vec<usize>,
    finished: bool,
}

impl StreamState {
    fn data(value: &Value) -> Event {
        Event::default().data(value.to_string())
    }

    fn push_deltas(&mut self, deltas: Vec<Delta>) {
        let tok = self.collector.tokenizer.clone();
        for d in deltas {
            if d.text.is_empty() && d.finish_reason.is_none() && d.logprobs.is_empty() {
                continue;
            }
            let lp = self.reply.logprobs(&tok, &d.logprobs, self.sent[d.index]);
            self.sent[d.index] += d.text.len();
            let choice = match self.reply.endpoint {
                Endpoint::Completions => json!({
                    "index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                }),
                Endpoint::ChatCompletions => {
                    let delta = if d.text.is_empty() {
                        json!({})
                    } else {
                        json!({"content": d.text})
                    };
                    json!({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
                }
            };
            let chunk = self.reply.envelope(true, vec![choice]);
            self.queue.push_back(Self::data(&chunk));
        }
    }

    fn push_end(&mut self) {
        if self.reply.include_usage {
            let mut chunk = self.reply.envelope(true, Vec::new());
            chunk["usage"] =
                api::usage(self.reply.prompt_tokens, self.collector.completion_tokens());
            self.queue.push_back(Self::data(&chunk));
        }
        self.queue.push_back(Event::default().data("[DONE]"));
        self.finished = true;
    }

    /// The next event, waiting for the engine when none is ready.
    async fn next(mut self) -> Option<(Result<Event, Infallible>, Self)> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some((Ok(event), self));
            }
            if self.finished {
                return None;
            }
            match self.updates.recv().await {
                Some(Update::Tokens(tokens)) => match self.collector.apply(tokens) {
                    Ok(deltas) => {
                        self.push_deltas(deltas);
                        if self.collector.all_done() {
                            self.push_end();
                        }
                    }
                    Err(e) => self.fail(&e),
                },
                Some(Update::Failed(message)) => {
                    self.fail(&ApiError::new(500, "server_error", message))
                }
                None => self.fail(&ApiError::new(500, "server_error", "the engine stopped")),
            }
        }
    }

    fn fail(&mut self, e: &ApiError) {
        self.collector.failed = true;
        self.queue.push_back(Self::data(&e.body()));
        self.finished = true;
    }
}

/// Streaming: one server-sent event per new piece of a choice, then
/// `usage` (when asked) and `[DONE]`. A client that goes away drops the
/// stream, and with it the receiver, which cancels the request.
fn stream(reply: Reply, collector: Collector, updates: mpsc::Receiver<Update>) -> Response {
    let n = collector.choices.len();
    let mut state = StreamState {
        reply,
        collector,
        updates,
        queue: VecDeque::new(),
        sent: vec![0; n],
        finished: false,
    };
    if state.reply.endpoint == Endpoint::ChatCompletions {
        for i in 0..n {
            let chunk = state.reply.envelope(
                true,
                vec![json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})],
            );
            state.queue.push_back(StreamState::data(&chunk));
        }
    }
    Sse::new(futures_util::stream::unfold(state, StreamState::next)).into_response()
}
