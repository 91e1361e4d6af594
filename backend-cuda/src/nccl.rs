//! NCCL between the GPUs of a tensor-parallel job: the all-reduce after
//! each branch runs on the device, on the backend's stream, instead of
//! through the host.
//!
//! NCCL is opened at run time like the rest of CUDA (cudarc's dynamic
//! loading), so the crate builds anywhere and a machine without
//! `libnccl.so` gets an error saying so. The ranks find each other as
//! nccl-tests do under MPI: rank 0 makes NCCL's unique id, and the job's
//! own communicator carries it to the others.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use cudarc::nccl::sys;
use tandem_core::parallel::Communicator;
use tandem_core::Result;

use crate::backend_error;

/// Bytes of NCCL's unique id (`ncclUniqueId`).
const ID_BYTES: usize = 128;

/// One rank's NCCL communicator.
pub struct Nccl {
    comm: Comm,
}

/// Whether `libnccl.so` can be opened, as an error naming what is missing.
pub fn check_nccl() -> Result<()> {
    // SAFETY: only tries to open the library by its candidate names.
    match unsafe { sys::is_culib_present() } {
        true => Ok(()),
        false => Err(backend_error(
            "NCCL (libnccl.so.2) is not installed: the GPUs of a --tp job exchange activations through it \
             (NVIDIA's `nvidia-nccl-cu13` wheel or the CUDA toolkit provides it)",
        )),
    }
}

impl Nccl {
    /// Joins the NCCL communicator of `job`'s ranks on `stream`.
    pub fn join(stream: Arc<CudaStream>, job: &dyn Communicator) -> Result<Nccl> {
        check_nccl()?;
        let failed = |what: &str, e: cudarc::nccl::result::NcclError| {
            backend_error(format!("NCCL {what}: {e:?}"))
        };
        let mut bytes = match job.rank() {
            0 => {
                let id = Id::new().map_err(|e| failed("unique id", e))?;
                id.internal().iter().map(|&c| c as u8).collect()
            }
            _ => Vec::new(),
        };
        job.broadcast_bytes(&mut bytes, 0)?;
        if bytes.len() != ID_BYTES {
            return Err(backend_error(format!(
                "NCCL: rank 0 sent a unique id of {} bytes, not {ID_BYTES}",
                bytes.len()
            )));
        }
        let mut internal = [0; ID_BYTES];
        for (dst, &b) in internal.iter_mut().zip(&bytes) {
            *dst = b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream, job.rank(), job.size(), Id::uninit(internal))
            .map_err(|e| failed("init", e))?;
        Ok(Nccl { comm })
    }

    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// The first `len` elements of `buf` become their sum over the ranks.
    pub fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        let mut view = buf.slice_mut(..len);
        self.comm
            .all_reduce_in_place(&mut view, &ReduceOp::Sum)
            .map(drop)
            .map_err(|e| backend_error(format!("NCCL all-reduce of {len} floats: {e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL, asking for it is an error that names the library.
    #[test]
    fn a_missing_nccl_is_named() {
        // SAFETY: as in check_nccl.
        if unsafe { sys::is_culib_present() } {
            eprintln!("NCCL is installed here: nothing to check");
            return;
        }
        let err = check_nccl().unwrap_err().to_string();
        assert!(
            err.contains("libnccl.so.2") && err.contains("--tp"),
            "{err}"
        );
    }
}
