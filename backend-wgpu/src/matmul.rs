//! The host side of the matmul family: one launch over every chunk of a
//! weight, the norm prologue, and the gated product of a chunked weight.

use super::*;

/// Activation rows up to which `matmul` takes the GEMV path (`wgsl/matmul.wgsl`).
pub(crate) const GEMV_MAX_ROWS: usize = 8;
/// Workgroup size of `gemv_rows` (one thread per output).
pub(crate) const GEMV_ROWS_WG: usize = 64;
/// Activation rows and weight rows of one `tiled` workgroup.
pub(crate) const TILE_ROWS: usize = 32;
pub(crate) const TILE_WEIGHT_ROWS: usize = 64;

/// A matmul-family kernel (`matmul` and the fused matmuls) over every chunk
/// of its weight: `wgsl/matmul_common.wgsl` says what each binding and
/// parameter is.
pub(crate) struct MatmulLaunch<'a> {
    pub(crate) variant: ShaderVariant,
    pub(crate) access: &'static [Access],
    pub(crate) x: &'a WgpuTensor,
    pub(crate) w: &'a WgpuWeight,
    pub(crate) bias: Option<&'a GpuBuffer>,
    pub(crate) rows: usize,
    /// Weight rows per output: 2 where an output is a gate and an up row.
    pub(crate) pair: usize,
    /// The bindings after the bias: the output, then the kernel's own.
    pub(crate) tail: &'a [&'a GpuBuffer],
    /// The parameters after the six that every matmul reads.
    pub(crate) extra: &'a [u32],
}

impl WgpuBackend {
    /// Records `l`, one dispatch per weight chunk, each on the entry point
    /// that suits its row count and the adapter.
    pub(crate) fn launch_matmul(&self, l: MatmulLaunch<'_>) -> Result<()> {
        let bias = l.bias.unwrap_or(&self.no_bias);
        for chunk in &l.w.chunks {
            let mut params = vec![
                u32_of(l.rows, "rows")?,
                u32_of(l.w.cols, "cols")?,
                u32_of(l.w.rows, "n")?,
                u32_of(chunk.row_start, "row")?,
                u32_of(chunk.rows, "rows")?,
                u32::from(l.bias.is_some()),
            ];
            params.extend_from_slice(l.extra);
            let outputs = chunk.rows / l.pair;
            let (entry, workgroups) = if l.rows > GEMV_MAX_ROWS {
                let tiles = outputs.div_ceil(TILE_WEIGHT_ROWS / l.pair);
                ("tiled", l.rows.div_ceil(TILE_ROWS) * tiles)
            } else if self.gemv_per_row {
                ("gemv_rows", outputs.div_ceil(GEMV_ROWS_WG))
            } else {
                ("gemv", outputs)
            };
            let mut buffers = vec![&chunk.buf, &l.x.buf, bias];
            buffers.extend_from_slice(l.tail);
            self.dispatch(l.variant, entry, l.access, &buffers, &params, workgroups)?;
        }
        Ok(())
    }

    /// A fused matmul's norm prologue as its kernel takes it: the rows
    /// normalised ahead where the kernel runs without it, the norm's binding
    /// and its parameters (`has_norm`, `eps`; a spare binding and zeros
    /// where there is none). Decode-sized matmuls on CPU adapters run one
    /// thread per output (`gemv_rows`), where a prologue would be recomputed
    /// for every output and cost more than the launch it saves: there
    /// `rms_norm` normalises the rows once first.
    pub(crate) fn prologue<'a>(
        &'a self,
        kernel: &str,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'a, WgpuWeight>>,
        rows: usize,
        cols: usize,
    ) -> Result<(Option<WgpuTensor>, &'a GpuBuffer, [u32; 2])> {
        match norm {
            Some(n) if self.gemv_per_row && rows <= GEMV_MAX_ROWS => {
                let mut normed = self.scratch(rows * cols)?;
                let p = RmsNormParams {
                    rows,
                    dim: cols,
                    eps: n.eps,
                };
                self.rms_norm(x, n.weight, p, &mut normed)?;
                Ok((Some(normed), &self.no_bias, [0, 0]))
            }
            Some(n) => Ok((
                None,
                n.weight.vector(cols, &format!("{kernel} norm"))?,
                [1, n.eps.to_bits()],
            )),
            None => Ok((None, &self.no_bias, [0, 0])),
        }
    }

    /// A tensor whose contents the next kernel overwrites whole.
    pub(crate) fn scratch(&self, len: usize) -> Result<WgpuTensor> {
        Ok(WgpuTensor {
            buf: self.gpu.pooled(4 * len as u64)?,
            len,
        })
    }

    /// `out = act(gate) * up` elementwise: the shared launch of `swiglu` and `geglu`.
    pub(crate) fn gated_product(
        &self,
        kernel: &'static str,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len(&format!("{kernel} gate"), gate.len, len)?;
        check_len(&format!("{kernel} up"), up.len, len)?;
        check_len(&format!("{kernel} out"), out.len, len)?;
        self.dispatch(
            simple(kernel),
            "main",
            &[READ, READ, WRITE],
            &[&gate.buf, &up.buf, &out.buf],
            &[u32_of(len, "len")?],
            len.div_ceil(256),
        )
    }
}
