//! Mixture-of-Experts routing and combining: `moe_route`, `moe_combine`.
//!
//! Both are scalar: routing does `k · experts` comparisons per row and
//! combining one multiply-add per output value, negligible next to the
//! expert matmuls between them (which are `matmul` on each expert's rows).

use tandem_core::backend::{MoeCombineParams, MoeRouteParams};
use tandem_core::model::arch::MAX_EXPERTS_PER_TOKEN;
use tandem_core::Result;

use crate::check;

/// Softmax over each row's `experts` logits, the `k` largest (descending,
/// the lower index first among equals), renormalised when asked; the shared
/// expert's gate through a sigmoid in a last slot.
pub(crate) fn moe_route(
    logits: &[f32],
    p: MoeRouteParams,
    ids: &mut [u32],
    weights: &mut [f32],
) -> Result<()> {
    let kernel = "moe_route";
    check::positive(kernel, "experts", p.experts)?;
    if p.k == 0 || p.k > p.experts || p.k > MAX_EXPERTS_PER_TOKEN {
        return Err(check::error(
            kernel,
            format!(
                "k = {} must be 1 to {} experts (at most {MAX_EXPERTS_PER_TOKEN})",
                p.k, p.experts
            ),
        ));
    }
    let (width, slots) = (p.width(), p.slots());
    check::buffer_len(
        kernel,
        "logits",
        logits.len(),
        check::product(kernel, &[p.rows, width])?,
    )?;
    let n = check::product(kernel, &[p.rows, slots])?;
    check::buffer_len(kernel, "ids", ids.len(), n)?;
    check::buffer_len(kernel, "weights", weights.len(), n)?;
    for r in 0..p.rows {
        let row = &logits[r * width..(r + 1) * width];
        let scores = &row[..p.experts];
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = scores.iter().map(|&l| (l - max).exp()).sum();
        let (ids, weights) = (&mut ids[r * slots..], &mut weights[r * slots..]);
        let mut chosen_sum = 0.0;
        for j in 0..p.k {
            let taken = &ids[..j];
            let best = (0..p.experts)
                .filter(|e| !taken.contains(&(*e as u32)))
                .fold(None, |best: Option<usize>, e| match best {
                    Some(b) if scores[b] >= scores[e] => Some(b),
                    _ => Some(e),
                })
                .expect("k <= experts leaves a candidate");
            ids[j] = best as u32;
            weights[j] = (scores[best] - max).exp() / sum;
            chosen_sum += weights[j];
        }
        if p.normalize {
            weights[..p.k].iter_mut().for_each(|w| *w /= chosen_sum);
        }
        if p.shared_gate {
            ids[p.k] = p.experts as u32;
            weights[p.k] = 1.0 / (1.0 + (-row[p.experts]).exp());
        }
    }
    Ok(())
}

/// `out[rows[i]] += w * y[i]`, `w` the routing weight of `p.expert` in the
/// row's slots (0 when the row was not routed to it).
pub(crate) fn moe_combine(
    y: &[f32],
    rows: &[u32],
    ids: &[u32],
    weights: &[f32],
    p: MoeCombineParams,
    out: &mut [f32],
) -> Result<()> {
    let kernel = "moe_combine";
    check::positive(kernel, "width", p.width)?;
    check::positive(kernel, "slots", p.slots)?;
    check::buffer_len(
        kernel,
        "y",
        y.len(),
        check::product(kernel, &[p.count, p.width])?,
    )?;
    check::buffer_len(kernel, "rows", rows.len(), p.count)?;
    let rows = &rows[..p.count];
    let out_rows = out.len() / p.width;
    check::indices_below(kernel, "rows", rows, out_rows.min(ids.len() / p.slots))?;
    check::buffer_len(
        kernel,
        "weights",
        weights.len(),
        ids.len() / p.slots * p.slots,
    )?;
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        let slots = r * p.slots..(r + 1) * p.slots;
        let w = ids[slots.clone()]
            .iter()
            .zip(&weights[slots])
            .find(|(&id, _)| id == p.expert)
            .map_or(0.0, |(_, &w)| w);
        let out = &mut out[r * p.width..(r + 1) * p.width];
        for (o, &v) in out.iter_mut().zip(&y[i * p.width..(i + 1) * p.width]) {
            *o += w * v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keeps_the_top_k_in_order_and_renormalises() {
        let logits = [0.0, 2.0, 1.0, 2.0, -1.0, 0.5];
        let p = MoeRouteParams {
            rows: 1,
            experts: 5,
            k: 3,
            normalize: false,
            shared_gate: true,
        };
        let (mut ids, mut weights) = ([0u32; 4], [0f32; 4]);
        moe_route(&logits, p, &mut ids, &mut weights).unwrap();
        assert_eq!(ids, [1, 3, 2, 5]);
        let sum: f32 = logits[..5].iter().map(|l| l.exp()).sum();
        assert!((weights[0] - 2f32.exp() / sum).abs() < 1e-6);
        assert!((weights[3] - 1.0 / (1.0 + (-0.5f32).exp())).abs() < 1e-6);
        let normalized = MoeRouteParams {
            normalize: true,
            ..p
        };
        moe_route(&logits, normalized, &mut ids, &mut weights).unwrap();
        assert!((weights[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let too_many = MoeRouteParams { k: 6, ..p };
        let message = moe_route(&logits, too_many, &mut ids, &mut weights)
            .unwrap_err()
            .to_string();
        assert!(message.contains("k = 6"), "{message}");
    }

    #[test]
    fn combining_adds_each_row_with_its_weight_for_the_expert() {
        let ids = [0, 2, 2, 1];
        let weights = [0.25, 0.75, 0.5, 0.5];
        let p = MoeCombineParams {
            count: 2,
            width: 2,
            expert: 2,
            slots: 2,
        };
        let mut out = [1.0; 4];
        moe_combine(&[1.0, 2.0, 3.0, 4.0], &[1, 0], &ids, &weights, p, &mut out).unwrap();
        assert_eq!(out, [1.0 + 0.75 * 3.0, 1.0 + 0.75 * 4.0, 1.5, 2.0]);
        let bad_row = moe_combine(&[0.0; 4], &[2, 0], &ids, &weights, p, &mut out);
        assert!(bad_row.unwrap_err().to_string().contains("rows[0] = 2"));
    }
}
