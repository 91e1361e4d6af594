//! Mixture-of-experts routing's host side, apart because only MoE layers
//! run it (`gather_rows`, which also picks the logits' rows, is not here).

use super::*;

impl CudaBackend {
    /// `moe_route`: a thread per row.
    pub(super) fn launch_moe_route(
        &self,
        logits: &CudaTensor,
        p: MoeRouteParams,
        ids: &mut CudaIndices,
        weights: &mut CudaTensor,
    ) -> Result<()> {
        if p.k == 0 || p.k > p.experts || p.k > MAX_EXPERTS_PER_TOKEN {
            return Err(backend_error(format!(
                "moe_route: k = {} must be 1 to {} experts (at most {MAX_EXPERTS_PER_TOKEN})",
                p.k, p.experts
            )));
        }
        check_len("moe_route: logits", logits.len(), p.rows * p.width())?;
        check_len("moe_route: ids", ids.len(), p.rows * p.slots())?;
        check_len("moe_route: weights", weights.len(), p.rows * p.slots())?;
        if p.rows == 0 {
            return Ok(());
        }
        let (rows, experts, k) = (
            to_u32(p.rows, "rows")?,
            to_u32(p.experts, "experts")?,
            to_u32(p.k, "k")?,
        );
        let (normalize, shared_gate) = (u32::from(p.normalize), u32::from(p.shared_gate));
        let grid = (blocks_for(p.rows, 64, "rows")?, 1, 1);
        sig::moe_route(
            self,
            Which::ONE,
            config(grid, 64, 0),
            &logits.buf,
            &rows,
            &experts,
            &k,
            &normalize,
            &shared_gate,
            &mut ids.buf,
            &mut weights.buf,
        )
    }

    /// `moe_combine`: a thread per value of each routed row.
    pub(super) fn launch_moe_combine(
        &self,
        y: &CudaTensor,
        rows: &CudaIndices,
        ids: &CudaIndices,
        weights: &CudaTensor,
        p: MoeCombineParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_len("moe_combine: y", y.len(), p.count * p.width)?;
        check_len("moe_combine: rows", rows.len(), p.count)?;
        check_len("moe_combine: weights", weights.len(), ids.len())?;
        if p.count == 0 || p.width == 0 {
            return Ok(());
        }
        // The rows and ids are device data: the kernel trusts them to lie in
        // `out` and `weights`, as the CPU reference's indexing does.
        let (width, slots) = (to_u32(p.width, "width")?, to_u32(p.slots, "slots")?);
        let grid = (
            blocks_for(p.width, 256, "width")?,
            grid_yz(p.count, "rows")?,
            1,
        );
        sig::moe_combine(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &y.buf,
            &rows.buf,
            &ids.buf,
            &weights.buf,
            &width,
            &p.expert,
            &slots,
            &mut out.buf,
        )
    }
}
