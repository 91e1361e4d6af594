//! `impl Backend for WgpuBackend`: every kernel's host side, its sizes
//! checked before the dispatch.

use super::*;

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type Indices = WgpuIndices;
    type Weight = WgpuWeight;
    type KvCache = WgpuKvCache;

    fn info(&self) -> BackendInfo {
        let on_off = |b: bool| if b { "on" } else { "off" };
        BackendInfo {
            name: "wgpu".into(),
            device: format!(
                "{} ({}, f16 {}, subgroups {})",
                self.adapter.name,
                self.adapter.backend,
                on_off(self.uses_f16()),
                on_off(self.uses_subgroups())
            ),
        }
    }

    fn alloc(&self, len: usize) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * len as u64)?;
        self.gpu.clear(&buf, 4 * len as u64);
        Ok(WgpuTensor { buf, len })
    }

    fn upload(&self, data: &[f32]) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytes_of_f32(data));
        Ok(WgpuTensor {
            buf,
            len: data.len(),
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download(&self, t: &WgpuTensor, len: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.download_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download(&self, _t: &WgpuTensor, _len: usize) -> Result<Vec<f32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_async",
        ))
    }

    fn upload_indices(&self, data: &[u32]) -> Result<WgpuIndices> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytemuck::cast_slice(data));
        Ok(WgpuIndices {
            buf,
            len: data.len(),
        })
    }

    fn write_indices(&self, dst: &mut WgpuIndices, data: &[u32]) -> Result<()> {
        check_len("write_indices", dst.len, data.len())?;
        // Queue writes land before the next submit: recorded kernels that
        // read the old values go first.
        self.gpu.submit()?;
        self.gpu.write(&dst.buf, bytemuck::cast_slice(data));
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download_indices(&self, t: &WgpuIndices, len: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.download_indices_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download_indices(&self, _t: &WgpuIndices, _len: usize) -> Result<Vec<u32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_indices_async",
        ))
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<WgpuWeight> {
        let format = w.format;
        if !w.cols.is_multiple_of(format.block_elems()) {
            return Err(backend_error(format!(
                "a {format} weight needs columns in multiples of {}, got {}",
                format.block_elems(),
                w.cols
            )));
        }
        let row_bytes = w.row_bytes();
        if w.data.len() < w.rows * row_bytes {
            return Err(backend_error(format!(
                "a {}x{} {format} weight needs {} bytes, got {}",
                w.rows,
                w.cols,
                w.rows * row_bytes,
                w.data.len()
            )));
        }
        if w.rows == 1 || w.cols == 1 {
            return self.upload_vector(w.rows, w.cols, &w.to_f32());
        }
        let rows_per_chunk = (self.max_chunk_bytes / row_bytes.max(1) as u64) as usize;
        if rows_per_chunk == 0 {
            return Err(backend_error(format!(
                "one row of a {format} weight ({row_bytes} bytes) exceeds the storage binding limit"
            )));
        }
        let mut chunks = Vec::new();
        for row_start in (0..w.rows).step_by(rows_per_chunk) {
            let rows = rows_per_chunk.min(w.rows - row_start);
            let bytes = &w.data[row_start * row_bytes..(row_start + rows) * row_bytes];
            let buf = self.gpu.dedicated(bytes.len() as u64, "weight")?;
            self.gpu.write(&buf, bytes);
            chunks.push(WeightChunk {
                row_start,
                rows,
                buf,
            });
        }
        Ok(WgpuWeight {
            format,
            rows: w.rows,
            cols: w.cols,
            chunks,
        })
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<WgpuKvCache> {
        layout.check()?;
        let slot_units = match layout.value_quant() {
            Some(quant) => quant.slot_words(),
            None if layout.values == KvDtype::F16 => layout.row_width().div_ceil(2),
            None => layout.row_width(),
        };
        let key_slot_words = layout.key_quant().map_or(slot_units, |k| k.slot_words());
        let key_block_units = layout
            .key_blocks()
            .map_or(layout.block_size * key_slot_words, |b| b.block_words());
        let bytes = 4 * (layout.num_slots() * slot_units) as u64;
        let key_bytes = 4 * (layout.num_blocks * key_block_units) as u64;
        Ok(WgpuKvCache {
            layout,
            k: self.gpu.dedicated(key_bytes, "K cache")?,
            v: self.gpu.dedicated(bytes, "V cache")?,
            slot_units,
            key_slot_words,
            key_block_units,
            bounds: None,
        })
    }

    fn copy_kv_blocks(&self, cache: &mut WgpuKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        let blocks = cache.layout.num_blocks;
        let block_bytes = 4 * (cache.layout.block_size * cache.slot_units) as u64;
        let key_block_bytes = 4 * cache.key_block_units as u64;
        if let Some(&(src, dst)) = pairs
            .iter()
            .find(|&&(src, dst)| src as usize >= blocks || dst as usize >= blocks)
        {
            return Err(backend_error(format!(
                "copy_kv_blocks: block pair ({src}, {dst}) outside a cache of {blocks} blocks"
            )));
        }
        if pairs.is_empty() || block_bytes == 0 {
            return Ok(());
        }
        // WebGPU forbids copies within one buffer: each block goes through a
        // scratch buffer, pair after pair, so chained pairs copy in order.
        let bounds_bytes = 4 * (2 * cache.layout.row_width()) as u64;
        let scratch = self
            .gpu
            .pooled(block_bytes.max(key_block_bytes).max(bounds_bytes))?;
        let mut stores = vec![(&cache.k, key_block_bytes), (&cache.v, block_bytes)];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds, bounds_bytes));
        }
        for &(src, dst) in pairs {
            for &(buf, bytes) in &stores {
                self.gpu.copy(buf, src as u64 * bytes, &scratch, 0, bytes);
                self.gpu.copy(&scratch, 0, buf, dst as u64 * bytes, bytes);
            }
        }
        Ok(())
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn embedding(
        &self,
        table: &WgpuWeight,
        tokens: &WgpuIndices,
        rows: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("embedding tokens", tokens.len, rows)?;
        check_len("embedding out", out.len, rows * table.cols)?;
        let pieces = table.cols.div_ceil(4);
        for chunk in &table.chunks {
            let params = [
                u32_of(rows, "rows")?,
                u32_of(table.cols, "cols")?,
                u32_of(chunk.row_start, "row")?,
                u32_of(chunk.rows, "rows")?,
            ];
            self.dispatch(
                ShaderVariant {
                    kernel: "embedding",
                    format: Some(table.format),
                    kv_f16: false,
                },
                "main",
                &[READ, READ, WRITE],
                &[&chunk.buf, &tokens.buf, &out.buf],
                &params,
                (rows * pieces).div_ceil(64),
            )?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm x", x.len, n)?;
        check_len("rms_norm out", out.len, n)?;
        let w = weight.vector(p.dim, "rms_norm weight")?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.dim, "dim")?,
            p.eps.to_bits(),
        ];
        self.dispatch(
            simple("rms_norm"),
            "main",
            &[READ, READ, WRITE],
            &[&x.buf, w, &out.buf],
            &params,
            p.rows,
        )
    }

    fn rms_norm_residual(
        &self,
        residual: &mut WgpuTensor,
        delta: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm_residual residual", residual.len, n)?;
        check_len("rms_norm_residual delta", delta.len, n)?;
        check_len("rms_norm_residual out", out.len, n)?;
        let w = weight.vector(p.dim, "rms_norm_residual weight")?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.dim, "dim")?,
            p.eps.to_bits(),
        ];
        self.dispatch(
            simple("rms_norm_residual"),
            "main",
            &[WRITE, READ, READ, WRITE],
            &[&residual.buf, &delta.buf, w, &out.buf],
            &params,
            p.rows,
        )
    }

    fn matmul(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("matmul x", x.len, p.rows * w.cols)?;
        check_len("matmul out", out.len, p.rows * w.rows)?;
        let bias = bias.map(|b| b.vector(w.rows, "matmul bias")).transpose()?;
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel: matmul_kernel_name(w.format),
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE],
            x,
            w,
            bias,
            rows: p.rows,
            pair: 1,
            tail: &[&out.buf],
            extra: &[],
        })
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, WgpuTensor>],
    ) -> Result<()> {
        let kernel = "matmul_rms_norm";
        if let Some(why) = split_error(outs.iter().map(|o| o.width), w.rows) {
            return Err(backend_error(format!("{kernel}: {why}")));
        }
        check_len("matmul_rms_norm x", x.len, p.rows * w.cols)?;
        for o in outs.iter() {
            check_len("matmul_rms_norm out", o.out.len, p.rows * o.width)?;
        }
        let bias = bias
            .map(|b| b.vector(w.rows, "matmul_rms_norm bias"))
            .transpose()?;
        let (normed, norm, [has_norm, eps]) = self.prologue(kernel, x, norm, p.rows, w.cols)?;
        let x = normed.as_ref().unwrap_or(x);
        // The first features of the second and third parts (n where absent:
        // the widths sum to n).
        let mut splits = [w.rows; MAX_SPLIT - 1];
        let mut start = 0;
        for (split, o) in splits.iter_mut().zip(outs.iter()) {
            start += o.width;
            *split = start;
        }
        let part = |i: usize| match outs.get(i) {
            Some(o) => &o.out.buf,
            None => &self.spare_outs[i - 1],
        };
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel,
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE, READ, WRITE, WRITE],
            x,
            w,
            bias,
            rows: p.rows,
            pair: 1,
            tail: &[part(0), norm, part(1), part(2)],
            extra: &[
                has_norm,
                eps,
                u32_of(splits[0], "split")?,
                u32_of(splits[1], "split")?,
            ],
        })
    }

    fn matmul_glu(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        glu: Glu,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let kernel = "matmul_glu";
        if !w.rows.is_multiple_of(2) {
            return Err(backend_error(format!(
                "{kernel}: a [gate; up] weight has an even number of rows, not {}",
                w.rows
            )));
        }
        let f = w.rows / 2;
        check_len("matmul_glu x", x.len, p.rows * w.cols)?;
        check_len("matmul_glu out", out.len, p.rows * f)?;
        if w.chunks.len() > 1 {
            // A gate row and its up row may lie in different chunks, which
            // one dispatch cannot read together: the halves are split into
            // scratch, then the unfused activation runs.
            let mut gate = self.scratch(p.rows * f)?;
            let mut up = self.scratch(p.rows * f)?;
            let mut halves = [
                SplitOut {
                    out: &mut gate,
                    width: f,
                },
                SplitOut {
                    out: &mut up,
                    width: f,
                },
            ];
            self.matmul_rms_norm(x, norm, w, None, p, &mut halves)?;
            return match glu {
                Glu::SwiGlu => self.swiglu(&gate, &up, p.rows * f, out),
                Glu::GeGlu => self.geglu(&gate, &up, p.rows * f, out),
            };
        }
        let (normed, norm, [has_norm, eps]) = self.prologue(kernel, x, norm, p.rows, w.cols)?;
        let x = normed.as_ref().unwrap_or(x);
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel,
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE, READ],
            x,
            w,
            bias: None,
            rows: p.rows,
            pair: 2,
            tail: &[&out.buf, norm],
            extra: &[has_norm, eps, u32::from(glu == Glu::GeGlu)],
        })
    }

    fn matmul_residual(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("matmul_residual x", x.len, p.rows * w.cols)?;
        check_len("matmul_residual out", out.len, p.rows * w.rows)?;
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel: "matmul_residual",
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE],
            x,
            w,
            bias: None,
            rows: p.rows,
            pair: 1,
            tail: &[&out.buf],
            extra: &[],
        })
    }

    fn kernel_launches(&self) -> Option<u64> {
        Some(self.gpu.launches())
    }

    fn rope(
        &self,
        x: &mut WgpuTensor,
        positions: &WgpuIndices,
        inv_freq: &WgpuTensor,
        p: RopeParams,
    ) -> Result<()> {
        if !p.rotary_dim.is_multiple_of(2) || p.rotary_dim > p.head_dim {
            return Err(backend_error(format!(
                "rope: rotary_dim {} must be even and at most head_dim {}",
                p.rotary_dim, p.head_dim
            )));
        }
        check_len("rope x", x.len, p.rows * p.heads * p.head_dim)?;
        check_len("rope positions", positions.len, p.rows)?;
        check_len("rope inv_freq", inv_freq.len, p.rotary_dim / 2)?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.rotary_dim, "rotary_dim")?,
            u32::from(p.style == RopeStyle::NeoX),
        ];
        self.dispatch(
            simple("rope"),
            "main",
            &[WRITE, READ, READ],
            &[&x.buf, &positions.buf, &inv_freq.buf],
            &params,
            (p.rows * p.heads * (p.rotary_dim / 2)).div_ceil(64),
        )
    }

    fn paged_kv_write(
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

    fn track_key_bounds(&self, cache: &mut WgpuKvCache) -> Result<()> {
        if cache.bounds.is_none() {
            let l = &cache.layout;
            let bytes = 4 * (l.num_blocks * 2 * l.row_width()) as u64;
            cache.bounds = Some(self.gpu.dedicated(bytes, "key bounds")?);
        }
        Ok(())
    }

    fn select_kv_blocks(
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

    fn paged_attention(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.attention_kernel(q, cache, idx, p, out, false)
    }

    fn paged_attention_scores(
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

    fn swiglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("swiglu", gate, up, len, out)
    }

    fn geglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("geglu", gate, up, len, out)
    }

    fn scale(&self, x: &mut WgpuTensor, len: usize, factor: f32) -> Result<()> {
        check_len("scale x", x.len, len)?;
        self.dispatch(
            simple("scale"),
            "main",
            &[WRITE],
            &[&x.buf],
            &[u32_of(len, "len")?, factor.to_bits()],
            len.div_ceil(256),
        )
    }

    fn gather_rows(
        &self,
        x: &WgpuTensor,
        rows: &WgpuIndices,
        n: usize,
        width: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("gather_rows rows", rows.len, n)?;
        check_len("gather_rows out", out.len, n * width)?;
        let src_rows = x.len.checked_div(width).unwrap_or(0);
        let params = [
            u32_of(n, "n")?,
            u32_of(width, "width")?,
            u32_of(src_rows, "rows")?,
        ];
        self.dispatch(
            simple("gather_rows"),
            "main",
            &[READ, READ, WRITE],
            &[&x.buf, &rows.buf, &out.buf],
            &params,
            (n * width).div_ceil(256),
        )
    }

    fn moe_route(
        &self,
        logits: &WgpuTensor,
        p: MoeRouteParams,
        ids: &mut WgpuIndices,
        weights: &mut WgpuTensor,
    ) -> Result<()> {
        if p.k == 0 || p.k > p.experts || p.k > MAX_EXPERTS_PER_TOKEN {
            return Err(backend_error(format!(
                "moe_route: k = {} must be 1 to {} experts (at most {MAX_EXPERTS_PER_TOKEN})",
                p.k, p.experts
            )));
        }
        check_len("moe_route logits", logits.len, p.rows * p.width())?;
        check_len("moe_route ids", ids.len, p.rows * p.slots())?;
        check_len("moe_route weights", weights.len, p.rows * p.slots())?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.experts, "experts")?,
            u32_of(p.k, "k")?,
            u32::from(p.normalize),
            u32::from(p.shared_gate),
        ];
        self.dispatch(
            simple("moe_route"),
            "main",
            &[READ, WRITE, WRITE],
            &[&logits.buf, &ids.buf, &weights.buf],
            &params,
            p.rows.div_ceil(64),
        )
    }

    fn moe_combine(
        &self,
        y: &WgpuTensor,
        rows: &WgpuIndices,
        ids: &WgpuIndices,
        weights: &WgpuTensor,
        p: MoeCombineParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("moe_combine y", y.len, p.count * p.width)?;
        check_len("moe_combine rows", rows.len, p.count)?;
        check_len("moe_combine weights", weights.len, ids.len)?;
        let params = [
            u32_of(p.count, "count")?,
            u32_of(p.width, "width")?,
            p.expert,
            u32_of(p.slots, "slots")?,
        ];
        self.dispatch(
            simple("moe_combine"),
            "main",
            &[READ, READ, READ, READ, WRITE],
            &[&y.buf, &rows.buf, &ids.buf, &weights.buf, &out.buf],
            &params,
            (p.count * p.width).div_ceil(256),
        )
    }

    fn argmax(
        &self,
        x: &WgpuTensor,
        rows: usize,
        width: usize,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        check_len("argmax x", x.len, rows * width)?;
        check_len("argmax out", out.len, rows)?;
        self.dispatch(
            simple("argmax"),
            "main",
            &[READ, WRITE],
            &[&x.buf, &out.buf],
            &[u32_of(rows, "rows")?, u32_of(width, "width")?],
            rows,
        )
    }
}
