//! cuBLAS for the dense F16/BF16 GEMMs of prefill, where tensor cores beat
//! the hand-written tiled kernel. Optional: without `libcublas` the backend
//! uses its own kernels for everything.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result, sys, CudaBlas};
use cudarc::driver::{sys::CUdeviceptr, CudaStream};
use tandem_core::Result;

use crate::backend_error;

/// Element type of the GEMM inputs (the output is always f32).
#[derive(Clone, Copy, Debug)]
pub(crate) enum HalfType {
    F16,
    BF16,
}

/// Half matrices the activations become: hi + lo (`split_half` in
/// `kernels/common.cuh`), one GEMM each.
pub(crate) const HALF_PARTS: usize = 2;

impl HalfType {
    fn cuda_type(self) -> sys::cudaDataType {
        match self {
            HalfType::F16 => sys::cudaDataType::CUDA_R_16F,
            HalfType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        }
    }
}

/// One product `out[t, r] (+)= sum_c x[t, c] * w[r, c]`, all row-major, with
/// `x` and `w` in the same half type and `out` in f32.
pub(crate) struct HalfGemm {
    pub ty: HalfType,
    pub w: CUdeviceptr,
    pub x: CUdeviceptr,
    pub out: CUdeviceptr,
    pub rows: usize,
    pub n: usize,
    pub cols: usize,
    /// Adds to `out` instead of overwriting it.
    pub accumulate: bool,
}

pub(crate) struct Blas {
    handle: CudaBlas,
}

impl Blas {
    /// cuBLAS on `stream`, or `None` when the library is not installed or
    /// will not start (the hand-written kernels then do the work).
    pub fn new(stream: Arc<CudaStream>) -> Option<Blas> {
        // SAFETY: only tries to open the library by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        CudaBlas::new(stream).ok().map(|handle| Blas { handle })
    }

    /// Runs `g` with f32 accumulation. Row-major `out = x · wᵀ` is, read
    /// column-major, `outᵀ (n × rows) = w (n × cols, stored as its
    /// transpose) · xᵀ (cols × rows)`: A = w transposed, B = x as stored.
    ///
    /// # Safety
    /// The pointers must address live device buffers of at least
    /// `n * cols` (w), `rows * cols` (x) and `rows * n` (out) elements.
    pub unsafe fn half_gemm(&self, g: &HalfGemm) -> Result<()> {
        let dim = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| backend_error(format!("cuBLAS GEMM: {what} = {v} exceeds i32")))
        };
        let (m, n, k) = (dim(g.n, "n")?, dim(g.rows, "rows")?, dim(g.cols, "cols")?);
        let alpha = 1.0f32;
        let beta = if g.accumulate { 1.0f32 } else { 0.0f32 };
        result::gemm_ex(
            *self.handle.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            g.w as *const c_void,
            g.ty.cuda_type(),
            k,
            g.x as *const c_void,
            g.ty.cuda_type(),
            k,
            (&beta as *const f32).cast::<c_void>(),
            g.out as *mut c_void,
            sys::cudaDataType::CUDA_R_32F,
            m,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| backend_error(format!("cublasGemmEx: {e:?}")))
    }
}
