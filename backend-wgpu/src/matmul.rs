//! The host side of the matmul family: the plain and fused entry points,
//! one launch over every chunk of a weight, the norm prologue, and the
//! gated product of a chunked weight.

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
    /// `Backend::matmul`.
    pub(crate) fn matmul_kernel(
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

    /// `Backend::matmul_rms_norm`: the output split into up to three parts.
    pub(crate) fn matmul_rms_norm_kernel(
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

    /// `Backend::matmul_glu`: fused on one chunk, split then gated on several.
    pub(crate) fn matmul_glu_kernel(
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

    /// `Backend::matmul_residual`.
    pub(crate) fn matmul_residual_kernel(
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
