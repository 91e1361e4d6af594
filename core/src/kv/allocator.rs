//! `KvBlockAllocator`: hands out physical KV blocks, counts their owners, and
//! remembers the content of full blocks for the prefix cache.
//!
//! Every block is in exactly one of three states:
//! - *used*: reference count > 0 (held by one or more block tables);
//! - *cached*: count 0, but it holds the K/V of a known full block (its
//!   content is registered), so a later request with the same prefix can
//!   take it back instead of recomputing it;
//! - *empty*: count 0 and nothing worth keeping.
//!
//! Allocation takes an empty block first and only then evicts the least
//! recently released cached block, so cached prefixes live as long as memory
//! allows.
//!
//! A hash only finds a candidate: a hit is taken when the candidate's own
//! tokens and the identity of its parent's content are equal too, so two
//! prefixes whose hashes collide never share K/V.

use std::collections::{BTreeMap, HashMap};

/// Content hash of a full block: hash of (parent block's hash, the block's tokens).
pub type BlockHash = u64;

/// Identifies one registered content; never reused, unlike block numbers.
pub type ContentId = u64;

/// Names the content of a computed full block: the hash that indexes the
/// prefix cache and the content id that the next block records as its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub id: ContentId,
}

/// What a registered block holds, kept so that a hit is checked exactly.
#[derive(Clone, Debug)]
struct BlockContent {
    key: BlockKey,
    /// The content the block's K/V were computed after (`None`: the first block).
    parent: Option<ContentId>,
    tokens: Box<[u32]>,
}

impl BlockContent {
    fn holds(&self, parent: Option<ContentId>, tokens: &[u32]) -> bool {
        self.parent == parent && *self.tokens == *tokens
    }
}

#[derive(Clone, Debug)]
pub struct KvBlockAllocator {
    ref_counts: Vec<u32>,
    /// Empty blocks, reused last-in first-out so recently touched memory is
    /// reused while it is still warm in caches.
    empty: Vec<u32>,
    /// The registered content of each block, if any.
    contents: Vec<Option<BlockContent>>,
    by_hash: HashMap<BlockHash, u32>,
    next_content: ContentId,
    /// Cached (count 0, registered) blocks by the tick they were released at: the first is evicted first.
    cached: BTreeMap<u64, u32>,
    /// Tick at which each cached block was released (its key in `cached`).
    released_at: Vec<u64>,
    tick: u64,
}

impl KvBlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_counts: vec![0; num_blocks],
            // Reversed so that block 0 is handed out first: easier to read in tests and dumps.
            empty: (0..num_blocks as u32).rev().collect(),
            contents: vec![None; num_blocks],
            by_hash: HashMap::new(),
            next_content: 0,
            cached: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks an allocation can take: empty ones and evictable cached ones.
    pub fn num_free(&self) -> usize {
        self.empty.len() + self.cached.len()
    }

    /// Blocks nobody holds that keep reusable prefix content.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// The empty blocks and the cached blocks (for invariant checks).
    pub fn free_lists(&self) -> (&[u32], impl Iterator<Item = u32> + '_) {
        (&self.empty, self.cached.values().copied())
    }

    /// A block with reference count 1 and no registered content, or `None`
    /// when every block is used. Evicts the least recently released cached
    /// block when no empty one is left.
    pub fn allocate(&mut self) -> Option<u32> {
        let block = match self.empty.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.cached.pop_first()?;
                self.unregister(b);
                b
            }
        };
        debug_assert_eq!(self.ref_counts[block as usize], 0);
        self.ref_counts[block as usize] = 1;
        Some(block)
    }

    /// One more owner of a used block, or the first owner of a cached one.
    pub fn retain(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_counts[b] == 0 {
            let was_cached = self.cached.remove(&self.released_at[b]).is_some();
            assert!(was_cached, "retain of empty KV block {block}");
        }
        self.ref_counts[b] += 1;
    }

    /// One owner fewer; returns true when nobody holds the block any more
    /// (it is then cached if its content is registered, else empty).
    pub fn release(&mut self, block: u32) -> bool {
        let b = block as usize;
        let rc = &mut self.ref_counts[b];
        assert!(*rc > 0, "release of free KV block {block}");
        *rc -= 1;
        if *rc > 0 {
            return false;
        }
        if self.contents[b].is_some() {
            self.tick += 1;
            self.released_at[b] = self.tick;
            self.cached.insert(self.tick, block);
        } else {
            self.empty.push(block);
        }
        true
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// The block (used or cached) holding `tokens` after the content
    /// `parent`, found under `hash`, with its key.
    pub fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<ContentId>,
        tokens: &[u32],
    ) -> Option<(u32, BlockKey)> {
        let block = *self.by_hash.get(&hash)?;
        let content = self.contents[block as usize].as_ref()?;
        content
            .holds(parent, tokens)
            .then_some((block, content.key))
    }

    /// Whether `block`'s content is registered (it must then never be written again).
    pub fn is_registered(&self, block: u32) -> bool {
        self.contents[block as usize].is_some()
    }

    /// Forgets every cached block's content (they become empty).
    pub fn evict_all_cached(&mut self) {
        while let Some((_, b)) = self.cached.pop_first() {
            self.unregister(b);
            self.empty.push(b);
        }
    }

    fn unregister(&mut self, block: u32) {
        let content = self.contents[block as usize]
            .take()
            .expect("cached blocks are registered");
        self.by_hash.remove(&content.key.hash);
    }

    /// Records that the used `block` now holds `tokens` computed after the
    /// content `parent`, and returns the key of that content. When another
    /// block already holds the same content (two sequences computed one
    /// prefix at once) its key is returned and `block` stays unregistered;
    /// when another content owns `hash` (a collision), `block` stays
    /// unregistered under a fresh id that no lookup can reach.
    pub fn register(
        &mut self,
        block: u32,
        hash: BlockHash,
        parent: Option<ContentId>,
        tokens: &[u32],
    ) -> BlockKey {
        debug_assert!(self.ref_counts[block as usize] > 0);
        let holder = self
            .by_hash
            .get(&hash)
            .copied()
            .or_else(|| self.contents[block as usize].is_some().then_some(block));
        if let Some(holder) = holder {
            let content = self.contents[holder as usize]
                .as_ref()
                .expect("by_hash points at registered blocks");
            if content.holds(parent, tokens) {
                return content.key;
            }
            return self.fresh_key(hash);
        }
        let key = self.fresh_key(hash);
        self.contents[block as usize] = Some(BlockContent {
            key,
            parent,
            tokens: tokens.into(),
        });
        self.by_hash.insert(hash, block);
        key
    }

    fn fresh_key(&mut self, hash: BlockHash) -> BlockKey {
        self.next_content += 1;
        BlockKey {
            hash,
            id: self.next_content,
        }
    }
}
