//! A request's updates turned into output per choice: text cut at stop
//! strings ([`ChoiceText`]), then, for a chat with tools, content and tool
//! calls ([`ToolCallParser`]); logprobs; the latencies the metrics record.

use std::sync::Arc;
use std::time::Instant;

use tandem_core::tokenizer::Tokenizer;

use crate::api::{ApiError, Job};
use crate::engine_loop::{ChoiceToken, EndReason};
use crate::metrics::{Metrics, Outcome};
use crate::text::ChoiceText;
use crate::tool_parser::{ToolCallParser, ToolEvent};

/// One token's logprobs; `logprob` is `None` for a prompt's first token,
/// which nothing precedes.
#[derive(Clone, Debug)]
pub struct LogprobEntry {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// New output of one choice.
pub struct Delta {
    pub index: usize,
    /// Text as content, or tool calls being read.
    pub pieces: Vec<ToolEvent>,
    pub logprobs: Vec<LogprobEntry>,
    pub finish_reason: Option<&'static str>,
}

struct Choice {
    text: ChoiceText,
    /// Reads tool calls from the text (a chat with tools).
    tools: Option<ToolCallParser>,
    /// Sum of the generated tokens' logprobs (`best_of` keeps the highest).
    logprob_sum: f64,
    last_token_at: Option<Instant>,
}

impl Choice {
    /// The choice's `finish_reason`: `"tool_calls"` for one that stopped after calls.
    fn finish_reason(&self) -> Option<&'static str> {
        match self.text.finish_reason {
            Some("stop") if self.tools.as_ref().is_some_and(|t| t.calls() > 0) => {
                Some("tool_calls")
            }
            reason => reason,
        }
    }

    /// `text` as pieces of output; the held rest too once the choice is done.
    fn pieces(&mut self, text: String) -> Vec<ToolEvent> {
        let done = self.text.is_done();
        match &mut self.tools {
            Some(parser) => {
                let mut pieces = parser.push(&text);
                if done {
                    pieces.extend(parser.finish());
                }
                pieces
            }
            None if text.is_empty() => Vec::new(),
            None => vec![ToolEvent::Content(text)],
        }
    }
}

/// Turns a request's updates into output per choice and records latencies.
pub struct Collector {
    pub tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    choices: Vec<Choice>,
    started: Instant,
    saw_first_token: bool,
    pub failed: bool,
}

impl Collector {
    /// `call_ids` starts the ids of the tool calls read.
    pub fn new(
        job: &Job,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<Metrics>,
        started: Instant,
        call_ids: &str,
    ) -> Self {
        let tools = job.tools.as_ref().filter(|t| t.reads_calls());
        Self {
            tokenizer,
            metrics,
            choices: (0..job.samples())
                .map(|i| Choice {
                    text: ChoiceText::new(job.stops.clone()),
                    tools: tools.map(|t| ToolCallParser::new(format!("{call_ids}{i}_"), t)),
                    logprob_sum: 0.0,
                    last_token_at: None,
                })
                .collect(),
            started,
            saw_first_token: false,
            failed: false,
        }
    }

    /// The samples being generated.
    pub fn samples(&self) -> usize {
        self.choices.len()
    }

    pub fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.text.is_done())
    }

    pub fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.text.completion_tokens).sum()
    }

    pub fn finish_reason(&self, index: usize) -> Option<&'static str> {
        self.choices[index].finish_reason()
    }

    /// The indices of the `n` choices with the highest sum of logprobs,
    /// highest first (`best_of`).
    pub fn best(&self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.choices.len()).collect();
        order.sort_by(|&a, &b| {
            let sum = |i: usize| self.choices[i].logprob_sum;
            sum(b).total_cmp(&sum(a)).then(a.cmp(&b))
        });
        order.truncate(n);
        order
    }

    /// Ends every unfinished choice for `reason`.
    pub fn end(&mut self, reason: EndReason) -> Result<Vec<Delta>, ApiError> {
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
                pieces: choice.pieces(text),
                logprobs: Vec::new(),
                finish_reason: choice.finish_reason(),
            });
        }
        Ok(deltas)
    }

    pub fn apply(&mut self, tokens: Vec<ChoiceToken>) -> Result<Vec<Delta>, ApiError> {
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
            let pieces = choice.pieces(text);
            if choice.tools.as_ref().is_some_and(ToolCallParser::is_ended) && !choice.text.is_done()
            {
                // Its one call is complete: the choice ends (what it still held is past the call).
                let rest = choice.text.end(&self.tokenizer, "stop");
                rest.map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
            }
            if let Some(lp) = &t.logprobs {
                choice.logprob_sum += f64::from(lp.logprob);
            }
            deltas.push(Delta {
                index: t.index,
                pieces,
                logprobs: t
                    .logprobs
                    .map(|lp| LogprobEntry {
                        token: t.token,
                        logprob: Some(lp.logprob),
                        top: lp.top,
                    })
                    .into_iter()
                    .collect(),
                finish_reason: choice.finish_reason(),
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
