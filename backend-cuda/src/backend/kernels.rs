//! `impl Backend for CudaBackend`: every kernel's host side, its sizes
//! checked before the launch.

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
        self.refuse_while_capturing("upload_weight")?;
        if !w.cols.is_multiple_of(w.format.block_elems()) {
            return Err(backend_error(format!(
                "a {} weight needs columns in multiples of {}, got {}",
                w.format,
                w.format.block_elems(),
                w.cols
            )));
        }
        let expected = w.format.bytes_for(w.rows as u64, w.cols as u64);
        if expected != Some(w.data.len() as u64) {
            return Err(backend_error(format!(
                "weight of {}x{} {} needs whole blocks per row and {:?} bytes, got {}",
                w.rows,
                w.cols,
                w.format,
                expected,
                w.data.len()
            )));
        }
        let mut buf = self.alloc_raw::<u8>(w.data.len())?;
        if !w.data.is_empty() {
            let mut view = buf.slice_mut(..w.data.len());
            self.stream
                .memcpy_htod(w.data, &mut view)
                .map_err(|e| backend_error(format!("copy weight to device: {e}")))?;
        }
        Ok(CudaWeight {
            format: w.format,
            rows: w.rows,
            cols: w.cols,
            buf,
        })
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
        let layout = cache.layout;
        // Quantized blocks carry their scales, so whole blocks copy everything.
        let (key_bytes, value_bytes) = (layout.key_block_bytes(), layout.value_block_bytes());
        for &(src, dst) in pairs {
            if src as usize >= layout.num_blocks || dst as usize >= layout.num_blocks {
                return Err(backend_error(format!(
                    "copy_kv_blocks: block pair ({src}, {dst}) outside {} blocks",
                    layout.num_blocks
                )));
            }
        }
        let bounds_bytes = 4 * 2 * layout.row_width();
        let mut stores = vec![
            (cache.k.device_ptr(&self.stream), key_bytes),
            (cache.v.device_ptr(&self.stream), value_bytes),
        ];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds.device_ptr(&self.stream), bounds_bytes));
        }
        for ((base, _sync), block_bytes) in &stores {
            let (base, block_bytes) = (*base, *block_bytes);
            for &(src, dst) in pairs {
                // SAFETY: both ranges lie inside `buf` (checked above) and the
                // copy is ordered on the backend's stream.
                unsafe {
                    driver_result::memcpy_dtod_async(
                        base + (dst as usize * block_bytes) as u64,
                        base + (src as usize * block_bytes) as u64,
                        block_bytes,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| backend_error(format!("copy_kv_blocks: {e}")))?;
            }
        }
        Ok(())
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
        let kernel = "matmul_rms_norm";
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        if let Some(why) = split_error(outs.iter().map(|o| o.width), n) {
            return Err(backend_error(format!("{kernel}: {why}")));
        }
        check_len("matmul_rms_norm: x", x.len(), rows * cols)?;
        for (i, o) in outs.iter().enumerate() {
            check_len(
                &format!("{kernel}: output {i}"),
                o.out.len(),
                rows * o.width,
            )?;
        }
        if let Some(b) = bias {
            check_len("matmul_rms_norm: bias", b.elems(), n)?;
        }
        check_norm(kernel, norm.as_ref(), cols)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            return self.rms_norm_cublas(blas, ty, x, norm.as_ref(), w, bias, rows, outs);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let mut normed = self.separate_norm(x, norm.as_ref(), rows, cols)?;
        let (x, norm) = match normed.as_mut() {
            Some(normed) => (&*normed.slice()?, None),
            None => (&x.buf, norm),
        };
        let (norm_fmt, eps) = norm_args(norm.as_ref());
        let bias_fmt = bias.map_or(0, |b| format_code(b.format));
        // Where parts 0 and 1 end (n for an absent part).
        let mut ends = [n; MAX_SPLIT];
        let mut end = 0;
        for (e, o) in ends.iter_mut().zip(outs.iter()) {
            end += o.width;
            *e = end;
        }
        let (end0, end1) = (to_u32(ends[0], "split")?, to_u32(ends[1], "split")?);
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(n, "n")?,
            to_u32(cols, "cols")?,
        );
        // The parts' outputs in order, null for an absent part.
        const _: () = assert!(MAX_SPLIT == 3, "matmul_rms_norm takes three outputs");
        let mut parts = outs.iter_mut().map(|o| &mut o.out.buf);
        let (out0, out1, out2) = (parts.next(), parts.next(), parts.next());
        sig::matmul_rms_norm(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            x,
            norm.as_ref().map(|n| &n.weight.buf),
            &norm_fmt,
            &eps,
            bias.map(|b| &b.buf),
            &bias_fmt,
            out0,
            out1,
            out2,
            &end0,
            &end1,
            &tokens,
            &n32,
            &cols32,
        )
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
        let kernel = "matmul_glu";
        if !w.rows.is_multiple_of(2) {
            return Err(backend_error(format!(
                "{kernel}: a [gate; up] weight has an even number of rows, not {}",
                w.rows
            )));
        }
        let (rows, f, cols) = (p.rows, w.rows / 2, w.cols);
        check_len("matmul_glu: x", x.len(), rows * cols)?;
        check_len("matmul_glu: out", out.len(), rows * f)?;
        check_norm(kernel, norm.as_ref(), cols)?;
        if rows == 0 || f == 0 {
            return Ok(());
        }
        let act = glu_code(glu);
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            return self.glu_cublas(blas, ty, x, norm.as_ref(), w, act, rows, out);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let mut normed = self.separate_norm(x, norm.as_ref(), rows, cols)?;
        let (x, norm) = match normed.as_mut() {
            Some(normed) => (&*normed.slice()?, None),
            None => (&x.buf, norm),
        };
        let (norm_fmt, eps) = norm_args(norm.as_ref());
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(w.rows, "n")?,
            to_u32(cols, "cols")?,
        );
        sig::matmul_glu(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            x,
            norm.as_ref().map(|n| &n.weight.buf),
            &norm_fmt,
            &eps,
            &act,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
    }

    fn matmul_residual(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        check_len("matmul_residual: x", x.len(), rows * cols)?;
        check_len("matmul_residual: out", out.len(), rows * n)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            // cuBLAS adds into out itself (beta = 1): no epilogue kernel.
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, None, rows, cols, halves)?;
            return self.half_gemms(blas, ty, halves, w, 0..n, rows, &mut out.buf, true);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(n, "n")?,
            to_u32(cols, "cols")?,
        );
        sig::matmul_residual(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            &x.buf,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
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
        let kernel = "mlp_residual";
        let (rows, dim, f) = (p.rows, gate_up.cols, gate_up.rows / 2);
        if !gate_up.rows.is_multiple_of(2) || down.rows != dim || down.cols != f {
            return Err(backend_error(format!(
                "{kernel}: [gate; up] of [{}, {dim}] and down of [{}, {}] (it must be [dim, f] for 2f rows of [gate; up])",
                gate_up.rows, down.rows, down.cols
            )));
        }
        check_len("mlp_residual: residual", residual.len(), rows * dim)?;
        check_norm(kernel, Some(&norm), dim)?;
        if rows == 0 || f == 0 || dim == 0 {
            return Ok(());
        }
        let formats = [gate_up.format, down.format];
        let one_kernel = match self.config.norm {
            NormPath::Separate => None,
            NormPath::Prologue => mlp_variant(formats, dim, f, rows),
        };
        let Some((variant, cfg)) = one_kernel else {
            return mlp_composed(self, residual, norm, gate_up, down, glu, p, act);
        };
        let (norm_fmt, eps) = norm_args(Some(&norm));
        let act = glu_code(glu);
        let (tokens, dim32, f32_) = (to_u32(rows, "rows")?, to_u32(dim, "dim")?, to_u32(f, "f")?);
        let mut scratch = self.mlp_scratch(f / MLP_SLICE * rows * dim)?;
        let (partials, counter) = scratch.partials_and_counter()?;
        sig::mlp_residual(
            self,
            Which::format_variant(gate_up.format, &variant),
            cfg,
            &gate_up.buf,
            &down.buf,
            &mut residual.buf,
            &norm.weight.buf,
            &norm_fmt,
            &eps,
            &act,
            partials,
            counter,
            &tokens,
            &dim32,
            &f32_,
        )
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

    fn paged_attention(
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

    fn paged_attention_scores(
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
        if p.k == 0 || p.k > p.experts || p.k > MAX_EXPERTS_PER_TOKEN {
            return Err(backend_error(format!(
                "moe_route: k = {} must be 1 to {} experts (at most {MAX_EXPERTS_PER_TOKEN})",
                p.k, p.experts
            )));
        }
        check_len("moe_route: logits", logits.len(), p.rows * p.width())?;
        check_len("moe_route: ids", ids.len(), p.rows * p.slots())?;
        check_len("moe_route: weights", weights.len(), p.rows * p.slots())?;
        if p.rows == 0 {
            return Ok(());
        }
        let (rows, experts, k) = (
            to_u32(p.rows, "rows")?,
            to_u32(p.experts, "experts")?,
            to_u32(p.k, "k")?,
        );
        let (normalize, shared_gate) = (u32::from(p.normalize), u32::from(p.shared_gate));
        let grid = (blocks_for(p.rows, 64, "rows")?, 1, 1);
        sig::moe_route(
            self,
            Which::ONE,
            config(grid, 64, 0),
            &logits.buf,
            &rows,
            &experts,
            &k,
            &normalize,
            &shared_gate,
            &mut ids.buf,
            &mut weights.buf,
        )
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
        check_len("moe_combine: y", y.len(), p.count * p.width)?;
        check_len("moe_combine: rows", rows.len(), p.count)?;
        check_len("moe_combine: weights", weights.len(), ids.len())?;
        if p.count == 0 || p.width == 0 {
            return Ok(());
        }
        // The rows and ids are device data: the kernel trusts them to lie in
        // `out` and `weights`, as the CPU reference's indexing does.
        let (width, slots) = (to_u32(p.width, "width")?, to_u32(p.slots, "slots")?);
        let grid = (
            blocks_for(p.width, 256, "width")?,
            grid_yz(p.count, "rows")?,
            1,
        );
        sig::moe_combine(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &y.buf,
            &rows.buf,
            &ids.buf,
            &weights.buf,
            &width,
            &p.expert,
            &slots,
            &mut out.buf,
        )
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
