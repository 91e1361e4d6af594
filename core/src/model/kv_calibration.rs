//! `--kv-dtype auto`'s calibration pass: how much the model's next-token
//! distribution moves when one layer's keys or values are stored at a
//! cheaper dtype ([`crate::kv::plan`] turns that into a plan).
//!
//! The calibration text runs as one prompt: once with every layer at F16
//! (the reference distribution), once at INT8 everywhere (the plan's
//! baseline), then once per layer, side (keys or values) and cheaper
//! candidate with only that one changed, and once per layer with that
//! layer back at F16. A candidate's loss is the mean KL
//! divergence of the reference from its distribution over the prompt's
//! positions, less the baseline's: the whole model's output measures what a
//! layer's error costs after every later layer has amplified or damped it,
//! which a layer's own attention error cannot say. A loss can be negative:
//! INT4 and INT2 keys are quantized per channel, INT8's per token, and on
//! a layer whose keys have outlier channels (Qwen2.5's first) the cheaper
//! layout is the better one.

use super::forward::{ForwardBatch, Model};
use crate::backend::{Backend, KvCacheLayout, KvDtype};
use crate::kv::plan::{KvSensitivity, PLAN_CANDIDATES, PLAN_FLOAT};
use crate::{Error, Result};

/// Fewest calibration tokens: a few KV blocks, so INT4 keys' per-block
/// ranges are those of real blocks.
pub const MIN_CALIBRATION_TOKENS: usize = 32;

/// Forward passes [`calibrate_kv`] runs over the text for a model of
/// `layers` layers: the reference, the baseline, four per layer (keys and
/// values at two candidates) and one with the layer at F16.
pub fn calibration_passes(layers: usize) -> usize {
    2 + (2 * (PLAN_CANDIDATES.len() - 1) + 1) * layers
}

/// Which side of a layer's cache a calibration pass changes.
#[derive(Clone, Copy)]
enum Side {
    Keys,
    Values,
}

/// Calibrates on `tokens`, all in one forward pass (so callers cut them to
/// a few hundred), in [`calibration_passes`] passes.
pub fn calibrate_kv<B: Backend>(
    model: &Model<B>,
    backend: &B,
    tokens: &[u32],
    block_size: usize,
) -> Result<KvSensitivity> {
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
    let num_blocks = tokens.len().div_ceil(block_size);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let slots: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut batch = ForwardBatch::new(block_size, num_blocks);
    batch.push_sequence(tokens, 0, &slots, &table);
    batch.logit_rows = (0..tokens.len() as u32).collect();
    let vocab = model.config.vocab_size;
    let run = |kv: &mut [B::KvCache]| -> Result<Vec<f32>> {
        let logits = model.forward(backend, &batch, kv)?;
        backend.download(&logits, tokens.len() * vocab)
    };

    let shape = model.kv_shape(block_size);
    let layout = |keys, values| KvCacheLayout {
        keys,
        values,
        ..KvCacheLayout::uniform(num_blocks, block_size, shape.kv_heads, shape.head_dim, keys)
    };
    let alloc = |keys, values| -> Result<Vec<B::KvCache>> {
        (0..layers)
            .map(|_| backend.alloc_kv_cache(layout(keys, values)))
            .collect()
    };
    let reference = log_softmax_rows(&run(&mut alloc(KvDtype::F16, KvDtype::F16)?)?, vocab);
    let baseline_dtype = PLAN_CANDIDATES[0];
    let mut kv = alloc(baseline_dtype, baseline_dtype)?;
    let baseline = mean_kl(&reference, &run(&mut kv)?, vocab);

    // The loss with layer `layer` alone stored at `keys`/`values`.
    let mut loss_of = |layer: usize, keys, values| -> Result<f64> {
        let kept = std::mem::replace(
            &mut kv[layer],
            backend.alloc_kv_cache(layout(keys, values))?,
        );
        let logits = run(&mut kv);
        kv[layer] = kept;
        Ok(mean_kl(&reference, &logits?, vocab) - baseline)
    };
    let mut sensitivity = KvSensitivity {
        keys: vec![[0.0; 3]; layers],
        values: vec![[0.0; 3]; layers],
        float: vec![0.0; layers],
    };
    for layer in 0..layers {
        for side in [Side::Keys, Side::Values] {
            for (c, &dtype) in PLAN_CANDIDATES.iter().enumerate().skip(1) {
                let (keys, values) = match side {
                    Side::Keys => (dtype, baseline_dtype),
                    Side::Values => (baseline_dtype, dtype),
                };
                let loss = loss_of(layer, keys, values)?;
                match side {
                    Side::Keys => sensitivity.keys[layer][c] = loss,
                    Side::Values => sensitivity.values[layer][c] = loss,
                }
            }
        }
        sensitivity.float[layer] = loss_of(layer, PLAN_FLOAT, PLAN_FLOAT)?;
    }
    Ok(sensitivity)
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
