//! Property tests of the KV bookkeeping and the scheduler together, without
//! a model: random adds, forks, steps (with preemption when the small pool
//! runs out), finishes and removals, checking after every operation that
//! - every block's reference count equals the number of tables holding it;
//! - the empty list, the cached (evictable) list and the used set partition
//!   the pool, and cached blocks are exactly the unreferenced registered ones;
//! - a running or finished sequence's table covers exactly its computed
//!   tokens, and a waiting one holds no blocks;
//!
//! and at the end, that everything drains and every block is free.
//! Releasing a free block panics in the allocator, so a double free fails too.

use std::collections::HashSet;

use proptest::prelude::*;
use tandem_core::kv::{KvCacheManager, SeqId};
use tandem_core::sched::{Scheduler, SchedulerConfig, SeqStatus};

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 24;

#[derive(Clone, Debug)]
enum Op {
    /// A prompt: a shared stem (so prefixes hit the cache) and a random tail.
    Add {
        stem: usize,
        tail: Vec<u32>,
        priority: i32,
    },
    Fork(usize),
    Step,
    Finish(usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, prop::collection::vec(0..20u32, 1..14), 0..3i32)
            .prop_map(|(stem, tail, priority)| Op::Add { stem, tail, priority }),
        1 => (0..16usize).prop_map(Op::Fork),
        6 => Just(Op::Step),
        1 => (0..16usize).prop_map(Op::Finish),
        1 => (0..16usize).prop_map(Op::Remove),
    ]
}

/// Generated tokens per sequence before it finishes by itself.
const MAX_NEW: usize = 6;

struct World {
    kv: KvCacheManager,
    sched: Scheduler<usize>,
    live: Vec<SeqId>,
    next: SeqId,
}

