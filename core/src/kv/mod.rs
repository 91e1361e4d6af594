//! The paged KV cache's bookkeeping (the storage itself lives on the backend).
//!
//! The cache is a pool of fixed-size blocks of `block_size` token slots.
//! Each sequence owns a [`BlockTable`]: the physical blocks holding its
//! tokens' K/V, in order. Blocks are reference counted so several sequences
//! can share a prompt's blocks; a sequence about to write into a shared block
//! gets a private copy first (copy-on-write). Attention reads K/V through the
//! block tables, so no sequence ever needs contiguous KV memory.
//!
//! Full blocks are also remembered by content (the prefix cache): a block
//! nobody holds any more keeps its K/V until memory is needed, and a new
//! sequence whose prompt starts with the same tokens shares it.
//!
//! With a KV budget (`eviction`), blocks a sequence no longer needs leave
//! holes in its table; the prefix cache only ever holds blocks computed
//! before a sequence's first eviction.

mod allocator;
mod block_table;
pub mod eviction;
mod manager;
pub mod plan;
mod prefix_cache;
#[cfg(test)]
mod props;
pub mod quant;

pub use allocator::{BlockHash, BlockKey, ContentId, KvBlockAllocator};
pub use block_table::BlockTable;
pub use eviction::{EvictionConfig, EvictionPlan, EvictionPolicy, KvBudget, EVICTED_BLOCK};
pub use manager::{KvCacheManager, SeqId, SlotReservation};
pub use plan::{KvPlan, KvPrecision, KvShape, LayerKvDtypes};
pub use prefix_cache::BlockHasher;

/// Tokens per KV block unless configured otherwise (vLLM's default too).
pub const DEFAULT_BLOCK_SIZE: usize = 16;
