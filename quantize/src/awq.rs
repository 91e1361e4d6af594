//! AWQ (Lin et al., 2023): channels whose inputs are large matter most, so
//! scale those weight columns up before rounding (`W·diag(s)`, with `s`
//! folded into the previous operation as `1/s`) and they lose less to the
//! grid. `s = mean|x|^α`, with `α` searched on a grid for each site to
//! minimise the output error of all the layers reading it,
//! `Σ ‖X (Ŵ - W)ᵀ‖²`, computed from the calibration Hessian `XᵀX`.
//! `α = 0` is plain round to nearest, so the search never does worse than
//! RTN on the calibration data.

use crate::fold::scale_columns;
use crate::grid::Scheme;
use crate::linalg::Cpu;
use crate::{rtn, Result};

/// One layer reading the site: its name, weights and rows.
pub struct Reader<'a> {
    pub name: &'a str,
    pub weights: &'a [f32],
    pub rows: usize,
}

/// The outcome of a scale search.
#[derive(Clone, Debug)]
pub struct Scales {
    /// One per factor (see [`crate::fold`]).
    pub factors: Vec<f32>,
    pub alpha: f32,
    /// Output error with these scales, and with none (RTN).
    pub error: f64,
    pub rtn_error: f64,
}

/// Searches `α` over `grid` steps in `[0, 1)`. `mean_abs` has one entry per
/// factor; `factor_of[c]` is input column `c`'s factor.
pub fn search(
    cpu: &Cpu,
    scheme: Scheme,
    readers: &[Reader<'_>],
    hessian: &[f32],
    mean_abs: &[f32],
    factor_of: &[usize],
    grid: usize,
) -> Result<Scales> {
    let cols = factor_of.len();
    let h = cpu.matrix(hessian, cols, cols)?;
    let mut best: Option<Scales> = None;
    for k in 0..grid.max(1) {
        let alpha = k as f32 / grid.max(1) as f32;
        let mut factors: Vec<f32> = mean_abs.iter().map(|m| m.max(1e-4).powf(alpha)).collect();
        // Centre the factors on 1 so the scaled weights keep their magnitude.
        let (lo, hi) = factors
            .iter()
            .fold((f32::INFINITY, 0.0f32), |(a, b), &s| (a.min(s), b.max(s)));
        let centre = (lo * hi).sqrt();
        factors.iter_mut().for_each(|s| *s /= centre);
        let s: Vec<f32> = factor_of.iter().map(|&f| factors[f]).collect();
        let mut error = 0.0;
        for r in readers {
            let scaled = scale_columns(r.weights, cols, &s);
            let q = rtn::quantize(scheme, r.name, &scaled, r.rows, cols)?.dequantize();
            let mut delta = q;
            for (row, w) in delta
                .chunks_exact_mut(cols)
                .zip(r.weights.chunks_exact(cols))
            {
                for ((d, w), s) in row.iter_mut().zip(w).zip(&s) {
                    *d = *d / s - w;
                }
            }
            error += cpu.quadratic_error(&delta, r.rows, &h)?;
        }
        let rtn_error = best.as_ref().map_or(error, |b| b.rtn_error);
        if best.as_ref().is_none_or(|b| error < b.error) {
            best = Some(Scales {
                factors,
                alpha,
                error,
                rtn_error,
            });
        }
    }
    Ok(best.expect("the grid has at least one point"))
}
