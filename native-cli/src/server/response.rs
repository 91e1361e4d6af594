//! Responses: a request's updates turned into text per choice, answered
//! once as JSON or streamed as server-sent events.
//!
//! A request the server ends early (deadline, shutdown) ends like any other:
//! each unfinished choice gets the server's `finish_reason` (`"timeout"`,
//! `"abort"`) with the text it had, a stream then sends `usage` (when asked)
//! and `[DONE]`. A non-streaming request that got no token at all is an
//! error instead: 504 for its deadline, 503 for a shutdown.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tandem_core::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::api::{self, ApiError, Endpoint, Job};
use crate::engine_loop::{ChoiceToken, EndReason, Update};
use crate::http::{error_response, json_response};
use crate::metrics::{Metrics, Outcome};
use crate::text::ChoiceText;

/// The fixed fields of a response.
pub struct Reply {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub prompt_tokens: usize,
    pub logprobs: bool,
    pub include_usage: bool,
}

/// The response to `job`, whose updates come from `updates`.
pub async fn respond(
    reply: Reply,
    job: &Job,
    updates: mpsc::Receiver<Update>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    started: Instant,
) -> Response {
    let collector = Collector::new(job, tokenizer, metrics, started);
    if job.stream {
        stream(reply, collector, updates)
    } else {
        complete(reply, collector, updates).await
    }
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

    /// Ends every unfinished choice for `reason`.
    fn end(&mut self, reason: EndReason) -> Result<Vec<Delta>, ApiError> {
        let mut deltas = Vec::new();
        for (index, choice) in self.choices.iter_mut().enumerate() {
            if choice.text.is_done() {
                continue;
            }
            let text = choice
                .text
                .end(&self.tokenizer, reason.finish_reason())
                .map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
            deltas.push(Delta {
                index,
                text,
                logprobs: Vec::new(),
                finish_reason: choice.text.finish_reason,
            });
        }
        Ok(deltas)
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
            Some(Update::Ended(reason)) if collector.completion_tokens() == 0 => {
                Err(nothing_generated(reason))
            }
            Some(Update::Ended(reason)) => collector.end(reason),
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

/// The error of a non-streaming request ended before its first token.
fn nothing_generated(reason: EndReason) -> ApiError {
    match reason {
        EndReason::Timeout => ApiError::new(
            504,
            "server_error",
            "the request's deadline passed before its first token",
        )
        .with_code("timeout"),
        EndReason::Shutdown => ApiError::new(503, "server_error", "the server is shutting down"),
    }
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
                Some(Update::Tokens(tokens)) => {
                    let deltas = self.collector.apply(tokens);
                    self.push(deltas);
                }
                Some(Update::Ended(reason)) => {
                    let deltas = self.collector.end(reason);
                    self.push(deltas);
                }
                Some(Update::Failed(message)) => {
                    self.fail(&ApiError::new(500, "server_error", message))
                }
                None => self.fail(&ApiError::new(500, "server_error", "the engine stopped")),
            }
        }
    }

    /// Queues new output, then the end once every choice is done.
    fn push(&mut self, deltas: Result<Vec<Delta>, ApiError>) {
        match deltas {
            Ok(deltas) => {
                self.push_deltas(deltas);
                if self.collector.all_done() {
                    self.push_end();
                }
            }
            Err(e) => self.fail(&e),
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
