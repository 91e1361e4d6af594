//! A draft model: a smaller model with the target's tokenizer (or the
//! target itself with fewer layers: self-speculation) that proposes k tokens
//! per sequence by decoding them autoregressively in its own paged KV cache.
//!
//! Drafting is batched over all sequences of a step, one forward pass per
//! drafted token. Each sequence's draft cache follows the target: before
//! drafting, it is cut back to the longest prefix it shares with the
//! target's accepted tokens (rejected drafts rolled back) and the missing
//! tokens are fed. With a cascade, an n-gram proposer drafts for the draft
//! model, which verifies those proposals with the same exact rule as the
//! target does, so one draft forward pass can yield several tokens.

use std::collections::HashMap;

use super::verify::{verify, Distribution};
use super::{Draft, DraftRequest, NgramProposer, Proposer, Target};
use crate::backend::{Backend, KvDtype};
use crate::kv::{KvCacheManager, SeqId};
use crate::model::forward::{AttentionExtra, ForwardBatch, Model};
use crate::model::ModelFiles;
use crate::sched::{Sampler, SamplingParams};
use crate::{Error, Result};

/// Keeps the draft's sampling stream apart from the target's.
const DRAFT_SEED_SALT: u64 = 0x5eed_d7af;
/// A draft cache lagging further behind its sequence than this (after
/// speculation paused) restarts on the last `CATCH_UP_WINDOW` tokens
/// instead of feeding the whole gap: otherwise every occasional probe
/// would pay for all the tokens decoded since the last one.
const MAX_CATCH_UP: usize = 64;
const CATCH_UP_WINDOW: usize = 16;

/// How a draft model's KV pool is sized and what drafts for it.
#[derive(Clone, Debug)]
pub struct DraftModelConfig {
    pub block_size: usize,
    /// Tokens the draft's KV pool holds over all sequences.
    pub capacity_tokens: usize,
    pub kv_dtype: KvDtype,
    /// Most tokens one draft forward pass feeds (long contexts are fed in chunks).
    pub max_batch_tokens: usize,
    /// An n-gram proposer drafting for the draft model (a two-level cascade).
    pub cascade: Option<NgramProposer>,
}

/// A draft's state of one sequence.
pub(super) struct DraftSequence {
    /// Where the draft's view of the sequence starts (0 unless it restarted
    /// on a window); its position 0 is the sequence's position `offset`.
    pub offset: usize,
    /// Tokens from `offset` on whose K/V the draft cache holds.
    pub computed: Vec<u32>,
    pub sampler: Sampler,
}

impl DraftSequence {
    /// The state of `seq` in `sequences`, made if missing (its sampling
    /// stream the target's seed with `salt`) and given a table in `manager`
    /// if it has none (after the pool was emptied: the view starts over).
    pub fn entry<'a>(
        sequences: &'a mut HashMap<SeqId, DraftSequence>,
        manager: &mut KvCacheManager,
        seq: SeqId,
        params: &SamplingParams,
        salt: u64,
    ) -> Result<&'a mut DraftSequence> {
        let ds = sequences.entry(seq).or_insert_with(|| DraftSequence {
            offset: 0,
            computed: Vec::new(),
            sampler: Sampler::new(SamplingParams {
                seed: params.seed ^ salt,
                ..params.clone()
            }),
        });
        if manager.table(seq).is_none() {
            manager.add_sequence(seq)?;
            ds.computed.clear();
            ds.offset = 0;
        }
        Ok(ds)
    }

    /// How much of its view of `context` the cache holds, short of the
    /// last token (at least one token is always fed).
    pub fn common_prefix(&self, context: &[u32]) -> usize {
        let view = context.get(self.offset..).unwrap_or_default();
        (self.computed.iter().zip(view))
            .take_while(|(a, b)| a == b)
            .count()
            .min(view.len().saturating_sub(1))
    }
}

