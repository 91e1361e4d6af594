//! Automatic prefix caching for [`KvCacheManager`]: requests that start
//! with the same prompt (a system prompt, a chat history) share its K/V
//! blocks instead of computing them again.
//!
//! Prefix caching follows vLLM's design: once a full block's K/V are computed
//! its content is registered under hash(parent block's hash, its tokens), so
//! the hash names the whole prefix up to that block. A new sequence looks its
//! prompt's full blocks up one by one ([`KvCacheManager::match_prefix`]) and
//! shares every block found instead of computing it again. A registered block
//! is never written again: a sequence that would write into one (after a
//! truncation) gets a copy first, as with blocks shared by a fork.
//!
//! The hash is SipHash under a random key per cache, so clients cannot craft
//! colliding prompts offline, and a hit is still checked against the block's
//! tokens and its parent's content before it is shared: a collision costs a
//! cache miss, never another client's K/V.

use std::hash::{BuildHasher, Hash, Hasher, RandomState};

use super::{BlockHash, BlockKey, KvCacheManager, SeqId};
use crate::{Error, Result};

/// Computes the prefix-cache key of a full block from its parent's hash and its tokens.
#[derive(Clone, Debug)]
pub enum BlockHasher {
    /// SipHash with a random key (the default).
    Keyed(RandomState),
    /// A given function: tests use a weak one to force collisions.
    Function(fn(Option<BlockHash>, &[u32]) -> BlockHash),
}

impl BlockHasher {
    fn hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        match self {
            Self::Keyed(state) => {
                let mut h = state.build_hasher();
                parent.hash(&mut h);
                tokens.hash(&mut h);
                h.finish()
            }
            Self::Function(f) => f(parent, tokens),
        }
    }
}

impl KvCacheManager {
    /// Forgets the content of every unreferenced cached block (blocks held by
    /// sequences keep theirs).
    pub fn clear_prefix_cache(&mut self) {
        self.allocator.evict_all_cached();
    }

