//! The fused matmuls' host side: one launch each where a separate norm,
//! gated activation or residual add would cost another pass over the
//! activations. Their cuBLAS compositions are in `matmul.rs`.

use super::*;

impl CudaBackend {
    /// `matmul_rms_norm`: one launch of `matmul_rms_norm.cu` (after
    /// `separate_norm`), composed on cuBLAS in dense F16/BF16 prefill.
    pub(super) fn launch_matmul_rms_norm(
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

    /// `matmul_glu`: one launch of `matmul_glu.cu` (after `separate_norm`),
    /// composed on cuBLAS in dense F16/BF16 prefill.
    pub(super) fn launch_matmul_glu(
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

    /// `matmul_residual`: one launch of `matmul_residual.cu`, or GEMMs
    /// accumulating into `out` in dense F16/BF16 prefill.
    pub(super) fn launch_matmul_residual(
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

    /// `mlp_residual`: one launch of `mlp_residual.cu` with
    /// `NormPath::Prologue` where it takes the shape, else `mlp_composed`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_mlp_residual(
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
}
