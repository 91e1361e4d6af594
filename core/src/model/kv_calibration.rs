//! `--kv-dtype auto`'s calibration pass: how much the model's next-token
//! distribution moves when one layer's keys and values are stored at the
//! quantized dtypes, every other layer staying at F16
//! ([`crate::kv::plan`] turns the losses into a plan).
//!
//! The calibration text runs as one prompt: once with every layer at F16
//! (the reference distribution), then once per layer and quantized pair
//! with only that layer quantized: INT8 keys and values, keys at INT4 and
//! INT2 with INT8 values, values at INT4 and INT2 with INT8 keys. A pair's
//! loss is the mean KL divergence of the reference from its distribution
//! over the prompt's positions: the whole model's output measures what a
//! layer's error costs after every later layer has amplified or damped it,
//! which a layer's own attention error cannot say. Keys and values add:
//! `(k, v)` costs `loss(k, int8) + loss(int8, v) - loss(int8, int8)`.
//!
//! Each layer is measured alone against F16 because small errors add up
//! that way: the KL grows with the square of the output's error, so one
//! layer's change measured on top of a quantized base also counts its
//! product with every other layer's error, a term of either sign as large
//! as the change itself (around uniform INT4 on SmolLM2, one layer at INT8
//! keys measured -0.002 nats of a total 0.020, and the plan they added up
//! to measured no better than the base). Against an INT8 base, Qwen2.5's
//! plan at INT4's budget lost 1.6% perplexity where uniform INT4 loses
//! 0.2%: INT8's per-token keys are the lossy format there.
//!
//! The sum is still a model, so the uniform pairs within the budget are
//! measured too, and the planner's pick is kept only where it measures
//! better than the best of them: a calibrated plan is never worse on the
//! calibration text than a uniform plan it could have been.

use super::forward::{ForwardBatch, Model};
use crate::backend::Backend;
use crate::kv::plan::{
    check_kv_budget, choose_plan, KvPlan, KvSensitivity, LayerKvDtypes, PLAN_CANDIDATES, PLAN_FLOAT,
};
use crate::kv::KvShape;
use crate::{Error, Result};

/// Fewest calibration tokens: a few KV blocks, so INT4 keys' per-block
/// ranges are those of real blocks.
pub const MIN_CALIBRATION_TOKENS: usize = 32;

/// What [`calibrate_kv`] measured and chose. KLs are mean KL divergences
/// (nats per position) of the F16 cache's distribution from the plan's.
#[derive(Clone, Debug)]
pub struct KvCalibration {
    /// Per layer, the losses of its pairs alone.
    pub sensitivity: KvSensitivity,
    /// Every uniform quantized pair within the budget with its KL.
    pub uniform: Vec<(LayerKvDtypes, f64)>,
    /// The pair of least KL among them.
    pub base: LayerKvDtypes,
    pub base_kl: f64,
    /// The planner's pick from `sensitivity`, and its measured KL.
    pub chosen: KvPlan,
    pub chosen_kl: f64,
    /// `chosen` if it beats the base, else the uniform base plan.
    pub plan: KvPlan,
    /// Forward passes run.
    pub passes: usize,
}

/// The uniform quantized pairs within `bits_per_element` on `shape` over
/// `layers` layers, in [`PLAN_CANDIDATES`] order (keys first).
pub fn uniform_pairs_within(
    shape: KvShape,
    layers: usize,
    bits_per_element: f64,
) -> Vec<LayerKvDtypes> {
    let mut pairs = Vec::new();
    for &keys in &PLAN_CANDIDATES {
        for &values in &PLAN_CANDIDATES {
            let pair = LayerKvDtypes { keys, values };
            if KvPlan::uniform_pair(pair, layers).fits(shape, bits_per_element) {
                pairs.push(pair);
            }
        }
    }
    pairs
}

/// The most forward passes [`calibrate_kv`] runs for a model of `layers`
/// layers: the reference, five per layer (INT8, keys and values at the
/// two other candidates), the uniform pairs within the budget and the
/// planner's pick.
pub fn calibration_passes(shape: KvShape, layers: usize, bits_per_element: f64) -> usize {
    let per_layer = 2 * (PLAN_CANDIDATES.len() - 1) + 1;
    2 + per_layer * layers + uniform_pairs_within(shape, layers, bits_per_element).len()
}

