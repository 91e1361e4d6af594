//! The residual stream of a forward pass: norms that add a pending branch
//! first, projections through the fused or separate matmuls, and branch
//! outputs added directly or through `delta`.

use super::Projections;
use crate::backend::{
    Backend, Glu, MatmulParams, MatmulTarget, NormPrologue, RmsNormParams, SplitOut,
};
use crate::parallel::Communicator;
use crate::{Error, Result};

/// The residual stream of one forward pass, with the branch output that
/// may still wait to be added.
pub(super) struct Stream<'a, B: Backend> {
    pub(super) residual: &'a mut B::Tensor,
    /// A branch's output not yet in `residual` (when `pending`).
    pub(super) delta: &'a mut B::Tensor,
    /// The normalised stream, for consumers without a norm prologue.
    pub(super) normed: &'a mut B::Tensor,
    pub(super) pending: bool,
    pub(super) norm: RmsNormParams,
    /// The other ranks of a tensor-parallel model: branch outputs are
    /// partial sums until reduced.
    pub(super) comm: Option<&'a dyn Communicator>,
}

/// A fused matmul's input and the norm it applies first, if any.
type FusedInput<'x, 'w, B> = (
    &'x <B as Backend>::Tensor,
    Option<NormPrologue<'w, <B as Backend>::Weight>>,
);

/// A branch's output projection and what stands between it and the residual add.
pub(super) struct Branch<'a, B: Backend> {
    pub(super) w: &'a B::Weight,
    pub(super) post_norm: &'a Option<B::Weight>,
    /// The backend adds the projection into the stream (`matmul_residual`).
    pub(super) direct: bool,
    pub(super) residual_multiplier: Option<f32>,
}

impl<B: Backend> Stream<'_, B> {
    /// `normed` = the stream (with any pending branch added) normalised by `weight`.
    pub(super) fn normalize(&mut self, backend: &B, weight: &B::Weight) -> Result<()> {
        if std::mem::take(&mut self.pending) {
            backend.rms_norm_residual(self.residual, self.delta, weight, self.norm, self.normed)
        } else {
            backend.rms_norm(self.residual, weight, self.norm, self.normed)
        }
    }

    /// The input of a fused matmul normalised by `weight`: the stream
    /// itself with the norm as prologue, or `normed` when a pending branch
    /// must be added first.
    fn fused_input<'w>(
        &mut self,
        backend: &B,
        weight: &'w B::Weight,
    ) -> Result<FusedInput<'_, 'w, B>> {
        if self.pending {
            self.normalize(backend, weight)?;
            return Ok((&*self.normed, None));
        }
        let eps = self.norm.eps;
        Ok((&*self.residual, Some(NormPrologue { weight, eps })))
    }

    /// Q, K and V (`outs`, of `widths`) of the stream normalised by `norm_weight`.
    pub(super) fn project(
        &mut self,
        backend: &B,
        norm_weight: &B::Weight,
        projections: &Projections<B>,
        mm: MatmulParams,
        outs: [&mut B::Tensor; 3],
        widths: &[usize; 3],
    ) -> Result<()> {
        match projections {
            Projections::Concatenated { w, bias } => {
                let (x, prologue) = self.fused_input(backend, norm_weight)?;
                let mut outs = outs
                    .into_iter()
                    .zip(widths)
                    .map(|(out, &width)| SplitOut { out, width })
                    .collect::<Vec<_>>();
                backend.matmul_rms_norm(x, prologue, w, bias.as_ref(), mm, &mut outs)
            }
            Projections::Separate(parts) => {
                self.normalize(backend, norm_weight)?;
                // One call for all: the CPU backend quantizes `normed` once.
                let mut targets = parts
                    .iter()
                    .zip(outs)
                    .map(|((w, bias), out)| MatmulTarget {
                        w,
                        bias: bias.as_ref(),
                        out,
                    })
                    .collect::<Vec<_>>();
                backend.matmuls(self.normed, &mut targets, mm)
            }
        }
    }

    /// The gated activation of the FFN (`ffn` features) into `act`, from
    /// the stream normalised by `norm_weight` (`gate` and `up` hold the
    /// unfused halves).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated(
        &mut self,
        backend: &B,
        norm_weight: &B::Weight,
        gate_up: &Projections<B>,
        glu: Glu,
        mm: MatmulParams,
        ffn: usize,
        [gate, up, act]: [&mut B::Tensor; 3],
    ) -> Result<()> {
        let len = mm.rows * ffn;
        match gate_up {
            Projections::Concatenated { w, .. } => {
                let (x, prologue) = self.fused_input(backend, norm_weight)?;
                backend.matmul_glu(x, prologue, w, glu, mm, act)
            }
            Projections::Separate(parts) => {
                self.normalize(backend, norm_weight)?;
                let mut targets = parts
                    .iter()
                    .zip([gate, up])
                    .map(|((w, _), out)| MatmulTarget { w, bias: None, out })
                    .collect::<Vec<_>>();
                backend.matmuls(self.normed, &mut targets, mm)?;
                let [gate, up] = [&*targets[0].out, &*targets[1].out];
                match glu {
                    Glu::SwiGlu => backend.swiglu(gate, up, len, act),
                    Glu::GeGlu => backend.geglu(gate, up, len, act),
                }
            }
        }
    }

    /// Adds `x · branch.w` into the stream: at once when the branch is
    /// direct and has no post-norm, else through `delta` (post-normed and
    /// scaled where the architecture says), left pending. A norm always
    /// stands between two branches, so nothing is pending here.
    pub(super) fn add_branch(
        &mut self,
        backend: &B,
        x: &B::Tensor,
        branch: Branch<'_, B>,
        scratch: &mut Option<B::Tensor>,
    ) -> Result<()> {
        let mm = MatmulParams {
            rows: self.norm.rows,
        };
        if branch.direct && branch.post_norm.is_none() {
            return backend.matmul_residual(x, branch.w, mm, self.residual);
        }
        post_normed(
            backend,
            x,
            branch.w,
            branch.post_norm,
            self.norm,
            scratch,
            self.delta,
            self.comm,
        )?;
        if let Some(factor) = branch.residual_multiplier {
            backend.scale(self.delta, self.norm.rows * self.norm.dim, factor)?;
        }
        self.pending = true;
        Ok(())
    }
}

