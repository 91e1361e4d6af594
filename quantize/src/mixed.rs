//! Mixed precision: how much each layer's quantization hurts, and the
//! per-layer precision that hurts least within a bits-per-weight budget.
//!
//! Sensitivity of layer `l` at a precision: the mean KL divergence
//! `KL(p_float ‖ p_q)` of the next-token distributions over the calibration
//! windows when only layer `l`'s linears are quantized. The float run's
//! residual stream at each layer's input is kept, so each measurement runs
//! only the layers from `l` on. Losses are treated as additive across
//! layers, and the plan is an exact knapsack over the layers (costs rounded
//! up to 1/8192 of the budget, so the budget is never exceeded).

use rayon::prelude::*;

use crate::dense::{linear_name, DenseModel, LINEARS};
use crate::{invalid, Result};

/// Per-layer storage precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    F16,
    Int8,
    Int4,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F16 => "F16",
            Precision::Int8 => "INT8",
            Precision::Int4 => "INT4",
        }
    }
}

/// A layer's linears in quantized form, as the f32 values the kernels compute.
pub type LayerWeights = Vec<(String, Vec<f32>)>;

/// `KL(p ‖ q)` averaged over rows of `vocab` logits.
fn mean_kl(p_logits: &[f32], q_logits: &[f32], vocab: usize) -> f64 {
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z = row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        row.iter().map(|&v| v as f64 - z).collect()
    };
    let rows = p_logits.len() / vocab;
    let total: f64 = p_logits
        .par_chunks_exact(vocab)
        .zip(q_logits.par_chunks_exact(vocab))
        .map(|(p, q)| {
            let (lp, lq) = (log_softmax(p), log_softmax(q));
            lp.iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>()
        })
        .sum();
    total / rows as f64
}

/// For each layer, the KL divergence with only that layer replaced by each
/// of `candidates[l]` (one entry per candidate precision).
pub fn sensitivities(
    model: &mut DenseModel,
    windows: &[Vec<u32>],
    candidates: &[Vec<LayerWeights>],
    mut progress: impl FnMut(usize),
) -> Result<Vec<Vec<f64>>> {
    let layers = model.config.num_layers;
    let vocab = model.config.vocab_size;
    let mut out: Vec<Vec<f64>> = candidates.iter().map(|c| vec![0.0; c.len()]).collect();
    for tokens in windows {
        let n = tokens.len();
        let mut h = model.embed(tokens)?;
        let mut inputs = Vec::with_capacity(layers);
        for l in 0..layers {
            inputs.push(h.clone());
            model.layer(l, &mut h, n, &mut |_, _| {})?;
        }
        let reference = model.logits(&h, n)?;
        for l in 0..layers {
            let original: LayerWeights = LINEARS
                .iter()
                .map(|s| {
                    let name = linear_name(l, s);
                    model.tensor(&name).map(|t| (name, t.data.clone()))
                })
                .collect::<Result<_>>()?;
            for (k, weights) in candidates[l].iter().enumerate() {
                for (name, w) in weights {
                    model.set(name, w.clone())?;
                }
                let mut h = inputs[l].clone();
                for m in l..layers {
                    model.layer(m, &mut h, n, &mut |_, _| {})?;
                }
                let logits = model.logits(&h, n)?;
                out[l][k] += mean_kl(&reference, &logits, vocab) / windows.len() as f64;
            }
            for (name, w) in original {
                model.set(&name, w)?;
            }
            progress(l);
        }
    }
    Ok(out)
}

/// One layer's options: precision, storage bits, and the loss it costs.
#[derive(Clone, Debug)]
pub struct Choice {
    pub precision: Precision,
    pub bits: f64,
    pub loss: f64,
}

