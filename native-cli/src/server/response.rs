//! Responses: a request's output per choice ([`Collector`]) answered once
//! as JSON or streamed as server-sent events.
//!
//! A request the server ends early (deadline, shutdown) ends like any other:
//! each unfinished choice gets the server's `finish_reason` (`"timeout"`,
//! `"abort"`) with the text it had, a stream then sends `usage` (when asked)
//! and `[DONE]`. A non-streaming request that got no token at all is an
//! error instead: 504 for its deadline, 503 for a shutdown.
//!
//! A chat's tool calls are `message.tool_calls` (content `null` when the
//! choice is only calls) and, streamed, `delta.tool_calls`: first the
//! call's index, id, type and name with empty arguments, then argument
//! fragments under the same index. `best_of` answers with the `n` choices
//! whose tokens have the highest summed logprob, highest first. `echo`
//! puts the prompt before each choice's text (and its tokens' logprobs
//! before the generated ones').

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
use crate::collector::{Collector, Delta, LogprobEntry};
use crate::engine_loop::{EndReason, Update};
use crate::http::{error_response, json_response};
use crate::logprobs::{self, TokenNames};
use crate::metrics::Metrics;
use crate::tool_parser::ToolEvent;

/// The fixed fields of a response.
pub struct Reply {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub prompt_tokens: usize,
    /// The client asked for logprobs.
    pub logprobs: bool,
    /// Tokens in logprobs are named `token_id:ID` (vLLM's `return_tokens_as_token_ids`).
    pub tokens_as_ids: bool,
    pub include_usage: bool,
    /// How many choices the response has (`n`; fewer than generated with `best_of`).
    pub choices: usize,
    /// The prompt, put before each choice's text (completions' `echo`).
    pub echo: Option<Echo>,
}

/// An echoed prompt: its text and, when logprobs were asked for, its tokens'.
#[derive(Clone, Debug, Default)]
pub struct Echo {
    pub text: String,
    pub logprobs: Vec<LogprobEntry>,
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
    let call_ids = format!("call_{}_", reply.id);
    let collector = Collector::new(job, tokenizer, metrics, started, &call_ids);
    if job.stream {
        stream(reply, collector, updates)
    } else {
        complete(reply, collector, updates).await
    }
}

/// One choice's output, gathered.
#[derive(Default)]
struct Output {
    content: String,
    /// `(id, name, arguments)`.
    calls: Vec<(String, String, String)>,
    logprobs: Vec<LogprobEntry>,
}

impl Output {
    fn add(&mut self, d: Delta) {
        for piece in d.pieces {
            match piece {
                ToolEvent::Content(text) => self.content.push_str(&text),
                ToolEvent::Call { id, name, .. } => self.calls.push((id, name, String::new())),
                ToolEvent::Arguments { index, text } => self.calls[index].2.push_str(&text),
            }
        }
        self.logprobs.extend(d.logprobs);
    }
}

impl Reply {
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

    fn names<'a>(&self, tokenizer: &'a Tokenizer) -> TokenNames<'a> {
        TokenNames {
            tokenizer,
            as_ids: self.tokens_as_ids,
        }
    }

    fn echo_text(&self) -> &str {
        self.echo.as_ref().map_or("", |e| e.text.as_str())
    }

    /// A whole choice.
    fn choice(
        &self,
        tok: &Tokenizer,
        index: usize,
        out: &Output,
        finish_reason: Option<&str>,
    ) -> Value {
        match self.endpoint {
            Endpoint::Completions => {
                let lp = self.logprobs.then(|| {
                    let echoed = self.echo.iter().flat_map(|e| e.logprobs.iter());
                    let all: Vec<LogprobEntry> = echoed.chain(&out.logprobs).cloned().collect();
                    logprobs::completion(self.names(tok), &all, 0)
                });
                json!({
                    "index": index,
                    "text": format!("{}{}", self.echo_text(), out.content),
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                })
            }
            Endpoint::ChatCompletions => {
                let mut message = json!({"role": "assistant", "content": out.content});
                if !out.calls.is_empty() {
                    if out.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = (out.calls.iter())
                        .map(|(id, name, arguments)| {
                            json!({"id": id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}})
                        })
                        .collect();
                }
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": self.logprobs.then(|| logprobs::chat(self.names(tok), &out.logprobs)),
                    "finish_reason": finish_reason,
                })
            }
        }
    }
}

