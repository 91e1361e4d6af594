//! `KvCacheManager`: the block tables of all sequences over one block pool,
//! with automatic prefix caching (in `prefix_cache`).
//!
//! Eviction ([`KvCacheManager::evict`]) turns table entries into holes
//! ([`EVICTED_BLOCK`]), releasing the sequence's reference only: a block
//! shared with other sequences or the prefix cache lives on for them. Once a
//! sequence has evicted, its later blocks were computed over an incomplete
//! prefix, so none of them is registered in the prefix cache.

use std::collections::HashMap;
use std::hash::RandomState;

use super::{BlockHasher, BlockTable, EvictionPlan, KvBlockAllocator, EVICTED_BLOCK};
use crate::{Error, Result};

/// Identifies a sequence in the engine and in the KV cache.
pub type SeqId = u64;

/// Where the K/V of newly appended tokens go, and the block copies the
/// backend must perform first (copy-on-write of shared blocks).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotReservation {
    /// One physical slot per appended token, in order.
    pub slots: Vec<u32>,
    /// `(src, dst)` whole-block copies to run before writing to `slots`.
    pub copies: Vec<(u32, u32)>,
}

#[derive(Debug)]
pub struct KvCacheManager {
    pub(super) allocator: KvBlockAllocator,
    pub(super) block_size: usize,
    pub(super) tables: HashMap<SeqId, BlockTable>,
    pub(super) hasher: BlockHasher,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_hasher(
            num_blocks,
            block_size,
            BlockHasher::Keyed(RandomState::new()),
        )
    }

    pub fn with_hasher(num_blocks: usize, block_size: usize, hasher: BlockHasher) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            allocator: KvBlockAllocator::new(num_blocks),
            block_size,
            tables: HashMap::new(),
            hasher,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.allocator.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.allocator.num_free()
    }

    pub fn num_used_blocks(&self) -> usize {
        self.allocator.num_used()
    }

    pub fn allocator(&self) -> &KvBlockAllocator {
        &self.allocator
    }

    pub fn table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.tables.get(&seq)
    }

    pub fn sequences(&self) -> impl Iterator<Item = (SeqId, &BlockTable)> {
        self.tables.iter().map(|(&s, t)| (s, t))
    }

    /// Registers an empty sequence.
    pub fn add_sequence(&mut self, seq: SeqId) -> Result<()> {
        if self.tables.contains_key(&seq) {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} already exists"
            )));
        }
        self.tables.insert(seq, BlockTable::default());
        Ok(())
    }

    fn table_of(&self, seq: SeqId) -> Result<&BlockTable> {
        self.tables
            .get(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))
    }

    /// Blocks that appending `n_new` tokens to `seq` would take from the pool.
    pub fn blocks_needed(&self, seq: SeqId, n_new: usize) -> Result<usize> {
        let table = self.table_of(seq)?;
        let have = table.blocks().len();
        let want = (table.num_tokens() + n_new).div_ceil(self.block_size);
        let cow = usize::from(n_new > 0 && self.last_block_needs_copy(table));
        Ok(want.saturating_sub(have) + cow)
    }

    /// Whether the next write lands in a partially filled block that others
    /// hold or whose content the prefix cache keeps.
    fn last_block_needs_copy(&self, table: &BlockTable) -> bool {
        !table.num_tokens().is_multiple_of(self.block_size)
            && table.blocks().last().is_some_and(|&b| {
                self.allocator.ref_count(b) > 1 || self.allocator.is_registered(b)
            })
    }

    /// Appends `n_new` token slots to `seq`: all or nothing.
    pub fn reserve(&mut self, seq: SeqId, n_new: usize) -> Result<SlotReservation> {
        let needed = self.blocks_needed(seq, n_new)?;
        if needed > self.allocator.num_free() {
            return Err(Error::KvCacheFull(format!(
                "sequence {seq} needs {needed} more blocks, {} free",
                self.allocator.num_free()
            )));
        }
        let bs = self.block_size;
        let mut table = self.tables.remove(&seq).expect("checked by blocks_needed");
        let mut copies = Vec::new();
        if n_new > 0 && self.last_block_needs_copy(&table) {
            let last = table.blocks().len() - 1;
            let old = table.blocks()[last];
            let new = self.allocator.allocate().expect("counted in blocks_needed");
            self.allocator.release(old);
            table.replace_block(last, new);
            copies.push((old, new));
        }
        let start = table.num_tokens();
        while table.capacity(bs) < start + n_new {
            table.push_block(self.allocator.allocate().expect("counted in blocks_needed"));
        }
        let slots = (start..start + n_new).map(|p| table.slot(p, bs)).collect();
        table.set_num_tokens(start + n_new);
        self.tables.insert(seq, table);
        Ok(SlotReservation { slots, copies })
    }

    /// Makes `child` share all of `parent`'s blocks (copy-on-write).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.tables.contains_key(&child) {
            return Err(Error::InvalidRequest(format!(
                "sequence {child} already exists"
            )));
        }
        let table = self.table_of(parent)?.clone();
        for &b in live(table.blocks()) {
            self.allocator.retain(b);
        }
        self.tables.insert(child, table);
        Ok(())
    }

    /// Keeps only the first `n_tokens` tokens of `seq` (rollback of rejected
    /// speculative tokens, or a chat turn rewritten), freeing unused blocks.
    pub fn truncate(&mut self, seq: SeqId, n_tokens: usize) -> Result<()> {
        let bs = self.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if n_tokens > table.num_tokens() {
            return Err(Error::InvalidRequest(format!(
                "cannot truncate sequence {seq} of {} tokens to {n_tokens}",
                table.num_tokens()
            )));
        }
        if !keeps_written_block(table, n_tokens, bs) {
            return Err(Error::InvalidRequest(format!(
                "cannot truncate sequence {seq} to {n_tokens} tokens: that block was evicted"
            )));
        }
        for b in table.truncate_blocks(n_tokens.div_ceil(bs)) {
            if b != EVICTED_BLOCK {
                self.allocator.release(b);
            }
        }
        table.truncate_keys(n_tokens / bs);
        table.set_num_tokens(n_tokens);
        Ok(())
    }

    /// Whether [`KvCacheManager::truncate`] can cut `seq` to `n_tokens`
    /// tokens (not into an evicted block).
    pub fn can_truncate(&self, seq: SeqId, n_tokens: usize) -> bool {
        self.tables.get(&seq).is_some_and(|t| {
            n_tokens <= t.num_tokens() && keeps_written_block(t, n_tokens, self.block_size)
        })
    }

    /// Forgets `seq`, releasing its blocks.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(table) = self.tables.remove(&seq) {
            for &b in live(table.blocks()) {
                self.allocator.release(b);
            }
        }
    }

    /// Evicts table entries `indices` of `seq`: each becomes a hole and the
    /// sequence's reference to its block is released. The last entry (the
    /// one being written) and holes cannot be evicted.
    pub fn evict(&mut self, seq: SeqId, indices: &[usize]) -> Result<()> {
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        let entries = table.blocks().len();
        for &i in indices {
            if i + 1 >= entries || table.blocks()[i] == EVICTED_BLOCK {
                return Err(Error::InvalidRequest(format!(
                    "sequence {seq}: block {i} of {entries} cannot be evicted"
                )));
            }
        }
        for &i in indices {
            let block = table.evict(i);
            if block != EVICTED_BLOCK {
                self.allocator.release(block);
            }
        }
        Ok(())
    }

    /// Evicts what `plan` selects from `seq`; returns how many blocks went.
    pub fn evict_over_budget(&mut self, seq: SeqId, plan: &EvictionPlan) -> Result<usize> {
        let chosen = plan.select(self.table_of(seq)?);
        self.evict(seq, &chosen)?;
        Ok(chosen.len())
    }

    /// Adds attention mass per table entry of `seq` (H2O, SnapKV scores),
    /// after scaling the scores so far by `decay`.
    pub fn add_block_scores(&mut self, seq: SeqId, mass: &[f32], decay: f32) -> Result<()> {
        self.tables
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?
            .add_scores(mass, decay);
        Ok(())
    }
}

