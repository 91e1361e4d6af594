//! The methods on tiny random layers: GPTQ and AWQ must beat round to
//! nearest on the output error over their calibration inputs, SmoothQuant
//! must beat plain W8A8, and smoothing must leave the float model's function
//! unchanged.

use tandem_core::sched::Rng;
use tandem_quantize::awq::{self, Reader};
use tandem_quantize::gptq::{self, GptqOptions};
use tandem_quantize::grid::Scheme;
use tandem_quantize::linalg::Cpu;
use tandem_quantize::{rtn, smoothquant};

fn normal(rng: &mut Rng) -> f32 {
    // Irwin–Hall: close enough to a Gaussian for test data.
    (0..12).map(|_| rng.next_f64() as f32).sum::<f32>() - 6.0
}

/// A layer and inputs shaped like a transformer's: channels of very
/// different magnitudes (a few outliers) and correlated through a mixing.
struct Layer {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
    n: usize,
    x: Vec<f32>,
}

impl Layer {
    fn random(seed: u64, rows: usize, cols: usize, n: usize) -> Layer {
        let mut rng = Rng::new(seed);
        let w: Vec<f32> = (0..rows * cols).map(|_| normal(&mut rng) * 0.05).collect();
        let mix: Vec<f32> = (0..cols * cols)
            .map(|i| {
                if i % (cols + 1) == 0 {
                    1.0
                } else {
                    normal(&mut rng) * 0.15
                }
            })
            .collect();
        let magnitude: Vec<f32> = (0..cols)
            .map(|c| {
                if c % 37 == 5 {
                    12.0
                } else {
                    0.5 + rng.next_f64() as f32
                }
            })
            .collect();
        let mut x = vec![0.0; n * cols];
        for t in 0..n {
            let z: Vec<f32> = (0..cols).map(|_| normal(&mut rng)).collect();
            for c in 0..cols {
                let v: f32 = (0..cols).map(|k| z[k] * mix[c * cols + k]).sum();
                x[t * cols + c] = v * magnitude[c];
            }
        }
        Layer {
            rows,
            cols,
            w,
            n,
            x,
        }
    }

    fn hessian(&self) -> Vec<f32> {
        let c = self.cols;
        let mut h = vec![0.0; c * c];
        for row in self.x.chunks_exact(c) {
            for i in 0..c {
                for j in 0..c {
                    h[i * c + j] += row[i] * row[j];
                }
            }
        }
        h
    }

    /// `‖X (W - Ŵ)ᵀ‖²` on the calibration inputs.
    fn output_error(&self, w_hat: &[f32]) -> f64 {
        let c = self.cols;
        let mut e = 0.0;
        for x in self.x.chunks_exact(c) {
            for r in 0..self.rows {
                let d: f64 = (0..c)
                    .map(|k| x[k] as f64 * (self.w[r * c + k] - w_hat[r * c + k]) as f64)
                    .sum();
                e += d * d;
            }
        }
        e
    }
}

#[test]
fn gptq_output_error_is_below_rtn() {
    let layer = Layer::random(1, 24, 160, 400);
    let h = layer.hessian();
    for (bits, group) in [(4, 32), (3, 32), (8, 0)] {
        let scheme = Scheme::new(bits, group).unwrap();
        let rtn = rtn::quantize(scheme, "w", &layer.w, layer.rows, layer.cols).unwrap();
        let rtn_err = layer.output_error(&rtn.dequantize());
        for act_order in [false, true] {
            let opts = GptqOptions {
                act_order,
                ..Default::default()
            };
            let q =
                gptq::quantize(scheme, "w", &layer.w, layer.rows, layer.cols, &h, opts).unwrap();
            let err = layer.output_error(&q.dequantize());
            eprintln!("{scheme:?} act_order={act_order}: GPTQ {err:.4} vs RTN {rtn_err:.4}");
            assert!(
                err < 0.8 * rtn_err,
                "{scheme:?} act_order={act_order}: GPTQ {err} vs RTN {rtn_err}"
            );
        }
    }
}