/// Non-streaming: waits for every choice, then answers once.
async fn complete(
    reply: Reply,
    mut collector: Collector,
    mut updates: mpsc::Receiver<Update>,
) -> Response {
    let mut outputs: Vec<Output> = (0..collector.samples())
        .map(|_| Output::default())
        .collect();
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
            Ok(deltas) => deltas.into_iter().for_each(|d| outputs[d.index].add(d)),
            Err(e) => {
                collector.failed = true;
                return error_response(&e);
            }
        }
    }
    let tok = collector.tokenizer.clone();
    let chosen = if reply.choices < collector.samples() {
        collector.best(reply.choices)
    } else {
        (0..collector.samples()).collect()
    };
    let choices = (chosen.iter().enumerate())
        .map(|(i, &c)| reply.choice(&tok, i, &outputs[c], collector.finish_reason(c)))
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

    fn chunk(&mut self, choice: Value) {
        let chunk = self.reply.envelope(true, vec![choice]);
        self.queue.push_back(Self::data(&chunk));
    }

    /// The first event of each choice: the assistant's role (chat), the echoed prompt (completions).
    fn push_start(&mut self) {
        let tok = self.collector.tokenizer.clone();
        for index in 0..self.collector.samples() {
            match self.reply.endpoint {
                Endpoint::ChatCompletions => self.chunk(json!({
                    "index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null,
                })),
                Endpoint::Completions => {
                    let Some(echo) = &self.reply.echo else {
                        continue;
                    };
                    let lp = (self.reply.logprobs)
                        .then(|| logprobs::completion(self.reply.names(&tok), &echo.logprobs, 0));
                    self.sent[index] = echo.text.len();
                    let choice = json!({"index": index, "text": echo.text, "logprobs": lp, "finish_reason": null});
                    self.chunk(choice);
                }
            }
        }
    }

    fn push_deltas(&mut self, deltas: Vec<Delta>) {
        let tok = self.collector.tokenizer.clone();
        for d in deltas {
            if d.pieces.is_empty() && d.finish_reason.is_none() && d.logprobs.is_empty() {
                continue;
            }
            match self.reply.endpoint {
                Endpoint::Completions => {
                    let text: String = (d.pieces.iter())
                        .map(|p| match p {
                            ToolEvent::Content(t) => t.as_str(),
                            _ => "",
                        })
                        .collect();
                    let lp = (self.reply.logprobs).then(|| {
                        logprobs::completion(
                            self.reply.names(&tok),
                            &d.logprobs,
                            self.sent[d.index],
                        )
                    });
                    self.sent[d.index] += text.len();
                    self.chunk(json!({
                        "index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                    }));
                }
                Endpoint::ChatCompletions => {
                    let mut deltas: Vec<Value> = d.pieces.into_iter().map(chat_delta).collect();
                    if deltas.is_empty() {
                        deltas.push(json!({}));
                    }
                    let last = deltas.len() - 1;
                    for (i, delta) in deltas.into_iter().enumerate() {
                        let lp = (i == 0 && self.reply.logprobs)
                            .then(|| logprobs::chat(self.reply.names(&tok), &d.logprobs));
                        let finish = if i == last { d.finish_reason } else { None };
                        self.chunk(json!({
                            "index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                        }));
                    }
                }
            }
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

/// A chat chunk's `delta` for one piece of output.
fn chat_delta(piece: ToolEvent) -> Value {
    match piece {
        ToolEvent::Content(text) => json!({"content": text}),
        ToolEvent::Call { index, id, name } => json!({"tool_calls": [{
            "index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""},
        }]}),
        ToolEvent::Arguments { index, text } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        }
    }
}

/// Streaming: one server-sent event per new piece of a choice, then
/// `usage` (when asked) and `[DONE]`. A client that goes away drops the
/// stream, and with it the receiver, which cancels the request.
fn stream(reply: Reply, collector: Collector, updates: mpsc::Receiver<Update>) -> Response {
    let n = collector.samples();
    let mut state = StreamState {
        reply,
        collector,
        updates,
        queue: VecDeque::new(),
        sent: vec![0; n],
        finished: false,
    };
    state.push_start();
    Sse::new(futures_util::stream::unfold(state, StreamState::next)).into_response()
}
