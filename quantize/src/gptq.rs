//! GPTQ (Frantar et al., 2022): quantizes a matrix one column at a time and
//! spreads each column's rounding error over the columns not yet quantized,
//! weighted by the inverse Hessian of the layer's calibration inputs, so the
//! output error `‖X (W - Ŵ)ᵀ‖²` stays small rather than each weight's.
//!
//! Rows are independent given `H⁻¹` and run in parallel, a tile of rows per
//! task so each row of the Cholesky factor is read once per tile. Group
//! steps are set when the sweep enters the group, from the error-updated
//! weights (as GPTQ does). With act-order the columns are swept by
//! decreasing Hessian diagonal; the group steps are then fixed beforehand
//! from the original weights ("static groups"), because the storage format
//! needs every group to be consecutive columns.

use rayon::prelude::*;

use crate::grid::{QuantizedMatrix, Scheme, Step};
use crate::linalg::inverse_upper_cholesky;
use crate::{invalid, Result};

#[derive(Clone, Copy, Debug)]
pub struct GptqOptions {
    /// Added to the Hessian's diagonal, as a fraction of its mean.
    pub damp: f64,
    /// Sweep columns by decreasing Hessian diagonal.
    pub act_order: bool,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            damp: 0.01,
            act_order: false,
        }
    }
}

const TILE_ROWS: usize = 8;

/// What GPTQ needs from a site's Hessian, computed once for all the layers
/// reading it: the sweep order, the inputs that were never active, and the
/// upper Cholesky factor of the damped, permuted inverse.
pub struct HessianFactor {
    cols: usize,
    order: Vec<usize>,
    dead: Vec<bool>,
    u: Vec<f32>,
}

impl HessianFactor {
    /// From `hessian = XᵀX` (`cols × cols`); `name` is for messages.
    pub fn new(name: &str, hessian: &[f32], cols: usize, opts: GptqOptions) -> Result<Self> {
        if hessian.len() != cols * cols {
            return invalid(format!(
                "{name}: a Hessian of {} values for {cols} inputs",
                hessian.len()
            ));
        }
        let mut h: Vec<f64> = hessian.iter().map(|&v| v as f64).collect();
        // Inputs that were always zero carry no information: their weights
        // cannot matter on the calibration data, so they quantize to zero.
        let mut dead = vec![false; cols];
        for (i, d) in dead.iter_mut().enumerate() {
            if h[i * cols + i] <= 0.0 {
                h[i * cols + i] = 1.0;
                *d = true;
            }
        }
        let order: Vec<usize> = if opts.act_order {
            let mut o: Vec<usize> = (0..cols).collect();
            o.sort_by(|&a, &b| h[b * cols + b].total_cmp(&h[a * cols + a]));
            o
        } else {
            (0..cols).collect()
        };
        let u = damped_inverse_factor(&h, cols, &order, opts.damp, name)?;
        Ok(HessianFactor {
            cols,
            order,
            dead,
            u,
        })
    }

    fn act_order(&self) -> bool {
        self.order.iter().enumerate().any(|(i, &c)| i != c)
    }
}

/// Quantizes `w` (`rows × cols`) given `hessian = XᵀX` (`cols × cols`) of its inputs.
pub fn quantize(
    scheme: Scheme,
    name: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    hessian: &[f32],
    opts: GptqOptions,
) -> Result<QuantizedMatrix> {
    scheme.check_cols(name, cols)?;
    let factor = HessianFactor::new(name, hessian, cols, opts)?;
    quantize_with(scheme, name, w, rows, &factor)
}

/// Quantizes `w` (`rows × factor.cols`) with a precomputed [`HessianFactor`].
pub fn quantize_with(
    scheme: Scheme,
    name: &str,
    w: &[f32],
    rows: usize,
    factor: &HessianFactor,
) -> Result<QuantizedMatrix> {
    let cols = factor.cols;
    scheme.check_matrix(name, w.len(), rows, cols)?;
    let g = scheme.group_len(cols);
    let mut w = w.to_vec();
    for (i, _) in factor.dead.iter().enumerate().filter(|(_, d)| **d) {
        w.iter_mut().skip(i).step_by(cols).for_each(|v| *v = 0.0);
    }
    let (order, u) = (&factor.order, &factor.u);
    let static_steps = factor.act_order() || matches!(scheme, Scheme::Int8PerChannel);

    let groups = cols / g;
    let mut codes = vec![0i8; rows * cols];
    let mut steps = vec![Step::for_range(scheme, 0.0, 0.0); rows * groups];
    codes
        .par_chunks_mut(TILE_ROWS * cols)
        .zip(steps.par_chunks_mut(TILE_ROWS * groups))
        .zip(w.par_chunks(TILE_ROWS * cols))
        .for_each(|((codes, steps), w)| {
            let tile = w.len() / cols;
            if static_steps {
                for (step, values) in steps.iter_mut().zip(w.chunks_exact(g)) {
                    *step = Step::covering(scheme, values);
                }
            }
            // The tile's rows in sweep order.
            let mut wp: Vec<f32> = w
                .chunks_exact(cols)
                .flat_map(|row| order.iter().map(move |&c| row[c]))
                .collect();
            for (i, &col) in order.iter().enumerate() {
                let urow = &u[i * cols..(i + 1) * cols];
                for r in 0..tile {
                    let row = &mut wp[r * cols..(r + 1) * cols];
                    if !static_steps && i % g == 0 {
                        steps[r * groups + i / g] = Step::covering(scheme, &row[i..i + g]);
                    }
                    let step = steps[r * groups + col / g];
                    let code = step.code(row[i]);
                    codes[r * cols + col] = code as i8;
                    let err = (row[i] - step.value(code)) / urow[i];
                    row[i + 1..]
                        .iter_mut()
                        .zip(&urow[i + 1..])
                        .for_each(|(v, u)| *v -= err * u);
                }
            }
        });
    Ok(QuantizedMatrix {
        scheme,
        rows,
        cols,
        codes,
        steps,
    })
}

/// The upper Cholesky factor of the inverse of `h` permuted to `order` and
/// damped; the damping grows tenfold while the matrix is not positive definite.
fn damped_inverse_factor(
    h: &[f64],
    n: usize,
    order: &[usize],
    damp: f64,
    name: &str,
) -> Result<Vec<f32>> {
    let mean_diag = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    let mut hp = vec![0.0; n * n];
    for (i, &a) in order.iter().enumerate() {
        for (j, &b) in order.iter().enumerate() {
            hp[i * n + j] = h[a * n + b];
        }
    }
    let mut damp = damp;
    for _ in 0..4 {
        let mut m = hp.clone();
        for i in 0..n {
            m[i * n + i] += damp * mean_diag;
        }
        if let Ok(u) = inverse_upper_cholesky(&m, n) {
            return Ok(u.into_iter().map(|v| v as f32).collect());
        }
        damp *= 10.0;
    }
    invalid(format!(
        "{name}: the calibration Hessian is not positive definite even with damping {damp}"
    ))
}
