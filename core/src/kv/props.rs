//! Property tests of the KV manager under eviction: random mixes of appends,
//! evictions, forks, prefix hits, preemption and speculation rollback never
//! leak a block, free one twice, write into a shared one, or hand out from
//! the prefix cache a block whose K/V are not those of the full prefix.

use std::collections::HashMap;

use proptest::prelude::*;

use super::{EvictionConfig, EvictionPolicy, KvBudget, KvCacheManager, SeqId, EVICTED_BLOCK};

const BS: usize = 2;
const POOL: usize = 24;

#[derive(Debug, Clone)]
enum Op {
    /// A new request: its prompt's cached prefix is shared, the rest computed.
    Admit(Vec<u32>),
    Append(usize, Vec<u32>),
    Fork(usize),
    /// `k` drafts written, `accepted` of them kept.
    Speculate(usize, Vec<u32>, usize),
    Truncate(usize, usize),
    /// Freed and recomputed from its tokens (preemption by recompute).
    Preempt(usize),
    Free(usize),
    /// Scores added, then the policy evicts down to the budget.
    Evict(usize, usize, Vec<u8>),
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0..2u32, 1..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        tokens(9).prop_map(Op::Admit),
        (0..8usize, tokens(5)).prop_map(|(s, t)| Op::Append(s, t)),
        (0..8usize).prop_map(Op::Fork),
        (0..8usize, tokens(5), 0..5usize).prop_map(|(s, t, a)| Op::Speculate(s, t, a)),
        (0..8usize, 0..20usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        (0..8usize).prop_map(Op::Preempt),
        (0..8usize).prop_map(Op::Free),
        (0..8usize, 0..6usize, prop::collection::vec(0..4u8, 12))
            .prop_map(|(s, p, w)| Op::Evict(s, p, w)),
    ]
}

/// What the model knows: each sequence's tokens, and what each physical
/// block holds once full: the prefix through it, and whether its K/V were
/// computed over that whole prefix (no eviction before).
#[derive(Default)]
struct Model {
    tokens: HashMap<SeqId, Vec<u32>>,
    content: HashMap<u32, (Vec<u32>, bool)>,
}

impl Model {
    /// Records the blocks of `seq` that became full between `from` and its end.
    fn filled(&mut self, m: &KvCacheManager, seq: SeqId, from: usize) {
        let t = m.table(seq).unwrap();
        let toks = &self.tokens[&seq];
        for i in from / BS..t.num_tokens() / BS {
            let block = t.blocks()[i];
            assert_ne!(block, EVICTED_BLOCK, "a block just written was evicted");
            self.content
                .insert(block, (toks[..(i + 1) * BS].to_vec(), !t.has_evicted()));
        }
    }

    /// Appends `new` to `seq` as a computed chunk; false if the pool is full.
    fn append(&mut self, m: &mut KvCacheManager, seq: SeqId, new: &[u32]) -> bool {
        let before = m.table(seq).unwrap().clone();
        let Ok(r) = m.reserve(seq, new.len()) else {
            assert_eq!(
                m.table(seq).unwrap(),
                &before,
                "a refused reserve changed the table"
            );
            return false;
        };
        for &slot in &r.slots {
            let block = slot / BS as u32;
            assert_eq!(
                m.allocator().ref_count(block),
                1,
                "write into a shared block"
            );
            assert!(
                !m.allocator().is_registered(block),
                "write into a cached block"
            );
        }
        let from = before.num_tokens();
        self.tokens.get_mut(&seq).unwrap().extend_from_slice(new);
        let toks = self.tokens[&seq].clone();
        m.commit_full_blocks(seq, &toks).unwrap();
        self.filled(m, seq, from);
        true
    }

    /// A new sequence over `prompt`: every prefix-cache hit must hold the
    /// exact K/V of the prompt's prefix.
    fn admit(&mut self, m: &mut KvCacheManager, seq: SeqId, prompt: &[u32]) -> bool {
        m.add_sequence(seq).unwrap();
        let hit = m.match_prefix(seq, prompt).unwrap();
        for (i, &block) in m.table(seq).unwrap().blocks().iter().enumerate() {
            let (prefix, exact) = &self.content[&block];
            assert!(
                *exact,
                "the prefix cache handed out a block computed after an eviction"
            );
            assert_eq!(&prefix[..], &prompt[..(i + 1) * BS], "a hit with other K/V");
        }
        self.tokens.insert(seq, prompt[..hit].to_vec());
        if hit < prompt.len() && !self.append(m, seq, &prompt[hit..]) {
            m.free(seq);
            self.tokens.remove(&seq);
            return false;
        }
        true
    }
}

