//! The two ways of serving a workload, driving the engine itself (no
//! HTTP), and what they record: each request's arrival, first token and
//! completion, the KV blocks held over time, and each static batch.
//!
//! Continuous batching hands each request to the engine when it arrives;
//! the scheduler admits it at the next step and a finished sequence leaves
//! at once (iteration-level batching).
//!
//! Static batching is request-level batching as HF `generate` does it: the
//! requests that have arrived (at most `max_running` of them, and no more
//! than the KV pool holds at their padded length) form a batch that starts
//! together and runs until its longest member ends. A finished member keeps
//! its slot: every member decodes to the batch's longest output and only its
//! own tokens count as output. Nothing joins a running batch. `generate`
//! returns the whole batch at once, so a member's end-to-end latency ends
//! when its batch ends; its first token counts when it is computed (as if
//! streamed). Two things flatter this baseline: prompts are not padded, and
//! the batcher knows each output length ahead (a real one reserves KV for
//! `max_new_tokens`).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use tandem_core::engine::{Engine, Request};
use tandem_core::kv::{KvCacheManager, SeqId};
use tandem_core::sched::SamplingParams;
use tandem_core::Backend;

use super::workload::BenchRequest;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Continuous,
    Static,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Continuous => "continuous",
            Mode::Static => "static",
        }
    }
}

/// Where a driver reads the time: seconds since the run started.
pub trait Clock {
    fn now(&self) -> f64;
    /// Returns at time `t` (the engine is idle until the next arrival).
    fn wait_until(&mut self, t: f64);
    /// Called after every engine step.
    fn step_done(&mut self) {}
}

/// Real time, from when it is created.
pub struct WallClock {
    start: Instant,
}

impl WallClock {
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Clock for WallClock {
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn wait_until(&mut self, t: f64) {
        let wait = t - self.now();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
    }
}

/// Simulated time: every engine step takes `step_seconds` and waiting jumps
/// ahead, so the drivers' timing can be checked exactly.
pub struct StepClock {
    now: f64,
    step_seconds: f64,
}

impl StepClock {
    pub fn new(step_seconds: f64) -> Self {
        Self {
            now: 0.0,
            step_seconds,
        }
    }
}

impl Clock for StepClock {
    fn now(&self) -> f64 {
        self.now
    }

    fn wait_until(&mut self, t: f64) {
        self.now = self.now.max(t);
    }

    fn step_done(&mut self) {
        self.now += self.step_seconds;
    }
}

/// One request as it was served (times in seconds since the run started).
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    pub arrival: f64,
    pub first_token: f64,
    pub done: f64,
    pub prompt_tokens: usize,
    /// Its own tokens (a static batch's padding left out).
    pub output_tokens: usize,
}

/// One batch of a static run.
#[derive(Clone, Debug, PartialEq)]
pub struct StaticBatch {
    /// Indices into the workload, in arrival order.
    pub members: Vec<usize>,
    pub started: f64,
    pub ended: f64,
    /// The longest member's output, which every member decodes.
    pub padded_output: usize,
    pub steps: u64,
}

/// KV blocks held by sequences over a run, integrated over time (the state
/// after each step lasts until the next one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvUse {
    pub pool_blocks: usize,
    pub peak_blocks: usize,
    block_seconds: f64,
    useful_slot_seconds: f64,
    held_slot_seconds: f64,
    /// The last observation: time, blocks held, useful slots, slots of the held blocks.
    last: (f64, usize, usize, usize),
}

impl KvUse {
    fn new(pool_blocks: usize) -> Self {
        Self {
            pool_blocks,
            ..Self::default()
        }
    }

    /// `useful[seq]`: how many of `seq`'s leading tokens count (its prompt and
    /// its own output; a static batch's padding after them does not).
    fn observe(&mut self, t: f64, kv: &KvCacheManager, useful: &HashMap<SeqId, usize>) {
        self.advance(t);
        let bs = kv.block_size();
        // A block shared by several sequences counts once, as far as its fullest holder fills it.
        let mut filled: HashMap<u32, usize> = HashMap::new();
        for (seq, table) in kv.sequences() {
            let tokens = table
                .num_tokens()
                .min(useful.get(&seq).copied().unwrap_or(0));
            for (i, &b) in table.blocks().iter().enumerate() {
                let n = tokens.saturating_sub(i * bs).min(bs);
                let f = filled.entry(b).or_default();
                *f = (*f).max(n);
            }
        }
        let blocks = kv.num_used_blocks();
        self.peak_blocks = self.peak_blocks.max(blocks);
        self.last = (t, blocks, filled.values().sum(), blocks * bs);
    }

