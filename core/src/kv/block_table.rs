//! `BlockTable`: where one sequence's tokens live in the paged KV cache.

use super::{BlockKey, EVICTED_BLOCK};

/// The physical blocks of one sequence, in token order, and how many token
/// slots of them are filled. Token `i` lives in block `blocks[i / block_size]`
/// at offset `i % block_size`; an evicted block is a hole
/// ([`EVICTED_BLOCK`]) that attention skips, the other tokens keeping their
/// positions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    num_tokens: usize,
    /// Content keys of the leading full blocks whose K/V are computed (the
    /// prefix-cache chain: each depends on the one before).
    keys: Vec<BlockKey>,
    /// Whether a block was ever evicted: K/V computed since then depend on
    /// an incomplete prefix, so no further block enters the prefix cache.
    evicted: bool,
    /// Attention mass each block received so far (decayed for H2O), by table index;
    /// shorter than `blocks` when the tail has received none yet.
    scores: Vec<f32>,
}

impl BlockTable {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// The physical slot of token `pos` (which must be inside the table's capacity).
    pub fn slot(&self, pos: usize, block_size: usize) -> u32 {
        self.blocks[pos / block_size] * block_size as u32 + (pos % block_size) as u32
    }

    /// Blocks that hold K/V (the table's entries less its holes).
    pub fn live_blocks(&self) -> usize {
        self.blocks.iter().filter(|&&b| b != EVICTED_BLOCK).count()
    }

    /// Whether any block of this sequence was evicted.
    pub fn has_evicted(&self) -> bool {
        self.evicted
    }

    /// Accumulated attention mass per table index (see [`BlockTable::add_scores`]).
    pub fn scores(&self) -> &[f32] {
        &self.scores
    }

    /// Scales the accumulated attention mass by `decay`, then adds
    /// `mass[i]` to that of table entry `i`.
    pub(crate) fn add_scores(&mut self, mass: &[f32], decay: f32) {
        let n = mass.len().min(self.blocks.len());
        if self.scores.len() < n {
            self.scores.resize(n, 0.0);
        }
        self.scores.iter_mut().for_each(|s| *s *= decay);
        for (s, m) in self.scores.iter_mut().zip(&mass[..n]) {
            *s += m;
        }
    }

    /// Makes entry `index` a hole, returning the block it held.
    pub(crate) fn evict(&mut self, index: usize) -> u32 {
        self.evicted = true;
        std::mem::replace(&mut self.blocks[index], EVICTED_BLOCK)
    }

    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    pub(crate) fn push_key(&mut self, key: BlockKey) {
        self.keys.push(key);
    }

    /// Forgets the keys past the first `full_blocks` (they are being rewritten).
    pub(crate) fn truncate_keys(&mut self, full_blocks: usize) {
        self.keys.truncate(full_blocks);
    }

    pub(crate) fn push_block(&mut self, block: u32) {
        self.blocks.push(block);
    }

    pub(crate) fn replace_block(&mut self, index: usize, block: u32) {
        self.blocks[index] = block;
    }

    pub(crate) fn set_num_tokens(&mut self, n: usize) {
        self.num_tokens = n;
    }

    /// Drops the blocks past `keep`, returning them.
    pub(crate) fn truncate_blocks(&mut self, keep: usize) -> Vec<u32> {
        self.scores.truncate(keep);
        self.blocks.split_off(keep.min(self.blocks.len()))
    }
}
