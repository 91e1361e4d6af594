//! Per-channel smoothing factors moved across a layer boundary: the input of
//! a site is divided by `s` (folded into the operation that produces it) and
//! the columns of the layers reading it are multiplied by `s`, so the float
//! model computes the same function while the weights take a shape that
//! quantizes better (AWQ) or the activations lose their outliers (SmoothQuant).
//!
//! Where `1/s` goes, per site: the attention / FFN RMSNorm weight (AttnIn,
//! FfnIn), the rows of `ffn_up` (FfnAct: `silu(gate) * up` is linear in up),
//! the rows of `attn_v` (AttnOut: each head's output is a mix of its V rows).
//! With grouped-query attention several heads read one V head, so an
//! AttnOut factor is shared by the same channel of every head in a group: an
//! AttnOut site has `kv_dim` factors, not `q_dim`.

use tandem_core::model::ModelConfig;

use crate::dense::{linear_name, DenseModel, Site};
use crate::{invalid, Result};

/// How many independent factors a site has.
pub fn factor_count(c: &ModelConfig, site: Site) -> usize {
    match site {
        Site::AttnIn | Site::FfnIn => c.hidden_size,
        Site::AttnOut => c.kv_dim(),
        Site::FfnAct => c.intermediate_size,
    }
}

/// The factor that input channel `channel` of `site` uses.
pub fn factor_of(c: &ModelConfig, site: Site, channel: usize) -> usize {
    match site {
        Site::AttnOut => {
            let head = channel / c.head_dim;
            let group = c.num_heads / c.num_kv_heads;
            (head / group) * c.head_dim + channel % c.head_dim
        }
        _ => channel,
    }
}

/// One factor per input channel.
pub fn expand(c: &ModelConfig, site: Site, factors: &[f32], width: usize) -> Vec<f32> {
    (0..width)
        .map(|ch| factors[factor_of(c, site, ch)])
        .collect()
}

/// Per-channel values reduced to one per factor with `combine` (e.g. max).
pub fn reduce(
    c: &ModelConfig,
    site: Site,
    per_channel: &[f32],
    combine: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let mut out: Vec<Option<f32>> = vec![None; factor_count(c, site)];
    for (ch, &v) in per_channel.iter().enumerate() {
        let slot = &mut out[factor_of(c, site, ch)];
        *slot = Some(slot.map_or(v, |a| combine(a, v)));
    }
    out.into_iter().map(|v| v.unwrap_or(0.0)).collect()
}

/// `w` (`rows × cols`) with column `c` multiplied by `s[c]`.
pub fn scale_columns(w: &[f32], cols: usize, s: &[f32]) -> Vec<f32> {
    let mut out = w.to_vec();
    for row in out.chunks_exact_mut(cols) {
        row.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
    }
    out
}

/// Divides `site`'s input by `factors` and scales the readers' columns to match.
pub fn apply(model: &mut DenseModel, layer: usize, site: Site, factors: &[f32]) -> Result<()> {
    let c = model.config.clone();
    if factors.len() != factor_count(&c, site)
        || factors.iter().any(|s| !(*s > 0.0 && s.is_finite()))
    {
        return invalid(format!(
            "layer {layer} {site:?}: {} smoothing factors, expected {} positive finite ones",
            factors.len(),
            factor_count(&c, site)
        ));
    }
    let inverse: Vec<f32> = factors.iter().map(|s| 1.0 / s).collect();
    let divide_rows = |model: &mut DenseModel, name: &str| -> Result<()> {
        let t = model.tensor(name)?;
        let cols = t.cols;
        let mut data = t.data.clone();
        for (row, s) in data.chunks_exact_mut(cols).zip(&inverse) {
            row.iter_mut().for_each(|v| *v *= s);
        }
        model.set(name, data)
    };
    match site {
        Site::AttnIn | Site::FfnIn => {
            let norm = if site == Site::AttnIn {
                "attn_norm"
            } else {
                "ffn_norm"
            };
            let name = format!("blk.{layer}.{norm}.weight");
            let w: Vec<f32> = model
                .tensor(&name)?
                .data
                .iter()
                .zip(&inverse)
                .map(|(w, s)| w * s)
                .collect();
            model.set(&name, w)?;
        }
        Site::FfnAct => divide_rows(model, &linear_name(layer, "ffn_up"))?,
        Site::AttnOut => {
            let v = linear_name(layer, "attn_v");
            // V's rows are one per KV channel, as the factors are.
            divide_rows(model, &v)?;
            let bias = format!("blk.{layer}.attn_v.bias");
            if let Ok(b) = model.tensor(&bias) {
                let b: Vec<f32> = b.data.iter().zip(&inverse).map(|(b, s)| b * s).collect();
                model.set(&bias, b)?;
            }
        }
    }
    for stem in site.linears() {
        let name = linear_name(layer, stem);
        let t = model.tensor(&name)?;
        let s = expand(&c, site, factors, t.cols);
        let w = scale_columns(&t.data, t.cols, &s);
        model.set(&name, w)?;
    }
    Ok(())
}