/// See the module documentation.
pub struct DraftModel<B: Backend> {
    label: String,
    model: Model<B>,
    kv: Vec<B::KvCache>,
    manager: KvCacheManager,
    sequences: HashMap<SeqId, DraftSequence>,
    config: DraftModelConfig,
}

/// One sequence's drafting within a call to `propose`.
pub(super) struct Work {
    pub request: usize,
    pub seq: SeqId,
    pub k: usize,
    /// The draft's view of the context (see `DraftSequence::offset`), then the drafts so far.
    pub history: Vec<u32>,
    pub drafts: Vec<u32>,
    pub dists: Vec<Distribution>,
    /// An EAGLE head's final hidden state of the last row it fed (empty
    /// for other drafts).
    pub hidden: Vec<f32>,
}

impl Work {
    pub fn new(request: usize, seq: SeqId, k: usize, history: Vec<u32>) -> Self {
        Self {
            request,
            seq,
            k,
            history,
            drafts: Vec::new(),
            dists: Vec::new(),
            hidden: Vec::new(),
        }
    }

    /// The drafts of `work` for `requests`, in order (empty where none);
    /// greedy ones without distributions (they were chosen deterministically).
    pub fn into_drafts(work: Vec<Work>, requests: &[DraftRequest<'_>]) -> Vec<Draft> {
        let mut out: Vec<Draft> = requests.iter().map(|_| Draft::default()).collect();
        for w in work {
            let deterministic = requests[w.request].params.temperature <= 0.0;
            out[w.request] = Draft {
                tokens: w.drafts,
                dists: (!deterministic).then_some(w.dists),
            };
        }
        out
    }
}

impl DraftModelConfig {
    /// Refuses sizes a draft's KV pool cannot have.
    pub(super) fn check(&self) -> Result<()> {
        if self.block_size == 0 || self.capacity_tokens == 0 || self.max_batch_tokens == 0 {
            return Err(Error::InvalidRequest(
                "the draft model needs a positive block size, KV capacity and batch size".into(),
            ));
        }
        Ok(())
    }
}

impl<B: Backend> DraftModel<B> {
    /// Loads `files` (all layers, or only `layers` for self-speculation).
    pub fn load(
        backend: &B,
        files: &ModelFiles,
        layers: Option<&[usize]>,
        config: DraftModelConfig,
    ) -> Result<Self> {
        config.check()?;
        if files.config.reads_hidden {
            return Err(Error::InvalidRequest(format!(
                "{} is an EAGLE head: load it as one (EagleDraft)",
                files.path.display()
            )));
        }
        let model = match layers {
            Some(l) => Model::load_layers(backend, files, l, &mut |_, _| {})?,
            None => Model::load(backend, files, &mut |_, _| {})?,
        };
        let num_blocks = config.capacity_tokens.div_ceil(config.block_size);
        let kv = model.alloc_kv_caches(backend, num_blocks, config.block_size, config.kv_dtype)?;
        let label = match layers {
            Some(l) => format!(
                "self-draft ({} of {} layers)",
                l.len(),
                files.config.num_layers
            ),
            None => match &files.config.output_tokens {
                Some(tokens) => format!(
                    "draft {} ({} of {} tokens)",
                    files.path.display(),
                    tokens.len(),
                    files.config.vocab_size
                ),
                None => format!("draft {}", files.path.display()),
            },
        };
        Ok(Self {
            label,
            model,
            kv,
            manager: KvCacheManager::new(num_blocks, config.block_size),
            sequences: HashMap::new(),
            config,
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// The draft's argmax after every position of `tokens` (teacher forced).
    pub fn greedy_predictions(&mut self, backend: &B, tokens: &[u32]) -> Result<Vec<u32>> {
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::with_capacity(tokens.len());
        self.score_chunks(backend, tokens, &mut |logits| {
            out.extend(logits.chunks(vocab).map(crate::sched::sampling::argmax))
        })?;
        Ok(out)
    }

    /// The draft's logits after every position of `tokens` (teacher forced,
    /// `[tokens, vocab]`, the tokens a reduced head never predicts at -inf).
    pub fn score(&mut self, backend: &B, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.score_chunks(backend, tokens, &mut |logits| out.extend(logits))?;
        Ok(out)
    }

    /// Feeds `tokens` in chunks of the batch size (see
    /// [`DraftPass::score_chunks`]).
    fn score_chunks(
        &mut self,
        backend: &B,
        tokens: &[u32],
        each: &mut dyn FnMut(Vec<f32>),
    ) -> Result<()> {
        let chunk = self.config.max_batch_tokens;
        self.pass().score_chunks(backend, tokens, chunk, &[], each)
    }

    fn pass(&mut self) -> DraftPass<'_, B> {
        DraftPass {
            model: &self.model,
            kv: &mut self.kv,
            manager: &mut self.manager,
        }
    }

    /// Cuts the draft cache of `seq` back to its common prefix with
    /// `context` (keeping at least one token to feed) and returns the offset
    /// of the draft's view: `context[offset..]` is what it drafts after.
    fn sync(&mut self, seq: SeqId, context: &[u32], params: &SamplingParams) -> Result<usize> {
        let (sequences, manager) = (&mut self.sequences, &mut self.manager);
        let ds = DraftSequence::entry(sequences, manager, seq, params, DRAFT_SEED_SALT)?;
        let view = context.get(ds.offset..).unwrap_or_default();
        let mut common = ds.common_prefix(context);
        let lag = view.len().saturating_sub(common);
        if view.is_empty() || (!ds.computed.is_empty() && lag > MAX_CATCH_UP) {
            ds.offset = context.len().saturating_sub(CATCH_UP_WINDOW);
            common = 0;
        }
        ds.computed.truncate(common);
        self.manager.truncate(seq, common)?;
        Ok(ds.offset)
    }

    /// Feeds `chunks` (sequence, start position, tokens) in one forward pass
    /// and returns the host logits of the requested rows (indices into the
    /// flattened rows), over the whole vocabulary.
    fn forward(
        &mut self,
        backend: &B,
        chunks: &[(SeqId, usize, &[u32])],
        logit_rows: Vec<u32>,
    ) -> Result<Vec<f32>> {
        Ok(self.pass().run(backend, chunks, logit_rows, Vec::new())?.0)
    }

    /// Feeds all but the last uncomputed token of each sequence, in chunks,
    /// without logits (first drafts of a long prompt).
    fn prefill(&mut self, backend: &B, work: &[Work]) -> Result<()> {
        for w in work {
            loop {
                let done = self.sequences[&w.seq].computed.len();
                let end = w.history.len() - 1;
                if done >= end {
                    break;
                }
                let n = (end - done).min(self.config.max_batch_tokens);
                let tokens = w.history[done..done + n].to_vec();
                self.forward(backend, &[(w.seq, done, &tokens)], Vec::new())?;
                let ds = self.sequences.get_mut(&w.seq).expect("synced");
                ds.computed.extend_from_slice(&tokens);
            }
        }
        Ok(())
    }

    /// One draft forward pass for every unfinished sequence: feeds its last
    /// token (plus cascade proposals), then extends its drafts with what
    /// the draft model samples there.
    fn draft_step(&mut self, backend: &B, work: &mut [Work]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let mut fed: Vec<(usize, Vec<u32>)> = Vec::new();
        let mut rows = Vec::new();
        let mut row = 0u32;
        for (i, w) in work.iter().enumerate() {
            if w.drafts.len() >= w.k {
                continue;
            }
            let proposals = self.config.cascade.map_or_else(Vec::new, |ng| {
                ng.propose(&w.history, w.k - w.drafts.len() - 1)
            });
            let mut tokens = vec![*w.history.last().expect("context is never empty")];
            tokens.extend_from_slice(&proposals);
            rows.extend(row..row + tokens.len() as u32);
            row += tokens.len() as u32;
            fed.push((i, tokens));
        }
        if fed.is_empty() {
            return Ok(());
        }
        let chunks: Vec<(SeqId, usize, &[u32])> = fed
            .iter()
            .map(|(i, t)| (work[*i].seq, work[*i].history.len() - 1, t.as_slice()))
            .collect();
        let logits = self.forward(backend, &chunks, rows)?;
        let mut offset = 0;
        for (i, tokens) in fed {
            let w = &mut work[i];
            let n_rows = tokens.len();
            let rows = &logits[offset * vocab..(offset + n_rows) * vocab];
            offset += n_rows;
            let ds = self.sequences.get_mut(&w.seq).expect("synced");
            let proposals = &tokens[1..];
            let mut dists = Vec::with_capacity(n_rows);
            let mut context = w.history.clone();
            let history_len = context.len();
            let verdict = {
                let sampler_params = ds.sampler.clone();
                verify(&mut ds.sampler, proposals, None, |r, accepted| {
                    context.truncate(history_len);
                    context.extend_from_slice(accepted);
                    let d = sampler_params
                        .distribution(&mut rows[r * vocab..(r + 1) * vocab].to_vec(), &context);
                    dists.push(d.clone());
                    d
                })
            };
            let start = w.history.len() - 1;
            ds.computed.truncate(start);
            ds.computed.push(tokens[0]);
            ds.computed
                .extend_from_slice(&proposals[..verdict.accepted]);
            self.manager.truncate(w.seq, ds.computed.len())?;
            let emitted = proposals[..verdict.accepted]
                .iter()
                .copied()
                .chain([verdict.next]);
            for (t, d) in emitted.zip(dists) {
                if w.drafts.len() == w.k {
                    break;
                }
                w.drafts.push(t);
                w.dists.push(d);
                w.history.push(t);
            }
        }
        Ok(())
    }
}

impl<B: Backend> Proposer<B> for DraftModel<B> {
    fn describe(&self) -> String {
        match self.config.cascade {
            Some(_) => format!("{} with n-gram cascade", self.label),
            None => self.label.clone(),
        }
    }

    fn propose(
        &mut self,
        backend: &B,
        _target: Target<'_, B>,
        requests: &[DraftRequest<'_>],
    ) -> Result<Vec<Draft>> {
        let mut work = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if r.k == 0 || r.context.is_empty() {
                continue;
            }
            let capacity = self.manager.num_blocks() * self.manager.block_size();
            if r.context.len() + r.k > capacity
                || r.context.len() + r.k > self.model.config.max_context
            {
                continue;
            }
            let offset = self.sync(r.seq, r.context, r.params)?;
            work.push(Work::new(i, r.seq, r.k, r.context[offset..].to_vec()));
        }
        // A full draft pool drops every draft sequence; the next calls start over.
        let outcome = self.prefill(backend, &work).and_then(|()| {
            while work.iter().any(|w| w.drafts.len() < w.k) {
                self.draft_step(backend, &mut work)?;
            }
            Ok(())
        });
        match outcome {
            Err(Error::KvCacheFull(_)) => {
                for seq in self.sequences.keys().copied().collect::<Vec<_>>() {
                    self.forget(seq);
                }
                return Ok(requests.iter().map(|_| Draft::default()).collect());
            }
            other => other?,
        }
        Ok(Work::into_drafts(work, requests))
    }

    fn forget(&mut self, seq: SeqId) {
        self.sequences.remove(&seq);
        self.manager.free(seq);
    }

    fn measure_cost(&mut self, backend: &B) -> Result<Option<f64>> {
        // One-token forward passes; the first one warms up.
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let clock = super::Stopwatch::start();
            self.greedy_predictions(backend, &[0])?;
            best = best.min(clock.seconds());
        }
        Ok(Some(best))
    }
}

/// A draft model's weights, paged KV and its manager, for one forward pass.
pub(super) struct DraftPass<'a, B: Backend> {
    pub model: &'a Model<B>,
    pub kv: &'a mut [B::KvCache],
    pub manager: &'a mut KvCacheManager,
}

impl<B: Backend> DraftPass<'_, B> {
    /// Feeds `chunks` (sequence, start position, tokens) in one forward
    /// pass, each row reading its row of `input_hidden` where the model is
    /// an EAGLE head, and returns the host logits of the requested rows
    /// (indices into the flattened rows) over the whole vocabulary, and an
    /// EAGLE head's final hidden state of every row.
    pub fn run(
        &mut self,
        backend: &B,
        chunks: &[(SeqId, usize, &[u32])],
        logit_rows: Vec<u32>,
        input_hidden: Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let bs = self.manager.block_size();
        let mut reservations = Vec::with_capacity(chunks.len());
        for &(seq, _, tokens) in chunks {
            reservations.push(self.manager.reserve(seq, tokens.len())?);
        }
        let max_blocks = chunks
            .iter()
            .map(|c| self.manager.table(c.0).map_or(1, |t| t.blocks().len()))
            .max()
            .unwrap_or(1);
        let mut batch = ForwardBatch::new(bs, max_blocks);
        for (&(seq, start, tokens), res) in chunks.iter().zip(&reservations) {
            for cache in self.kv.iter_mut() {
                if !res.copies.is_empty() {
                    backend.copy_kv_blocks(cache, &res.copies)?;
                }
            }
            let table = self.manager.table(seq).expect("reserved above");
            batch.push_sequence(tokens, start, &res.slots, table.blocks());
        }
        let n = logit_rows.len();
        batch.logit_rows = logit_rows;
        batch.input_hidden = input_hidden;
        let config = &self.model.config;
        let (logits, hidden) = match config.reads_hidden {
            true => {
                let extra = AttentionExtra::None;
                let (logits, h) = self.model.forward_hidden(backend, &batch, self.kv, extra)?;
                let h = backend.download(&h, batch.rows() * config.hidden_size)?;
                (logits, h)
            }
            false => (self.model.forward(backend, &batch, self.kv)?, Vec::new()),
        };
        if n == 0 {
            return Ok((Vec::new(), hidden));
        }
        let logits = backend.download(&logits, n * config.logit_width())?;
        let logits = match &config.output_tokens {
            Some(tokens) => widen_logits(&logits, tokens, config.vocab_size),
            None => logits,
        };
        Ok((logits, hidden))
    }