impl World {
    fn new() -> Self {
        Self {
            kv: KvCacheManager::new(NUM_BLOCKS, BLOCK_SIZE),
            sched: Scheduler::new(SchedulerConfig {
                max_batch_tokens: 10,
                max_running: 6,
                max_waiting: 64,
            })
            .unwrap(),
            live: Vec::new(),
            next: 0,
        }
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        (!self.live.is_empty()).then(|| self.live[i % self.live.len()])
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Add {
                stem,
                tail,
                priority,
            } => {
                // Prompts never outgrow the pool with their new tokens.
                let mut prompt: Vec<u32> = (0..stem as u32 * 5).map(|t| 100 + t).collect();
                prompt.extend(tail);
                self.sched.add(self.next, prompt, priority, 0).unwrap();
                self.live.push(self.next);
                self.next += 1;
            }
            Op::Fork(i) => {
                if let Some(parent) = self.pick(i) {
                    let s = self.sched.get(parent).unwrap();
                    let n_generated = s.data;
                    if s.status() == SeqStatus::Running {
                        self.kv.fork(parent, self.next).unwrap();
                        self.sched.fork(parent, self.next, n_generated).unwrap();
                        self.live.push(self.next);
                        self.next += 1;
                    }
                }
            }
            Op::Step => self.step()?,
            Op::Finish(i) => {
                if let Some(s) = self.pick(i) {
                    if self.sched.get(s).unwrap().status() == SeqStatus::Running {
                        self.sched.finish(s);
                    }
                }
            }
            Op::Remove(i) => {
                if let Some(s) = self.pick(i) {
                    self.live.retain(|&x| x != s);
                    self.sched.remove(s);
                    self.kv.free(s);
                }
            }
        }
        Ok(())
    }

    /// One scheduler step; sequences whose tokens are all computed append a
    /// token (a function of their history, like a greedy model).
    fn step(&mut self) -> Result<(), TestCaseError> {
        let schedule = self.sched.schedule(&mut self.kv).unwrap();
        prop_assert!(schedule.num_tokens() <= self.sched.config().max_batch_tokens);
        let mut seen = HashSet::new();
        for c in &schedule.chunks {
            prop_assert!(seen.insert(c.seq), "sequence {} scheduled twice", c.seq);
            prop_assert_eq!(c.reservation.slots.len(), c.len);
            prop_assert!(!schedule.preempted.contains(&c.seq));
        }
        self.sched.complete(&schedule, &mut self.kv).unwrap();
        for c in &schedule.chunks {
            let s = self.sched.get_mut(c.seq).unwrap();
            if c.start + c.len == s.tokens.len() {
                let next = s.tokens.iter().fold(7u32, |h, &t| h.wrapping_mul(31) ^ t) % 20;
                s.tokens.push(next);
                s.data += 1;
                if s.data >= MAX_NEW {
                    self.sched.finish(c.seq);
                }
            }
        }
        Ok(())
    }

    fn remove_finished(&mut self) {
        let finished: Vec<SeqId> = self
            .sched
            .sequences()
            .filter(|(_, s)| s.status() == SeqStatus::Finished)
            .map(|(id, _)| id)
            .collect();
        for s in finished {
            self.live.retain(|&x| x != s);
            self.sched.remove(s);
            self.kv.free(s);
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let alloc = self.kv.allocator();
        let mut holders = [0u32; NUM_BLOCKS];
        for (id, t) in self.kv.sequences() {
            prop_assert_eq!(t.blocks().len(), t.num_tokens().div_ceil(BLOCK_SIZE));
            for &b in t.blocks() {
                holders[b as usize] += 1;
            }
            let s = self.sched.get(id);
            prop_assert!(s.is_some(), "table of unknown sequence {}", id);
            prop_assert_eq!(s.unwrap().num_computed(), t.num_tokens());
        }
        for (id, s) in self.sched.sequences() {
            match s.status() {
                SeqStatus::Waiting => {
                    prop_assert!(self.kv.table(id).is_none());
                    prop_assert_eq!(s.num_computed(), 0);
                }
                SeqStatus::Running | SeqStatus::Finished => {
                    prop_assert!(self.kv.table(id).is_some(), "{} has no table", id)
                }
            }
        }
        let (empty, cached) = alloc.free_lists();
        let mut state = vec![None; NUM_BLOCKS];
        for &b in empty {
            prop_assert!(
                state[b as usize].replace("empty").is_none(),
                "block {} twice",
                b
            );
            prop_assert!(!alloc.is_registered(b));
        }
        for b in cached {
            prop_assert!(
                state[b as usize].replace("cached").is_none(),
                "block {} twice",
                b
            );
            prop_assert!(alloc.is_registered(b));
        }
        for (b, &h) in holders.iter().enumerate() {
            prop_assert_eq!(alloc.ref_count(b as u32), h, "block {}", b);
            prop_assert_eq!(h > 0, state[b].is_none(), "block {} used xor free", b);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn kv_and_scheduler_invariants_hold(ops in prop::collection::vec(op(), 1..80)) {
        let mut w = World::new();
        for op in ops {
            w.apply(op)?;
            w.check()?;
        }
        // Everything left drains (finished sequences leave, as a server
        // removes them): no deadlock, every block comes back.
        for _ in 0..10_000 {
            w.remove_finished();
            if !w.sched.has_work() {
                break;
            }
            w.step()?;
            w.check()?;
        }
        prop_assert!(!w.sched.has_work(), "the scheduler made no progress");
        for s in std::mem::take(&mut w.live) {
            w.sched.remove(s);
            w.kv.free(s);
        }
        w.check()?;
        prop_assert_eq!(w.kv.num_used_blocks(), 0);
        prop_assert_eq!(w.kv.num_free_blocks(), NUM_BLOCKS);
    }
}

/// Preemption by recompute is invisible: with a pool too small for all
/// sequences at once, every sequence produces the tokens it produces alone.
#[test]
fn preempted_sequences_resume_with_identical_output() {
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| (0..(5 + 3 * i)).map(|t| (t * 7 + i) % 20).collect())
        .collect();
    let run = |prompts: &[Vec<u32>], num_blocks: usize| {
        let mut kv = KvCacheManager::new(num_blocks, BLOCK_SIZE);
        let mut sched: Scheduler<usize> = Scheduler::new(SchedulerConfig {
            max_batch_tokens: 16,
            ..SchedulerConfig::default()
        })
        .unwrap();
        for (i, p) in prompts.iter().enumerate() {
            sched.add(i as SeqId, p.clone(), 0, 0).unwrap();
        }
        let mut outputs = vec![Vec::new(); prompts.len()];
        while sched.has_work() {
            let schedule = sched.schedule(&mut kv).unwrap();
            assert!(!schedule.chunks.is_empty());
            sched.complete(&schedule, &mut kv).unwrap();
            for c in &schedule.chunks {
                let s = sched.get_mut(c.seq).unwrap();
                if c.start + c.len == s.tokens.len() {
                    let next = s.tokens.iter().fold(7u32, |h, &t| h.wrapping_mul(31) ^ t) % 20;
                    s.tokens.push(next);
                    s.data += 1;
                    if s.data == 12 {
                        outputs[c.seq as usize] = s.tokens.clone();
                        sched.remove(c.seq);
                        kv.free(c.seq);
                    }
                }
            }
        }
        assert_eq!(kv.num_used_blocks(), 0);
        (outputs, sched.stats().preemptions)
    };
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(std::slice::from_ref(p), 64).0.remove(0))
        .collect();
    let (together, preemptions) = run(&prompts, 14);
    assert!(preemptions > 0, "the small pool forces preemptions");
    assert_eq!(together, alone);
}
