//! Each kernel called once on a backend, its inputs uploaded and its
//! output read back: the suite runs the same call on the backend under
//! test and on the reference, so a case states only its inputs.

use tandem_core::backend::{Backend, Glu, MatmulParams, RmsNormParams, RopeParams};
use tandem_core::quant::WeightFormat;

use super::{HostWeight, Out};

pub(super) fn vector<X: Backend>(be: &X, values: &[f32]) -> tandem_core::Result<X::Weight> {
    HostWeight::new(WeightFormat::F32, 1, values.len(), values).upload(be)
}

pub(super) fn embedding<X: Backend>(be: &X, table: &HostWeight, tokens: &[u32]) -> Out {
    let w = table.upload(be)?;
    let ids = be.upload_indices(tokens)?;
    let mut out = be.alloc(tokens.len() * table.cols)?;
    be.embedding(&w, &ids, tokens.len(), &mut out)?;
    be.download(&out, tokens.len() * table.cols)
}

pub(super) fn rms_norm<X: Backend>(be: &X, x: &[f32], weight: &[f32], p: RmsNormParams) -> Out {
    let xs = be.upload(x)?;
    let w = vector(be, weight)?;
    let mut out = be.alloc(x.len())?;
    be.rms_norm(&xs, &w, p, &mut out)?;
    be.download(&out, x.len())
}

/// The normalized rows followed by the updated residual.
pub(super) fn rms_norm_residual<X: Backend>(
    be: &X,
    residual: &[f32],
    delta: &[f32],
    weight: &[f32],
    p: RmsNormParams,
) -> Out {
    let mut res = be.upload(residual)?;
    let d = be.upload(delta)?;
    let w = vector(be, weight)?;
    let mut out = be.alloc(residual.len())?;
    be.rms_norm_residual(&mut res, &d, &w, p, &mut out)?;
    let mut all = be.download(&out, residual.len())?;
    all.extend(be.download(&res, residual.len())?);
    Ok(all)
}

pub(super) fn matmul<X: Backend>(
    be: &X,
    x: &[f32],
    w: &HostWeight,
    bias: Option<&[f32]>,
    rows: usize,
) -> Out {
    let xs = be.upload(x)?;
    let weight = w.upload(be)?;
    let b = bias.map(|b| vector(be, b)).transpose()?;
    let mut out = be.alloc(rows * w.rows)?;
    be.matmul(&xs, &weight, b.as_ref(), MatmulParams { rows }, &mut out)?;
    be.download(&out, rows * w.rows)
}

pub(super) fn rope<X: Backend>(
    be: &X,
    x: &[f32],
    positions: &[u32],
    inv_freq: &[f32],
    p: RopeParams,
) -> Out {
    let mut xs = be.upload(x)?;
    let pos = be.upload_indices(positions)?;
    let freq = be.upload(inv_freq)?;
    be.rope(&mut xs, &pos, &freq, p)?;
    be.download(&xs, x.len())
}

pub(super) fn swiglu<X: Backend>(be: &X, gate: &[f32], up: &[f32]) -> Out {
    let (g, u) = (be.upload(gate)?, be.upload(up)?);
    let mut out = be.alloc(gate.len())?;
    be.swiglu(&g, &u, gate.len(), &mut out)?;
    be.download(&out, gate.len())
}

pub(super) fn geglu<X: Backend>(be: &X, gate: &[f32], up: &[f32]) -> Out {
    let (g, u) = (be.upload(gate)?, be.upload(up)?);
    let mut out = be.alloc(gate.len())?;
    be.geglu(&g, &u, gate.len(), &mut out)?;
    be.download(&out, gate.len())
}

pub(super) fn swiglu_or_geglu<X: Backend>(be: &X, glu: Glu, gate: &[f32], up: &[f32]) -> Out {
    match glu {
        Glu::SwiGlu => swiglu(be, gate, up),
        Glu::GeGlu => geglu(be, gate, up),
    }
}

pub(super) fn scale<X: Backend>(be: &X, x: &[f32], len: usize, factor: f32) -> Out {
    let mut xs = be.upload(x)?;
    be.scale(&mut xs, len, factor)?;
    be.download(&xs, x.len())
}

pub(super) fn gather_rows<X: Backend>(be: &X, x: &[f32], picks: &[u32], width: usize) -> Out {
    let xs = be.upload(x)?;
    let rows = be.upload_indices(picks)?;
    let mut out = be.alloc(picks.len() * width)?;
    be.gather_rows(&xs, &rows, picks.len(), width, &mut out)?;
    be.download(&out, picks.len() * width)
}

pub(super) fn argmax<X: Backend>(be: &X, x: &[f32], rows: usize, width: usize) -> Out {
    let xs = be.upload(x)?;
    let mut out = be.upload_indices(&vec![u32::MAX; rows])?;
    be.argmax(&xs, rows, width, &mut out)?;
    Ok(be
        .download_indices(&out, rows)?
        .into_iter()
        .map(|i| i as f32)
        .collect())
}