/// Where a Q or K projection's matmul writes: its raw buffer when a per-head
/// norm follows (`None` when the architecture allocated none), else its output.
pub(super) fn projection_out<'a, T>(
    head_norm: bool,
    raw: &'a mut Option<T>,
    out: &'a mut T,
) -> Option<&'a mut T> {
    if head_norm {
        raw.as_mut()
    } else {
        Some(out)
    }
}

/// `out = x·w` (summed over the ranks of `comm`), then RMSNorm by
/// `post_norm` when the architecture has one (through `scratch`, which such
/// architectures allocate).
#[allow(clippy::too_many_arguments)]
fn post_normed<B: Backend>(
    backend: &B,
    x: &B::Tensor,
    w: &B::Weight,
    post_norm: &Option<B::Weight>,
    norm: RmsNormParams,
    scratch: &mut Option<B::Tensor>,
    out: &mut B::Tensor,
    comm: Option<&dyn Communicator>,
) -> Result<()> {
    let mm = MatmulParams { rows: norm.rows };
    let len = norm.rows * norm.dim;
    let reduce = |t: &mut B::Tensor| match comm {
        Some(comm) => backend.all_reduce_sum(t, len, comm),
        None => Ok(()),
    };
    match (post_norm, scratch) {
        (None, _) => {
            backend.matmul(x, w, None, mm, out)?;
            reduce(out)
        }
        (Some(weight), Some(raw)) => {
            backend.matmul(x, w, None, mm, raw)?;
            reduce(raw)?;
            backend.rms_norm(raw, weight, norm, out)
        }
        (Some(_), None) => Err(Error::backend(
            backend.info().name,
            "forward pass: no post-norm buffer for this architecture",
        )),
    }
}