#[test]
fn gptq_zeroes_dead_inputs_and_keeps_codes_in_range() {
    let mut layer = Layer::random(2, 8, 64, 100);
    for row in layer.x.chunks_exact_mut(64) {
        row[3] = 0.0;
    }
    let h = layer.hessian();
    let scheme = Scheme::new(4, 32).unwrap();
    let q = gptq::quantize(scheme, "w", &layer.w, 8, 64, &h, GptqOptions::default()).unwrap();
    assert!(q.codes.iter().all(|&c| (0..=15).contains(&c)));
    let d = q.dequantize();
    for r in 0..8 {
        assert!(d[r * 64 + 3].abs() <= q.step(r, 3).scale * 0.5 + 1e-3);
    }
}

#[test]
fn awq_output_error_is_below_rtn() {
    let layer = Layer::random(3, 24, 160, 400);
    let h = layer.hessian();
    let scheme = Scheme::new(4, 32).unwrap();
    let mean_abs: Vec<f32> = (0..layer.cols)
        .map(|c| {
            layer
                .x
                .iter()
                .skip(c)
                .step_by(layer.cols)
                .map(|v| v.abs())
                .sum::<f32>()
                / layer.n as f32
        })
        .collect();
    let identity: Vec<usize> = (0..layer.cols).collect();
    let cpu = Cpu::default();
    let reader = Reader {
        name: "w",
        weights: &layer.w,
        rows: layer.rows,
    };
    let found = awq::search(&cpu, scheme, &[reader], &h, &mean_abs, &identity, 20).unwrap();
    // The model's weights become Q(W·diag(s))·diag(1/s) once 1/s is folded into the input.
    let scaled = tandem_quantize::fold::scale_columns(&layer.w, layer.cols, &found.factors);
    let q = rtn::quantize(scheme, "w", &scaled, layer.rows, layer.cols)
        .unwrap()
        .dequantize();
    let inverse: Vec<f32> = found.factors.iter().map(|s| 1.0 / s).collect();
    let awq_w = tandem_quantize::fold::scale_columns(&q, layer.cols, &inverse);
    let err = layer.output_error(&awq_w);
    let rtn_err = layer.output_error(
        &rtn::quantize(scheme, "w", &layer.w, layer.rows, layer.cols)
            .unwrap()
            .dequantize(),
    );
    eprintln!("AWQ alpha {}: {err:.4} vs RTN {rtn_err:.4}", found.alpha);
    assert!(found.alpha > 0.0);
    assert!(err < 0.9 * rtn_err, "AWQ {err} vs RTN {rtn_err}");
    // The search's own figures are the same errors, computed from the Hessian.
    assert!(
        (found.error - err).abs() < 1e-2 * err,
        "{} vs {err}",
        found.error
    );
    assert!((found.rtn_error - rtn_err).abs() < 1e-2 * rtn_err);
}

#[test]
fn smoothquant_beats_plain_w8a8_on_outlier_channels() {
    let layer = Layer::random(4, 32, 160, 256);
    let act_max: Vec<f32> = (0..layer.cols)
        .map(|c| {
            layer
                .x
                .iter()
                .skip(c)
                .step_by(layer.cols)
                .fold(0.0f32, |a, v| a.max(v.abs()))
        })
        .collect();
    let identity: Vec<usize> = (0..layer.cols).collect();
    let reader = Reader {
        name: "w",
        weights: &layer.w,
        rows: layer.rows,
    };
    let s = smoothquant::search(
        &Cpu::default(),
        &[reader],
        &layer.x,
        layer.n,
        &act_max,
        &identity,
    )
    .unwrap();
    eprintln!(
        "SmoothQuant alpha {:?}: {} vs {}",
        s.alpha, s.error, s.unsmoothed_error
    );
    assert!(s.alpha.is_some());
    assert!(s.error < 0.8 * s.unsmoothed_error);
}