/// Whether cutting `table` to `n_tokens` tokens leaves the block the next
/// write lands in (a partly kept one) in place: not evicted.
fn keeps_written_block(table: &BlockTable, n_tokens: usize, bs: usize) -> bool {
    n_tokens.is_multiple_of(bs) || table.blocks()[n_tokens / bs] != EVICTED_BLOCK
}

/// The entries of a block table that hold a block (not holes).
fn live(blocks: &[u32]) -> impl Iterator<Item = &u32> {
    blocks.iter().filter(|&&b| b != EVICTED_BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reserve_fills_blocks_in_order() {
        let mut m = KvCacheManager::new(8, 4);
        m.add_sequence(1).unwrap();
        let r = m.reserve(1, 6).unwrap();
        assert_eq!(r.slots, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(m.num_used_blocks(), 2);
        assert_eq!(m.reserve(1, 1).unwrap().slots, vec![6]);
        assert_eq!(m.num_used_blocks(), 2);
    }

    #[test]
    fn full_pool_is_an_error_and_changes_nothing() {
        let mut m = KvCacheManager::new(2, 4);
        m.add_sequence(1).unwrap();
        m.reserve(1, 5).unwrap();
        let err = m.reserve(1, 4).unwrap_err();
        assert!(matches!(err, Error::KvCacheFull(_)), "{err}");
        assert_eq!(m.table(1).unwrap().num_tokens(), 5);
        assert_eq!(m.num_free_blocks(), 0);
    }

    #[test]
    fn fork_shares_then_copies_the_partial_last_block_on_write() {
        let mut m = KvCacheManager::new(8, 4);
        m.add_sequence(1).unwrap();
        m.reserve(1, 6).unwrap();
        m.fork(1, 2).unwrap();
        assert_eq!(m.num_used_blocks(), 2);
        let r = m.reserve(2, 1).unwrap();
        assert_eq!(r.copies, vec![(1, 2)]);
        assert_eq!(r.slots, vec![2 * 4 + 2]);
        assert_eq!(m.table(2).unwrap().blocks(), &[0, 2]);
        assert_eq!(m.allocator().ref_count(0), 2);
        assert_eq!(m.allocator().ref_count(1), 1);
        m.free(1);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 8);
    }

    #[test]
    fn truncate_releases_tail_blocks() {
        let mut m = KvCacheManager::new(8, 4);
        m.add_sequence(1).unwrap();
        m.reserve(1, 11).unwrap();
        m.truncate(1, 5).unwrap();
        assert_eq!(m.num_used_blocks(), 2);
        assert_eq!(m.reserve(1, 1).unwrap().slots, vec![5]);
        assert!(m.truncate(1, 50).is_err());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add,
        Append(usize, usize),
        Fork(usize),
        Truncate(usize, usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Add),
            (0..8usize, 1..12usize).prop_map(|(s, n)| Op::Append(s, n)),
            (0..8usize).prop_map(Op::Fork),
            (0..8usize, 0..30usize).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0..8usize).prop_map(Op::Free),
        ]
    }

    proptest! {
        /// Reference counts equal the number of tables holding each block, and
        /// free blocks are exactly the unreferenced ones, after any operations.
        #[test]
        fn refcounts_match_tables(ops in prop::collection::vec(op(), 1..60)) {
            let mut m = KvCacheManager::new(16, 3);
            let mut live: Vec<SeqId> = Vec::new();
            let mut next = 0;
            for op in ops {
                match op {
                    Op::Add => { m.add_sequence(next).unwrap(); live.push(next); next += 1; }
                    Op::Append(i, n) if !live.is_empty() => {
                        let s = live[i % live.len()];
                        let before = m.table(s).unwrap().clone();
                        match m.reserve(s, n) {
                            Ok(r) => prop_assert_eq!(r.slots.len(), n),
                            Err(_) => prop_assert_eq!(m.table(s).unwrap(), &before),
                        }
                    }
                    Op::Fork(i) if !live.is_empty() => {
                        let s = live[i % live.len()];
                        m.fork(s, next).unwrap(); live.push(next); next += 1;
                    }
                    Op::Truncate(i, n) if !live.is_empty() => {
                        let s = live[i % live.len()];
                        let len = m.table(s).unwrap().num_tokens();
                        m.truncate(s, n.min(len)).unwrap();
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let s = live.remove(i % live.len());
                        m.free(s);
                    }
                    _ => {}
                }
                let mut holders = vec![0u32; m.num_blocks()];
                for (_, t) in m.sequences() {
                    prop_assert!(t.capacity(3) >= t.num_tokens());
                    prop_assert!(t.blocks().len() == t.num_tokens().div_ceil(3));
                    for &b in t.blocks() { holders[b as usize] += 1; }
                }
                let mut free = 0;
                for (b, &h) in holders.iter().enumerate() {
                    prop_assert_eq!(m.allocator().ref_count(b as u32), h);
                    free += usize::from(h == 0);
                }
                prop_assert_eq!(free, m.num_free_blocks());
            }
        }
    }
}
