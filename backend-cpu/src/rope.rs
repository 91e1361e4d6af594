//! Rotary position embedding, in place.

use tandem_core::backend::{RopeParams, RopeStyle};
use tandem_core::Result;

use crate::check;
use crate::workers::Workers;

/// Fewest elements worth a task of their own.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// Rotates pair `i` of each head of row `t` by `positions[t] * inv_freq[i]`.
/// The sines and cosines of a row are computed once and shared by its heads.
pub(crate) fn rope(
    workers: &Workers,
    x: &mut [f32],
    positions: &[u32],
    inv_freq: &[f32],
    p: RopeParams,
) -> Result<()> {
    let kernel = "rope";
    check::positive(kernel, "head_dim", p.head_dim)?;
    check::positive(kernel, "heads", p.heads)?;
    if !p.rotary_dim.is_multiple_of(2) || p.rotary_dim > p.head_dim {
        return Err(check::error(
            kernel,
            format!(
                "rotary_dim {} must be even and at most head_dim {}",
                p.rotary_dim, p.head_dim
            ),
        ));
    }
    let half = p.rotary_dim / 2;
    let width = check::product(kernel, &[p.heads, p.head_dim])?;
    let n = check::product(kernel, &[p.rows, width])?;
    check::buffer_len(kernel, "x", x.len(), n)?;
    check::buffer_len(kernel, "positions", positions.len(), p.rows)?;
    check::buffer_len(kernel, "inv_freq", inv_freq.len(), half)?;
    if half == 0 {
        return Ok(());
    }
    let chunk = workers.chunk_len(p.rows, width, MIN_CHUNK_ELEMS.div_ceil(width));
    workers.for_each_chunk(&mut x[..n], chunk, |i, x| {
        let first_row = i * chunk / width;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        for (r, row) in x.chunks_exact_mut(width).enumerate() {
            let position = positions[first_row + r] as f32;
            for ((c, s), &f) in cos.iter_mut().zip(&mut sin).zip(inv_freq) {
                (*s, *c) = (position * f).sin_cos();
            }
            for head in row.chunks_exact_mut(p.head_dim) {
                rotate_head(&mut head[..p.rotary_dim], &cos, &sin, p.style);
            }
        }
    });
    Ok(())
}

fn rotate_head(head: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    match style {
        RopeStyle::Interleaved => {
            for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
        RopeStyle::NeoX => {
            let (first, second) = head.split_at_mut(cos.len());
            for (((x0, x1), &c), &s) in first.iter_mut().zip(second).zip(cos).zip(sin) {
                (*x0, *x1) = (*x0 * c - *x1 * s, *x0 * s + *x1 * c);
            }
        }
    }
}
