//! Where a key tile's rows lie in the paged cache, and how they are read:
//! a tile inside one live block is consecutive slots (read row by row,
//! and prefetched while the tile before it computes); any other tile is
//! gathered position by position, with zeros for the positions no query
//! sees.

use std::ops::RangeInclusive;

use tandem_core::backend::AttentionParams;
use tandem_core::kv::EVICTED_BLOCK;

use super::ops::TileOps;
use super::tile::LANES;
use super::{KvRows, Task};

/// Starts loading the key and value rows of the first key tile from
/// `start` on that is not a hole, if it is a common one (wholly before
/// `hi`, inside one live block): the next one the loop reads.
#[inline(always)]
pub(super) fn prefetch_tile<K: KvRows, V: KvRows>(
    task: &Task<'_, K, V>,
    kv_head: usize,
    table: &[u32],
    mut start: usize,
    hi: usize,
) {
    let p = task.p;
    while start + LANES - 1 <= hi {
        if let Some(first) = whole_tile_at(table, p, start, kv_head) {
            let kv_width = p.kv_heads * p.head_dim;
            task.keys.prefetch_rows(first, kv_width, LANES, p.head_dim);
            task.values
                .prefetch_rows(first, kv_width, LANES, p.head_dim);
            return;
        }
        if table[start / p.block_size] != EVICTED_BLOCK {
            return;
        }
        start += LANES;
    }
}

/// The element offset of KV head `kv_head`'s row at the key tile `start`,
/// if the tile lies inside one live block: its rows are then consecutive
/// slots, `kv_heads * head_dim` elements apart.
#[inline(always)]
pub(super) fn whole_tile_at(
    table: &[u32],
    p: AttentionParams,
    start: usize,
    kv_head: usize,
) -> Option<usize> {
    let (block, within) = (start / p.block_size, start % p.block_size);
    if within + LANES > p.block_size || table[block] == EVICTED_BLOCK {
        return None;
    }
    let slot = table[block] as usize * p.block_size + within;
    Some(slot * p.kv_heads * p.head_dim + kv_head * p.head_dim)
}

/// Reads the key and value rows of the key tile at `start` into
/// `keys_out` and `values_out`, position by position (it straddles
/// blocks, or holds positions outside `keys` or evicted), and returns
/// which positions are live: seen by some query and not evicted. A tile
/// with none live is not read (sparse attention's tables are mostly holes).
#[inline(always)]
pub(super) fn read_kv_tile<K: KvRows, V: KvRows, T: TileOps>(
    task: &Task<'_, K, V>,
    kv_head: usize,
    (keys_out, values_out): (&mut [f32], &mut [f32]),
    start: usize,
    keys: RangeInclusive<usize>,
    table: &[u32],
) -> [bool; LANES] {
    let p = task.p;
    let (hd, kv_width) = (p.head_dim, p.kv_heads * p.head_dim);
    let mut offsets = [0usize; LANES];
    let mut live = [false; LANES];
    let (mut block, mut within) = (start / p.block_size, start % p.block_size);
    for l in 0..LANES {
        if keys.contains(&(start + l)) && table[block] != EVICTED_BLOCK {
            live[l] = true;
            let slot = table[block] as usize * p.block_size + within;
            offsets[l] = slot * kv_width + kv_head * hd;
        }
        within += 1;
        if within == p.block_size {
            (block, within) = (block + 1, 0);
        }
    }
    if !live.contains(&true) {
        return live;
    }
    // Positions outside `keys` may not be written (or no longer be this
    // sequence's), evicted ones are nowhere: zeros stand in for them.
    for (l, &live) in live.iter().enumerate() {
        let (k, v) = (
            &mut keys_out[l * hd..][..hd],
            &mut values_out[l * hd..][..hd],
        );
        if live {
            task.keys.read_into::<T>(offsets[l], k);
            task.values.read_into::<T>(offsets[l], v);
        } else {
            k.fill(0.0);
            v.fill(0.0);
        }
    }
    live
}
