//! Scoring: the logits (and, for EAGLE training, the hidden states) of
//! every position of a token sequence evaluated from scratch, in a
//! temporary sequence of the engine's cache, for perplexity, reference
//! checks and the draft-length controller's step timings.

use super::eviction::ScoredRows;
use super::Engine;
use crate::backend::Backend;
use crate::kv::SeqId;
use crate::model::forward::ForwardBatch;
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Logits of every position from `first_row` on, for `tokens` evaluated
    /// from scratch (perplexity, reference checks). Uses a temporary sequence
    /// whose blocks are freed before returning. Returns `[rows, vocab]`.
    /// Under the engine's KV budget the sequence is cut back after every
    /// chunk of `max_batch_tokens`, the tokens before `first_row` counting
    /// as its prompt.
    pub fn score(&mut self, tokens: &[u32], first_row: usize) -> Result<Vec<f32>> {
        self.score_sequence(tokens, first_row, None)
    }

    /// [`Engine::score`] from row 0, with every row's final hidden state
    /// (`[rows, hidden]`, before the output norm): what an EAGLE head is
    /// trained on. Returns the logits and the hidden states.
    pub fn score_hidden(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut hidden = Vec::with_capacity(tokens.len() * self.model.config.hidden_size);
        let logits = self.score_sequence(tokens, 0, Some(&mut hidden))?;
        Ok((logits, hidden))
    }

    fn score_sequence(
        &mut self,
        tokens: &[u32],
        first_row: usize,
        hidden: Option<&mut Vec<f32>>,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() || first_row >= tokens.len() {
            return Err(Error::InvalidRequest("nothing to score".into()));
        }
        self.check_tokens(tokens)?;
        self.check_fits(tokens.len() - 1, self.eviction.as_ref())?;
        let id = self.next_id;
        self.next_id += 1;
        self.kv_manager.add_sequence(id)?;
        let result = self.score_chunks(id, tokens, first_row, hidden);
        self.kv_manager.free(id);
        result
    }

    fn score_chunks(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        first_row: usize,
        mut hidden: Option<&mut Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let bs = self.kv_manager.block_size();
        let mut out = Vec::with_capacity((tokens.len() - first_row) * vocab);
        // Under a KV budget the unscored context is the prompt: SnapKV
        // selects once it is computed, as before decoding.
        let prompt_len = first_row.max(1);
        for (chunk_idx, chunk) in tokens.chunks(self.config.max_batch_tokens).enumerate() {
            let start = chunk_idx * self.config.max_batch_tokens;
            let res = self.kv_manager.reserve(id, chunk.len())?;
            let table = self.kv_manager.table(id).expect("added by caller");
            let mut batch = ForwardBatch::new(bs, table.blocks().len());
            batch.push_sequence(chunk, start, &res.slots, table.blocks());
            batch.logit_rows = (first_row.max(start)..start + chunk.len())
                .map(|p| (p - start) as u32)
                .collect();
            let scored: Vec<ScoredRows> = (self.eviction.iter())
                .map(|&plan| ScoredRows {
                    seq: id,
                    first_row: 0,
                    len: chunk.len(),
                    plan,
                    prompt_len,
                })
                .collect();
            let (logits, chunk_hidden) = self.forward_scoring(&batch, &scored, hidden.is_some())?;
            if let Some(plan) = self.eviction {
                self.evict_computed(id, &plan, start + chunk.len(), prompt_len)?;
            }
            if let (Some(out), Some(h)) = (hidden.as_deref_mut(), chunk_hidden) {
                let dim = self.model.config.hidden_size;
                out.extend(self.backend.download(&h, chunk.len() * dim)?);
            }
            if !batch.logit_rows.is_empty() {
                out.extend(
                    self.backend
                        .download(&logits, batch.logit_rows.len() * vocab)?,
                );
            }
        }
        Ok(out)
    }
}
