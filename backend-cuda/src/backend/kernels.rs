//! `impl Backend for CudaBackend`: the trait in one place, the short
//! kernels' host sides inline, their sizes checked before the launch; the
//! longer paths delegate to the sibling modules of their kind.

use super::*;

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Indices = CudaIndices;
    type Weight = CudaWeight;
    type KvCache = CudaKvCache;

    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: BACKEND_NAME.to_string(),
            device: self.report.to_string(),
        }
    }

    fn alloc(&self, len: usize) -> Result<CudaTensor> {
        self.refuse_while_capturing("alloc")?;
        Ok(CudaTensor {
            buf: self.alloc_raw(len)?,
        })
    }

    fn upload(&self, data: &[f32]) -> Result<CudaTensor> {
        let mut t = self.alloc(data.len())?;
        self.write_prefix("upload", &mut t.buf, data)?;
        Ok(t)
    }

    fn download(&self, t: &CudaTensor, len: usize) -> Result<Vec<f32>> {
        self.refuse_while_capturing("download")?;
        download(&self.stream, &t.buf, len)
    }

    fn upload_indices(&self, data: &[u32]) -> Result<CudaIndices> {
        self.refuse_while_capturing("upload_indices")?;
        let mut t = CudaIndices {
            buf: self.alloc_raw(data.len())?,
        };
        self.write_indices(&mut t, data)?;
        Ok(t)
    }

    fn download_indices(&self, t: &CudaIndices, len: usize) -> Result<Vec<u32>> {
        self.refuse_while_capturing("download_indices")?;
        download(&self.stream, &t.buf, len)
    }

    fn write_indices(&self, dst: &mut CudaIndices, data: &[u32]) -> Result<()> {
        self.write_prefix("write_indices", &mut dst.buf, data)
    }

    fn join_ranks(&self, comm: &dyn tandem_core::parallel::Communicator) -> Result<()> {
        if self.nccl.get().is_none() {
            let nccl = crate::nccl::Nccl::join(Arc::clone(&self.stream), comm)?;
            let _ = self.nccl.set(nccl);
        }
        Ok(())
    }

    fn all_reduce_sum(
        &self,
        t: &mut CudaTensor,
        len: usize,
        comm: &dyn tandem_core::parallel::Communicator,
    ) -> Result<()> {
        self.refuse_while_capturing("all_reduce_sum")?;
        check_len("all_reduce_sum", t.buf.len(), len)?;
        match self.nccl.get() {
            Some(nccl) if nccl.size() == comm.size() => nccl.all_reduce_sum(&mut t.buf, len),
            _ => {
                let mut host = download(&self.stream, &t.buf, len)?;
                comm.all_reduce_sum(&mut host)?;
                self.write_prefix("all_reduce_sum", &mut t.buf, &host)
            }
        }
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<CudaWeight> {
        self.store_weight(w)
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<CudaKvCache> {
        self.refuse_while_capturing("alloc_kv_cache")?;
        layout.check()?;
        let bytes = |block_bytes: usize| {
            layout
                .num_blocks
                .checked_mul(block_bytes)
                .ok_or_else(|| backend_error("KV cache size overflows"))
        };
        Ok(CudaKvCache {
            layout,
            k: self.alloc_raw(bytes(layout.key_block_bytes())?)?,
            v: self.alloc_raw(bytes(layout.value_block_bytes())?)?,
            bounds: None,
        })
    }

    fn copy_kv_blocks(&self, cache: &mut CudaKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.copy_cache_blocks(cache, pairs)
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn can_record(&self) -> bool {
        true
    }

    fn begin_capture(&self) -> Result<()> {
        self.begin_graph_capture()
    }

    fn end_capture(&self) -> Result<Box<dyn RecordedStep>> {
        Ok(Box::new(self.end_graph_capture()?))
    }

    fn embedding(
        &self,
        table: &CudaWeight,
        tokens: &CudaIndices,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let dim = table.cols;
        check_len("embedding: tokens", tokens.len(), rows)?;
        check_len("embedding: out", out.len(), rows * dim)?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (fmt, row_bytes) = (format_code(table.format), table.row_bytes() as u64);
        let (vocab, dim32) = (to_u32(table.rows, "vocabulary")?, to_u32(dim, "dim")?);
        let grid = (blocks_for(dim, 256, "dim")?, grid_yz(rows, "rows")?, 1);
        sig::embedding(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &table.buf,
            &fmt,
            &row_bytes,
            &vocab,
            &tokens.buf,
            &dim32,
            &mut out.buf,
        )
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_len("rms_norm: x", x.len(), p.rows * p.dim)?;
        check_len("rms_norm: out", out.len(), p.rows * p.dim)?;
        check_len("rms_norm: weight", weight.elems(), p.dim)?;
        if p.rows == 0 || p.dim == 0 {
            return Ok(());
        }
        self.launch_rms_norm(&x.buf, weight, p, &mut out.buf)
    }

    fn rms_norm_residual(
        &self,
        residual: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm_residual: residual", residual.len(), n)?;
        check_len("rms_norm_residual: delta", delta.len(), n)?;
        check_len("rms_norm_residual: out", out.len(), n)?;
        check_len("rms_norm_residual: weight", weight.elems(), p.dim)?;
        if p.rows == 0 || p.dim == 0 {
            return Ok(());
        }
        let (fmt, dim) = (format_code(weight.format), to_u32(p.dim, "dim")?);
        let grid = (to_u32(p.rows, "rows")?, 1, 1);
        sig::rms_norm_residual(
            self,
            Which::ONE,
            config(grid, row_threads(p.dim), 0),
            &mut residual.buf,
            &delta.buf,
            &weight.buf,
            &fmt,
            &dim,
            &p.eps,
            &mut out.buf,
        )
    }

    fn matmul(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        check_len("matmul: x", x.len(), rows * cols)?;
        check_len("matmul: out", out.len(), rows * n)?;
        if let Some(b) = bias {
            check_len("matmul: bias", b.elems(), n)?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        match self.cublas_for(w, rows) {
            Some((blas, ty)) => self.matmul_cublas(blas, ty, x, w, bias, rows, out),
            None => self.matmul_kernel(x, w, bias, rows, out),
        }
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &CudaTensor,
        norm: Option<NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, CudaTensor>],
    ) -> Result<()> {
        self.launch_matmul_rms_norm(x, norm, w, bias, p, outs)
    }

    fn matmul_glu(
        &self,
        x: &CudaTensor,
        norm: Option<NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        glu: Glu,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_matmul_glu(x, norm, w, glu, p, out)
    }

    fn matmul_residual(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_matmul_residual(x, w, p, out)
    }

    fn mlp_residual(
        &self,
        residual: &mut CudaTensor,
        norm: NormPrologue<'_, CudaWeight>,
        gate_up: &CudaWeight,
        down: &CudaWeight,
        glu: Glu,
        p: MatmulParams,
        act: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_mlp_residual(residual, norm, gate_up, down, glu, p, act)
    }

    fn kernel_launches(&self) -> Option<u64> {
        Some(self.launches.load(Ordering::Relaxed))
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &CudaIndices,
        inv_freq: &CudaTensor,
        p: RopeParams,
    ) -> Result<()> {
        if p.rotary_dim > p.head_dim || !p.rotary_dim.is_multiple_of(2) {
            return Err(backend_error(format!(
                "rope: rotary_dim {} must be even and at most head_dim {}",
                p.rotary_dim, p.head_dim
            )));
        }
        check_len("rope: x", x.len(), p.rows * p.heads * p.head_dim)?;
        check_len("rope: positions", positions.len(), p.rows)?;
        check_len("rope: inv_freq", inv_freq.len(), p.rotary_dim / 2)?;
        let pairs = p.rows * p.heads * (p.rotary_dim / 2);
        if pairs == 0 {
            return Ok(());
        }
        let (rows, heads) = (to_u32(p.rows, "rows")?, to_u32(p.heads, "heads")?);
        let (head_dim, rotary_dim) = (
            to_u32(p.head_dim, "head_dim")?,
            to_u32(p.rotary_dim, "rotary_dim")?,
        );
        let style: i32 = match p.style {
            RopeStyle::Interleaved => 0,
            RopeStyle::NeoX => 1,
        };
        let grid = (blocks_for(pairs, 256, "rope pairs")?, 1, 1);
        sig::rope(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &mut x.buf,
            &positions.buf,
            &inv_freq.buf,
            &rows,
            &heads,
            &head_dim,
            &rotary_dim,
            &style,
        )
    }

    fn paged_kv_write(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &CudaIndices,
        rows: usize,
        cache: &mut CudaKvCache,
    ) -> Result<()> {
        self.write_kv_rows(k, v, slots, rows, cache)?;
        self.write_key_bounds(k, slots, rows, cache)
    }

    fn track_key_bounds(&self, cache: &mut CudaKvCache) -> Result<()> {
        self.refuse_while_capturing("track_key_bounds")?;
        if cache.bounds.is_none() {
            let l = cache.layout;
            cache.bounds = Some(self.alloc_raw(l.num_blocks * 2 * l.row_width())?);
        }
        Ok(())
    }

    fn select_kv_blocks(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut CudaIndices,
    ) -> Result<()> {
        self.launch_select_kv_blocks(q, cache, idx, p, select, out)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_paged_attention(q, cache, idx, p, out)
    }

    fn paged_attention_scores(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_paged_attention_scores(q, cache, idx, p, scores)
    }

    fn swiglu(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.gated_product(Glu::SwiGlu, gate, up, len, out)
    }

    fn geglu(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.gated_product(Glu::GeGlu, gate, up, len, out)
    }

    fn scale(&self, x: &mut CudaTensor, len: usize, factor: f32) -> Result<()> {
        check_len("scale: x", x.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let len64 = len as u64;
        let grid = (blocks_for(len, 256, "len")?.min(1 << 16), 1, 1);
        sig::scale(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &mut x.buf,
            &len64,
            &factor,
        )
    }

    fn gather_rows(
        &self,
        x: &CudaTensor,
        rows: &CudaIndices,
        n: usize,
        width: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_len("gather_rows: rows", rows.len(), n)?;
        check_len("gather_rows: out", out.len(), n * width)?;
        if n == 0 || width == 0 {
            return Ok(());
        }
        // The source rows are device data: the kernel trusts them to lie in
        // `x`, as the CPU reference's indexing does.
        let width32 = to_u32(width, "width")?;
        let grid = (blocks_for(width, 256, "width")?, grid_yz(n, "rows")?, 1);
        sig::gather_rows(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &x.buf,
            &rows.buf,
            &width32,
            &mut out.buf,
        )
    }

    fn moe_route(
        &self,
        logits: &CudaTensor,
        p: MoeRouteParams,
        ids: &mut CudaIndices,
        weights: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_moe_route(logits, p, ids, weights)
    }

    fn moe_combine(
        &self,
        y: &CudaTensor,
        rows: &CudaIndices,
        ids: &CudaIndices,
        weights: &CudaTensor,
        p: MoeCombineParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.launch_moe_combine(y, rows, ids, weights, p, out)
    }

    fn argmax(
        &self,
        x: &CudaTensor,
        rows: usize,
        width: usize,
        out: &mut CudaIndices,
    ) -> Result<()> {
        check_len("argmax: x", x.len(), rows * width)?;
        check_len("argmax: out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let width32 = to_u32(width, "width")?;
        let grid = (to_u32(rows, "rows")?, 1, 1);
        sig::argmax(
            self,
            Which::ONE,
            config(grid, row_threads(width), 0),
            &x.buf,
            &width32,
            &mut out.buf,
        )
    }
}
