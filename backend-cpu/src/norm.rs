//! RMSNorm, plain and fused with the residual add.

use tandem_core::backend::RmsNormParams;
use tandem_core::Result;

use crate::buffers::Weight;
use crate::check;
use crate::math::sum_of_squares;
use crate::workers::Workers;

/// Fewest elements worth a task of their own.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// Checks the buffers of a norm over `p.rows × p.dim` and returns that size.
fn check_sizes(kernel: &str, p: RmsNormParams, x_len: usize, out_len: usize) -> Result<usize> {
    check::positive(kernel, "dim", p.dim)?;
    let n = check::product(kernel, &[p.rows, p.dim])?;
    check::buffer_len(kernel, "x", x_len, n)?;
    check::buffer_len(kernel, "out", out_len, n)?;
    Ok(n)
}

pub(crate) fn rms_norm(
    workers: &Workers,
    x: &[f32],
    weight: &Weight,
    p: RmsNormParams,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "rms_norm";
    let n = check_sizes(kernel, p, x.len(), out.len())?;
    let weight = weight.vector(kernel, "weight", p.dim)?;
    let chunk = workers.chunk_len(p.rows, p.dim, MIN_CHUNK_ELEMS.div_ceil(p.dim));
    workers.for_each_chunk(&mut out[..n], chunk, |i, out| {
        let x = &x[i * chunk..][..out.len()];
        for (x, out) in x.chunks_exact(p.dim).zip(out.chunks_exact_mut(p.dim)) {
            let inv_rms = inverse_rms(sum_of_squares(x), p);
            scale_row(x, &weight, inv_rms, out);
        }
    });
    Ok(())
}

/// `residual += delta; out = rms_norm(residual)`: the first pass over a row
/// adds the delta, the second sums the squares as `rms_norm` does, the
/// third normalizes. The sum in `rms_norm`'s order gives the bits of a fused
/// matmul's `residual += delta` followed by its norm prologue, so fusing
/// never changes greedy output.
pub(crate) fn rms_norm_residual(
    workers: &Workers,
    residual: &mut [f32],
    delta: &[f32],
    weight: &Weight,
    p: RmsNormParams,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "rms_norm_residual";
    let n = check_sizes(kernel, p, residual.len(), out.len())?;
    check::buffer_len(kernel, "delta", delta.len(), n)?;
    let weight = weight.vector(kernel, "weight", p.dim)?;
    let chunk = workers.chunk_len(p.rows, p.dim, MIN_CHUNK_ELEMS.div_ceil(p.dim));
    workers.for_each_chunk_pair(
        (&mut residual[..n], chunk),
        (&mut out[..n], chunk),
        |i, residual, out| {
            let delta = &delta[i * chunk..][..out.len()];
            for ((residual, delta), out) in residual
                .chunks_exact_mut(p.dim)
                .zip(delta.chunks_exact(p.dim))
                .zip(out.chunks_exact_mut(p.dim))
            {
                for (r, d) in residual.iter_mut().zip(delta) {
                    *r += d;
                }
                let inv_rms = inverse_rms(sum_of_squares(residual), p);
                scale_row(residual, &weight, inv_rms, out);
            }
        },
    );
    Ok(())
}

fn inverse_rms(sum_of_squares: f32, p: RmsNormParams) -> f32 {
    1.0 / (sum_of_squares / p.dim as f32 + p.eps).sqrt()
}

fn scale_row(x: &[f32], weight: &[f32], inv_rms: f32, out: &mut [f32]) {
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv_rms * w;
    }
}
