//! KV eviction: each sequence keeps at most a budget of KV blocks, so a long
//! context fits in fixed memory.
//!
//! Eviction works on whole blocks of the paged cache. An evicted block leaves
//! a hole in the sequence's block table ([`EVICTED_BLOCK`]) that every
//! backend's paged attention skips; the remaining tokens keep their positions
//! (and so their RoPE angles): nothing is compacted. Some blocks are never
//! evicted: those holding any of the first `sinks` tokens (attention sinks),
//! those holding any of the last `recent` tokens, and the last block, which
//! is the only partly filled one and the one being written. Among the others
//! the policy chooses:
//! - `streaming` evicts the oldest first (StreamingLLM: sinks + a window);
//! - `h2o` evicts the block with the least attention mass accumulated over
//!   the queries since it was written (H2O's heavy hitters), each query's
//!   mass worth [`H2O_DECAY`] less per query that came after it;
//! - `snapkv` scores the prompt's blocks once, by the attention of the
//!   prompt's last `recent` queries, and evicts the lowest; blocks written
//!   after the prompt carry no score and stay while a prompt block is left
//!   to evict (SnapKV compresses the prompt and keeps the generation), then
//!   leave oldest first.
//!
//! Scores come from the deeper half of the layers ([`scoring_layers`]).
//! Measured on SmolLM2 (`scripts/kv-eviction-quality.sh`, 12.5% budget),
//! H2O's plain sum over every layer gave +33% perplexity where keeping the
//! newest blocks gave +18%: early layers attend by position, and an
//! undecayed sum favours blocks for having been around longer. Both
//! changes together give +13%.
//!
//! A budget is checked at the end of every step: a step's own chunk may
//! exceed it until then. Budgets given in percent are of the engine's
//! context limit.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use super::BlockTable;
use crate::{Error, Result};

/// The block id of an evicted table entry: attention skips it.
pub const EVICTED_BLOCK: u32 = u32::MAX;

/// Sink tokens kept unless `--kv-sinks` says otherwise (StreamingLLM's four).
pub const DEFAULT_SINKS: usize = 4;

/// What an H2O score keeps of its value per later query: a half-life of
/// about 69 queries, so a block is judged by the attention it gets now more
/// than by what it got while it was near the queries.
pub const H2O_DECAY: f32 = 0.99;

/// The layers of a `num_layers`-layer model whose attention scores blocks:
/// the deeper half, where attention follows content rather than position.
pub fn scoring_layers(num_layers: usize) -> Range<usize> {
    num_layers / 2..num_layers
}

/// Which blocks go first when a sequence is over its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    H2o,
    SnapKv,
    Streaming,
}

impl EvictionPolicy {
    pub const ALL: [EvictionPolicy; 3] = [Self::H2o, Self::SnapKv, Self::Streaming];

    pub fn name(self) -> &'static str {
        match self {
            Self::H2o => "h2o",
            Self::SnapKv => "snapkv",
            Self::Streaming => "streaming",
        }
    }

    /// Whether the policy reads attention scores (the scored attention kernel runs).
    pub fn needs_scores(self) -> bool {
        self != Self::Streaming
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EvictionPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "--kv-evict: unknown policy `{s}` (expected h2o, snapkv or streaming)"
                ))
            })
    }
}

/// How much KV one sequence may keep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    Tokens(usize),
    /// Percent of the engine's context limit, in (0, 100].
    Percent(f64),
}

impl KvBudget {
    /// The budget in tokens for a context limit of `context` tokens.
    pub fn tokens(self, context: usize) -> usize {
        match self {
            Self::Tokens(n) => n,
            Self::Percent(p) => (context as f64 * p / 100.0).floor() as usize,
        }
    }
}

impl FromStr for KvBudget {
    type Err = Error;

    /// `TOKENS` or `PCT%`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::InvalidRequest(format!(
                "--kv-budget: `{s}` {why} (expected a token count or a percentage like 25%)"
            ))
        };
        let s_trim = s.trim();
        if let Some(pct) = s_trim.strip_suffix('%') {
            let p: f64 = pct.trim().parse().map_err(|_| bad("is not a number"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(bad("is not a percentage in (0, 100]"));
            }
            return Ok(Self::Percent(p));
        }
        match s_trim.parse::<usize>() {
            Ok(0) => Err(bad("keeps nothing")),
            Ok(n) => Ok(Self::Tokens(n)),
            Err(_) => Err(bad("is not a whole number")),
        }
    }
}

