//! The host side of the KV cache and attention kernels: row writes and
//! their key bounds, block selection, and the attention dispatch of every
//! variant.

use super::*;

impl WgpuBackend {
    /// `Backend::paged_kv_write`: the rows, then the key bounds where tracked.
    pub(crate) fn paged_kv_write_kernel(
        &self,
        k: &WgpuTensor,
        v: &WgpuTensor,
        slots: &WgpuIndices,
        rows: usize,
        cache: &mut WgpuKvCache,
    ) -> Result<()> {
        self.write_kv_rows(k, v, slots, rows, cache)?;
        let Some(bounds) = &cache.bounds else {
            return Ok(());
        };
        let layout = &cache.layout;
        let params = [
            u32_of(rows, "rows")?,
            u32_of(layout.row_width(), "KV width")?,
            u32_of(layout.head_dim, "head_dim")?,
            u32_of(layout.block_size, "block_size")?,
            u32_of(layout.num_slots(), "slots")?,
        ];
        self.dispatch(
            simple("kv_key_bounds"),
            "main",
            &[READ, READ, WRITE],
            &[&k.buf, &slots.buf, bounds],
            &params,
            (rows * layout.row_width()).div_ceil(64),
        )
    }

    /// `paged_kv_write`'s K/V rows (bounds apart).
    pub(crate) fn write_kv_rows(
        &self,
        k: &WgpuTensor,
        v: &WgpuTensor,
        slots: &WgpuIndices,
        rows: usize,
        cache: &mut WgpuKvCache,
    ) -> Result<()> {
        let width = cache.layout.row_width();
        check_len("paged_kv_write k", k.len, rows * width)?;
        check_len("paged_kv_write v", v.len, rows * width)?;
        check_len("paged_kv_write slots", slots.len, rows)?;
        if let Some(quant) = cache.layout.value_quant() {
            let key_bits = cache.layout.key_quant().map_or(0, |k| k.bits);
            let params = [
                u32_of(rows, "rows")?,
                u32_of(quant.kv_heads, "kv_heads")?,
                u32_of(quant.head_dim, "head_dim")?,
                u32_of(quant.groups_per_head, "groups per head")?,
                u32_of(cache.layout.num_slots(), "slots")?,
                u32_of(cache.key_slot_words, "key slot width")?,
                u32_of(key_bits, "key bits")?,
                u32_of(cache.slot_units, "slot width")?,
                u32_of(quant.bits, "bits")?,
                u32::from(cache.layout.key_blocks().is_none()),
            ];
            self.dispatch(
                simple("paged_kv_write_quant"),
                "main",
                &[READ, READ, READ, WRITE, WRITE],
                &[&k.buf, &v.buf, &slots.buf, &cache.k, &cache.v],
                &params,
                (rows * quant.groups()).div_ceil(64),
            )?;
            let Some(blocks) = cache.layout.key_blocks() else {
                return Ok(());
            };
            let params = [
                u32_of(rows, "rows")?,
                u32_of(blocks.channels(), "KV width")?,
                u32_of(blocks.block_size, "block_size")?,
                u32_of(cache.layout.num_slots(), "slots")?,
                u32_of(blocks.bits, "key bits")?,
            ];
            return self.dispatch(
                simple("paged_kv_write_int4_keys"),
                "main",
                &[READ, READ, WRITE],
                &[&k.buf, &slots.buf, &cache.k],
                &params,
                (rows * blocks.words_per_token()).div_ceil(64),
            );
        }
        let params = [
            u32_of(rows, "rows")?,
            u32_of(width, "width")?,
            u32_of(cache.layout.num_slots(), "slots")?,
            u32_of(cache.slot_units, "slot width")?,
        ];
        self.dispatch(
            ShaderVariant {
                kernel: "paged_kv_write",
                format: None,
                kv_f16: cache.layout.values == KvDtype::F16,
            },
            "main",
            &[READ, READ, READ, WRITE, WRITE],
            &[&k.buf, &v.buf, &slots.buf, &cache.k, &cache.v],
            &params,
            (rows * cache.slot_units).div_ceil(256),
        )
    }

