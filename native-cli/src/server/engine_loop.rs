//! The engine on its own thread. HTTP tasks send it [`Command`]s over a
//! channel; it answers each submission with an admission result and then
//! streams [`Update`]s into the request's own bounded channel.
//!
//! The loop never blocks on a client: updates go out with `try_send`, and
//! whatever does not fit waits in the request's backlog for the next
//! iteration. Before every step, requests whose receiver is gone are removed
//! from the engine, which frees their KV blocks at once.
//!
//! Between steps it also scores prompts ([`Command::Score`], completions'
//! `echo` with `logprobs`), which holds the other requests for that time.
//!
//! The loop also ends requests early, removing them from the engine the same
//! way and sending [`Update::Ended`]: a request whose deadline has passed
//! ([`EndReason::Timeout`]), and every request when the server shuts down
//! ([`Command::EndAll`], [`EndReason::Shutdown`]), after which it refuses
//! new ones.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use tandem_core::engine::{Engine, FinishReason, Request, TokenLogprobs};
use tandem_core::kv::SeqId;
use tandem_core::sched::SubmitError;
use tandem_core::tokenizer::Tokenizer;
use tandem_core::Backend;
use tandem_structured::StructuredOutput;
use tokio::sync::{mpsc, oneshot};

use crate::collector::LogprobEntry;
use crate::metrics::Metrics;
use crate::scoring;
use crate::token_floor::TokenFloor;

/// Updates one request's channel holds before the loop keeps them in its backlog.
const UPDATE_CHANNEL_CAPACITY: usize = 64;

/// How long an idle loop waits before offering slow clients their backlog again.
const BACKLOG_RETRY: Duration = Duration::from_millis(2);

/// One token of one choice.
#[derive(Clone, Debug)]
pub struct ChoiceToken {
    /// Index of the choice (sample) within the request.
    pub index: usize,
    pub token: u32,
    pub finished: Option<FinishReason>,
    pub logprobs: Option<TokenLogprobs>,
}

/// What the engine sends a request after admission.
#[derive(Debug)]
pub enum Update {
    /// Tokens of one or more of the request's choices, from one step.
    Tokens(Vec<ChoiceToken>),
    /// The engine failed; the request ends.
    Failed(String),
    /// The server ended the request: every choice not finished yet ends for this reason.
    Ended(EndReason),
}

/// Why the server ended a request before its choices finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// Its deadline passed.
    Timeout,
    /// The server is shutting down and the grace period is over.
    Shutdown,
}