/// Calibrates a plan of at most `bits_per_element` on `tokens`, all in one
/// forward pass (so callers cut them to a few hundred), in at most
/// [`calibration_passes`] passes.
pub fn calibrate_kv<B: Backend>(
    model: &Model<B>,
    backend: &B,
    tokens: &[u32],
    block_size: usize,
    bits_per_element: f64,
) -> Result<KvCalibration> {
    if tokens.len() < MIN_CALIBRATION_TOKENS {
        return Err(Error::InvalidRequest(format!(
            "KV calibration needs at least {MIN_CALIBRATION_TOKENS} tokens of text, got {}",
            tokens.len()
        )));
    }
    if model.placement.is_some() {
        return Err(Error::Unsupported(
            "KV calibration (--kv-dtype auto) on a split model".into(),
        ));
    }
    let layers = model.config.num_layers;
    let shape = model.kv_shape(block_size);
    check_kv_budget(shape, layers, bits_per_element)?;
    let num_blocks = tokens.len().div_ceil(block_size);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let slots: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut batch = ForwardBatch::new(block_size, num_blocks);
    batch.push_sequence(tokens, 0, &slots, &table);
    batch.logit_rows = (0..tokens.len() as u32).collect();
    let vocab = model.config.vocab_size;
    let mut passes = 0;
    let mut run = |kv: &mut [B::KvCache]| -> Result<Vec<f32>> {
        passes += 1;
        let logits = model.forward(backend, &batch, kv)?;
        backend.download(&logits, tokens.len() * vocab)
    };
    let alloc_layer = |d: LayerKvDtypes| {
        backend.alloc_kv_cache(KvPlan::uniform_pair(d, 1).layout(0, shape, num_blocks))
    };
    let alloc = |plan: &KvPlan| -> Result<Vec<B::KvCache>> {
        (0..layers)
            .map(|l| backend.alloc_kv_cache(plan.layout(l, shape, num_blocks)))
            .collect()
    };
    let mut kv = alloc(&KvPlan::uniform(PLAN_FLOAT, layers))?;
    let reference = log_softmax_rows(&run(&mut kv)?, vocab);
    let mut kl_of =
        |kv: &mut [B::KvCache]| -> Result<f64> { Ok(mean_kl(&reference, &run(kv)?, vocab)) };

    let int8 = PLAN_CANDIDATES[0];
    let mut sensitivity = KvSensitivity {
        keys: vec![[0.0; 3]; layers],
        values: vec![[0.0; 3]; layers],
        float: vec![0.0; layers],
    };
    for layer in 0..layers {
        // The KL with layer `layer` alone at `keys`/`values`.
        let mut alone = |keys, values| -> Result<f64> {
            let kept =
                std::mem::replace(&mut kv[layer], alloc_layer(LayerKvDtypes { keys, values })?);
            let kl = kl_of(&mut kv);
            kv[layer] = kept;
            kl
        };
        let both = alone(int8, int8)?;
        sensitivity.keys[layer][0] = both;
        for (c, &dtype) in PLAN_CANDIDATES.iter().enumerate().skip(1) {
            sensitivity.keys[layer][c] = alone(dtype, int8)?;
            sensitivity.values[layer][c] = alone(int8, dtype)? - both;
        }
    }

    let mut uniform = Vec::new();
    for pair in uniform_pairs_within(shape, layers, bits_per_element) {
        uniform.push((
            pair,
            kl_of(&mut alloc(&KvPlan::uniform_pair(pair, layers))?)?,
        ));
    }
    let chosen = choose_plan(&sensitivity, shape, bits_per_element)?;
    let measured = uniform
        .iter()
        .find(|(pair, _)| KvPlan::uniform_pair(*pair, layers) == chosen);
    let chosen_kl = match measured {
        Some(&(_, kl)) => kl,
        None => kl_of(&mut alloc(&chosen)?)?,
    };
    let (base, base_kl) = uniform
        .iter()
        .copied()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("a budget at or above the floor admits uniform INT2");
    let plan = if chosen_kl <= base_kl {
        chosen.clone()
    } else {
        KvPlan::uniform_pair(base, layers)
    };
    Ok(KvCalibration {
        sensitivity,
        uniform,
        base,
        base_kl,
        chosen,
        chosen_kl,
        plan,
        passes,
    })
}

/// Each `vocab`-wide row of logits as log-probabilities, in f64.
fn log_softmax_rows(logits: &[f32], vocab: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks_exact(vocab) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        let log_z = max + sum.ln();
        out.extend(row.iter().map(|&x| x as f64 - log_z));
    }
    out
}

/// Mean over rows of KL(reference ‖ softmax(logits)).
fn mean_kl(reference: &[f64], logits: &[f32], vocab: usize) -> f64 {
    let logq = log_softmax_rows(logits, vocab);
    let rows = reference.len() / vocab;
    let total: f64 = reference
        .chunks_exact(vocab)
        .zip(logq.chunks_exact(vocab))
        .map(|(p, q)| {
            p.iter()
                .zip(q)
                .map(|(&lp, &lq)| lp.exp() * (lp - lq))
                .sum::<f64>()
        })
        .sum();
    total / rows.max(1) as f64
}
