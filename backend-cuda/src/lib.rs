//! The CUDA backend: the fused kernels of `kernels/*.cu`, compiled at first
//! use by NVRTC for the GPU at hand, run through cudarc on one stream.
//!
//! The crate builds and links on any machine: cudarc opens the driver, NVRTC
//! and cuBLAS at run time. Every entry point first checks that the driver
//! library can be opened (cudarc panics otherwise), so a machine without CUDA
//! gets an [`tandem_core::Error::Backend`] saying so, never a panic.
//!
//! - [`device`]: driver presence, [`list_devices`] for `tandem inspect --devices`.
//! - [`sources`]: the kernel sources, embedded; one file per manifest entry.
//! - [`nvrtc`]: compiling a kernel file to CUBIN, and ptxas's resource figures.
//! - [`cache`]: compiled kernels on disk, per GPU architecture.
//! - [`backend`]: [`CudaBackend`], the `Backend` implementation.
//! - [`graph`]: recording a step as a CUDA graph (`Backend::begin_capture`).
//! - [`nccl`]: the all-reduce of a tensor-parallel job between GPUs.
//! - `signatures`: every kernel launched, its file, entry point and
//!   parameters, in one table the launch code goes through.

pub mod backend;
pub mod cache;
pub mod device;
pub mod graph;
pub mod nccl;
pub mod nvrtc;
pub mod sources;

mod blas;
mod signatures;

pub use backend::{
    AttentionPath, CudaBackend, CudaConfig, CudaIndices, CudaKvCache, CudaTensor, CudaWeight,
    DensePrefill, NormPath,
};
pub use device::{driver_present, list_devices, DeviceReport};
pub use graph::DecodeGraph;

/// The backend's name on the command line and in errors.
pub const BACKEND_NAME: &str = "cuda";

pub(crate) fn backend_error(message: impl Into<String>) -> tandem_core::Error {
    tandem_core::Error::backend(BACKEND_NAME, message)
}