    /// `Backend::select_kv_blocks`.
    pub(crate) fn select_kv_blocks_kernel(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "select_kv_blocks: its input is one block table per sequence \
                 (it writes one per KV head); per-head input tables are refused",
            ));
        }
        let bounds = cache.bounds.as_ref().ok_or_else(|| {
            backend_error("select_kv_blocks: the cache keeps no key bounds (track_key_bounds)")
        })?;
        check_attention_shape("select_kv_blocks", p, &cache.layout)?;
        if p.max_blocks_per_seq == 0 || select.top_blocks == 0 {
            return Err(backend_error(format!(
                "select_kv_blocks: {} table columns and {} top blocks: both must be positive",
                p.max_blocks_per_seq, select.top_blocks
            )));
        }
        let seqs = idx.block_tables.len / p.max_blocks_per_seq;
        check_len("select_kv_blocks q", q.len, p.rows * p.heads * p.head_dim)?;
        check_len("select_kv_blocks row_seq", idx.row_seq.len, p.rows)?;
        check_len("select_kv_blocks positions", idx.positions.len, p.rows)?;
        // One table per sequence and KV head.
        let out_len = seqs * p.kv_heads * p.max_blocks_per_seq;
        check_len("select_kv_blocks out", out.len, out_len)?;
        let scratch = self
            .gpu
            .pooled(4 * (seqs * p.kv_heads * p.max_blocks_per_seq).max(1) as u64)?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.kv_heads, "kv_heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.block_size, "block_size")?,
            u32_of(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            u32_of(seqs, "sequences")?,
            u32_of(select.top_blocks, "top blocks")?,
            u32_of(select.sink_blocks, "sink blocks")?,
            u32_of(select.recent_blocks, "recent blocks")?,
        ];
        self.dispatch(
            simple("select_kv_blocks"),
            "main",
            &[READ, READ, READ, READ, READ, WRITE, WRITE],
            &[
                &q.buf,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                bounds,
                &scratch,
                &out.buf,
            ],
            &params,
            seqs,
        )
    }

    /// `paged_attention`, or with `scored` its attention-score variant
    /// (`out` then holds the scores: `Backend::paged_attention_scores`).
    pub(crate) fn attention_kernel(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut WgpuTensor,
        scored: bool,
    ) -> Result<()> {
        let layout = &cache.layout;
        check_attention_shape("paged_attention", p, layout)?;
        let window = match p.sliding_window {
            None => 0,
            Some(0) => {
                return Err(backend_error(
                    "paged_attention: a sliding window of 0 sees nothing",
                ))
            }
            Some(w) => u32_of(w, "sliding window")?,
        };
        let n = p.rows * p.heads * p.head_dim;
        check_len("paged_attention q", q.len, n)?;
        let out_len = match scored {
            true => p.rows * p.kv_heads * p.max_blocks_per_seq,
            false => n,
        };
        check_len("paged_attention out", out.len, out_len)?;
        check_len("paged_attention row_seq", idx.row_seq.len, p.rows)?;
        check_len("paged_attention positions", idx.positions.len, p.rows)?;
        if p.rows > 0 {
            // At least one sequence's tables (kv_heads of them when per head);
            // the rows' sequences themselves are on the device.
            check_len(
                "paged_attention block_tables",
                idx.block_tables.len,
                p.tables_per_seq() * p.max_blocks_per_seq,
            )?;
        }
        // The score variant runs one workgroup per (row, KV head).
        let workgroups = p.rows * if scored { p.kv_heads } else { p.heads };
        let mut params = vec![
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.kv_heads, "kv_heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.block_size, "block_size")?,
            u32_of(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            u32_of(layout.num_blocks, "num_blocks")?,
            window,
            u32_of(cache.slot_units, "slot width")?,
            p.scale.to_bits(),
            // `head_tables`, word 10 of both attention Params structs.
            u32::from(p.per_head_tables),
        ];
        let buffers = [
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &out.buf,
        ];
        if let Some(quant) = layout.value_quant() {
            params.push(u32_of(quant.groups_per_head, "groups per head")?);
            params.push(u32_of(quant.bits, "bits")?);
            let key_channels = layout.key_blocks().map_or(0, |b| b.channels());
            params.push(u32_of(key_channels, "KV width")?);
            params.push(u32_of(cache.key_slot_words, "key slot width")?);
            params.push(u32_of(key_bits(layout), "key bits")?);
            return self.dispatch(
                simple(if scored {
                    "paged_attention_quant_scores"
                } else {
                    "paged_attention_quant"
                }),
                "main",
                &[READ, READ, READ, READ, READ, READ, WRITE],
                &buffers,
                &params,
                workgroups,
            );
        }
        self.dispatch(
            ShaderVariant {
                kernel: if scored {
                    "paged_attention_scores"
                } else {
                    "paged_attention"
                },
                format: None,
                kv_f16: layout.values == KvDtype::F16,
            },
            "main",
            &[READ, READ, READ, READ, READ, READ, WRITE],
            &buffers,
            &params,
            workgroups,
        )
    }
    /// `Backend::paged_attention_scores`: one table per sequence only.
    pub(crate) fn attention_scores_kernel(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut WgpuTensor,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "paged_attention_scores: per-head block tables are not supported; \
                 one table per sequence",
            ));
        }
        self.attention_kernel(q, cache, idx, p, scores, true)
    }
}