impl fmt::Display for KvBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tokens(n) => write!(f, "{n}"),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// What the user asked for: `--kv-budget`, `--kv-evict`, `--kv-sinks`, `--kv-recent`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvictionConfig {
    pub budget: KvBudget,
    pub policy: EvictionPolicy,
    pub sinks: usize,
    /// Tokens of the recent window; `None`: half the blocks the sinks leave.
    pub recent: Option<usize>,
}

impl EvictionConfig {
    pub fn new(budget: KvBudget, policy: EvictionPolicy) -> Self {
        Self {
            budget,
            policy,
            sinks: DEFAULT_SINKS,
            recent: None,
        }
    }

    /// The budget in blocks of `block_size` for a context limit of `context`
    /// tokens; an error names the flag when the budget cannot hold the sinks
    /// and the recent window.
    pub fn plan(&self, context: usize, block_size: usize) -> Result<EvictionPlan> {
        let budget = self.budget.tokens(context);
        let budget_blocks = budget / block_size;
        let sink_blocks = self.sinks.div_ceil(block_size);
        if budget_blocks < sink_blocks + 1 {
            return Err(Error::InvalidRequest(format!(
                "--kv-budget: {} ({budget} tokens) holds {budget_blocks} blocks of {block_size} \
                 tokens; the {} sink tokens and the block being written need {}",
                self.budget,
                self.sinks,
                sink_blocks + 1
            )));
        }
        let recent = self
            .recent
            .unwrap_or((budget_blocks - sink_blocks - 1) / 2 * block_size);
        // The window may straddle one block more than it fills.
        let recent_blocks = recent.div_ceil(block_size) + 1;
        if sink_blocks + recent_blocks > budget_blocks {
            return Err(Error::InvalidRequest(format!(
                "--kv-recent: a window of {recent} tokens and {} sink tokens need up to {} \
                 blocks of {block_size}, more than the --kv-budget of {} ({budget_blocks} blocks)",
                self.sinks,
                sink_blocks + recent_blocks,
                self.budget
            )));
        }
        Ok(EvictionPlan {
            policy: self.policy,
            budget_blocks,
            block_size,
            sinks: self.sinks,
            recent,
        })
    }
}

/// An [`EvictionConfig`] resolved against a context limit and block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionPlan {
    pub policy: EvictionPolicy,
    /// Most live blocks a sequence keeps at the end of a step.
    pub budget_blocks: usize,
    pub block_size: usize,
    pub sinks: usize,
    pub recent: usize,
}

impl EvictionPlan {
    /// Whether table entry `index` of a sequence of `len` tokens and
    /// `entries` table entries must stay (sinks, recent window, last block).
    pub fn is_protected(&self, index: usize, entries: usize, len: usize) -> bool {
        let bs = self.block_size;
        index * bs < self.sinks
            || index + 1 >= entries
            || (index + 1) * bs > len.saturating_sub(self.recent)
    }

