//! Per-block key bounds for sparse attention's block selection: for each KV
//! block and KV head, every key channel's minimum and maximum over the
//! block's written slots. Kept from the f32 keys as they are written (before
//! any F16 rounding or quantization), so they bound the keys attention
//! reads up to that rounding.
//!
//! A write to a block's first slot restarts its bounds (a block is filled
//! from its start whenever it is (re)used); later writes only widen them,
//! so a slot rewritten after a rollback leaves them looser, never wrong.
//! Blocks written before tracking started have no bounds (zeros) until
//! they are filled again.

/// Layout: `[num_blocks, kv_heads, 2, head_dim]`, minima then maxima.
#[derive(Clone, Debug)]
pub(crate) struct KeyBounds {
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    data: Vec<f32>,
}

impl KeyBounds {
    /// Bounds for `num_blocks` blocks, all zero until their first slot is written.
    pub(crate) fn new(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            block_size,
            kv_heads,
            head_dim,
            data: vec![0.0; num_blocks * kv_heads * 2 * head_dim],
        }
    }

    fn block_len(&self) -> usize {
        self.kv_heads * 2 * self.head_dim
    }

    /// Widens (or, at a block's first slot, restarts) the bounds of the
    /// blocks that rows `k` (`[rows, kv_heads * head_dim]`) are written to.
    pub(crate) fn write_rows(&mut self, slots: &[u32], k: &[f32]) {
        let width = self.kv_heads * self.head_dim;
        for (&slot, key) in slots.iter().zip(k.chunks_exact(width)) {
            let slot = slot as usize;
            self.write(slot, key, slot.is_multiple_of(self.block_size));
        }
    }

    fn write(&mut self, slot: usize, key: &[f32], restart: bool) {
        let (len, d) = (self.block_len(), self.head_dim);
        let block = &mut self.data[slot / self.block_size * len..][..len];
        for (bounds, key) in block.chunks_exact_mut(2 * d).zip(key.chunks_exact(d)) {
            let (min, max) = bounds.split_at_mut(d);
            if restart {
                min.copy_from_slice(key);
                max.copy_from_slice(key);
            } else {
                for ((lo, hi), &x) in min.iter_mut().zip(max.iter_mut()).zip(key) {
                    *lo = lo.min(x);
                    *hi = hi.max(x);
                }
            }
        }
    }

    /// Copies whole blocks' bounds `src -> dst` (with the blocks' K/V).
    pub(crate) fn copy(&mut self, (src, dst): (u32, u32)) {
        let len = self.block_len();
        let src = src as usize * len;
        self.data.copy_within(src..src + len, dst as usize * len);
    }

    /// Block `block`'s bounds for KV head `g`: `(minima, maxima)`.
    pub(crate) fn of(&self, block: usize, g: usize) -> (&[f32], &[f32]) {
        let d = self.head_dim;
        let at = block * self.block_len() + g * 2 * d;
        self.data[at..at + 2 * d].split_at(d)
    }
}
