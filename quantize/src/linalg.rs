//! The dense linear algebra the methods need: `X·Wᵀ` on the CPU backend's
//! multi-threaded kernels, and the Cholesky factorisations GPTQ uses (f64:
//! Hessians of real activations are badly conditioned).

use rayon::prelude::*;
use tandem_core::backend::MatmulParams;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

use crate::{invalid, Result};

/// An f32 matrix uploaded once as the weight of `X·Wᵀ` products.
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    weight: <CpuBackend as Backend>::Weight,
}

/// Multiplies f32 matrices on the CPU backend.
pub struct Cpu {
    backend: CpuBackend,
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu {
            backend: CpuBackend::new(0),
        }
    }
}

impl Cpu {
    pub fn matrix(&self, w: &[f32], rows: usize, cols: usize) -> Result<Matrix> {
        debug_assert_eq!(w.len(), rows * cols);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let weight = self.backend.upload_weight(WeightView {
            format: WeightFormat::F32,
            rows,
            cols,
            data: &bytes,
        })?;
        Ok(Matrix { rows, cols, weight })
    }

    /// `x [n, w.cols] · wᵀ` → `[n, w.rows]`.
    pub fn xwt(&self, x: &[f32], n: usize, w: &Matrix) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), n * w.cols);
        let x = self.backend.upload(x)?;
        let mut out = self.backend.alloc(n * w.rows)?;
        self.backend
            .matmul(&x, &w.weight, None, MatmulParams { rows: n }, &mut out)?;
        Ok(self.backend.download(&out, n * w.rows)?)
    }

    /// `x [n, cols] · wᵀ` for a matrix used once.
    pub fn xwt_once(
        &self,
        x: &[f32],
        n: usize,
        w: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>> {
        let m = self.matrix(w, rows, cols)?;
        self.xwt(x, n, &m)
    }

    /// `Σ_r Δ_r H Δ_rᵀ` for `delta` of `rows × cols` and symmetric `h`: the
    /// squared output error `‖X Δᵀ‖²` when `h = XᵀX`.
    pub fn quadratic_error(&self, delta: &[f32], rows: usize, h: &Matrix) -> Result<f64> {
        let dh = self.xwt(delta, rows, h)?;
        Ok(dh
            .iter()
            .zip(delta)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum())
    }
}

/// Lower Cholesky factor of the symmetric positive-definite `a` (`n × n`,
/// row-major), in place. `Err` when `a` is not positive definite.
pub fn cholesky_lower(a: &mut [f64], n: usize) -> Result<()> {
    for i in 0..n {
        let (done, rest) = a.split_at_mut(i * n);
        let row_i = &mut rest[..n];
        for j in 0..=i {
            let lj = if j < i {
                &done[j * n..j * n + j]
            } else {
                &row_i[..0]
            };
            let dot: f64 = if j < i {
                row_i[..j].iter().zip(lj).map(|(x, y)| x * y).sum()
            } else {
                row_i[..j].iter().map(|x| x * x).sum()
            };
            let s = row_i[j] - dot;
            if j == i {
                if s <= 0.0 || !s.is_finite() {
                    return invalid(format!("matrix is not positive definite (pivot {i})"));
                }
                row_i[i] = s.sqrt();
            } else {
                row_i[j] = s / done[j * n + j];
            }
        }
        row_i[i + 1..].iter_mut().for_each(|v| *v = 0.0);
    }
    Ok(())
}

/// The inverse of the lower-triangular `l` (`n × n`), also lower triangular.
pub fn invert_lower(l: &[f64], n: usize) -> Vec<f64> {
    let columns: Vec<Vec<f64>> = (0..n)
        .into_par_iter()
        .map(|j| {
            // Column j of L⁻¹: forward substitution of e_j.
            let mut x = vec![0.0; n];
            x[j] = 1.0 / l[j * n + j];
            for i in j + 1..n {
                let row = &l[i * n..i * n + i];
                let s: f64 = row[j..].iter().zip(&x[j..i]).map(|(a, b)| a * b).sum();
                x[i] = -s / l[i * n + i];
            }
            x
        })
        .collect();
    let mut inv = vec![0.0; n * n];
    for (j, col) in columns.iter().enumerate() {
        for i in j..n {
            inv[i * n + j] = col[i];
        }
    }
    inv
}

/// The upper-triangular `U` with `H⁻¹ = UᵀU` (GPTQ's "Cholesky of the
/// inverse"), from one factorisation: if `J H J = M Mᵀ` with `J` the
/// reversal, then `U = J M⁻¹ J`.
pub fn inverse_upper_cholesky(h: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut m = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            m[i * n + j] = h[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    cholesky_lower(&mut m, n)?;
    let minv = invert_lower(&m, n);
    let mut u = vec![0.0; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = minv[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spd(n: usize) -> Vec<f64> {
        let b: Vec<f64> = (0..n * n)
            .map(|i| ((i * 7919 % 113) as f64 - 56.0) / 40.0)
            .collect();
        let mut h = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (0..n).map(|k| b[i * n + k] * b[j * n + k]).sum::<f64>()
                    + if i == j { 0.5 } else { 0.0 };
            }
        }
        h
    }

    #[test]
    fn upper_cholesky_of_inverse_reconstructs_the_inverse() {
        let n = 13;
        let h = spd(n);
        let u = inverse_upper_cholesky(&h, n).unwrap();
        // H · (UᵀU) = I.
        for i in 0..n {
            for j in 0..n {
                let hinv_kj = |k: usize| (0..n).map(|m| u[m * n + k] * u[m * n + j]).sum::<f64>();
                let v: f64 = (0..n).map(|k| h[i * n + k] * hinv_kj(k)).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-8, "({i},{j}) = {v}");
            }
        }
        for i in 0..n {
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0);
            }
        }
    }

    #[test]
    fn cholesky_refuses_an_indefinite_matrix() {
        let mut a = vec![1.0, 2.0, 2.0, 1.0];
        assert!(cholesky_lower(&mut a, 2).is_err());
    }

    #[test]
    fn xwt_matches_a_plain_product() {
        let cpu = Cpu::default();
        let (n, rows, cols) = (5, 7, 19);
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32 * 0.25).collect();
        let y = cpu.xwt_once(&x, n, &w, rows, cols).unwrap();
        for t in 0..n {
            for r in 0..rows {
                let want: f32 = (0..cols).map(|c| x[t * cols + c] * w[r * cols + c]).sum();
                assert!((y[t * rows + r] - want).abs() < 1e-3);
            }
        }
    }
}
