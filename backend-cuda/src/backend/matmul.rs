//! The host side of the matmuls beyond one launch: the separate norm
//! path, the gated product, and dense F16/BF16 prefill through cuBLAS.

use super::*;

impl CudaBackend {
    /// With `NormPath::Separate`, `rms_norm(x)` into the scratch partials
    /// for a matmul kernel to read with no norm of its own; `None` where the
    /// kernel applies `norm` itself (or there is none).
    pub(super) fn separate_norm(
        &self,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        rows: usize,
        cols: usize,
    ) -> Result<Option<ScratchSlice<'_, f32>>> {
        let Some(norm) = norm.filter(|_| self.config.norm == NormPath::Separate) else {
            return Ok(None);
        };
        let mut normed = self.partials(rows * cols, "norm")?;
        let p = RmsNormParams {
            rows,
            dim: cols,
            eps: norm.eps,
        };
        self.launch_rms_norm(&x.buf, norm.weight, p, normed.slice()?)?;
        Ok(Some(normed))
    }

    /// `rms_norm.cu` over `p.rows` rows of `x` into `out`, one block a row.
    pub(super) fn launch_rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (fmt, dim) = (format_code(weight.format), to_u32(p.dim, "dim")?);
        let grid = (to_u32(p.rows, "rows")?, 1, 1);
        sig::rms_norm(
            self,
            Which::ONE,
            config(grid, row_threads(p.dim), 0),
            x,
            &weight.buf,
            &fmt,
            &dim,
            &p.eps,
            out,
        )
    }

    /// `out = act(gate) * up` elementwise: the shared launch of `swiglu` and `geglu`.
    pub(super) fn gated_product(
        &self,
        glu: Glu,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let kernel = match glu {
            Glu::SwiGlu => "swiglu",
            Glu::GeGlu => "geglu",
        };
        check_len(&format!("{kernel}: gate"), gate.len(), len)?;
        check_len(&format!("{kernel}: up"), up.len(), len)?;
        check_len(&format!("{kernel}: out"), out.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let len64 = len as u64;
        // A grid-stride loop: enough blocks to fill the GPU, not one per element.
        let grid = (blocks_for(len, 256, "len")?.min(1 << 16), 1, 1);
        let (one, cfg) = (Which::ONE, config(grid, 256, 0));
        match glu {
            Glu::SwiGlu => sig::swiglu(self, one, cfg, &gate.buf, &up.buf, &len64, &mut out.buf),
            Glu::GeGlu => sig::geglu(self, one, cfg, &gate.buf, &up.buf, &len64, &mut out.buf),
        }
    }

    /// Decode GEMV for up to `GEMV_MAX_TOKENS` rows, the tiled kernel beyond.
    pub(super) fn matmul_kernel(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let bias_fmt = bias.map_or(0, |b| format_code(b.format));
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(w.rows, "n")?,
            to_u32(w.cols, "cols")?,
        );
        sig::matmul(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            &x.buf,
            bias.map(|b| &b.buf),
            &bias_fmt,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
    }

    /// cuBLAS and the half type when a matmul of `rows` tokens by `w` goes
    /// to cuBLAS: dense F16/BF16 prefill. Decode (at most `GEMV_MAX_TOKENS`
    /// rows, the only steps recorded as graphs) never does, so the scratch
    /// these paths grow is never needed during a capture.
    pub(super) fn cublas_for(&self, w: &CudaWeight, rows: usize) -> Option<(&Blas, HalfType)> {
        let ty = half_type(w.format)?;
        let blas = self.blas.as_ref()?;
        (rows > GEMV_MAX_TOKENS && w.cols > 0).then_some((blas, ty))
    }

    /// Dense prefill GEMM on tensor cores: the activations are rounded to the
    /// weight's half type (bf16 as a hi + lo pair, see `matmul_bf16.cu`),
    /// cuBLAS multiplies with f32 accumulation, then the bias is added.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        {
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * w.cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, None, rows, w.cols, halves)?;
            self.half_gemms(blas, ty, halves, w, 0..w.rows, rows, &mut out.buf, false)?;
        }
        if let Some(b) = bias {
            let bias_fmt = format_code(b.format);
            let (rows32, n32) = (to_u32(rows, "rows")?, to_u32(w.rows, "n")?);
            let grid = (
                blocks_for(rows * w.rows, 256, "out elements")?.min(1 << 16),
                1,
                1,
            );
            sig::matmul_add_bias(
                self,
                Which::format(w.format),
                config(grid, 256, 0),
                &mut out.buf,
                &b.buf,
                &bias_fmt,
                &rows32,
                &n32,
            )?;
        }
        Ok(())
    }

    /// `x`, through the norm when there is one, in the GEMM's half type into
    /// `halves`: f16, or bf16 as hi then lo (`rows * cols` each).
    pub(super) fn half_activations(
        &self,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        rows: usize,
        cols: usize,
        halves: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let len = rows * cols;
        check_len("GEMM scratch", halves.len(), HALF_PARTS * len)?;
        if let Some(norm) = norm {
            // One block per row: the row's inverse RMS, then its halves.
            let (fmt, cols32) = (format_code(norm.weight.format), to_u32(cols, "cols")?);
            let cfg = config((to_u32(rows, "rows")?, 1, 1), row_threads(cols), 0);
            let (mut hi, mut lo) = halves.split_at_mut(len);
            let (x, weight, eps) = (&x.buf, &norm.weight.buf, &norm.eps);
            // Units of matmul_rms_norm.cu, each has both; the half format's.
            return match ty {
                HalfType::F16 => sig::matmul_rms_norm_f16_split_x(
                    self,
                    Which::format(WeightFormat::F16),
                    cfg,
                    x,
                    weight,
                    &fmt,
                    eps,
                    &cols32,
                    &mut hi,
                    &mut lo,
                ),
                HalfType::BF16 => sig::matmul_rms_norm_bf16_split_x(
                    self,
                    Which::format(WeightFormat::BF16),
                    cfg,
                    x,
                    weight,
                    &fmt,
                    eps,
                    &cols32,
                    &mut hi,
                    &mut lo,
                ),
            };
        }
        let len64 = len as u64;
        let cfg = config(
            (blocks_for(len, 256, "x elements")?.min(1 << 16), 1, 1),
            256,
            0,
        );
        let (mut hi, mut lo) = halves.split_at_mut(len);
        match ty {
            HalfType::F16 => {
                sig::matmul_f16_split_x(self, Which::ONE, cfg, &x.buf, &mut hi, &mut lo, &len64)
            }
            HalfType::BF16 => {
                sig::matmul_bf16_split_x(self, Which::ONE, cfg, &x.buf, &mut hi, &mut lo, &len64)
            }
        }
    }

    /// `out (+)= x · w[w_rows]ᵀ` on cuBLAS from the half activations that
    /// `half_activations` wrote: one GEMM per half matrix (hi, then lo
    /// accumulated). `out` is `[rows, w_rows.len()]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn half_gemms(
        &self,
        blas: &Blas,
        ty: HalfType,
        halves: &CudaSlice<u16>,
        w: &CudaWeight,
        w_rows: Range<usize>,
        rows: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let (n, cols) = (w_rows.len(), w.cols);
        let len = rows * cols;
        if w_rows.end > w.rows {
            return Err(backend_error(format!(
                "GEMM of weight rows {w_rows:?} of {}",
                w.rows
            )));
        }
        check_len("GEMM scratch", halves.len(), HALF_PARTS * len)?;
        check_len("GEMM output", out.len(), rows * n)?;
        if n == 0 {
            return Ok(());
        }
        let (w_ptr, _w_sync) = w.buf.device_ptr(&self.stream);
        let (x_ptr, _x_sync) = halves.device_ptr(&self.stream);
        let (out_ptr, _out_sync) = out.device_ptr_mut(&self.stream);
        for part in 0..HALF_PARTS {
            let gemm = HalfGemm {
                ty,
                w: w_ptr + (w_rows.start * cols * 2) as u64,
                x: x_ptr + (part * len * 2) as u64,
                out: out_ptr,
                rows,
                n,
                cols,
                accumulate: accumulate || part > 0,
            };
            // SAFETY: the weight rows lie in w (cols halves each, whole rows
            // checked at upload), the scratch holds `parts * len` halves and
            // out `rows * n` f32 (all checked above).
            unsafe { blas.half_gemm(&gemm) }?;
            self.count_launch();
        }
        Ok(())
    }

    /// `matmul_rms_norm` on cuBLAS, composed: the normalised activations in
    /// half precision (one kernel), one GEMM per part straight into its
    /// output (that part's rows of w), then each part's slice of the bias.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        outs: &mut [SplitOut<'_, CudaTensor>],
    ) -> Result<()> {
        {
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * w.cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, norm, rows, w.cols, halves)?;
            let mut start = 0;
            for o in outs.iter_mut() {
                let part = start..start + o.width;
                self.half_gemms(blas, ty, halves, w, part, rows, &mut o.out.buf, false)?;
                start += o.width;
            }
        }
        let Some(b) = bias else {
            return Ok(());
        };
        let (bias_fmt, rows32) = (format_code(b.format), to_u32(rows, "rows")?);
        let mut start = 0;
        for o in outs.iter_mut() {
            let (width, start32) = (to_u32(o.width, "width")?, to_u32(start, "split")?);
            start += o.width;
            if o.width == 0 {
                continue;
            }
            let grid = (
                blocks_for(rows * o.width, 256, "out elements")?.min(1 << 16),
                1,
                1,
            );
            sig::matmul_rms_norm_add_bias(
                self,
                Which::format(w.format),
                config(grid, 256, 0),
                &mut o.out.buf,
                &b.buf,
                &bias_fmt,
                &rows32,
                &width,
                &start32,
            )?;
        }
        Ok(())
    }

    /// `matmul_glu` on cuBLAS, composed: the (normalised) activations in
    /// half precision, the gate GEMM into `out`, the up GEMM into scratch,
    /// then `matmul_glu_gate` (out = act(out) * up).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn glu_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        act: i32,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (f, cols) = (w.rows / 2, w.cols);
        let len = rows * f;
        let mut scratch = self.gemm_scratch(HALF_PARTS * rows * cols, len)?;
        let (halves, up) = scratch.halves_and_floats()?;
        let up = up.ok_or_else(|| backend_error("scratch buffer missing"))?;
        self.half_activations(ty, x, norm, rows, cols, halves)?;
        self.half_gemms(blas, ty, halves, w, 0..f, rows, &mut out.buf, false)?;
        self.half_gemms(blas, ty, halves, w, f..2 * f, rows, up, false)?;
        let len64 = len as u64;
        let grid = (blocks_for(len, 256, "out elements")?.min(1 << 16), 1, 1);
        sig::matmul_glu_gate(
            self,
            Which::format(w.format),
            config(grid, 256, 0),
            &mut out.buf,
            &*up,
            &len64,
            &act,
        )
    }
}
