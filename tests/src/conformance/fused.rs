//! The fused matmuls in the conformance suite: each against the unfused
//! composition it replaces, run on the reference (RMSNorm, then `matmul`,
//! then the split, the gated activation or the residual add), over float,
//! block and k-quant formats, decode and prefill row counts (1, 3, 17, 40:
//! GEMV paths and past one 32-row tile), output widths that fill no tile,
//! with and without the norm prologue and the bias. A backend without fused
//! matmuls is not asked.

use tandem_core::backend::{Backend, Glu, MatmulParams, NormPrologue, RmsNormParams, SplitOut};
use tandem_core::quant::WeightFormat;

use super::{matmul, rms_norm, swiglu_or_geglu, vector, HostWeight, Out, Suite};

const EPS: f32 = 1e-5;

/// Formats the fused kernels are checked with: float, 32-element blocks
/// with and without offsets, Tandem's INT4 groups and W8A8, two k-quants.
const FORMATS: [WeightFormat; 8] = [
    WeightFormat::F32,
    WeightFormat::F16,
    WeightFormat::Q8_0,
    WeightFormat::Q4_1,
    WeightFormat::W8A8,
    WeightFormat::Int4 {
        group: tandem_core::quant::Int4Group::G64,
    },
    WeightFormat::Q4_K,
    WeightFormat::Q6_K,
];

/// Activation rows of each case, in turn.
const ROWS: [usize; 4] = [1, 3, 17, 40];

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    pub(super) fn fused_matmuls(&mut self) {
        if !self.backend.fuses_matmuls() {
            return;
        }
        for (i, format) in FORMATS.into_iter().enumerate() {
            let cols = match format {
                f if f.is_k_quant() => 512,
                f if f.is_quantized() => 5 * f.block_elems(),
                _ => 45,
            };
            let rows = ROWS[i % ROWS.len()];
            let with_norm = i % 4 != 3;
            self.split_case(format, rows, cols, with_norm, i % 2 == 0);
            self.glu_case(format, rows, cols, with_norm, Glu::SwiGlu);
            self.glu_case(format, ROWS[(i + 1) % ROWS.len()], cols, true, Glu::GeGlu);
            self.residual_case(format, ROWS[(i + 2) % ROWS.len()], cols);
        }
        // One part: the logits from the unnormalised residual.
        self.split_case(WeightFormat::Q8_0, 2, 96, true, false);
    }

    /// Q, K and V from one weight of 37 + 11 + 11 rows.
    fn split_case(
        &mut self,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        norm: bool,
        bias: bool,
    ) {
        let widths: &[usize] = if rows == 2 { &[67] } else { &[37, 11, 11] };
        let n: usize = widths.iter().sum();
        let w = HostWeight::new(format, n, cols, &self.rng.values(n * cols, 1.0));
        let x = self.rng.values(rows * cols, 2.0);
        let g = norm.then(|| self.rng.values(cols, 1.0));
        let b = bias.then(|| self.rng.values(n, 1.0));
        let got = split(
            self.backend,
            &x,
            g.as_deref(),
            &w,
            b.as_deref(),
            rows,
            widths,
        );
        let want = unfused_split(
            self.reference,
            &x,
            g.as_deref(),
            &w,
            b.as_deref(),
            rows,
            widths,
        );
        let case = format!(
            "{format} {rows}x{cols} by {n}x{cols} into {widths:?}{}{}",
            if norm { ", normed" } else { "" },
            if bias { " + bias" } else { "" }
        );
        self.check("matmul_rms_norm", case, got, want);
    }

    /// Gate and up of 19 features each (38 weight rows).
    fn glu_case(&mut self, format: WeightFormat, rows: usize, cols: usize, norm: bool, glu: Glu) {
        let f = 19;
        let w = HostWeight::new(format, 2 * f, cols, &self.rng.values(2 * f * cols, 1.0));
        let x = self.rng.values(rows * cols, 2.0);
        let g = norm.then(|| self.rng.values(cols, 1.0));
        let got = glu_fused(self.backend, &x, g.as_deref(), &w, glu, rows);
        let want = unfused_glu(self.reference, &x, g.as_deref(), &w, glu, rows);
        let case = format!(
            "{format} {glu:?} {rows}x{cols} by {}x{cols}{}",
            2 * f,
            if norm { ", normed" } else { "" }
        );
        self.check("matmul_glu", case, got, want);
    }

    /// 67 outputs added onto a residual stream.
    fn residual_case(&mut self, format: WeightFormat, rows: usize, cols: usize) {
        let n = 67;
        let w = HostWeight::new(format, n, cols, &self.rng.values(n * cols, 1.0));
        let x = self.rng.values(rows * cols, 1.0);
        let residual = self.rng.values(rows * n, 4.0);
        let got = residual_fused(self.backend, &x, &w, &residual, rows);
        let want = matmul(self.reference, &x, &w, None, rows)
            .map(|y| y.iter().zip(&residual).map(|(y, r)| r + y).collect());
        let case = format!("{format} {rows}x{cols} by {n}x{cols} onto the residual");
        self.check("matmul_residual", case, got, want);
    }
}

