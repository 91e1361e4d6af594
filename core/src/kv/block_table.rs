//! `BlockTable`: where one sequence's tokens live in the paged KV cache.

use super::BlockKey;

/// The physical blocks of one sequence, in token order, and how many token
/// slots of them are filled. Token `i` lives in block `blocks[i / block_size]`
/// at offset `i % block_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    num_tokens: usize,
    /// Content keys of the leading full blocks whose K/V are computed (the
    /// prefix-cache chain: each depends on the one before).
    keys: Vec<BlockKey>,
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
        self.blocks.split_off(keep.min(self.blocks.len()))
    }
}
