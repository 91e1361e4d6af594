//! The fused matmuls and the whole MLP in the conformance suite: each
//! against the unfused composition it replaces, run on the reference (RMSNorm, then `matmul`,
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
        // The whole MLP, (rows, dim, f): decode sizes take CUDA's one kernel,
        // 17 rows, f = 37 (its slices are 32 wide), W8A8 and dim = 45 (rows
        // not 16-byte aligned) the composition.
        let int4 = WeightFormat::Int4 {
            group: tandem_core::quant::Int4Group::G64,
        };
        let cases = [
            (WeightFormat::F32, 3, 45, 37),
            (WeightFormat::F16, 1, 48, 64),
            (WeightFormat::Q8_0, 2, 96, 96),
            (WeightFormat::Q4_1, 17, 160, 64),
            (WeightFormat::W8A8, 1, 64, 32),
            (int4, 5, 128, 128),
            (WeightFormat::Q4_K, 1, 256, 512),
            (WeightFormat::Q6_K, 8, 512, 256),
        ];
        for (i, (format, rows, dim, f)) in cases.into_iter().enumerate() {
            let glu = if i % 2 == 0 { Glu::SwiGlu } else { Glu::GeGlu };
            self.mlp_case(format, rows, dim, f, glu);
        }
    }

    /// `[gate; up]` of `2f` rows and down `[dim, f]` added onto a residual
    /// stream of `dim` columns, normed first.
    fn mlp_case(&mut self, format: WeightFormat, rows: usize, dim: usize, f: usize, glu: Glu) {
        // Weights of a trained model's size: outputs far from zero are what
        // a relative tolerance measures.
        let gate_up = HostWeight::new(format, 2 * f, dim, &self.rng.values(2 * f * dim, 0.2));
        let down = HostWeight::new(format, dim, f, &self.rng.values(dim * f, 0.05));
        let residual = self.rng.values(rows * dim, 2.0);
        let g = self.rng.values(dim, 1.0);
        let got = mlp_fused(self.backend, &residual, &g, [&gate_up, &down], glu, rows);
        let want = unfused_glu(self.reference, &residual, Some(&g), &gate_up, glu, rows)
            .and_then(|act| matmul(self.reference, &act, &down, None, rows))
            .map(|y| y.iter().zip(&residual).map(|(y, r)| r + y).collect());
        let case = format!("{format} {glu:?} {rows}x{dim}, f = {f}");
        self.check("mlp_residual", case, got, want);
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

fn mlp_fused<X: Backend>(
    be: &X,
    residual: &[f32],
    norm: &[f32],
    [gate_up, down]: [&HostWeight; 2],
    glu: Glu,
    rows: usize,
) -> Out {
    let mut stream = be.upload(residual)?;
    let weight = vector(be, norm)?;
    let mut act = be.alloc(rows * down.cols)?;
    let (gate_up, down) = (gate_up.upload(be)?, down.upload(be)?);
    let norm = NormPrologue {
        weight: &weight,
        eps: EPS,
    };
    let p = MatmulParams { rows };
    be.mlp_residual(&mut stream, norm, &gate_up, &down, glu, p, &mut act)?;
    be.download(&stream, residual.len())
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