impl EndReason {
    /// The `finish_reason` of the choices it ends.
    pub fn finish_reason(self) -> &'static str {
        match self {
            EndReason::Timeout => "timeout",
            EndReason::Shutdown => "abort",
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Engine(#[from] SubmitError),
    #[error("the server is shutting down")]
    ShuttingDown,
}

pub enum Command {
    Submit {
        /// Boxed: a request is far larger than the other commands.
        request: Box<Request>,
        /// When the loop ends the request if it has not finished.
        deadline: Option<Instant>,
        updates: mpsc::Sender<Update>,
        admitted: oneshot::Sender<Result<(), Refused>>,
    },
    /// Ends every request ([`EndReason::Shutdown`]) and refuses new ones.
    EndAll,
    /// Each prompt token's logprob, with `top` alternatives.
    Score {
        tokens: Vec<u32>,
        top: usize,
        scored: oneshot::Sender<Result<Vec<LogprobEntry>, String>>,
    },
}

/// What the HTTP side holds: the way in, the tokenizer and the model's limits.
#[derive(Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    pub tokenizer: Arc<Tokenizer>,
    /// Compiles `response_format` and grammars for the tokenizer.
    pub structured: Arc<StructuredOutput>,
    pub token_floor: TokenFloor,
    pub max_context: usize,
    /// Tokens per KV block (what a request's KV budget is planned in).
    pub kv_block_size: usize,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// Queues `request`, to be ended at `deadline` if it has not finished;
    /// on admission returns the receiver of its updates.
    pub async fn submit(
        &self,
        request: Request,
        deadline: Option<Instant>,
    ) -> Result<mpsc::Receiver<Update>, Refused> {
        let (updates, receiver) = mpsc::channel(UPDATE_CHANNEL_CAPACITY);
        let (admitted, answer) = oneshot::channel();
        self.commands
            .send(Command::Submit {
                request: Box::new(request),
                deadline,
                updates,
                admitted,
            })
            .map_err(|_| Refused::ShuttingDown)?;
        answer.await.map_err(|_| Refused::ShuttingDown)??;
        Ok(receiver)
    }

    /// Each of `tokens`' logprob after the tokens before it, with `top`
    /// alternatives (the first token has none).
    pub async fn score(&self, tokens: Vec<u32>, top: usize) -> Result<Vec<LogprobEntry>, String> {
        let (scored, answer) = oneshot::channel();
        self.commands
            .send(Command::Score {
                tokens,
                top,
                scored,
            })
            .map_err(|_| Refused::ShuttingDown.to_string())?;
        answer
            .await
            .map_err(|_| Refused::ShuttingDown.to_string())?
    }

    /// Ends every request now (`finish_reason: "abort"`) and refuses new ones.
    pub fn end_all(&self) {
        let _ = self.commands.send(Command::EndAll);
    }
}

/// What the engine thread reports once its engine is built.
struct Ready {
    tokenizer: Tokenizer,
    max_context: usize,
    kv_block_size: usize,
}

/// The engine thread's end of the channels, handed to the closure that builds the engine.
pub struct EngineInbox {
    commands: std_mpsc::Receiver<Command>,
    ready: std_mpsc::Sender<Ready>,
    metrics: Arc<Metrics>,
}

/// Starts the engine thread. `start` runs on it (backends need not be
/// `Send`): it builds the engine and calls [`EngineInbox::run`], which
/// returns when every [`EngineHandle`] is dropped.
pub fn spawn_engine<F>(start: F) -> Result<EngineHandle>
where
    F: FnOnce(EngineInbox) -> Result<()> + Send + 'static,
{
    let (commands_tx, commands) = std_mpsc::channel();
    let (ready, ready_rx) = std_mpsc::channel();
    let metrics = Arc::new(Metrics::default());
    let inbox = EngineInbox {
        commands,
        ready,
        metrics: metrics.clone(),
    };
    let thread = thread::Builder::new()
        .name("tandem-engine".into())
        .spawn(move || start(inbox))
        .context("starting the engine thread")?;
    match ready_rx.recv() {
        Ok(Ready {
            tokenizer,
            max_context,
            kv_block_size,
        }) => {
            let tokenizer = Arc::new(tokenizer);
            Ok(EngineHandle {
                commands: commands_tx,
                token_floor: TokenFloor::of(&tokenizer),
                structured: Arc::new(StructuredOutput::new(tokenizer.clone())),
                tokenizer,
                max_context,
                kv_block_size,
                metrics,
            })
        }
        Err(_) => match thread.join() {
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Err(anyhow!("the engine thread stopped before it was ready")),
            Err(_) => Err(anyhow!("the engine thread panicked while starting")),
        },
    }
}

/// A request being generated, as the loop tracks it.
struct Active {
    /// Its sequences, one per choice; `None` once that choice finished.
    seqs: Vec<Option<SeqId>>,
    updates: mpsc::Sender<Update>,
    /// Updates the client has not taken yet.
    backlog: VecDeque<Update>,
    deadline: Option<Instant>,
}

impl Active {
    fn is_done(&self) -> bool {
        self.seqs.iter().all(Option::is_none)
    }

