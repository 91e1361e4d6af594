//! The host side of mixture-of-experts routing and combining, the two
//! kernels only MoE layers call; the experts themselves run as ordinary
//! matmuls (`matmul`) over gathered rows.

use super::*;

impl WgpuBackend {
    /// `Backend::moe_route`.
    pub(crate) fn moe_route_kernel(
        &self,
        logits: &WgpuTensor,
        p: MoeRouteParams,
        ids: &mut WgpuIndices,
        weights: &mut WgpuTensor,
    ) -> Result<()> {
        if p.k == 0 || p.k > p.experts || p.k > MAX_EXPERTS_PER_TOKEN {
            return Err(backend_error(format!(
                "moe_route: k = {} must be 1 to {} experts (at most {MAX_EXPERTS_PER_TOKEN})",
                p.k, p.experts
            )));
        }
        check_len("moe_route logits", logits.len, p.rows * p.width())?;
        check_len("moe_route ids", ids.len, p.rows * p.slots())?;
        check_len("moe_route weights", weights.len, p.rows * p.slots())?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.experts, "experts")?,
            u32_of(p.k, "k")?,
            u32::from(p.normalize),
            u32::from(p.shared_gate),
        ];
        self.dispatch(
            simple("moe_route"),
            "main",
            &[READ, WRITE, WRITE],
            &[&logits.buf, &ids.buf, &weights.buf],
            &params,
            p.rows.div_ceil(64),
        )
    }

    /// `Backend::moe_combine`.
    pub(crate) fn moe_combine_kernel(
        &self,
        y: &WgpuTensor,
        rows: &WgpuIndices,
        ids: &WgpuIndices,
        weights: &WgpuTensor,
        p: MoeCombineParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("moe_combine y", y.len, p.count * p.width)?;
        check_len("moe_combine rows", rows.len, p.count)?;
        check_len("moe_combine weights", weights.len, ids.len)?;
        let params = [
            u32_of(p.count, "count")?,
            u32_of(p.width, "width")?,
            p.expert,
            u32_of(p.slots, "slots")?,
        ];
        self.dispatch(
            simple("moe_combine"),
            "main",
            &[READ, READ, READ, READ, WRITE],
            &[&y.buf, &rows.buf, &ids.buf, &weights.buf, &out.buf],
            &params,
            (p.count * p.width).div_ceil(256),
        )
    }
}