/// The fused kernel's parts, concatenated part after part.
fn split<X: Backend>(
    be: &X,
    x: &[f32],
    norm: Option<&[f32]>,
    w: &HostWeight,
    bias: Option<&[f32]>,
    rows: usize,
    widths: &[usize],
) -> Out {
    let xs = be.upload(x)?;
    let weight = w.upload(be)?;
    let g = norm.map(|g| vector(be, g)).transpose()?;
    let b = bias.map(|b| vector(be, b)).transpose()?;
    let mut tensors = widths
        .iter()
        .map(|&width| be.alloc(rows * width))
        .collect::<tandem_core::Result<Vec<_>>>()?;
    let mut outs: Vec<SplitOut<'_, X::Tensor>> = tensors
        .iter_mut()
        .zip(widths)
        .map(|(out, &width)| SplitOut { out, width })
        .collect();
    let prologue = g.as_ref().map(|weight| NormPrologue { weight, eps: EPS });
    be.matmul_rms_norm(
        &xs,
        prologue,
        &weight,
        b.as_ref(),
        MatmulParams { rows },
        &mut outs,
    )?;
    let mut all = Vec::new();
    for (t, &width) in tensors.iter().zip(widths) {
        all.extend(be.download(t, rows * width)?);
    }
    Ok(all)
}

/// RMSNorm, matmul, then the columns cut apart on the host.
fn unfused_split<X: Backend>(
    be: &X,
    x: &[f32],
    norm: Option<&[f32]>,
    w: &HostWeight,
    bias: Option<&[f32]>,
    rows: usize,
    widths: &[usize],
) -> Out {
    let normed = normed(be, x, norm, rows)?;
    let y = matmul(be, &normed, w, bias, rows)?;
    let mut all = Vec::new();
    let mut start = 0;
    for &width in widths {
        for row in y.chunks(w.rows) {
            all.extend_from_slice(&row[start..start + width]);
        }
        start += width;
    }
    Ok(all)
}

fn glu_fused<X: Backend>(
    be: &X,
    x: &[f32],
    norm: Option<&[f32]>,
    w: &HostWeight,
    glu: Glu,
    rows: usize,
) -> Out {
    let f = w.rows / 2;
    let xs = be.upload(x)?;
    let weight = w.upload(be)?;
    let g = norm.map(|g| vector(be, g)).transpose()?;
    let mut out = be.alloc(rows * f)?;
    let prologue = g.as_ref().map(|weight| NormPrologue { weight, eps: EPS });
    be.matmul_glu(&xs, prologue, &weight, glu, MatmulParams { rows }, &mut out)?;
    be.download(&out, rows * f)
}

/// RMSNorm, matmul, then the gated activation kernel over the two halves.
fn unfused_glu<X: Backend>(
    be: &X,
    x: &[f32],
    norm: Option<&[f32]>,
    w: &HostWeight,
    glu: Glu,
    rows: usize,
) -> Out {
    let f = w.rows / 2;
    let normed = normed(be, x, norm, rows)?;
    let y = matmul(be, &normed, w, None, rows)?;
    let (gate, up): (Vec<f32>, Vec<f32>) = (
        y.chunks(2 * f).flat_map(|r| r[..f].to_vec()).collect(),
        y.chunks(2 * f).flat_map(|r| r[f..].to_vec()).collect(),
    );
    swiglu_or_geglu(be, glu, &gate, &up)
}

fn residual_fused<X: Backend>(
    be: &X,
    x: &[f32],
    w: &HostWeight,
    residual: &[f32],
    rows: usize,
) -> Out {
    let xs = be.upload(x)?;
    let weight = w.upload(be)?;
    let mut out = be.upload(residual)?;
    be.matmul_residual(&xs, &weight, MatmulParams { rows }, &mut out)?;
    be.download(&out, residual.len())
}

fn normed<X: Backend>(be: &X, x: &[f32], norm: Option<&[f32]>, rows: usize) -> Out {
    match norm {
        Some(g) => rms_norm(
            be,
            x,
            g,
            RmsNormParams {
                rows,
                dim: g.len(),
                eps: EPS,
            },
        ),
        None => Ok(x.to_vec()),
    }
}