    fn advance(&mut self, t: f64) {
        let (since, blocks, useful, held) = self.last;
        let dt = (t - since).max(0.0);
        self.block_seconds += blocks as f64 * dt;
        self.useful_slot_seconds += useful as f64 * dt;
        self.held_slot_seconds += held as f64 * dt;
        self.last.0 = t;
    }

    /// Mean blocks held over `[0, duration]`.
    pub fn mean_blocks(&self, duration: f64) -> f64 {
        self.block_seconds / duration.max(1e-12)
    }

    /// Of the slots in held blocks, the share (time-weighted) holding a
    /// prompt or counted output token; padding and the unfilled end of
    /// each sequence's last block are the rest.
    pub fn useful_fraction(&self) -> f64 {
        self.useful_slot_seconds / self.held_slot_seconds.max(1e-12)
    }
}

/// What one run of a workload recorded.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub mode: Mode,
    /// In workload order.
    pub served: Vec<Served>,
    /// Static runs only.
    pub batches: Vec<StaticBatch>,
    /// From 0 (the first arrival) to the last request's end.
    pub duration: f64,
    pub kv: KvUse,
    pub steps: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Every token the engine generated, a static batch's padding included.
    pub generated_tokens: u64,
}

/// Serves `work`, request `i` arriving at `arrivals[i]` (non-decreasing),
/// greedily on `engine`, and returns what happened. Every request is removed
/// from the engine by the end.
pub fn run<B: Backend>(
    engine: &mut Engine<B>,
    work: &[BenchRequest],
    arrivals: &[f64],
    mode: Mode,
    clock: &mut impl Clock,
) -> Result<RunOutcome> {
    if work.len() != arrivals.len() {
        bail!(
            "{} requests but {} arrival times",
            work.len(),
            arrivals.len()
        );
    }
    if arrivals.windows(2).any(|w| w[1] < w[0])
        || arrivals.iter().any(|t| !t.is_finite() || *t < 0.0)
    {
        bail!("arrival times must be non-negative and in order");
    }
    let before = engine.stats();
    let mut rec = Recorder::new(work, arrivals, engine.kv_manager().num_blocks());
    let batches = match mode {
        Mode::Continuous => {
            continuous(engine, &mut rec, clock)?;
            Vec::new()
        }
        Mode::Static => static_batches(engine, &mut rec, clock)?,
    };
    let after = engine.stats();
    let served = rec.served()?;
    let duration = served.iter().map(|s| s.done).fold(0.0, f64::max);
    let mut kv = rec.kv;
    kv.advance(duration);
    Ok(RunOutcome {
        mode,
        served,
        batches,
        duration,
        kv,
        steps: after.steps - before.steps,
        preemptions: after.preemptions - before.preemptions,
        prompt_tokens: after.prompt_tokens - before.prompt_tokens,
        prefix_hit_tokens: after.prefix_hit_tokens - before.prefix_hit_tokens,
        generated_tokens: after.generated_tokens - before.generated_tokens,
    })
}

/// Every request handed in as it arrives; the scheduler does the rest.
fn continuous<B: Backend>(
    engine: &mut Engine<B>,
    rec: &mut Recorder,
    clock: &mut impl Clock,
) -> Result<()> {
    let mut next = 0;
    loop {
        while next < rec.work.len() && rec.arrivals[next] <= clock.now() {
            rec.submit(engine, next, rec.work[next].output_tokens)?;
            next += 1;
        }
        if !engine.has_work() {
            match rec.arrivals.get(next) {
                Some(&t) => clock.wait_until(t),
                None => return Ok(()),
            }
            continue;
        }
        let events = engine.step()?;
        clock.step_done();
        let t = clock.now();
        for ev in events {
            let i = rec.token(ev.seq, t);
            if ev.finished.is_some() {
                rec.progress[i].done = Some(t);
                engine.remove(ev.seq);
            }
        }
        rec.kv.observe(t, engine.kv_manager(), &rec.useful);
    }
}