    /// Removes the unfinished choices from the engine and tells the client why.
    fn end<B: Backend>(
        &mut self,
        reason: EndReason,
        engine: &mut Engine<B>,
        owner: &mut HashMap<SeqId, (u64, usize)>,
    ) {
        if self.is_done() {
            return;
        }
        for s in self.seqs.iter_mut().filter_map(Option::take) {
            engine.remove(s);
            owner.remove(&s);
        }
        self.backlog.push_back(Update::Ended(reason));
    }
}

impl EngineInbox {
    /// Serves commands until every handle is dropped.
    pub fn run<B: Backend>(self, mut engine: Engine<B>, tokenizer: Tokenizer) -> Result<()> {
        let ready = Ready {
            tokenizer,
            max_context: engine.max_context(),
            kv_block_size: engine.config().block_size,
        };
        if self.ready.send(ready).is_err() {
            return Ok(());
        }
        let mut active: HashMap<u64, Active> = HashMap::new();
        // Which request and choice each sequence belongs to.
        let mut owner: HashMap<SeqId, (u64, usize)> = HashMap::new();
        let mut next_request = 0u64;
        let mut shutting_down = false;
        let total_blocks = engine.kv_manager().num_blocks();
        loop {
            // Wait for work when idle; otherwise take what has arrived and step.
            let first = if engine.has_work() {
                self.commands.try_recv().ok()
            } else if !active.is_empty() {
                // Only slow clients' backlogs are left: look again shortly.
                self.commands.recv_timeout(BACKLOG_RETRY).ok()
            } else {
                match self.commands.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return Ok(()),
                }
            };
            for command in first
                .into_iter()
                .chain(std::iter::from_fn(|| self.commands.try_recv().ok()))
            {
                let (request, deadline, updates, admitted) = match command {
                    Command::Submit {
                        request,
                        deadline,
                        updates,
                        admitted,
                    } => (*request, deadline, updates, admitted),
                    Command::EndAll => {
                        shutting_down = true;
                        for a in active.values_mut() {
                            a.end(EndReason::Shutdown, &mut engine, &mut owner);
                        }
                        continue;
                    }
                    Command::Score {
                        tokens,
                        top,
                        scored,
                    } => {
                        let result = scoring::prompt_logprobs(&mut engine, &tokens, top);
                        let _ = scored.send(result.map_err(|e| e.to_string()));
                        continue;
                    }
                };
                if shutting_down {
                    let _ = admitted.send(Err(Refused::ShuttingDown));
                    continue;
                }
                match engine.submit(request) {
                    Ok(ids) => {
                        if admitted.send(Ok(())).is_err() {
                            // The client left while queued.
                            ids.iter().for_each(|&s| engine.remove(s));
                            continue;
                        }
                        let id = next_request;
                        next_request += 1;
                        for (choice, &s) in ids.iter().enumerate() {
                            owner.insert(s, (id, choice));
                        }
                        active.insert(
                            id,
                            Active {
                                seqs: ids.into_iter().map(Some).collect(),
                                updates,
                                backlog: VecDeque::new(),
                                deadline,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = admitted.send(Err(e.into()));
                    }
                }
            }
            // End requests whose deadline has passed.
            let now = Instant::now();
            for a in active.values_mut() {
                if a.deadline.is_some_and(|d| d <= now) {
                    a.end(EndReason::Timeout, &mut engine, &mut owner);
                }
            }
            // Cancel requests nobody listens to any more.
            active.retain(|_, a| {
                if !a.updates.is_closed() {
                    return true;
                }
                for s in a.seqs.iter().flatten() {
                    engine.remove(*s);
                    owner.remove(s);
                }
                false
            });
            if engine.has_work() {
                match engine.step() {
                    Ok(events) => {
                        let mut per_request: HashMap<u64, Vec<ChoiceToken>> = HashMap::new();
                        for ev in events {
                            let Some(&(id, index)) = owner.get(&ev.seq) else {
                                continue;
                            };
                            if ev.finished.is_some() {
                                engine.remove(ev.seq);
                                owner.remove(&ev.seq);
                                if let Some(a) = active.get_mut(&id) {
                                    a.seqs[index] = None;
                                }
                            }
                            per_request.entry(id).or_default().push(ChoiceToken {
                                index,
                                token: ev.token,
                                finished: ev.finished,
                                logprobs: ev.logprobs,
                            });
                        }
                        for (id, tokens) in per_request {
                            if let Some(a) = active.get_mut(&id) {
                                a.backlog.push_back(Update::Tokens(tokens));
                            }
                        }
                    }
                    Err(failure) => {
                        // The engine removed the failed step's sequences: their
                        // requests end (with any sibling choices), the others go
                        // on. A failure naming none blocks everyone: all end.
                        let message = format!("generation failed: {}", failure.error);
                        let mut ended: Vec<u64> = if failure.failed.is_empty() {
                            active.keys().copied().collect()
                        } else {
                            (failure.failed.iter())
                                .filter_map(|s| owner.get(s).map(|&(id, _)| id))
                                .collect()
                        };
                        ended.sort_unstable();
                        ended.dedup();
                        for id in ended {
                            let Some(a) = active.get_mut(&id) else {
                                continue;
                            };
                            for s in a.seqs.iter_mut().filter_map(Option::take) {
                                engine.remove(s);
                                owner.remove(&s);
                            }
                            a.backlog.push_back(Update::Failed(message.clone()));
                        }
                    }
                }
            }
            // Hand out what each client can take now; keep the rest.
            active.retain(|_, a| {
                while let Some(update) = a.backlog.pop_front() {
                    match a.updates.try_send(update) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full(update)) => {
                            a.backlog.push_front(update);
                            break;
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => {
                            a.backlog.clear();
                            break;
                        }
                    }
                }
                // Dropping the sender of a finished request ends its stream.
                !(a.is_done() && a.backlog.is_empty())
            });
            self.metrics.update_engine(engine.stats(), total_blocks);
        }
    }
}