/// Picks one choice per layer minimising the summed loss with total bits at
/// most `budget_bits` per weight; `weights[l]` is layer `l`'s weight count.
pub fn plan(choices: &[Vec<Choice>], weights: &[usize], budget_bits: f64) -> Result<Vec<usize>> {
    const UNITS: usize = 8192;
    let total_weights: usize = weights.iter().sum();
    let budget = budget_bits * total_weights as f64;
    let cheapest: f64 = choices
        .iter()
        .zip(weights)
        .map(|(c, &w)| c.iter().map(|c| c.bits).fold(f64::INFINITY, f64::min) * w as f64)
        .sum();
    if cheapest > budget {
        return invalid(format!(
            "a budget of {budget_bits} bits per weight is below the smallest plan ({:.3} bits per weight)",
            cheapest / total_weights as f64
        ));
    }
    let unit = budget / UNITS as f64;
    let cost = |c: &Choice, w: usize| (c.bits * w as f64 / unit).ceil() as usize;
    // best[u]: least loss using at most u units over the layers seen so far.
    let mut best = vec![0.0f64; UNITS + 1];
    let mut picks: Vec<Vec<Option<usize>>> = Vec::with_capacity(choices.len());
    for (layer, &w) in choices.iter().zip(weights) {
        let mut next = vec![f64::INFINITY; UNITS + 1];
        let mut pick = vec![None; UNITS + 1];
        for u in 0..=UNITS {
            for (k, c) in layer.iter().enumerate() {
                let cu = cost(c, w);
                if cu <= u && best[u - cu] + c.loss < next[u] {
                    next[u] = best[u - cu] + c.loss;
                    pick[u] = Some(k);
                }
            }
        }
        best = next;
        picks.push(pick);
    }
    // Walk back from the full budget.
    let mut u = UNITS;
    let mut chosen = vec![0; choices.len()];
    for l in (0..choices.len()).rev() {
        let k =
            match picks[l][u] {
                Some(k) => k,
                None => return invalid(
                    "no plan fits the budget once sizes are rounded; raise --budget-bits slightly",
                ),
            };
        chosen[l] = k;
        u -= cost(&choices[l][k], weights[l]);
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choices(loss4: f64, loss8: f64) -> Vec<Choice> {
        vec![
            Choice {
                precision: Precision::F16,
                bits: 16.0,
                loss: 0.0,
            },
            Choice {
                precision: Precision::Int8,
                bits: 8.0,
                loss: loss8,
            },
            Choice {
                precision: Precision::Int4,
                bits: 4.0,
                loss: loss4,
            },
        ]
    }

    #[test]
    fn budget_goes_to_the_most_sensitive_layers() {
        let layers = vec![
            choices(1.0, 0.01),
            choices(9.0, 0.1),
            choices(0.5, 0.0),
            choices(3.0, 0.02),
        ];
        // 6.1 bits/weight over 4 equal layers: two layers can be INT8.
        let picked = plan(&layers, &[100; 4], 6.1).unwrap();
        let p: Vec<Precision> = picked
            .iter()
            .zip(&layers)
            .map(|(&k, c)| c[k].precision)
            .collect();
        assert_eq!(
            p,
            [
                Precision::Int4,
                Precision::Int8,
                Precision::Int4,
                Precision::Int8
            ]
        );
        // Enough for everything in F16.
        let all = plan(&layers, &[100; 4], 16.0).unwrap();
        assert!(all
            .iter()
            .zip(&layers)
            .all(|(&k, c)| c[k].precision == Precision::F16));
    }

    #[test]
    fn budget_below_the_smallest_plan_is_refused() {
        let e = plan(&[choices(1.0, 0.1)], &[10], 3.5)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("below the smallest plan (4.000 bits per weight)"),
            "{e}"
        );
    }

    #[test]
    fn kl_of_a_distribution_with_itself_is_zero() {
        let p = [0.5f32, -1.0, 2.0, 0.0, 1.0, 1.0];
        assert!(mean_kl(&p, &p, 3).abs() < 1e-12);
        assert!(mean_kl(&p, &[0.0; 6], 3) > 0.0);
    }
}
