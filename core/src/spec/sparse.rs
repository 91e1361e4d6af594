//! Sparse self-speculation: the target drafts its own next tokens reading
//! only the KV blocks that matter (Quest-style selection, as TriForce and
//! MagicDec draft), and verifies them with full attention.
//!
//! A draft pass is the target's own forward pass over its own paged cache,
//! one token per sequence (more with a cascade), where every layer
//! attends through `Backend::select_kv_blocks`: the sinks, the recent
//! window, and per KV head the blocks whose key bounds could score highest
//! against the query, each KV head reading only its own (a table per KV
//! head: a union over the heads read three times the blocks on SmolLM2). The drafted tokens' K/V go into the slots that the
//! verification pass then overwrites with full attention's (it feeds the
//! same tokens at the same positions), and the table is cut back to the
//! accepted tokens afterwards, so nothing the draft wrote survives. Below
//! a context of `sinks + recent + top` blocks the draft is the target
//! itself: the draft-length controller, which measures the draft's cost,
//! turns it off there. With a cascade, an n-gram proposer drafts for the
//! sparse draft, which checks those proposals by the exact rule in the
//! same pass, as a draft model does.

use std::collections::HashMap;

use super::verify::verify;
use super::{Draft, DraftRequest, NgramProposer, Proposer, Target};
use crate::backend::{Backend, BlockSelectParams};
use crate::kv::SeqId;
use crate::model::forward::{AttentionExtra, ForwardBatch};
use crate::sched::{Sampler, SamplingParams};
use crate::{Error, Result};

/// Keeps the draft's sampling stream apart from the target's.
const SPARSE_SEED_SALT: u64 = 0x5ba5_d7af;
/// Blocks of the sequence's start every draft reads (attention sinks).
pub const SPARSE_SINK_BLOCKS: usize = 1;
/// Blocks of the recent window every draft reads, the one being filled included.
pub const SPARSE_RECENT_BLOCKS: usize = 4;
/// `sparse` without a count: blocks per KV head besides sinks and window
/// (256 tokens per KV head in blocks of 16: the best of 16 and 64 at 7k
/// tokens on SmolLM2, `scripts/bench-sparse-spec.py`).
pub const DEFAULT_SPARSE_BLOCKS: usize = 16;

/// See the module documentation.
pub struct SparseDraft {
    select: BlockSelectParams,
    /// An n-gram proposer drafting for this draft (a two-level cascade).
    cascade: Option<NgramProposer>,
    samplers: HashMap<SeqId, Sampler>,
}

/// One sequence's drafting within a call to `propose`.
struct Work {
    request: usize,
    seq: SeqId,
    k: usize,
    /// Tokens whose K/V the target's cache holds (all but the last accepted).
    computed: usize,
    history: Vec<u32>,
    draft: Draft,
}

impl SparseDraft {
    /// Drafts attending to `top_blocks` selected KV blocks per KV head, plus
    /// [`SPARSE_SINK_BLOCKS`] and [`SPARSE_RECENT_BLOCKS`].
    pub fn new(top_blocks: usize) -> Result<Self> {
        if top_blocks == 0 {
            return Err(Error::InvalidRequest(
                "sparse speculation needs at least one selected block (sparse:BLOCKS)".into(),
            ));
        }
        Ok(Self {
            select: BlockSelectParams {
                top_blocks,
                sink_blocks: SPARSE_SINK_BLOCKS,
                recent_blocks: SPARSE_RECENT_BLOCKS,
            },
            cascade: None,
            samplers: HashMap::new(),
        })
    }

    /// Lets `ngram` draft for this draft (`--cascade ngram,sparse`).
    pub fn with_cascade(mut self, ngram: NgramProposer) -> Self {
        self.cascade = Some(ngram);
        self
    }