    /// The table entries to evict so that `table` keeps at most the budget,
    /// in the policy's order.
    pub fn select(&self, table: &BlockTable) -> Vec<usize> {
        let live = table.live_blocks();
        if live <= self.budget_blocks {
            return Vec::new();
        }
        let entries = table.blocks().len();
        let len = table.num_tokens();
        let mut candidates: Vec<usize> = (0..entries)
            .filter(|&i| table.blocks()[i] != EVICTED_BLOCK && !self.is_protected(i, entries, len))
            .collect();
        if self.policy != EvictionPolicy::Streaming {
            let scores = table.scores();
            // Unscored blocks (written after SnapKV's selection) last, oldest
            // first: SnapKV compresses the prompt and keeps what is generated.
            candidates.sort_by(|&a, &b| match (scores.get(a), scores.get(b)) {
                (Some(x), Some(y)) => x.total_cmp(y).then(a.cmp(&b)),
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, None) => a.cmp(&b),
            });
        }
        candidates.truncate(live - self.budget_blocks);
        candidates
    }

    /// The factor on a sequence's block scores before a step's mass from
    /// `queries` scored rows is added: [`H2O_DECAY`] per query for H2O;
    /// SnapKV scores its window once and keeps it whole.
    pub fn score_decay(&self, queries: usize) -> f32 {
        match self.policy {
            EvictionPolicy::H2o => H2O_DECAY.powi(queries.min(i32::MAX as usize) as i32),
            EvictionPolicy::SnapKv | EvictionPolicy::Streaming => 1.0,
        }
    }

    /// Whether the query at `position` of a sequence whose prompt has
    /// `prompt_len` tokens contributes scores: every query for H2O, the
    /// prompt's last `recent` queries (at least one) for SnapKV.
    pub fn scores_query(&self, position: usize, prompt_len: usize) -> bool {
        match self.policy {
            EvictionPolicy::H2o => true,
            EvictionPolicy::SnapKv => {
                position < prompt_len && position + self.recent.max(1) >= prompt_len
            }
            EvictionPolicy::Streaming => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvCacheManager;

    #[test]
    fn budgets_parse_as_tokens_or_percent_and_name_the_flag() {
        assert_eq!("512".parse::<KvBudget>().unwrap(), KvBudget::Tokens(512));
        assert_eq!("25%".parse::<KvBudget>().unwrap(), KvBudget::Percent(25.0));
        assert_eq!(KvBudget::Percent(12.5).tokens(4096), 512);
        for bad in ["0", "-3", "x", "0%", "150%", "%", "1.5"] {
            let err = bad.parse::<KvBudget>().unwrap_err().to_string();
            assert!(err.contains("--kv-budget") && err.contains(bad), "{err}");
        }
        let err = "lru".parse::<EvictionPolicy>().unwrap_err().to_string();
        assert!(err.contains("--kv-evict") && err.contains("lru"), "{err}");
        assert_eq!(
            "SnapKV".parse::<EvictionPolicy>().unwrap(),
            EvictionPolicy::SnapKv
        );
    }

    #[test]
    fn a_budget_too_small_for_sinks_and_window_is_refused() {
        let config = EvictionConfig::new(KvBudget::Tokens(16), EvictionPolicy::Streaming);
        let err = config.plan(1000, 16).unwrap_err().to_string();
        assert!(err.contains("--kv-budget"), "{err}");
        let config = EvictionConfig {
            recent: Some(64),
            ..EvictionConfig::new(KvBudget::Tokens(64), EvictionPolicy::H2o)
        };
        let err = config.plan(1000, 16).unwrap_err().to_string();
        assert!(err.contains("--kv-recent"), "{err}");
        let plan = EvictionConfig::new(KvBudget::Percent(50.0), EvictionPolicy::H2o)
            .plan(256, 16)
            .unwrap();
        assert_eq!((plan.budget_blocks, plan.recent), (8, 48));
    }

    fn filled(m: &mut KvCacheManager, seq: u64, tokens: usize) {
        m.add_sequence(seq).unwrap();
        m.reserve(seq, tokens).unwrap();
    }

    #[test]
    fn streaming_keeps_the_sinks_and_the_newest_blocks() {
        let plan = EvictionConfig {
            sinks: 4,
            recent: Some(8),
            ..EvictionConfig::new(KvBudget::Tokens(20), EvictionPolicy::Streaming)
        }
        .plan(1000, 4)
        .unwrap();
        let mut m = KvCacheManager::new(32, 4);
        filled(&mut m, 1, 38); // 10 blocks, the last holds 2 tokens
        assert_eq!(plan.select(m.table(1).unwrap()), vec![1, 2, 3, 4, 5]);
        m.evict_over_budget(1, &plan).unwrap();
        let t = m.table(1).unwrap();
        assert_eq!(t.live_blocks(), 5);
        let kept: Vec<usize> = (0..10)
            .filter(|&i| t.blocks()[i] != EVICTED_BLOCK)
            .collect();
        assert_eq!(kept, vec![0, 6, 7, 8, 9]);
        assert_eq!(m.num_used_blocks(), 5);
    }

    /// H2O over 4-token blocks, no sinks, a recent window of 4 tokens.
    fn h2o_plan(budget_tokens: usize) -> EvictionPlan {
        EvictionConfig {
            sinks: 0,
            recent: Some(4),
            ..EvictionConfig::new(KvBudget::Tokens(budget_tokens), EvictionPolicy::H2o)
        }
        .plan(1000, 4)
        .unwrap()
    }

    #[test]
    fn h2o_keeps_the_blocks_with_the_most_attention() {
        let plan = h2o_plan(16);
        let mut m = KvCacheManager::new(32, 4);
        filled(&mut m, 1, 32);
        m.add_block_scores(1, &[0.1, 3.0, 0.2, 0.0, 2.0, 0.5, 0.0, 0.0], 1.0)
            .unwrap();
        m.evict_over_budget(1, &plan).unwrap();
        let t = m.table(1).unwrap();
        let kept: Vec<usize> = (0..8).filter(|&i| t.blocks()[i] != EVICTED_BLOCK).collect();
        // The recent window (tokens 28..32) and the last block are block 7.
        assert_eq!(kept, vec![1, 4, 5, 7]);
    }

    #[test]
    fn h2o_scores_fade_so_old_attention_loses_to_new() {
        let plan = h2o_plan(8);
        let mut m = KvCacheManager::new(32, 4);
        filled(&mut m, 1, 24);
        // Block 1 drew twice block 2's mass, but 100 queries ago.
        m.add_block_scores(1, &[0.0, 2.0, 0.0, 0.0, 0.0, 0.0], 1.0)
            .unwrap();
        let decay = plan.score_decay(100);
        assert!((decay - H2O_DECAY.powi(100)).abs() < 1e-6 && decay < 0.5);
        m.add_block_scores(1, &[0.0, 0.0, 1.0, 0.0, 0.0, 0.0], decay)
            .unwrap();
        m.evict_over_budget(1, &plan).unwrap();
        let t = m.table(1).unwrap();
        let kept: Vec<usize> = (0..6).filter(|&i| t.blocks()[i] != EVICTED_BLOCK).collect();
        assert_eq!(kept, vec![2, 5]);
        let snapkv = EvictionPlan {
            policy: EvictionPolicy::SnapKv,
            ..plan
        };
        assert_eq!(snapkv.score_decay(100), 1.0);
    }

    #[test]
    fn snapkv_evicts_the_prompts_lowest_blocks_before_anything_generated() {
        let plan = EvictionPlan {
            policy: EvictionPolicy::SnapKv,
            ..h2o_plan(24)
        };
        let mut m = KvCacheManager::new(32, 4);
        let kept = |m: &KvCacheManager| -> Vec<usize> {
            let t = m.table(1).unwrap();
            (0..t.blocks().len())
                .filter(|&i| t.blocks()[i] != EVICTED_BLOCK)
                .collect()
        };
        // A prompt of 4 blocks scored at its end, then 4 blocks generated.
        filled(&mut m, 1, 16);
        m.add_block_scores(1, &[0.5, 0.1, 2.0, 0.3], 1.0).unwrap();
        m.reserve(1, 16).unwrap();
        m.evict_over_budget(1, &plan).unwrap();
        assert_eq!(kept(&m), vec![0, 2, 4, 5, 6, 7]);
        // Every prompt block goes before a generated one...
        m.reserve(1, 8).unwrap();
        m.evict_over_budget(1, &plan).unwrap();
        assert_eq!(kept(&m), vec![4, 5, 6, 7, 8, 9]);
        // ...then the oldest generated go first.
        m.reserve(1, 4).unwrap();
        m.evict_over_budget(1, &plan).unwrap();
        assert_eq!(kept(&m), vec![5, 6, 7, 8, 9, 10]);
    }

    #[test]
    fn the_deeper_half_of_the_layers_scores() {
        assert_eq!(scoring_layers(30), 15..30);
        assert_eq!(scoring_layers(5), 2..5);
        assert_eq!(scoring_layers(1), 0..1);
    }
}