    /// Shares the cached blocks of the longest prefix of `tokens` made of
    /// full blocks, in the empty sequence `seq`. Returns how many leading
    /// tokens are now in the cache (a multiple of the block size).
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        let bs = self.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if table.num_tokens() != 0 {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} already has tokens; prefixes are matched on empty sequences"
            )));
        }
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs) {
            let hash = self.hasher.hash(parent.map(|p: BlockKey| p.hash), chunk);
            let Some((block, key)) = self.allocator.lookup(hash, parent.map(|p| p.id), chunk)
            else {
                break;
            };
            self.allocator.retain(block);
            table.push_block(block);
            table.push_key(key);
            parent = Some(key);
        }
        let cached = table.blocks().len() * bs;
        table.set_num_tokens(cached);
        Ok(cached)
    }

    /// Registers the full blocks of `seq` whose K/V are now computed, given
    /// the sequence's leading `computed` tokens, so later requests can share them.
    pub fn commit_full_blocks(&mut self, seq: SeqId, computed: &[u32]) -> Result<()> {
        let bs = self.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::InvalidRequest(format!("unknown sequence {seq}")))?;
        if table.has_evicted() {
            return Ok(());
        }
        let full = computed.len().min(table.num_tokens()) / bs;
        for i in table.keys().len()..full {
            let parent = table.keys().last().copied();
            let tokens = &computed[i * bs..(i + 1) * bs];
            let hash = self.hasher.hash(parent.map(|p| p.hash), tokens);
            let key =
                self.allocator
                    .register(table.blocks()[i], hash, parent.map(|p| p.id), tokens);
            table.push_key(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn computed(m: &mut KvCacheManager, seq: SeqId, tokens: &[u32]) {
        m.add_sequence(seq).unwrap();
        m.reserve(seq, tokens.len()).unwrap();
        m.commit_full_blocks(seq, tokens).unwrap();
    }

    #[test]
    fn a_shared_prefix_is_found_block_by_block() {
        let mut m = KvCacheManager::new(8, 4);
        let tokens: Vec<u32> = (0..10).collect();
        computed(&mut m, 1, &tokens);
        // Two full blocks are registered, the partial third is not.
        m.add_sequence(2).unwrap();
        assert_eq!(m.match_prefix(2, &tokens).unwrap(), 8);
        assert_eq!(
            m.table(2).unwrap().blocks(),
            &m.table(1).unwrap().blocks()[..2]
        );
        assert_eq!(m.allocator().ref_count(0), 2);
        // A different second block stops the match after the first.
        let mut other = tokens.clone();
        other[5] = 99;
        m.add_sequence(3).unwrap();
        assert_eq!(m.match_prefix(3, &other).unwrap(), 4);
        // The same tokens at a different position (other parent) do not match.
        m.add_sequence(4).unwrap();
        assert_eq!(m.match_prefix(4, &tokens[4..]).unwrap(), 0);
    }

    #[test]
    fn freed_prefix_blocks_stay_cached_until_memory_is_needed() {
        let mut m = KvCacheManager::new(4, 4);
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        computed(&mut m, 1, &a);
        m.free(1);
        assert_eq!((m.num_free_blocks(), m.allocator().num_cached()), (4, 2));
        computed(&mut m, 2, &b);
        m.free(2);
        assert_eq!(m.allocator().num_cached(), 4);
        // Needing one block evicts the least recently released: `a`'s first.
        m.add_sequence(3).unwrap();
        m.reserve(3, 1).unwrap();
        m.add_sequence(4).unwrap();
        assert_eq!(
            m.match_prefix(4, &a).unwrap(),
            0,
            "a's chain is broken at block 0"
        );
        m.add_sequence(5).unwrap();
        assert_eq!(m.match_prefix(5, &b).unwrap(), 8);
    }

    #[test]
    fn a_registered_block_is_copied_before_it_is_rewritten() {
        let mut m = KvCacheManager::new(8, 4);
        let tokens: Vec<u32> = (0..8).collect();
        computed(&mut m, 1, &tokens);
        m.truncate(1, 6).unwrap();
        let r = m.reserve(1, 1).unwrap();
        assert_eq!(r.copies, vec![(1, 2)]);
        assert_eq!(m.allocator().num_cached(), 1, "the original stays cached");
        m.add_sequence(2).unwrap();
        assert_eq!(m.match_prefix(2, &tokens).unwrap(), 8);
    }

    /// Every block of every prefix collides.
    fn weak_hash(_: Option<BlockHash>, _: &[u32]) -> BlockHash {
        7
    }

    #[test]
    fn colliding_prefixes_never_share_blocks() {
        let mut m = KvCacheManager::with_hasher(16, 4, BlockHasher::Function(weak_hash));
        let a: Vec<u32> = (0..12).collect();
        computed(&mut m, 1, &a);
        // Another first block under the same hash: no hit.
        let b: Vec<u32> = (100..112).collect();
        m.add_sequence(2).unwrap();
        assert_eq!(m.match_prefix(2, &b).unwrap(), 0);
        // The same first block, then a second whose hash is held by `a`'s first.
        let mut c = a.clone();
        c[6] = 99;
        m.add_sequence(3).unwrap();
        assert_eq!(m.match_prefix(3, &c).unwrap(), 4);
        // `a` itself: its first block is the only one the weak hash can index.
        m.add_sequence(4).unwrap();
        assert_eq!(m.match_prefix(4, &a).unwrap(), 4);
    }

    #[test]
    fn a_block_computed_after_other_content_is_not_a_hit() {
        // `v`'s first block collides with `a`'s, so `v`'s second block is
        // registered with `v`'s first as parent. A prompt with `a`'s first
        // block and `v`'s second block must not get that K/V.
        fn first_blocks_collide(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
            match parent {
                None => 1,
                Some(p) => p.wrapping_mul(31) + u64::from(tokens[0]),
            }
        }
        let mut m = KvCacheManager::with_hasher(16, 4, BlockHasher::Function(first_blocks_collide));
        let a: Vec<u32> = vec![1, 2, 3, 4];
        computed(&mut m, 1, &a);
        let v: Vec<u32> = vec![9, 9, 9, 9, 5, 6, 7, 8];
        computed(&mut m, 2, &v);
        let forged: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8];
        m.add_sequence(3).unwrap();
        assert_eq!(m.match_prefix(3, &forged).unwrap(), 4);
        assert_eq!(
            m.table(3).unwrap().blocks(),
            &m.table(1).unwrap().blocks()[..1]
        );
        // `v` itself still finds nothing past the collision at its first block.
        m.add_sequence(4).unwrap();
        assert_eq!(m.match_prefix(4, &v).unwrap(), 0);
    }

    #[test]
    fn the_same_prefix_computed_twice_shares_one_chain() {
        let mut m = KvCacheManager::new(16, 4);
        let a: Vec<u32> = (0..8).collect();
        computed(&mut m, 1, &a);
        computed(&mut m, 2, &a);
        assert_eq!(m.table(1).unwrap().keys(), m.table(2).unwrap().keys());
        m.free(1);
        m.add_sequence(3).unwrap();
        assert_eq!(m.match_prefix(3, &a).unwrap(), 8);
    }
}