    /// One draft pass: feeds each unfinished sequence's last token (and
    /// the cascade's proposals after it) at the next positions, keeps the
    /// proposals the draft's own distributions accept and samples one
    /// token more. The table is cut back to the positions whose K/V the
    /// next pass reads.
    fn draft_step<B: Backend>(
        &mut self,
        backend: &B,
        target: &mut Target<'_, B>,
        work: &mut [Work],
    ) -> Result<()> {
        let mut fed: Vec<(usize, Vec<u32>)> = Vec::new();
        let mut reservations = Vec::new();
        for (i, w) in work.iter().enumerate() {
            let left = w.k.saturating_sub(w.draft.tokens.len());
            if left == 0 {
                continue;
            }
            let mut tokens = vec![*w.history.last().expect("context is never empty")];
            if let Some(ngram) = &self.cascade {
                tokens.extend(ngram.propose(&w.history, left - 1));
            }
            match target.kv_manager.reserve(w.seq, tokens.len()) {
                Ok(r) => reservations.push(r),
                // A full pool ends this sequence's drafts where they are.
                Err(Error::KvCacheFull(_)) => continue,
                Err(e) => return Err(e),
            }
            fed.push((i, tokens));
        }
        if fed.is_empty() {
            return Ok(());
        }
        for r in &reservations {
            if !r.copies.is_empty() {
                for cache in target.kv.iter_mut() {
                    backend.copy_kv_blocks(cache, &r.copies)?;
                }
            }
        }
        let bs = target.kv_manager.block_size();
        let tables: Vec<&[u32]> = fed
            .iter()
            .map(|(i, _)| {
                let table = target.kv_manager.table(work[*i].seq).expect("reserved");
                table.blocks()
            })
            .collect();
        let width = tables.iter().map(|t| t.len()).max().unwrap_or(1);
        let mut batch = ForwardBatch::new(bs, width);
        for (((i, tokens), r), table) in fed.iter().zip(&reservations).zip(&tables) {
            let pos = work[*i].history.len() - 1;
            batch.push_sequence(tokens, pos, &r.slots, table);
        }
        let rows = batch.rows();
        batch.logit_rows = (0..rows as u32).collect();
        // One table per sequence and KV head, which the selection writes.
        let kv_heads = target.model.config.num_kv_heads;
        let mut scratch = backend.upload_indices(&vec![0; batch.block_tables.len() * kv_heads])?;
        let extra = AttentionExtra::Sparse {
            select: self.select,
            tables: &mut scratch,
        };
        let logits = target
            .model
            .forward_with(backend, &batch, target.kv, extra)?;
        let vocab = target.model.config.vocab_size;
        let logits = backend.download(&logits, rows * vocab)?;
        let mut offset = 0;
        for (i, tokens) in fed {
            let w = &mut work[i];
            let rows = &logits[offset * vocab..(offset + tokens.len()) * vocab];
            offset += tokens.len();
            let sampler = self.samplers.get_mut(&w.seq).expect("created in propose");
            let shaper = sampler.clone();
            let history_len = w.history.len();
            let mut context = w.history.clone();
            let mut dists = Vec::new();
            let verdict = verify(sampler, &tokens[1..], None, |r, accepted| {
                context.truncate(history_len);
                context.extend_from_slice(accepted);
                let d =
                    shaper.distribution(&mut rows[r * vocab..(r + 1) * vocab].to_vec(), &context);
                dists.push(d.clone());
                d
            });
            let emitted = tokens[1..=verdict.accepted]
                .iter()
                .copied()
                .chain([verdict.next]);
            for (token, dist) in emitted.zip(dists) {
                if w.draft.tokens.len() == w.k {
                    break;
                }
                w.draft.tokens.push(token);
                w.draft.dists.get_or_insert_with(Vec::new).push(dist);
                w.history.push(token);
            }
            target.kv_manager.truncate(w.seq, w.history.len() - 1)?;
        }
        Ok(())
    }
}

impl<B: Backend> Proposer<B> for SparseDraft {
    fn describe(&self) -> String {
        let label = format!(
            "sparse self-draft ({} blocks per KV head, {} sink and {} recent blocks)",
            self.select.top_blocks, self.select.sink_blocks, self.select.recent_blocks
        );
        match self.cascade {
            Some(_) => format!("{label} with n-gram cascade"),
            None => label,
        }
    }

    fn drafts_with_target(&self) -> bool {
        true
    }

    fn propose(
        &mut self,
        backend: &B,
        mut target: Target<'_, B>,
        requests: &[DraftRequest<'_>],
    ) -> Result<Vec<Draft>> {
        let mut work = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let Some(table) = target.kv_manager.table(r.seq) else {
                continue;
            };
            // Only a sequence whose cache holds all but its last token drafts.
            if r.k == 0 || table.num_tokens() + 1 != r.context.len() {
                continue;
            }
            self.samplers.entry(r.seq).or_insert_with(|| {
                Sampler::new(SamplingParams {
                    seed: r.params.seed ^ SPARSE_SEED_SALT,
                    ..r.params.clone()
                })
            });
            work.push(Work {
                request: i,
                seq: r.seq,
                k: r.k,
                computed: table.num_tokens(),
                history: r.context.to_vec(),
                draft: Draft::default(),
            });
        }
        let mut outcome = Ok(());
        for _ in 0..requests.iter().map(|r| r.k).max().unwrap_or(0) {
            let before: usize = work.iter().map(|w| w.draft.tokens.len()).sum();
            outcome = self.draft_step(backend, &mut target, &mut work);
            let after: usize = work.iter().map(|w| w.draft.tokens.len()).sum();
            if outcome.is_err() || after == before {
                break;
            }
        }
        // What the drafts wrote is the verification's to overwrite: the
        // tables go back to the accepted tokens either way.
        for w in &work {
            target.kv_manager.truncate(w.seq, w.computed)?;
        }
        outcome?;
        let mut out: Vec<Draft> = requests.iter().map(|_| Draft::default()).collect();
        for mut w in work {
            if requests[w.request].params.temperature <= 0.0 {
                w.draft.dists = None;
            }
            out[w.request] = w.draft;
        }
        Ok(out)
    }

    fn forget(&mut self, seq: SeqId) {
        self.samplers.remove(&seq);
    }
}