    /// Feeds `tokens` teacher forced through a scratch sequence, in chunks
    /// of `chunk` rows, each row reading its row of `input_hidden` (empty
    /// for a model that reads none), and hands each chunk's logits to
    /// `each`, so a long sample never holds all of them at once.
    pub fn score_chunks(
        mut self,
        backend: &B,
        tokens: &[u32],
        chunk: usize,
        input_hidden: &[f32],
        each: &mut dyn FnMut(Vec<f32>),
    ) -> Result<()> {
        const SCRATCH: SeqId = SeqId::MAX;
        let dim = input_hidden.len() / tokens.len().max(1);
        self.manager.add_sequence(SCRATCH)?;
        let mut result = Ok(());
        for (i, piece) in tokens.chunks(chunk).enumerate() {
            let start = i * chunk;
            let rows = (0..piece.len() as u32).collect();
            let input = input_hidden[start * dim..(start + piece.len()) * dim].to_vec();
            match self.run(backend, &[(SCRATCH, start, piece)], rows, input) {
                Ok((logits, _)) => each(logits),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.manager.free(SCRATCH);
        result
    }
}

/// Rows of a reduced head's logits (one per token of `tokens`) spread over
/// the whole vocabulary. The tokens it never predicts get -inf: every
/// sampler gives them probability zero, so the draft distribution the
/// acceptance rule sees is exactly the one the draft sampled from.
fn widen_logits(rows: &[f32], tokens: &[u32], vocab: usize) -> Vec<f32> {
    let mut out = vec![f32::NEG_INFINITY; rows.len() / tokens.len() * vocab];
    for (row, wide) in rows
        .chunks_exact(tokens.len())
        .zip(out.chunks_exact_mut(vocab))
    {
        for (&token, &logit) in tokens.iter().zip(row) {
            wide[token as usize] = logit;
        }
    }
    out
}
