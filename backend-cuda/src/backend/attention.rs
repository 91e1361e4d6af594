//! The host side of the KV cache and attention kernels: row writes and
//! key bounds, block selection, the decode (split over keys) and prefill
//! paths, and the per-block scores.

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

    /// `paged_kv_write`'s per-block key bounds, where the cache tracks them.
    pub(super) fn write_key_bounds(
        &self,
        k: &CudaTensor,
        slots: &CudaIndices,
        rows: usize,
        cache: &mut CudaKvCache,
    ) -> Result<()> {
        let layout = cache.layout;
        let (Some(bounds), true) = (&mut cache.bounds, rows > 0) else {
            return Ok(());
        };
        let channels = layout.row_width();
        let grid = (
            blocks_for(rows * channels, 128, "key bound elements")?,
            1,
            1,
        );
        sig::kv_key_bounds(
            self,
            Which::ONE,
            config(grid, 128, 0),
            &k.buf,
            &slots.buf,
            &to_u32(rows, "rows")?,
            &to_u32(channels, "KV width")?,
            &to_u32(layout.head_dim, "head_dim")?,
            &to_u32(layout.block_size, "block_size")?,
            &to_u32(layout.num_slots(), "KV slots")?,
            bounds,
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

    /// `select_kv_blocks`: a block per sequence ranks its table entries by
    /// the cache's key bounds.
    pub(super) fn launch_select_kv_blocks(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut CudaIndices,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "select_kv_blocks: per-head block tables are not supported as input; \
                 one table per sequence",
            ));
        }
        let bounds = cache.bounds.as_ref().ok_or_else(|| {
            backend_error("select_kv_blocks: the cache keeps no key bounds (track_key_bounds)")
        })?;
        let layout = cache.layout;
        if p.kv_heads == 0
            || !p.heads.is_multiple_of(p.kv_heads)
            || (p.kv_heads, p.head_dim, p.block_size)
                != (layout.kv_heads, layout.head_dim, layout.block_size)
            || p.head_dim > SELECT_MAX_HEAD_DIM
            || p.max_blocks_per_seq == 0
            || select.top_blocks == 0
        {
            return Err(backend_error(format!(
                "select_kv_blocks: {} heads over {} KV heads of {} dims in blocks of {}, top {}, \
                 do not fit a cache of {} KV heads of {} dims in blocks of {} \
                 (at most {SELECT_MAX_HEAD_DIM} dims, one block)",
                p.heads,
                p.kv_heads,
                p.head_dim,
                p.block_size,
                select.top_blocks,
                layout.kv_heads,
                layout.head_dim,
                layout.block_size
            )));
        }
        let seqs = idx.block_tables.len() / p.max_blocks_per_seq;
        check_len(
            "select_kv_blocks: q",
            q.len(),
            p.rows * p.heads * p.head_dim,
        )?;
        check_len("select_kv_blocks: row_seq", idx.row_seq.len(), p.rows)?;
        check_len("select_kv_blocks: positions", idx.positions.len(), p.rows)?;
        // One table per sequence and KV head.
        check_len(
            "select_kv_blocks: out",
            out.len(),
            seqs * p.kv_heads * p.max_blocks_per_seq,
        )?;
        if seqs == 0 {
            return Ok(());
        }
        let mut scratch =
            self.partials(seqs * p.kv_heads * p.max_blocks_per_seq, "block bounds")?;
        let scratch = scratch.slice()?;
        sig::select_kv_blocks(
            self,
            Which::ONE,
            config((to_u32(seqs, "sequences")?, 1, 1), 128, 0),
            &q.buf,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            bounds,
            &to_u32(p.rows, "rows")?,
            &to_u32(p.heads, "heads")?,
            &to_u32(p.kv_heads, "kv_heads")?,
            &to_u32(p.head_dim, "head_dim")?,
            &to_u32(p.block_size, "block_size")?,
            &to_u32(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            &to_u32(select.top_blocks, "top blocks")?,
            &to_u32(select.sink_blocks, "sink blocks")?,
            &to_u32(select.recent_blocks, "recent blocks")?,
            scratch,
            &mut out.buf,
        )
    }

    /// `paged_attention`: the quantized cache's kernel, else split-K decode or
    /// prefill as `CudaConfig::attention` picks.
    pub(super) fn launch_paged_attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let layout = cache.layout;
        let out_len = (out.len(), p.rows * p.heads * p.head_dim);
        let Some(shape) = attention_shape(&layout, &idx, p, q.len(), out_len)? else {
            return Ok(());
        };
        if let Some(quant) = layout.value_quant() {
            let shape = quant_shape(&layout, quant, shape)?;
            let grid = (to_u32(p.heads, "heads")?, grid_yz(p.rows, "rows")?, 1);
            return sig::paged_attention_quant(
                self,
                Which::ONE,
                config(grid, WARP_THREADS, 0),
                &q.buf,
                &cache.k,
                &cache.v,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &shape,
                &mut out.buf,
            );
        }
        let suffix = kv_variant(layout.values);
        match self.config.attention {
            AttentionPath::Auto if p.rows <= DECODE_MAX_ROWS => {
                let max_context = p.max_blocks_per_seq * p.block_size;
                let splits = decode_splits(max_context, p.heads * p.rows, self.sm_count);
                self.attention_decode(
                    q,
                    cache,
                    &idx,
                    p,
                    shape,
                    suffix,
                    max_context.div_ceil(splits),
                    out,
                )
            }
            AttentionPath::Auto | AttentionPath::Prefill => {
                self.attention_prefill(q, cache, &idx, p, shape, suffix, out)
            }
            AttentionPath::DecodeSplit { keys_per_split } => {
                self.attention_decode(q, cache, &idx, p, shape, suffix, keys_per_split.max(1), out)
            }
        }
    }

    /// `paged_attention_scores`: the quantized or the plain cache's kernel.
    pub(super) fn launch_paged_attention_scores(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut CudaTensor,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "paged_attention_scores: per-head block tables are not supported; \
                 one table per sequence",
            ));
        }
        let layout = cache.layout;
        let scores_len = (scores.len(), p.rows * p.kv_heads * p.max_blocks_per_seq);
        let Some(shape) = attention_shape(&layout, &idx, p, q.len(), scores_len)? else {
            return Ok(());
        };
        // One warp per (KV head, row).
        let grid = (to_u32(p.kv_heads, "kv_heads")?, grid_yz(p.rows, "rows")?, 1);
        let cfg = config(grid, WARP_THREADS, 0);
        match layout.value_quant() {
            Some(quant) => sig::paged_attention_quant_scores(
                self,
                Which::ONE,
                cfg,
                &q.buf,
                &cache.k,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &quant_shape(&layout, quant, shape)?,
                &mut scores.buf,
            ),
            None => sig::paged_attention_scores(
                self,
                Which::variant(kv_variant(layout.values)),
                cfg,
                &q.buf,
                &cache.k,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &shape,
                &mut scores.buf,
            ),
        }
    }
}
