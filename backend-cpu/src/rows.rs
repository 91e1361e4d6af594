//! Row lookups and row reductions: `embedding`, `gather_rows`, `argmax`.

use tandem_core::Result;

use crate::buffers::Weight;
use crate::check;
use crate::workers::Workers;

/// Fewest elements worth a task of their own.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// `out[t] = table[tokens[t]]` as f32, decoding only the rows looked up.
pub(crate) fn embedding(
    workers: &Workers,
    table: &Weight,
    tokens: &[u32],
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "embedding";
    let dim = table.cols();
    check::positive(kernel, "table columns", dim)?;
    check::buffer_len(kernel, "tokens", tokens.len(), rows)?;
    let n = check::product(kernel, &[rows, dim])?;
    check::buffer_len(kernel, "out", out.len(), n)?;
    let tokens = &tokens[..rows];
    check::indices_below(kernel, "tokens", tokens, table.rows())?;
    let chunk = workers.chunk_len(rows, dim, MIN_CHUNK_ELEMS.div_ceil(dim));
    workers.for_each_chunk(&mut out[..n], chunk, |i, out| {
        let first = i * chunk / dim;
        for (t, out) in out.chunks_exact_mut(dim).enumerate() {
            let token = tokens[first + t] as usize;
            table.dequantize_rows(token..token + 1, out);
        }
    });
    Ok(())
}

/// `out[i] = x[rows[i]]` for rows of `width` elements.
pub(crate) fn gather_rows(
    x: &[f32],
    rows: &[u32],
    n: usize,
    width: usize,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "gather_rows";
    check::positive(kernel, "width", width)?;
    check::buffer_len(kernel, "rows", rows.len(), n)?;
    check::buffer_len(
        kernel,
        "out",
        out.len(),
        check::product(kernel, &[n, width])?,
    )?;
    let rows = &rows[..n];
    check::indices_below(kernel, "rows", rows, x.len() / width)?;
    for (&r, out) in rows.iter().zip(out.chunks_exact_mut(width)) {
        let r = r as usize;
        out.copy_from_slice(&x[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// Index of the largest value of each row, the lowest among equal maxima;
/// NaNs are never the maximum (a row of NaNs gives 0).
pub(crate) fn argmax(
    workers: &Workers,
    x: &[f32],
    rows: usize,
    width: usize,
    out: &mut [u32],
) -> Result<()> {
    let kernel = "argmax";
    check::positive(kernel, "width", width)?;
    check::buffer_len(
        kernel,
        "x",
        x.len(),
        check::product(kernel, &[rows, width])?,
    )?;
    check::buffer_len(kernel, "out", out.len(), rows)?;
    let rows_per_chunk = MIN_CHUNK_ELEMS.div_ceil(width);
    workers.for_each_chunk(&mut out[..rows], rows_per_chunk, |i, out| {
        for (r, out) in out.iter_mut().enumerate() {
            let row = i * rows_per_chunk + r;
            *out = argmax_row(&x[row * width..(row + 1) * width]);
        }
    });
    Ok(())
}

/// Two vectorizable passes: the maximum in eight lanes, then the first
/// position holding it.
fn argmax_row(row: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let mut max = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for chunk in chunks {
        for i in 0..8 {
            // `v > lane` is false for NaN, so NaNs never replace a lane.
            lanes[i] = if chunk[i] > lanes[i] {
                chunk[i]
            } else {
                lanes[i]
            };
        }
    }
    for lane in lanes {
        if lane > max {
            max = lane;
        }
    }
    row.iter().position(|&v| v == max).unwrap_or(0) as u32
}
