//! The exact-distribution test of speculative sampling: the joint
//! distribution of a target's first tokens after a prompt, computed from its
//! logits, and a chi-square test of sampled sequences against it.

use std::collections::BTreeMap;

use tandem_core::engine::Engine;
use tandem_core::sched::{Sampler, SamplingParams};
use tandem_cpu::CpuBackend;

/// Upper critical value of chi-square with `df` degrees of freedom at
/// significance 1e-4 (z = 3.719), by the Wilson–Hilferty approximation.
pub fn chi_square_critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.719;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// The exact joint distribution of the first `n` sampled tokens after `prompt`.
pub fn exact_joint(
    engine: &mut Engine<CpuBackend>,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
) -> BTreeMap<Vec<u32>, f64> {
    let vocab = engine.model().config.vocab_size;
    let sampler = Sampler::new(params.clone());
    let mut joint = BTreeMap::from([(Vec::new(), 1.0)]);
    for _ in 0..n {
        let mut next = BTreeMap::new();
        for (prefix, p) in joint {
            let mut context = prompt.to_vec();
            context.extend(&prefix);
            let last = context.len() - 1;
            let mut logits = engine.score(&context, last).unwrap()[..vocab].to_vec();
            for (t, q) in sampler.distribution(&mut logits, &context) {
                let mut seq: Vec<u32> = prefix.clone();
                seq.push(t);
                next.insert(seq, p * q);
            }
        }
        joint = next;
    }
    joint
}

/// Asserts that `counts` (sampled sequences, `samples` in all) are drawn
/// from `exact`: no impossible sequence, and chi-square below the 1e-4
/// critical value, cells expected fewer than 5 times pooled into one.
pub fn assert_sampled_as(
    what: &str,
    exact: &BTreeMap<Vec<u32>, f64>,
    mut counts: BTreeMap<Vec<u32>, f64>,
    samples: usize,
) {
    let n = samples as f64;
    let (mut chi2, mut cells, mut pooled_obs, mut pooled_exp) = (0.0, 0usize, 0.0, 0.0);
    for (seq, &p) in exact {
        let obs = counts.remove(seq).unwrap_or(0.0);
        if n * p < 5.0 {
            pooled_obs += obs;
            pooled_exp += n * p;
        } else {
            chi2 += (obs - n * p).powi(2) / (n * p);
            cells += 1;
        }
    }
    assert!(counts.is_empty(), "{what}: impossible sequences {counts:?}");
    if pooled_exp > 0.0 {
        chi2 += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1.0);
        cells += 1;
    }
    let critical = chi_square_critical(cells - 1);
    eprintln!("{what}: chi-square {chi2:.1} over {cells} cells (critical {critical:.1})");
    assert!(
        chi2 < critical,
        "{what}: chi-square {chi2:.1} over {cells} cells exceeds {critical:.1}"
    );
}
