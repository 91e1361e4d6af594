//! The fused matmuls: a matmul with the RMSNorm of its input as prologue and
//! a split of its output, a gated activation or a residual add as epilogue;
//! and the whole dense MLP (`mlp_residual`), the last two in one call.
//!
//! On the CPU the gain is one call where there were three to five (each a
//! parallel region with its barrier, and on a GPU a launch); the steps inside
//! are the unfused kernels' own code, so a fused call gives the bits of the
//! composition it replaces and greedy output never depends on fusion.

use tandem_core::backend::{split_error, Glu, RmsNormParams};
use tandem_core::Result;

use crate::buffers::Weight;
use crate::check;
use crate::isa::Isa;
use crate::math::{gelu_tanh, silu};
use crate::matmul::matmul;
use crate::norm::rms_norm;
use crate::workers::Workers;

/// Fewest elements of an epilogue worth a task of their own.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// A fused matmul's input: `rows` rows of `x`, normalised first by `norm`
/// (weight, eps) when given.
#[derive(Clone, Copy)]
pub(crate) struct NormedInput<'a> {
    pub x: &'a [f32],
    pub rows: usize,
    pub norm: Option<(&'a Weight, f32)>,
}

/// `x` itself, or its rows normalised into scratch.
fn prologue<'a>(
    workers: &Workers,
    input: &NormedInput<'a>,
    cols: usize,
) -> Result<std::borrow::Cow<'a, [f32]>> {
    let NormedInput { x, rows, norm } = *input;
    let Some((weight, eps)) = norm else {
        return Ok(x.into());
    };
    let mut normed = vec![0.0; check::product("matmul_rms_norm", &[rows, cols])?];
    let p = RmsNormParams {
        rows,
        dim: cols,
        eps,
    };
    rms_norm(workers, x, weight, p, &mut normed)?;
    Ok(normed.into())
}

/// `y = norm(x) · wᵀ + bias`, the columns of `y` split in order into `outs`.
pub(crate) fn matmul_rms_norm(
    workers: &Workers,
    isa: Isa,
    input: NormedInput<'_>,
    w: &Weight,
    bias: Option<&Weight>,
    outs: &mut [(&mut [f32], usize)],
) -> Result<()> {
    let kernel = "matmul_rms_norm";
    let rows = input.rows;
    let n = w.rows();
    if let Some(why) = split_error(outs.iter().map(|(_, width)| *width), n) {
        return Err(check::error(kernel, why));
    }
    for (out, width) in outs.iter() {
        check::buffer_len(
            kernel,
            "out",
            out.len(),
            check::product(kernel, &[rows, *width])?,
        )?;
    }
    let x = prologue(workers, &input, w.cols())?;
    if let [(out, _)] = outs {
        return matmul(workers, isa, &x, w, bias, rows, out);
    }
    let mut y = vec![0.0; check::product(kernel, &[rows, n])?];
    matmul(workers, isa, &x, w, bias, rows, &mut y)?;
    let mut start = 0;
    for (out, width) in outs.iter_mut() {
        for (dst, row) in out.chunks_exact_mut(*width).zip(y.chunks_exact(n)) {
            dst.copy_from_slice(&row[start..start + *width]);
        }
        start += *width;
    }
    Ok(())
}

/// `out[t, i] = act(y[t, i]) * y[t, f + i]` for `y = norm(x) · wᵀ`, `w` = `[gate; up]`.
pub(crate) fn matmul_glu(
    workers: &Workers,
    isa: Isa,
    input: NormedInput<'_>,
    w: &Weight,
    glu: Glu,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "matmul_glu";
    let rows = input.rows;
    if !w.rows().is_multiple_of(2) {
        return Err(check::error(
            kernel,
            format!(
                "a [gate; up] weight has an even number of rows, not {}",
                w.rows()
            ),
        ));
    }
    let f = w.rows() / 2;
    let len = check::product(kernel, &[rows, f])?;
    check::buffer_len(kernel, "out", out.len(), len)?;
    let x = prologue(workers, &input, w.cols())?;
    let mut y = vec![0.0; 2 * len];
    matmul(workers, isa, &x, w, None, rows, &mut y)?;
    match glu {
        Glu::SwiGlu => gated_rows(workers, silu, &y, f, &mut out[..len]),
        Glu::GeGlu => gated_rows(workers, gelu_tanh, &y, f, &mut out[..len]),
    }
    Ok(())
}

/// `out[t, i] = act(y[t, i]) * y[t, f + i]` over rows of `y` = `[gate | up]`,
/// the arithmetic of the unfused activation kernels.
fn gated_rows(
    workers: &Workers,
    act: impl Fn(f32) -> f32 + Sync,
    y: &[f32],
    f: usize,
    out: &mut [f32],
) {
    let rows = out.len() / f.max(1);
    let chunk = workers.chunk_len(rows, f, MIN_CHUNK_ELEMS.div_ceil(f.max(1)));
    workers.for_each_chunk(out, chunk, |i, out| {
        let first = i * chunk / f;
        for (t, out) in out.chunks_exact_mut(f).enumerate() {
            let row = &y[(first + t) * 2 * f..][..2 * f];
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = act(g) * u;
            }
        }
    });
}

/// `out += x · wᵀ`.
pub(crate) fn matmul_residual(
    workers: &Workers,
    isa: Isa,
    x: &[f32],
    w: &Weight,
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "matmul_residual";
    let len = check::product(kernel, &[rows, w.rows()])?;
    check::buffer_len(kernel, "out", out.len(), len)?;
    let mut y = vec![0.0; len];
    matmul(workers, isa, x, w, None, rows, &mut y)?;
    for (o, y) in out.iter_mut().zip(&y) {
        *o += y;
    }
    Ok(())
}

/// `residual += down · glu(norm(residual) · gate_upᵀ)`: [`matmul_glu`] into
/// `act` (`[rows, f]` at least), then [`matmul_residual`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn mlp_residual(
    workers: &Workers,
    isa: Isa,
    residual: &mut [f32],
    rows: usize,
    norm: (&Weight, f32),
    [gate_up, down]: [&Weight; 2],
    glu: Glu,
    act: &mut [f32],
) -> Result<()> {
    let kernel = "mlp_residual";
    let (dim, f) = (gate_up.cols(), gate_up.rows() / 2);
    if down.rows() != dim || down.cols() != f {
        return Err(check::error(
            kernel,
            format!(
                "down is [{}, {}], not [{dim}, {f}] for a [gate; up] weight of [{}, {dim}]",
                down.rows(),
                down.cols(),
                gate_up.rows()
            ),
        ));
    }
    check::buffer_len(
        kernel,
        "residual",
        residual.len(),
        check::product(kernel, &[rows, dim])?,
    )?;
    let act_len = check::product(kernel, &[rows, f])?;
    check::buffer_len(kernel, "act", act.len(), act_len)?;
    let act = &mut act[..act_len];
    let input = NormedInput {
        x: residual,
        rows,
        norm: Some(norm),
    };
    matmul_glu(workers, isa, input, gate_up, glu, act)?;
    matmul_residual(workers, isa, act, down, rows, residual)
}