fn check_counts(m: &KvCacheManager) -> Result<(), TestCaseError> {
    let mut holders = vec![0u32; m.num_blocks()];
    for (_, t) in m.sequences() {
        prop_assert_eq!(t.blocks().len(), t.num_tokens().div_ceil(BS));
        let mut live: Vec<u32> = t
            .blocks()
            .iter()
            .copied()
            .filter(|&b| b != EVICTED_BLOCK)
            .collect();
        prop_assert_eq!(live.len(), t.live_blocks());
        if let Some(&last) = t.blocks().last() {
            let partial = !t.num_tokens().is_multiple_of(BS);
            prop_assert!(
                !partial || last != EVICTED_BLOCK,
                "the block being written is a hole"
            );
        }
        live.sort_unstable();
        let n = live.len();
        live.dedup();
        prop_assert_eq!(live.len(), n, "a table holds a block twice");
        for b in live {
            holders[b as usize] += 1;
        }
    }
    let mut free = 0;
    for (b, &h) in holders.iter().enumerate() {
        prop_assert_eq!(
            m.allocator().ref_count(b as u32),
            h,
            "block {} leaked or over-freed",
            b
        );
        free += usize::from(h == 0);
    }
    prop_assert_eq!(free, m.num_free_blocks());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn eviction_keeps_the_pool_and_the_prefix_cache_consistent(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        let mut m = KvCacheManager::new(POOL, BS);
        let mut model = Model::default();
        let mut live: Vec<SeqId> = Vec::new();
        let mut next: SeqId = 0;
        let pick = |live: &[SeqId], i: usize| live[i % live.len()];
        for op in ops {
            match op {
                Op::Admit(prompt) => {
                    if model.admit(&mut m, next, &prompt) {
                        live.push(next);
                    }
                    next += 1;
                }
                Op::Append(i, new) if !live.is_empty() => {
                    model.append(&mut m, pick(&live, i), &new);
                }
                Op::Fork(i) if !live.is_empty() => {
                    let s = pick(&live, i);
                    m.fork(s, next).unwrap();
                    let toks = model.tokens[&s].clone();
                    model.tokens.insert(next, toks);
                    live.push(next);
                    next += 1;
                }
                Op::Speculate(i, drafts, accepted) if !live.is_empty() => {
                    let s = pick(&live, i);
                    let len = m.table(s).unwrap().num_tokens();
                    if m.reserve(s, drafts.len()).is_ok() {
                        let keep = len + accepted.min(drafts.len());
                        m.truncate(s, keep).unwrap();
                        model.tokens.get_mut(&s).unwrap().extend_from_slice(&drafts[..keep - len]);
                        let toks = model.tokens[&s].clone();
                        m.commit_full_blocks(s, &toks).unwrap();
                        model.filled(&m, s, len);
                    }
                }
                Op::Truncate(i, n) if !live.is_empty() => {
                    let s = pick(&live, i);
                    let before = m.table(s).unwrap().clone();
                    let n = n.min(before.num_tokens());
                    match m.truncate(s, n) {
                        Ok(()) => model.tokens.get_mut(&s).unwrap().truncate(n),
                        Err(_) => prop_assert_eq!(m.table(s).unwrap(), &before),
                    }
                }
                Op::Preempt(i) if !live.is_empty() => {
                    let s = pick(&live, i);
                    live.retain(|&x| x != s);
                    m.free(s);
                    let toks = model.tokens.remove(&s).unwrap();
                    if !toks.is_empty() && model.admit(&mut m, next, &toks) {
                        live.push(next);
                    }
                    next += 1;
                }
                Op::Free(i) if !live.is_empty() => {
                    let s = live.remove(i % live.len());
                    m.free(s);
                    model.tokens.remove(&s);
                }
                Op::Evict(i, p, weights) if !live.is_empty() => {
                    let s = pick(&live, i);
                    let policy = EvictionPolicy::ALL[p % 3];
                    let config = EvictionConfig {
                        sinks: p % 2,
                        recent: Some(p % 3),
                        ..EvictionConfig::new(KvBudget::Tokens(6 + 2 * p), policy)
                    };
                    let plan = config.plan(100, BS).unwrap();
                    let mass: Vec<f32> = weights.iter().map(|&w| f32::from(w)).collect();
                    m.add_block_scores(s, &mass, 1.0).unwrap();
                    let before = m.table(s).unwrap().clone();
                    m.evict_over_budget(s, &plan).unwrap();
                    let t = m.table(s).unwrap();
                    prop_assert!(t.live_blocks() <= plan.budget_blocks);
                    for (j, &b) in t.blocks().iter().enumerate() {
                        let was_live = before.blocks()[j] != EVICTED_BLOCK;
                        if was_live && plan.is_protected(j, t.blocks().len(), t.num_tokens()) {
                            prop_assert_ne!(b, EVICTED_BLOCK, "a protected block was evicted");
                        }
                    }
                }
                _ => {}
            }
            check_counts(&m)?;
        }
        for s in live {
            m.free(s);
        }
        prop_assert_eq!(m.num_free_blocks(), POOL);
    }
}
