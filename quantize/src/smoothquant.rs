//! SmoothQuant (Xiao et al., 2022): activations have a few channels far
//! larger than the rest, which per-token INT8 cannot represent well; weights
//! do not. Dividing input channel `c` by `s_c = max|x_c|^α / max|w_c|^(1-α)`
//! and multiplying the weight columns by it ([`crate::fold`]) moves the
//! difficulty from activations to weights. `α` is chosen per site on the
//! calibration samples by simulating the W8A8 product (per-token INT8
//! activations × per-channel INT8 weights) and keeping the one with the
//! least output error; "no smoothing" is a candidate too.

use tandem_core::quant::quantize_activation_row_i8;

use crate::fold::scale_columns;
use crate::grid::Scheme;
use crate::linalg::Cpu;
use crate::{rtn, Result};

pub use crate::awq::Reader;

/// The `α` values tried.
pub const ALPHAS: [f32; 8] = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9];

/// Each row of `x` rounded to symmetric INT8 with its own scale `max|x|/127`,
/// as the W8A8 kernel quantizes activations.
pub fn fake_quantize_rows(x: &[f32], width: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    let mut q = vec![0i8; width];
    for row in out.chunks_exact_mut(width) {
        let scale = quantize_activation_row_i8(row, &mut q);
        row.iter_mut()
            .zip(&q)
            .for_each(|(v, &q)| *v = scale * q as f32);
    }
    out
}

/// `s = max|x|^α / max|w|^(1-α)` per factor (both maxima per factor).
pub fn factors(act_max: &[f32], weight_max: &[f32], alpha: f32) -> Vec<f32> {
    act_max
        .iter()
        .zip(weight_max)
        .map(|(&a, &w)| {
            let s = a.max(1e-5).powf(alpha) / w.max(1e-5).powf(1.0 - alpha);
            s.clamp(1e-5, 1e5)
        })
        .collect()
}

/// The chosen smoothing for one site.
#[derive(Clone, Debug)]
pub struct Smoothing {
    /// `None`: the site is left as it is.
    pub alpha: Option<f32>,
    pub factors: Vec<f32>,
    pub error: f64,
    pub unsmoothed_error: f64,
}

/// Squared error of the simulated W8A8 outputs of `readers` on `samples`
/// (`n` rows) with input channels divided by `s`.
fn w8a8_error(
    cpu: &Cpu,
    readers: &[Reader<'_>],
    samples: &[f32],
    n: usize,
    s: &[f32],
) -> Result<f64> {
    let cols = s.len();
    let mut xs = samples.to_vec();
    for row in xs.chunks_exact_mut(cols) {
        row.iter_mut().zip(s).for_each(|(v, s)| *v /= s);
    }
    let xq = fake_quantize_rows(&xs, cols);
    let mut error = 0.0;
    for r in readers {
        let exact = cpu.xwt_once(samples, n, r.weights, r.rows, cols)?;
        let scaled = scale_columns(r.weights, cols, s);
        let wq = rtn::quantize(Scheme::Int8PerChannel, r.name, &scaled, r.rows, cols)?.dequantize();
        let approx = cpu.xwt_once(&xq, n, &wq, r.rows, cols)?;
        error += exact
            .iter()
            .zip(&approx)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>();
    }
    Ok(error)
}

/// Picks `α` for one site. `act_max` has one entry per factor, `factor_of[c]`
/// is input column `c`'s factor; `samples` are `n` input rows.
pub fn search(
    cpu: &Cpu,
    readers: &[Reader<'_>],
    samples: &[f32],
    n: usize,
    act_max: &[f32],
    factor_of: &[usize],
) -> Result<Smoothing> {
    let cols = factor_of.len();
    let mut weight_max = vec![0.0f32; act_max.len()];
    for r in readers {
        for row in r.weights.chunks_exact(cols) {
            for (c, v) in row.iter().enumerate() {
                let m = &mut weight_max[factor_of[c]];
                *m = m.max(v.abs());
            }
        }
    }
    let ones = vec![1.0; act_max.len()];
    let unsmoothed_error = w8a8_error(cpu, readers, samples, n, &vec![1.0; cols])?;
    let mut best = Smoothing {
        alpha: None,
        factors: ones,
        error: unsmoothed_error,
        unsmoothed_error,
    };
    for alpha in ALPHAS {
        let f = factors(act_max, &weight_max, alpha);
        let s: Vec<f32> = factor_of.iter().map(|&i| f[i]).collect();
        let error = w8a8_error(cpu, readers, samples, n, &s)?;
        if error < best.error {
            best = Smoothing {
                alpha: Some(alpha),
                factors: f,
                error,
                unsmoothed_error,
            };
        }
    }
    Ok(best)
}
