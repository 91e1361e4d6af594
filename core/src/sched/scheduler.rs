//! The continuous-batching scheduler: which sequences run in the next step,
//! and how many of their tokens.
//!
//! Every step picks the batch anew (iteration-level scheduling), so finished
//! sequences leave and waiting ones join at any step. One pass goes over all
//! sequences in priority order (higher first); within a priority, decode
//! tokens of running sequences come first (they are cheap and bound the
//! latency users see), then prompt chunks of running sequences, then new
//! admissions, each first come first served. The pass stops when the step's
//! token budget is spent, so a long prompt is prefilled in chunks across
//! steps, interleaved with the decodes of everyone else.
//!
//! When the KV pool cannot hold a running sequence's next tokens, the
//! lowest-priority, most recently arrived running sequence not yet planned
//! is preempted by recompute: its blocks are freed and it goes back to the
//! waiting queue with all its tokens (prompt and generated), keeping its
//! place. When it is admitted again its tokens are prefilled again (the
//! prefix cache often still has most of its blocks); its sampler state lives
//! with the caller's data, so it continues exactly where it stopped. A
//! waiting request may preempt running sequences of strictly lower priority,
//! never of its own, so FCFS holds within a priority.
//!
//! The scheduler keeps the caller's per-sequence data (`T`) beside the
//! tokens; the engine stores its samplers there, tests store nothing.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::kv::{KvCacheManager, SeqId, SlotReservation};
use crate::{Error, Result};

/// A request's priority class: higher runs first and is preempted last.
pub type Priority = i32;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most tokens one step feeds through the model.
    pub max_batch_tokens: usize,
    /// Most sequences running at once (admission stops there).
    pub max_running: usize,
    /// Most requests waiting for admission; more are refused (queue full).
    pub max_waiting: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 256,
            max_waiting: 1024,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued for admission, holding no KV blocks.
    Waiting,
    /// Admitted: holds KV blocks for its computed tokens and has tokens to compute.
    Running,
    /// Done generating; keeps its KV blocks until removed (or continued).
    Finished,
}

/// A sequence as the scheduler sees it.
#[derive(Clone, Debug)]
pub struct SchedSeq<T> {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Leading tokens whose K/V are in the cache.
    num_computed: usize,
    priority: Priority,
    /// Order of arrival: FCFS within a priority, kept across preemptions.
    arrival: u64,
    status: SeqStatus,
    /// Whether it was admitted before (a resumed preemption is not a new prompt for the statistics).
    admitted_before: bool,
    /// Trailing tokens that are speculative drafts, not yet accepted: they
    /// are computed like any token but never enter the prefix cache, are
    /// dropped on preemption, and are settled by [`Scheduler::settle_drafts`].
    num_drafts: usize,
    pub data: T,
}

impl<T> SchedSeq<T> {
    pub fn num_computed(&self) -> usize {
        self.num_computed
    }

    pub fn priority(&self) -> Priority {
        self.priority
    }

    pub fn status(&self) -> SeqStatus {
        self.status
    }

    pub fn num_drafts(&self) -> usize {
        self.num_drafts
    }

    /// The tokens without the trailing drafts.
    pub fn accepted_tokens(&self) -> &[u32] {
        &self.tokens[..self.tokens.len() - self.num_drafts]
    }

    /// Whether the next step computes exactly the last accepted token (drafts aside).
    pub fn is_decoding(&self) -> bool {
        self.status == SeqStatus::Running
            && self.tokens.len() - self.num_drafts == self.num_computed + 1
    }

    fn queue_key(&self, id: SeqId) -> QueueKey {
        (Reverse(self.priority), self.arrival, id)
    }
}

/// Best first: highest priority, then earliest arrival.
type QueueKey = (Reverse<Priority>, u64, SeqId);

/// Tokens `start..start + len` of `seq` run in this step, writing their K/V
/// where `reservation` says.
#[derive(Clone, Debug)]
pub struct ScheduledChunk {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    pub reservation: SlotReservation,
}