/// Batches of the requests that have arrived, each run to its longest
/// member's end before the next is formed.
fn static_batches<B: Backend>(
    engine: &mut Engine<B>,
    rec: &mut Recorder,
    clock: &mut impl Clock,
) -> Result<Vec<StaticBatch>> {
    let kv = engine.kv_manager();
    let fit = BatchFit {
        max_batch: engine.config().max_running,
        pool_blocks: kv.num_blocks(),
        block_size: kv.block_size(),
        max_len: engine.max_context().min(kv.num_blocks() * kv.block_size()),
    };
    let mut batches = Vec::new();
    let mut queue = VecDeque::new();
    let mut next = 0;
    loop {
        while next < rec.work.len() && rec.arrivals[next] <= clock.now() {
            queue.push_back(next);
            next += 1;
        }
        if queue.is_empty() {
            match rec.arrivals.get(next) {
                Some(&t) => clock.wait_until(t),
                None => return Ok(batches),
            }
            continue;
        }
        let members = fit.take(&mut queue, rec.work);
        let padded_output = members
            .iter()
            .map(|&i| rec.work[i].output_tokens)
            .max()
            .unwrap_or(0);
        let started = clock.now();
        let seqs = members
            .iter()
            .map(|&i| rec.submit(engine, i, padded_output))
            .collect::<Result<Vec<_>>>()?;
        let mut steps = 0;
        while engine.has_work() {
            let events = engine.step()?;
            clock.step_done();
            steps += 1;
            let t = clock.now();
            for ev in events {
                rec.token(ev.seq, t);
            }
            rec.kv.observe(t, engine.kv_manager(), &rec.useful);
        }
        let ended = clock.now();
        for (&i, &seq) in members.iter().zip(&seqs) {
            rec.progress[i].done = Some(ended);
            engine.remove(seq);
        }
        rec.kv.observe(ended, engine.kv_manager(), &rec.useful);
        batches.push(StaticBatch {
            members,
            started,
            ended,
            padded_output,
            steps,
        });
    }
}

/// How large a static batch may grow.
struct BatchFit {
    max_batch: usize,
    pool_blocks: usize,
    block_size: usize,
    /// Where the engine stops any sequence.
    max_len: usize,
}

impl BatchFit {
    /// The first queued requests, at most `max_batch`, while the batch's KV
    /// at its padded length fits the pool (always at least one).
    fn take(&self, queue: &mut VecDeque<usize>, work: &[BenchRequest]) -> Vec<usize> {
        let mut members: Vec<usize> = Vec::new();
        let mut padded = 0;
        while let Some(&i) = queue.front() {
            if members.len() == self.max_batch {
                break;
            }
            let longest = padded.max(work[i].output_tokens);
            let blocks: usize = members
                .iter()
                .chain([&i])
                .map(|&j| {
                    (work[j].prompt.len() + longest)
                        .min(self.max_len)
                        .div_ceil(self.block_size)
                })
                .sum();
            if !members.is_empty() && blocks > self.pool_blocks {
                break;
            }
            members.push(i);
            padded = longest;
            queue.pop_front();
        }
        members
    }
}

/// Per request: when its first counted token came, how many came, when it ended.
#[derive(Clone, Debug, Default)]
struct Progress {
    first_token: Option<f64>,
    counted: usize,
    done: Option<f64>,
}

/// What the drivers share: the workload, the requests' progress, which
/// sequence serves which request, and the KV record.
struct Recorder<'a> {
    work: &'a [BenchRequest],
    arrivals: &'a [f64],
    progress: Vec<Progress>,
    request_of: HashMap<SeqId, usize>,
    /// Per sequence, its prompt and own output length (for [`KvUse`]).
    useful: HashMap<SeqId, usize>,
    kv: KvUse,
}

impl<'a> Recorder<'a> {
    fn new(work: &'a [BenchRequest], arrivals: &'a [f64], pool_blocks: usize) -> Self {
        Self {
            work,
            arrivals,
            progress: vec![Progress::default(); work.len()],
            request_of: HashMap::new(),
            useful: HashMap::new(),
            kv: KvUse::new(pool_blocks),
        }
    }

    /// Hands request `i` to the engine, generating `max_new_tokens` greedily.
    fn submit<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        i: usize,
        max_new_tokens: usize,
    ) -> Result<SeqId> {
        let r = &self.work[i];
        let request = Request::new(r.prompt.clone(), SamplingParams::default(), max_new_tokens);
        let seq = engine
            .submit(request)
            .map_err(|e| anyhow!("benchmark request {i}: {e}"))?[0];
        self.request_of.insert(seq, i);
        self.useful.insert(seq, r.prompt.len() + r.output_tokens);
        Ok(seq)
    }

    /// Counts a token of `seq` made at `t` (unless it is padding); returns its request.
    fn token(&mut self, seq: SeqId, t: f64) -> usize {
        let i = self.request_of[&seq];
        let p = &mut self.progress[i];
        if p.counted < self.work[i].output_tokens {
            p.counted += 1;
            p.first_token.get_or_insert(t);
        }
        i
    }

    fn served(&self) -> Result<Vec<Served>> {
        self.progress
            .iter()
            .enumerate()
            .map(|(i, p)| match (p.first_token, p.done) {
                (Some(first_token), Some(done)) => Ok(Served {
                    arrival: self.arrivals[i],
                    first_token,
                    done,
                    prompt_tokens: self.work[i].prompt.len(),
                    output_tokens: p.counted,
                }),
                _ => Err(anyhow!("benchmark request {i} did not finish")),
            })
            .collect()
    }
}
