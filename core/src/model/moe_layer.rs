//! A Mixture-of-Experts FFN on a backend: the router, every expert's three
//! matrices (read from either tensor layout, `super::experts`), and the
//! kernels of one pass.
//!
//! One pass: router `matmul` → `moe_route` (top-k and weights per row) →
//! the routing read back and the rows grouped by expert on the host → per
//! expert with rows: `gather_rows` of its rows → gate/up `matmul` →
//! `swiglu` → down `matmul` → `moe_combine` into the output. Each expert's
//! matrices are thus read once per step for all the rows routed to it, by
//! the same `matmul` kernels (every weight format) dense layers use, and
//! experts no row chose are not read at all. The read-back makes the pass
//! unrecordable: MoE models decode eagerly.
//!
//! On a split model (`crate::parallel::plan`) a rank holds only its
//! experts, each cut to its features: it runs those on the rows routed to
//! them, and its output is a partial sum the caller all-reduces.
//!
//! `MoeSpec::group_rows` false runs each expert on one row at a time
//! instead, reading its matrices once per row routed to it: the baseline
//! that shows what grouping buys in prefill (`tandem bench
//! --ungrouped-experts`, README).

use super::experts::{expert_view, router_name, shared_gate_name, ExpertMatrix};
use super::{ModelFiles, MoeSpec};
use crate::backend::{Backend, MatmulParams, MoeCombineParams, MoeRouteParams};
use crate::parallel::plan::Split;
use crate::parallel::shard::shard;
use crate::parallel::TensorParallelPlan;
use crate::quant::{WeightFormat, WeightView};
use crate::{Error, Result};

/// One expert's SwiGLU FFN.
struct Expert<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
    width: usize,
}

/// One layer's router and experts; the shared expert, if any, last.
pub(super) struct MoeLayer<B: Backend> {
    spec: MoeSpec,
    /// `[router_width, hidden]` F32: the router's rows, then the shared gate.
    router: B::Weight,
    /// `None`: an expert another rank holds.
    experts: Vec<Option<Expert<B>>>,
}

/// The activations of one MoE pass beyond the dense FFN's (whose gate, up
/// and act buffers the experts reuse).
pub(crate) struct MoeBuffers<B: Backend> {
    logits: B::Tensor,
    ids: B::Indices,
    weights: B::Tensor,
    gathered: B::Tensor,
    expert_out: B::Tensor,
}

impl<B: Backend> MoeBuffers<B> {
    pub(crate) fn alloc(backend: &B, spec: &MoeSpec, rows: usize, hidden: usize) -> Result<Self> {
        let slots = rows * spec.slots();
        Ok(Self {
            logits: backend.alloc(rows * spec.router_width())?,
            ids: backend.upload_indices(&vec![0; slots])?,
            weights: backend.alloc(slots)?,
            gathered: backend.alloc(rows * hidden)?,
            expert_out: backend.alloc(rows * hidden)?,
        })
    }
}

