//! The HTTP routes: OpenAI-compatible completions and chat completions
//! (JSON or server-sent events), models, vLLM's `/tokenize` and
//! `/detokenize`, health and metrics.
//!
//! A generation request is read and checked in this order: the API key
//! (before the body is read), the body (within `body_read_timeout`, at most
//! `max_body_bytes`), then the JSON, the chat template and the tokenizer on
//! the blocking pool, never on the async runtime's threads, at most one
//! request per core at a time (the others wait for a slot, so a flood of
//! large prompts neither stalls `/health` and the streams nor queues
//! unbounded blocking work), then admission by the engine. `/tokenize` and
//! `/detokenize` go through the same key check, body limits and slots.
//!
//! Every failure is an OpenAI error body with a fitting status: 400 for bad
//! fields or a prompt too long for the context, 401 for a wrong API key, 404
//! for an unknown model or path, 408 for a body not received in time, 413
//! for an oversized body, 503 (with `Retry-After`) when the waiting queue is
//! full or the server is shutting down, 500 when generation itself fails;
//! 504 for a request whose deadline passed before its first token.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tandem_core::sched::SubmitError;
use tokio::sync::{mpsc, Semaphore};

use crate::api::{self, ApiError, Endpoint, Job, Limits};
use crate::auth::ApiKey;
use crate::engine_loop::{EngineHandle, Refused, Update};
use crate::metrics::Outcome;
use crate::response::{self, Echo, Reply};
use crate::tokenize;

/// `Retry-After` (seconds) of a 503: a full queue drains in about a step's time.
const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients pass as `model` (and `/v1/models` lists).
    pub model_id: String,
    /// When set, `/v1/*` requests must carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// A connection that has not sent a whole request head within this is
    /// closed (idle keep-alive connections included).
    pub header_read_timeout: Duration,
    /// A body not received within this (from the end of the head) gets 408.
    pub body_read_timeout: Duration,
    /// Most connections open at once; more wait in the accept backlog.
    pub max_connections: usize,
    /// How long a shutdown lets running requests finish before ending them.
    pub shutdown_grace: Duration,
    /// The deadline of requests that set none, and the longest one a request may set.
    pub request_timeout: Option<Duration>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_id: "model".into(),
            api_key: None,
            max_body_bytes: 4 << 20,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 2048,
            shutdown_grace: Duration::from_secs(30),
            request_timeout: None,
        }
    }
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    config: Arc<ServerConfig>,
    api_key: Option<Arc<ApiKey>>,
    /// Slots for parsing and tokenizing on the blocking pool, one per core.
    parse_slots: Arc<Semaphore>,
    /// Request ids, and the seeds of requests that give none.
    counter: Arc<AtomicU64>,
    started: u64,
}

pub fn router(engine: EngineHandle, config: ServerConfig) -> Router {
    let body_limit = config.max_body_bytes;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let state = AppState {
        engine,
        api_key: config.api_key.as_deref().map(|k| Arc::new(ApiKey::new(k))),
        config: Arc::new(config),
        parse_slots: Arc::new(Semaphore::new(cores)),
        counter: Arc::new(AtomicU64::new(0)),
        started: unix_time(),
    };
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize_text))
        .route("/detokenize", post(detokenize_ids))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json_response(status, e.body());
    let headers = response.headers_mut();
    match status {
        StatusCode::SERVICE_UNAVAILABLE => {
            headers.insert(header::RETRY_AFTER, RETRY_AFTER_SECONDS.into());
        }
        // The rest of the body may still be on its way: the connection cannot be reused.
        StatusCode::REQUEST_TIMEOUT => {
            headers.insert(header::CONNECTION, "close".parse().expect("a header value"));
        }
        _ => {}
    }
    response
}