/// The plan of one step.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences preempted (blocks freed, back to waiting) while planning.
    pub preempted: Vec<SeqId>,
}

impl Schedule {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.len).sum()
    }
}

/// Counters since the scheduler was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Prompt tokens of admitted requests (first admission only).
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache instead of computed.
    pub prefix_hit_tokens: u64,
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the waiting queue is full ({0} requests are waiting); try again later")]
    QueueFull(usize),
    #[error(transparent)]
    Rejected(#[from] Error),
}

#[derive(Debug)]
pub struct Scheduler<T> {
    config: SchedulerConfig,
    seqs: BTreeMap<SeqId, SchedSeq<T>>,
    waiting: BTreeSet<QueueKey>,
    running: BTreeSet<QueueKey>,
    next_arrival: u64,
    stats: SchedulerStats,
}

impl<T> Scheduler<T> {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        if config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(Error::InvalidRequest(
                "the batch token budget and the running limit must be positive".into(),
            ));
        }
        Ok(Self {
            config,
            seqs: BTreeMap::new(),
            waiting: BTreeSet::new(),
            running: BTreeSet::new(),
            next_arrival: 0,
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether `n` more requests would overflow the waiting queue.
    pub fn queue_full(&self, n: usize) -> bool {
        self.waiting.len() + n > self.config.max_waiting
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn get(&self, seq: SeqId) -> Option<&SchedSeq<T>> {
        self.seqs.get(&seq)
    }

    pub fn get_mut(&mut self, seq: SeqId) -> Option<&mut SchedSeq<T>> {
        self.seqs.get_mut(&seq)
    }

    pub fn sequences(&self) -> impl Iterator<Item = (SeqId, &SchedSeq<T>)> {
        self.seqs.iter().map(|(&id, s)| (id, s))
    }

    /// Queues a new sequence (the caller checks [`Scheduler::queue_full`] first).
    pub fn add(&mut self, seq: SeqId, tokens: Vec<u32>, priority: Priority, data: T) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        if self.seqs.contains_key(&seq) {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} already exists"
            )));
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let s = SchedSeq {
            tokens,
            num_computed: 0,
            priority,
            arrival,
            status: SeqStatus::Waiting,
            admitted_before: false,
            num_drafts: 0,
            data,
        };
        self.waiting.insert(s.queue_key(seq));
        self.seqs.insert(seq, s);
        Ok(())
    }

    /// Makes `child` a copy of the running `parent` (tokens, progress, place
    /// in line); the caller forks the KV blocks alongside.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, data: T) -> Result<()> {
        if self.seqs.contains_key(&child) {
            return Err(Error::InvalidRequest(format!(
                "sequence {child} already exists"
            )));
        }
        let p = self
            .seqs
            .get(&parent)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {parent}")))?;
        let s = SchedSeq {
            tokens: p.accepted_tokens().to_vec(),
            num_computed: p.num_computed.min(p.tokens.len() - p.num_drafts),
            priority: p.priority,
            arrival: p.arrival,
            status: p.status,
            admitted_before: true,
            num_drafts: 0,
            data,
        };
        match s.status {
            SeqStatus::Running => self.running.insert(s.queue_key(child)),
            SeqStatus::Waiting => self.waiting.insert(s.queue_key(child)),
            SeqStatus::Finished => false,
        };
        self.seqs.insert(child, s);
        Ok(())
    }

    /// Forgets `seq`; the caller frees its KV blocks.
    pub fn remove(&mut self, seq: SeqId) -> Option<SchedSeq<T>> {
        let s = self.seqs.remove(&seq)?;
        let key = s.queue_key(seq);
        self.waiting.remove(&key);
        self.running.remove(&key);
        Some(s)
    }

    /// Marks `seq` done; it keeps its blocks until removed or continued.
    pub fn finish(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            let key = s.queue_key(seq);
            self.running.remove(&key);
            self.waiting.remove(&key);
            s.status = SeqStatus::Finished;
        }
    }

    /// Continues a finished sequence whose new tokens the caller appended.
    pub fn resume(&mut self, seq: SeqId) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if s.status != SeqStatus::Finished {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} is still generating"
            )));
        }
        s.status = SeqStatus::Running;
        self.running.insert(s.queue_key(seq));
        Ok(())
    }

    /// Keeps the first `n` tokens of a finished sequence (the caller truncates its KV).
    pub fn rewind(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if s.status != SeqStatus::Finished {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} is still generating"
            )));
        }
        if n > s.tokens.len() {
            return Err(Error::InvalidRequest(format!(
                "cannot rewind sequence {seq} of {} tokens to {n}",
                s.tokens.len()
            )));
        }
        s.tokens.truncate(n);
        s.num_computed = s.num_computed.min(n);
        Ok(())
    }

    /// Appends speculative `drafts` to a decoding sequence (see [`SchedSeq::num_drafts`]).
    pub fn push_drafts(&mut self, seq: SeqId, drafts: &[u32]) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if !s.is_decoding() || s.num_drafts != 0 {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} is not waiting for its next token"
            )));
        }
        s.tokens.extend_from_slice(drafts);
        s.num_drafts = drafts.len();
        Ok(())
    }

    /// Replaces the drafts of `seq` by its verified continuation: the first
    /// `n_accepted` drafts stay (their K/V computed), the rest are dropped,
    /// then `tokens` (the accepted drafts' successors decided by the
    /// verifier, possibly cut short by a stop condition) are the sequence's
    /// new tail. Its KV is truncated to what is still valid and newly full
    /// blocks enter the prefix cache.
    pub fn settle_drafts(
        &mut self,
        seq: SeqId,
        n_accepted: usize,
        kv: &mut KvCacheManager,
    ) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if n_accepted > s.num_drafts {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} has {} drafts, not {n_accepted}",
                s.num_drafts
            )));
        }
        let keep = s.tokens.len() - s.num_drafts + n_accepted;
        s.tokens.truncate(keep);
        s.num_drafts = 0;
        s.num_computed = s.num_computed.min(keep);
        kv.truncate(seq, s.num_computed)?;
        kv.commit_full_blocks(seq, &s.tokens[..s.num_computed])
    }

    /// Plans the next step: reserves KV slots for every chunk, preempting
    /// and admitting as described in the module documentation.
    pub fn schedule(&mut self, kv: &mut KvCacheManager) -> Result<Schedule> {
        const DECODE: u8 = 0;
        const PREFILL: u8 = 1;
        const ADMIT: u8 = 2;
        let mut out = Schedule::default();
        let mut budget = self.config.max_batch_tokens;
        let mut order: Vec<(Reverse<Priority>, u8, u64, SeqId)> = self
            .running
            .iter()
            .map(|&(p, arrival, id)| {
                let s = &self.seqs[&id];
                let class = if s.tokens.len() - s.num_drafts - s.num_computed == 1 {
                    DECODE
                } else {
                    PREFILL
                };
                (p, class, arrival, id)
            })
            .chain(
                self.waiting
                    .iter()
                    .map(|&(p, arrival, id)| (p, ADMIT, arrival, id)),
            )
            .collect();
        order.sort_unstable();
        // Running sequences not planned yet, the first preemption victim first.
        let mut victims: BTreeSet<(Priority, Reverse<u64>, SeqId)> = self
            .running
            .iter()
            .map(|&(Reverse(p), arrival, id)| (p, Reverse(arrival), id))
            .collect();
        let mut admissions_open = true;
        for (Reverse(priority), class, arrival, id) in order {
            if budget == 0 {
                break;
            }
            let victim_key = (priority, Reverse(arrival), id);
            let s = &self.seqs[&id];
            let n = (s.tokens.len() - s.num_computed).min(budget);
            if class != ADMIT {
                if s.status != SeqStatus::Running || n == 0 {
                    continue; // preempted earlier in this pass, or nothing to compute
                }
                // Drafts are a bet: they never cost another sequence its place.
                let accepted_n = (s.tokens.len() - s.num_drafts - s.num_computed).min(n);
                let n = if kv.blocks_needed(id, n)? <= kv.num_free_blocks() {
                    n
                } else {
                    accepted_n
                };
                loop {
                    if kv.blocks_needed(id, n)? <= kv.num_free_blocks() {
                        victims.remove(&victim_key);
                        out.chunks.push(self.reserve(kv, id, n)?);
                        budget -= n;
                        break;
                    }
                    let &victim = victims.first().expect("the sequence itself is a candidate");
                    victims.remove(&victim);
                    self.preempt(kv, victim.2, &mut out);
                    if victim.2 == id {
                        break;
                    }
                }
                continue;
            }
            if !admissions_open || self.running.len() >= self.config.max_running {
                admissions_open = false;
                continue;
            }
            kv.add_sequence(id)?;
            let prefix = &s.tokens[..s.tokens.len() - 1];
            let hit = kv.match_prefix(id, prefix)?;
            let n = (s.tokens.len() - hit).min(budget);
            loop {
                if kv.blocks_needed(id, n)? <= kv.num_free_blocks() {
                    self.admit(id, hit);
                    out.chunks.push(self.reserve(kv, id, n)?);
                    budget -= n;
                    break;
                }
                match victims.first() {
                    Some(&victim) if victim.0 < priority => {
                        victims.remove(&victim);
                        self.preempt(kv, victim.2, &mut out);
                    }
                    _ => {
                        // Head-of-line: later requests wait behind this one.
                        kv.free(id);
                        admissions_open = false;
                        break;
                    }
                }
            }
        }
        Ok(out)
    }

    fn reserve(&mut self, kv: &mut KvCacheManager, seq: SeqId, n: usize) -> Result<ScheduledChunk> {
        let start = self.seqs[&seq].num_computed;
        Ok(ScheduledChunk {
            seq,
            start,
            len: n,
            reservation: kv.reserve(seq, n)?,
        })
    }

    fn admit(&mut self, seq: SeqId, cached_tokens: usize) {
        let s = self.seqs.get_mut(&seq).expect("admitting a known sequence");
        let key = s.queue_key(seq);
        self.waiting.remove(&key);
        self.running.insert(key);
        s.status = SeqStatus::Running;
        s.num_computed = cached_tokens;
        if !s.admitted_before {
            s.admitted_before = true;
            self.stats.prompt_tokens += s.tokens.len() as u64;
            self.stats.prefix_hit_tokens += cached_tokens as u64;
        }
    }

    fn preempt(&mut self, kv: &mut KvCacheManager, seq: SeqId, out: &mut Schedule) {
        let s = self
            .seqs
            .get_mut(&seq)
            .expect("preempting a known sequence");
        let key = s.queue_key(seq);
        self.running.remove(&key);
        self.waiting.insert(key);
        s.status = SeqStatus::Waiting;
        s.num_computed = 0;
        let accepted = s.tokens.len() - s.num_drafts;
        s.tokens.truncate(accepted);
        s.num_drafts = 0;
        kv.free(seq);
        self.stats.preemptions += 1;
        out.preempted.push(seq);
    }

    /// Records that the step ran: the chunks' tokens are computed, and their
    /// newly full blocks go into the prefix cache.
    pub fn complete(&mut self, schedule: &Schedule, kv: &mut KvCacheManager) -> Result<()> {
        for c in &schedule.chunks {
            let s = self
                .seqs
                .get_mut(&c.seq)
                .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {}", c.seq)))?;
            s.num_computed = c.start + c.len;
            let accepted = s.num_computed.min(s.tokens.len() - s.num_drafts);
            kv.commit_full_blocks(c.seq, &s.tokens[..accepted])?;
        }
        Ok(())
    }
}