impl<B: Backend> MoeLayer<B> {
    /// Uploads layer `layer`'s router and experts (this rank's `share` of
    /// them, on a split model); `upload` puts a matrix on the backend (and
    /// counts it). Also returns the bytes of the loaded routed experts one
    /// token does not read (all but `experts_per_token`).
    pub(super) fn load(
        backend: &B,
        files: &ModelFiles,
        spec: MoeSpec,
        layer: usize,
        share: Option<&TensorParallelPlan>,
        upload: &mut dyn FnMut(WeightView<'_>, &str) -> Result<B::Weight>,
    ) -> Result<(Self, usize)> {
        let missing =
            |name: &str| Error::bad_file(&files.path, format!("tensor {name} is missing"));
        let router_tensor = router_name(layer);
        let mut router = files
            .tensors
            .view(&router_tensor)
            .ok_or_else(|| missing(&router_tensor))?
            .to_f32();
        let mut routed_bytes = 0;
        let mut held = 0;
        let mut experts = Vec::with_capacity(spec.router_width());
        for e in 0..spec.experts {
            if share.is_some_and(|p| !p.holds_expert(e)) {
                experts.push(None);
                continue;
            }
            let mut matrix = |m: ExpertMatrix| {
                let name = m.per_expert_name(layer, e);
                let view =
                    expert_view(&files.tensors, layer, m, e).ok_or_else(|| missing(&name))?;
                let split = share.map_or(Split::Whole, |p| p.expert_split(m));
                let cut = shard(view, &split, &name)?;
                routed_bytes += cut.data.len();
                upload(cut.view(), &name)
            };
            experts.push(Some(Expert {
                gate: matrix(ExpertMatrix::Gate)?,
                up: matrix(ExpertMatrix::Up)?,
                down: matrix(ExpertMatrix::Down)?,
                width: share.map_or(files.config.intermediate_size, |p| p.ffn.len()),
            }));
            held += 1;
        }
        if let Some(width) = spec.shared_ffn {
            let gate_name = shared_gate_name(layer);
            let gate = files
                .tensors
                .view(&gate_name)
                .ok_or_else(|| missing(&gate_name))?;
            router.extend(gate.to_f32());
            let mut matrix = |m: ExpertMatrix| {
                let name = m.shared_name(layer);
                let view = files.tensors.view(&name).ok_or_else(|| missing(&name))?;
                let split = share.map_or(Split::Whole, |p| p.split(&name));
                upload(shard(view, &split, &name)?.view(), &name)
            };
            experts.push(Some(Expert {
                gate: matrix(ExpertMatrix::Gate)?,
                up: matrix(ExpertMatrix::Up)?,
                down: matrix(ExpertMatrix::Down)?,
                width: share.map_or(width, |p| p.shared_ffn.len()),
            }));
        }
        let router_bytes: Vec<u8> = router.iter().flat_map(|v| v.to_le_bytes()).collect();
        let router = backend.upload_weight(WeightView {
            format: WeightFormat::F32,
            rows: spec.router_width(),
            cols: files.config.hidden_size,
            data: &router_bytes,
        })?;
        let unread = routed_bytes / held.max(1) * held.saturating_sub(spec.experts_per_token);
        Ok((
            Self {
                spec,
                router,
                experts,
            },
            unread,
        ))
    }

    /// `out = Σ_slots weight · expert(x)` over the `rows` rows of `x`
    /// (`[rows, hidden]`); `gate`, `up` and `act` hold `rows` rows of the
    /// widest expert.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        backend: &B,
        x: &B::Tensor,
        rows: usize,
        hidden: usize,
        buffers: &mut MoeBuffers<B>,
        [gate, up, act]: [&mut B::Tensor; 3],
        out: &mut B::Tensor,
    ) -> Result<()> {
        let spec = &self.spec;
        let mm = |rows| MatmulParams { rows };
        backend.matmul(x, &self.router, None, mm(rows), &mut buffers.logits)?;
        let route = MoeRouteParams {
            rows,
            experts: spec.experts,
            k: spec.experts_per_token,
            normalize: spec.normalize_weights,
            shared_gate: spec.shared_ffn.is_some(),
        };
        backend.moe_route(
            &buffers.logits,
            route,
            &mut buffers.ids,
            &mut buffers.weights,
        )?;
        let ids = backend.download_indices(&buffers.ids, rows * route.slots())?;
        let groups = rows_by_expert(&ids, route.slots(), self.experts.len())
            .map_err(|m| Error::backend(backend.info().name, m))?;
        backend.scale(out, rows * hidden, 0.0)?;
        let rows_per_call = if spec.group_rows { usize::MAX } else { 1 };
        for (e, (expert, group)) in self.experts.iter().zip(&groups).enumerate() {
            let Some(expert) = expert else { continue };
            for expert_rows in group.chunks(rows_per_call) {
                let n = expert_rows.len();
                let rows_of = backend.upload_indices(expert_rows)?;
                backend.gather_rows(x, &rows_of, n, hidden, &mut buffers.gathered)?;
                backend.matmul(&buffers.gathered, &expert.gate, None, mm(n), gate)?;
                backend.matmul(&buffers.gathered, &expert.up, None, mm(n), up)?;
                backend.swiglu(gate, up, n * expert.width, act)?;
                backend.matmul(act, &expert.down, None, mm(n), &mut buffers.expert_out)?;
                let combine = MoeCombineParams {
                    count: n,
                    width: hidden,
                    expert: e as u32,
                    slots: route.slots(),
                };
                backend.moe_combine(
                    &buffers.expert_out,
                    &rows_of,
                    &buffers.ids,
                    &buffers.weights,
                    combine,
                    out,
                )?;
            }
        }
        Ok(())
    }
}

/// The rows routed to each of `experts` experts, in row order, from the
/// routing's `[rows, slots]` expert ids.
pub fn rows_by_expert(
    ids: &[u32],
    slots: usize,
    experts: usize,
) -> std::result::Result<Vec<Vec<u32>>, String> {
    let mut groups = vec![Vec::new(); experts];
    for (i, &e) in ids.iter().enumerate() {
        let group = groups
            .get_mut(e as usize)
            .ok_or_else(|| format!("moe_route chose expert {e} of {experts}"))?;
        group.push((i / slots) as u32);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_grouped_by_expert_in_row_order() {
        // Three rows, two slots: expert 2 gets every row, expert 1 none.
        let ids = [2, 0, 3, 2, 2, 0];
        let groups = rows_by_expert(&ids, 2, 4).unwrap();
        assert_eq!(groups, [vec![0, 2], vec![], vec![0, 1, 2], vec![1]]);
        assert!(rows_by_expert(&[4], 1, 4).unwrap_err().contains("expert 4"));
    }
}
