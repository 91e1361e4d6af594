//! The host side of the row-wise kernels: embedding, norms, RoPE, scaling,
//! row gathers and argmax. Each is one dispatch over rows (one per table
//! chunk for the embedding) with nothing to share with the matmul or
//! attention paths, so they sit together here.

use super::*;

impl WgpuBackend {
    /// `Backend::embedding`, one dispatch per chunk of the table.
    pub(crate) fn embedding_kernel(
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

    /// `Backend::rms_norm`.
    pub(crate) fn rms_norm_kernel(
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

    /// `Backend::rms_norm_residual`.
    pub(crate) fn rms_norm_residual_kernel(
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

    /// `Backend::rope`.
    pub(crate) fn rope_kernel(
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

    /// `Backend::scale`.
    pub(crate) fn scale_kernel(&self, x: &mut WgpuTensor, len: usize, factor: f32) -> Result<()> {
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

    /// `Backend::gather_rows`.
    pub(crate) fn gather_rows_kernel(
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

    /// `Backend::argmax`.
    pub(crate) fn argmax_kernel(
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
