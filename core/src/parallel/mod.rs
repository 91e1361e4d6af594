//! Running one model over several ranks: tensor, pipeline and expert
//! parallelism.
//!
//! A [`Communicator`] moves f32 activations and command bytes between the
//! ranks of one job. `core` holds the trait and the single-rank
//! implementation; the transports live outside it (MPI in `tandem-mpi`, for
//! CPU and wgpu ranks; NCCL belongs to the CUDA backend), so `core` names none.
//!
//! A [`Job`] arranges its ranks as pipeline stages of `tp` ranks each
//! (`job`). Pipeline parallelism (`pipeline`) gives each stage a contiguous
//! range of layers; activations go from stage to stage by send/recv, a
//! step's rows in micro-batches so the stages overlap. Tensor parallelism
//! (`plan`) gives each rank of a stage whole attention heads and a slice of
//! the FFN width (or of each MoE layer's experts): Q/K/V and gate/up split
//! by output rows, O and down by input columns, so each rank's branch
//! output is a partial sum that one all-reduce per branch completes.
//! Weights are sliced as they are read (`shard`), and rank 0 drives the
//! others through `link`: every forward pass, KV allocation and block copy
//! it makes is sent first, so all ranks run the same kernels in the same
//! order. `metered` wraps a communicator to count the bytes and time of
//! each kind of operation (`bench --tp/--pp`).

pub mod job;
pub mod link;
pub mod metered;
pub mod pipeline;
pub mod plan;
pub mod shard;

pub use job::{Job, JobShape};
pub use link::{announce, receive, Command, Placement};
pub use metered::{CommStats, Meter, Metered, Op};
pub use pipeline::PipelinePlan;
pub use plan::TensorParallelPlan;

use std::sync::Arc;

use crate::Result;

/// Collective and point-to-point operations among the ranks of one job.
/// Every rank calls the collectives in the same order; slices have the same
/// length on every rank unless a method says otherwise.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `data` becomes the element-wise sum of every rank's `data`.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()>;
    /// `out` (`size()` × `local.len()`) becomes every rank's `local`, in rank order.
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()>;
    /// Chunk `r` of `send` goes to rank `r`; chunk `r` of `recv` comes from
    /// rank `r` (`size()` equal chunks each).
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    fn send(&self, data: &[f32], to: usize) -> Result<()>;
    fn recv(&self, data: &mut [f32], from: usize) -> Result<()>;
    /// `data` on every rank becomes `root`'s (its length included).
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// The ranks that give the same `color`, as a communicator of their
    /// own, ranked as here. Collective: every rank calls it.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>>;
    /// Ends the whole job after an error that leaves the ranks out of step
    /// (one failed part-way through a pass the others are still in). By
    /// default this process exits with status 1 without finalising, which
    /// makes `mpirun` end the other ranks.
    fn abort_job(&self, reason: &str) -> ! {
        write_stderr_line(&format!("error: {reason}"));
        std::process::exit(1)
    }
}

/// Writes `line` and a newline to stderr in one write. `mpirun` merges
/// the stderr of a job's ranks chunk by chunk, and `eprintln!` writes a
/// line in pieces, so one rank's line could land inside another's.
/// Unlike `eprintln!`, a failed write is ignored: a closed stderr is no
/// reason to stop.
pub fn write_stderr_line(line: &str) {
    use std::io::Write as _;
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    let _ = std::io::stderr().write_all(&bytes);
}

/// The communicator of a job with one rank: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _data: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(local);
        Ok(())
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn send(&self, _data: &[f32], to: usize) -> Result<()> {
        Err(no_peer(to))
    }
    fn recv(&self, _data: &mut [f32], from: usize) -> Result<()> {
        Err(no_peer(from))
    }
    fn broadcast_bytes(&self, _data: &mut Vec<u8>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn split(&self, _color: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(SingleRank))
    }
}

/// A shared communicator is one (a job's stage communicator, metered).
impl<C: Communicator + ?Sized> Communicator for Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        (**self).all_reduce_sum(data)
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        (**self).all_gather(local, out)
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        (**self).all_to_all(send, recv)
    }
    fn send(&self, data: &[f32], to: usize) -> Result<()> {
        (**self).send(data, to)
    }
    fn recv(&self, data: &mut [f32], from: usize) -> Result<()> {
        (**self).recv(data, from)
    }
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        (**self).broadcast_bytes(data, root)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        (**self).split(color)
    }
    fn abort_job(&self, reason: &str) -> ! {
        (**self).abort_job(reason)
    }
}

fn no_peer(rank: usize) -> crate::Error {
    crate::Error::Communication(format!("rank {rank} does not exist: this job has one rank"))
}
