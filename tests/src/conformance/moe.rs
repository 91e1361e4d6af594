//! The Mixture-of-Experts kernels of the conformance suite: routing with
//! odd expert counts, ties, every k up to the limit and a shared gate; the
//! weighted combine with uneven routing (an expert with no row, one with
//! every row).

use tandem_core::backend::{Backend, MoeCombineParams, MoeRouteParams};
use tandem_core::model::arch::MAX_EXPERTS_PER_TOKEN;

use super::{Out, Suite};

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    pub(super) fn moe_route(&mut self) {
        for (rows, experts, k, normalize, shared_gate) in [
            (1, 1, 1, true, false),
            (7, 5, 2, false, true),
            (33, 8, 3, true, false),
            (5, 60, MAX_EXPERTS_PER_TOKEN, true, true),
            (130, 64, 8, false, false),
        ] {
            let p = MoeRouteParams {
                rows,
                experts,
                k,
                normalize,
                shared_gate,
            };
            let mut logits = self.rng.values(rows * p.width(), 3.0);
            // A tie in every row: the lower index must come first.
            for r in 0..rows {
                let (a, b) = (self.rng.below(experts), self.rng.below(experts));
                logits[r * p.width() + a] = 3.5;
                logits[r * p.width() + b] = 3.5;
            }
            let got = moe_route(self.backend, &logits, p);
            let want = moe_route(self.reference, &logits, p);
            self.check(
                "moe_route",
                format!("{rows} rows, top {k} of {experts}, normalize {normalize}, shared {shared_gate}"),
                got,
                want,
            );
        }
    }

    pub(super) fn moe_combine(&mut self) {
        // (rows, slots, width, expert, the rows routed to it): none, all,
        // a few out of order.
        let cases: [(usize, usize, usize, u32, Vec<u32>); 4] = [
            (6, 2, 13, 3, vec![]),
            (6, 2, 13, 1, (0..6).collect()),
            (9, 3, 300, 2, vec![8, 0, 4]),
            (1, 1, 1, 0, vec![0]),
        ];
        for (rows, slots, width, expert, routed) in cases {
            let mut ids: Vec<u32> = (0..rows * slots)
                .map(|_| self.rng.below(4) as u32 + 4)
                .collect();
            for &r in &routed {
                ids[r as usize * slots + self.rng.below(slots)] = expert;
            }
            let weights = self.rng.values(rows * slots, 1.0);
            let y = self.rng.values(routed.len() * width, 1.0);
            let out = self.rng.values(rows * width, 1.0);
            let p = MoeCombineParams {
                count: routed.len(),
                width,
                expert,
                slots,
            };
            let inputs = (&y[..], &routed[..], &ids[..], &weights[..], &out[..]);
            let got = moe_combine(self.backend, inputs, p);
            let want = moe_combine(self.reference, inputs, p);
            self.check(
                "moe_combine",
                format!(
                    "{} of {rows} rows of {width} to expert {expert}",
                    routed.len()
                ),
                got,
                want,
            );
        }
    }
}

/// The ids (as f32) then the weights.
fn moe_route<X: Backend>(be: &X, logits: &[f32], p: MoeRouteParams) -> Out {
    let slots = p.rows * p.slots();
    let xs = be.upload(logits)?;
    let mut ids = be.upload_indices(&vec![u32::MAX; slots])?;
    let mut weights = be.alloc(slots)?;
    be.moe_route(&xs, p, &mut ids, &mut weights)?;
    let mut out: Vec<f32> = be
        .download_indices(&ids, slots)?
        .into_iter()
        .map(|i| i as f32)
        .collect();
    out.extend(be.download(&weights, slots)?);
    Ok(out)
}

/// `moe_combine`'s inputs: y, the routed rows, ids, weights, the output's start.
type CombineInputs<'a> = (&'a [f32], &'a [u32], &'a [u32], &'a [f32], &'a [f32]);

fn moe_combine<X: Backend>(
    be: &X,
    (y, routed, ids, weights, out): CombineInputs<'_>,
    p: MoeCombineParams,
) -> Out {
    let ys = be.upload(if y.is_empty() { &[0.0] } else { y })?;
    let rows = be.upload_indices(if routed.is_empty() { &[0] } else { routed })?;
    let ids = be.upload_indices(ids)?;
    let weights = be.upload(weights)?;
    let mut acc = be.upload(out)?;
    be.moe_combine(&ys, &rows, &ids, &weights, p, &mut acc)?;
    be.download(&acc, out.len())
}