pub(crate) fn json_response(status: StatusCode, body: Value) -> Response {
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

fn check_key(s: &AppState, request: &Request) -> Result<(), ApiError> {
    match &s.api_key {
        Some(key) => key.check(request.headers()),
        None => Ok(()),
    }
}

async fn models(State(s): State<AppState>, request: Request) -> Response {
    if let Err(e) = check_key(&s, &request) {
        return error_response(&e);
    }
    json_response(
        StatusCode::OK,
        json!({"object": "list", "data": [{
            "id": s.config.model_id, "object": "model", "created": s.started, "owned_by": "tandem",
        }]}),
    )
}

async fn completions(State(s): State<AppState>, request: Request) -> Response {
    generate(s, request, Endpoint::Completions).await
}

async fn chat_completions(State(s): State<AppState>, request: Request) -> Response {
    generate(s, request, Endpoint::ChatCompletions).await
}

async fn tokenize_text(State(s): State<AppState>, request: Request) -> Response {
    answer(&s, request, tokenize::tokenize).await
}

async fn detokenize_ids(State(s): State<AppState>, request: Request) -> Response {
    answer(&s, request, tokenize::detokenize).await
}

/// A request answered from its body alone, off the async runtime.
async fn answer(
    s: &AppState,
    request: Request,
    reply: fn(&[u8], &Limits<'_>) -> Result<Value, ApiError>,
) -> Response {
    let result = async {
        check_key(s, &request)?;
        let body = read_body(s, request).await?;
        off_runtime(s, move |limits| reply(&body, limits)).await
    };
    match result.await {
        Ok(value) => json_response(StatusCode::OK, value),
        Err(e) => error_response(&e),
    }
}

async fn generate(s: AppState, request: Request, endpoint: Endpoint) -> Response {
    let arrived = Instant::now();
    match start(&s, request, endpoint, arrived).await {
        Ok((job, echo, updates)) => {
            let n = s.counter.fetch_add(1, Ordering::Relaxed);
            let prefix = match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::ChatCompletions => "chatcmpl",
            };
            let reply = Reply {
                id: format!("{prefix}-{n}"),
                created: unix_time(),
                model: s.config.model_id.clone(),
                endpoint,
                prompt_tokens: job.prompt_tokens(),
                logprobs: job.logprobs.is_some(),
                tokens_as_ids: job.tokens_as_ids,
                include_usage: job.include_usage,
                choices: job.choices,
                echo,
            };
            let tokenizer = s.engine.tokenizer.clone();
            let metrics = s.engine.metrics.clone();
            response::respond(reply, &job, updates, tokenizer, metrics, arrived).await
        }
        Err(e) => {
            s.engine.metrics.request_done(Outcome::Rejected);
            error_response(&e)
        }
    }
}

/// Checks the request, scores its prompt for `echo` with logprobs, and
/// queues it in the engine.
async fn start(
    s: &AppState,
    request: Request,
    endpoint: Endpoint,
    arrived: Instant,
) -> Result<(Job, Option<Echo>, mpsc::Receiver<Update>), ApiError> {
    check_key(s, &request)?;
    let body = read_body(s, request).await?;
    let job = off_runtime(s, move |limits| api::parse(endpoint, &body, limits)).await?;
    let echo = match (&job.echo, job.logprobs) {
        (None, _) => None,
        (Some(text), None) => Some(Echo {
            text: text.clone(),
            logprobs: Vec::new(),
        }),
        (Some(text), Some(top)) => Some(Echo {
            text: text.clone(),
            logprobs: s
                .engine
                .score(job.request.prompt.clone(), top)
                .await
                .map_err(|e| {
                    ApiError::new(
                        503,
                        "server_error",
                        format!("scoring the prompt for 'echo' failed: {e}"),
                    )
                })?,
        }),
    };
    let timeout = job
        .timeout
        .into_iter()
        .chain(s.config.request_timeout)
        .min();
    let updates = s
        .engine
        .submit(job.request.clone(), timeout.map(|t| arrived + t))
        .await
        .map_err(|e| match e {
            Refused::Engine(SubmitError::Rejected(e)) => ApiError::bad_request(e.to_string(), None),
            Refused::Engine(SubmitError::QueueFull(_)) | Refused::ShuttingDown => {
                ApiError::new(503, "server_error", e.to_string())
            }
        })?;
    Ok((job, echo, updates))
}

/// The whole body, within the body read timeout and the size limit.
async fn read_body(s: &AppState, request: Request) -> Result<Bytes, ApiError> {
    let limit = s.config.body_read_timeout;
    let body = tokio::time::timeout(limit, Bytes::from_request(request, &()))
        .await
        .map_err(|_| {
            ApiError::new(
                408,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    limit.as_secs_f64()
                ),
            )
        })?;
    body.map_err(|rejection| {
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
    })
}

/// `work` on the blocking pool, in one of the per-core slots.
async fn off_runtime<T: Send + 'static>(
    s: &AppState,
    work: impl FnOnce(&Limits<'_>) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let slot = s
        .parse_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::new(503, "server_error", "the server is shutting down"))?;
    let engine = s.engine.clone();
    let config = s.config.clone();
    let default_seed = s.counter.fetch_add(1, Ordering::Relaxed) ^ s.started.rotate_left(32);
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let limits = Limits {
            model_id: &config.model_id,
            max_context: engine.max_context,
            kv_block_size: engine.kv_block_size,
            tokenizer: &engine.tokenizer,
            token_floor: &engine.token_floor,
            structured: &engine.structured,
            default_seed,
        };
        work(&limits)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            500,
            "server_error",
            format!("reading the request failed: {e}"),
        )
    })?
}
