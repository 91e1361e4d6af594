//! The host side of the KV cache and attention kernels: row writes,
//! and the decode (split over keys) and prefill paths.

use super::*;

impl CudaBackend {
    /// `paged_kv_write`'s K/V rows (bounds apart).
    pub(super) fn write_kv_rows(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &CudaIndices,
        rows: usize,
        cache: &mut CudaKvCache,
    ) -> Result<()> {
        let layout = cache.layout;
        let width = layout.row_width();
        check_len("paged_kv_write: k", k.len(), rows * width)?;
        check_len("paged_kv_write: v", v.len(), rows * width)?;
        check_len("paged_kv_write: slots", slots.len(), rows)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let rows32 = to_u32(rows, "rows")?;
        let num_slots = to_u32(layout.num_slots(), "KV slots")?;
        if let Some(quant) = layout.value_quant() {
            let (kv_heads, head_dim, groups_per_head) = (
                to_u32(quant.kv_heads, "kv_heads")?,
                to_u32(quant.head_dim, "head_dim")?,
                to_u32(quant.groups_per_head, "groups per head")?,
            );
            let (slot_words, bits) = (
                to_u32(quant.slot_words(), "slot words")?,
                to_u32(quant.bits, "bits")?,
            );
            let key_quant = layout.key_quant();
            let (key_slot_words, key_bits) = (
                to_u32(key_quant.map_or(0, |k| k.slot_words()), "key slot words")?,
                to_u32(key_quant.map_or(0, |k| k.bits), "key bits")?,
            );
            let keys = u32::from(layout.key_blocks().is_none());
            let grid = (blocks_for(rows * quant.groups(), 128, "KV groups")?, 1, 1);
            sig::paged_kv_write_quant(
                self,
                Which::ONE,
                config(grid, 128, 0),
                &k.buf,
                &v.buf,
                &slots.buf,
                &rows32,
                &kv_heads,
                &head_dim,
                &groups_per_head,
                &num_slots,
                &key_slot_words,
                &key_bits,
                &slot_words,
                &bits,
                &keys,
                &mut cache.k,
                &mut cache.v,
            )?;
            let Some(blocks) = layout.key_blocks() else {
                return Ok(());
            };
            let (channels, block_size, key_bits) = (
                to_u32(blocks.channels(), "KV width")?,
                to_u32(blocks.block_size, "block_size")?,
                to_u32(blocks.bits, "key bits")?,
            );
            let words = rows * blocks.words_per_token();
            let grid = (blocks_for(words, 128, "INT4 key words")?, 1, 1);
            return sig::paged_kv_write_int4_keys(
                self,
                Which::ONE,
                config(grid, 128, 0),
                &k.buf,
                &slots.buf,
                &rows32,
                &channels,
                &block_size,
                &num_slots,
                &key_bits,
                &mut cache.k,
            );
        }
        let width32 = to_u32(width, "KV width")?;
        let grid = (blocks_for(rows * width, 256, "KV elements")?, 1, 1);
        sig::paged_kv_write(
            self,
            Which::variant(kv_variant(layout.values)),
            config(grid, 256, 0),
            &k.buf,
            &v.buf,
            &slots.buf,
            &rows32,
            &width32,
            &num_slots,
            &mut cache.k,
            &mut cache.v,
        )
    }

    /// Split-K decode attention: a block per (head, row, split of
    /// `keys_per_split` keys), then the reduction when there is more than one
    /// split.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_decode(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: &AttentionIndices<'_, Self>,
        p: AttentionParams,
        shape: AttentionShape,
        suffix: &str,
        keys_per_split: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let max_context = p.max_blocks_per_seq * p.block_size;
        let split_keys = keys_per_split.div_ceil(KEY_TILE).max(1) * KEY_TILE;
        let splits = max_context.div_ceil(split_keys).max(1);
        let split_keys = to_u32(split_keys, "split length")?;
        let grid = (
            to_u32(p.heads, "heads")?,
            grid_yz(p.rows, "rows")?,
            grid_yz(splits, "splits")?,
        );
        let partial_len = p.rows * p.heads * splits * (p.head_dim + 2);
        let mut partials = self.partials(if splits > 1 { partial_len } else { 1 }, "attention")?;
        let partials = partials.slice()?;
        sig::paged_attention_decode(
            self,
            Which::variant(suffix),
            config(grid, ATTENTION_THREADS, 0),
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &shape,
            &split_keys,
            &mut *partials,
            &mut out.buf,
        )?;
        if splits > 1 {
            let (heads, head_dim, splits32) =
                (shape.heads, shape.head_dim, to_u32(splits, "splits")?);
            let grid = (shape.heads, grid_yz(p.rows, "rows")?, 1);
            sig::paged_attention_reduce(
                self,
                Which::ONE,
                config(grid, ATTENTION_THREADS, 0),
                &*partials,
                &heads,
                &head_dim,
                &splits32,
                &mut out.buf,
            )?;
        }
        Ok(())
    }

    /// Prefill attention: a block per (16 query rows, head), K/V tiles
    /// staged in shared memory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_prefill(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: &AttentionIndices<'_, Self>,
        p: AttentionParams,
        shape: AttentionShape,
        suffix: &str,
        out: &mut CudaTensor,
    ) -> Result<()> {
        // More shared memory than the default is opted into by
        // `CudaBackend::kernel`.
        let smem = prefill_shared_bytes(p.head_dim);
        let grid = (
            blocks_for(p.rows, PREFILL_ROWS, "rows")?,
            grid_yz(p.heads, "heads")?,
            1,
        );
        sig::paged_attention_prefill(
            self,
            Which::variant(suffix),
            config(grid, ATTENTION_THREADS, smem as u32),
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &shape,
            &mut out.buf,
        )
    }
}
