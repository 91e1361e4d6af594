//! [`CudaBackend`]: the `Backend` trait on one GPU.
//!
//! All work goes to one stream, in call order, so buffers need no
//! synchronisation beyond it (cudarc's per-buffer event tracking is turned
//! off: it would cost two events per launch and cannot be captured in a
//! graph). Only the `download*` methods wait for the GPU.
//!
//! Kernels are compiled from the embedded sources at first use, through the
//! on-disk cache (`crate::cache`), one module per kernel file. Before a kernel
//! touches memory its sizes are checked against the buffers on the host: a
//! wrong size is an error here, never an out-of-bounds write on the device.
//!
//! The fused matmuls (`matmul_rms_norm`, `matmul_glu`, `matmul_residual`) are
//! one launch of `kernels/matmul_{rms_norm,glu,residual}.cu` each, except in
//! dense F16/BF16 prefill, which goes to cuBLAS like `matmul` and composes
//! there (see `cublas_for`).

mod attention;
mod fused;
mod kernel_set;
mod kernels;
mod launch;
mod matmul;
mod moe;
mod scratch;
mod tensors;
#[cfg(test)]
mod tests;

pub use tensors::{CudaIndices, CudaKvCache, CudaTensor, CudaWeight};

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{
    result as driver_result, sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use tandem_core::backend::{
    mlp_composed, split_error, AttentionIndices, AttentionParams, Backend, BackendInfo,
    BlockSelectParams, Glu, KvCacheLayout, KvDtype, MatmulParams, MoeCombineParams, MoeRouteParams,
    NormPrologue, RecordedStep, RmsNormParams, RopeParams, RopeStyle, SplitOut, MAX_SPLIT,
};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::model::arch::MAX_EXPERTS_PER_TOKEN;
use tandem_core::quant::{Int4Group, WeightFormat, WeightView};
use tandem_core::Result;

use crate::blas::{Blas, HalfGemm, HalfType, HALF_PARTS};
use crate::cache::{self, CacheKey, KernelCache};
use crate::device::{require_driver, DeviceReport};
use crate::nvrtc::{self, CompileOptions, GpuArch};
use crate::signatures::{self as sig, Resolved, Signature, Which};
use crate::sources::{self, KernelFile};
use crate::{backend_error, BACKEND_NAME};

// The parts of this module see each other's items through these.
use kernel_set::*;
use launch::*;
use scratch::*;
use tensors::*;

pub(crate) use launch::{format_stem, AttentionShape, QuantAttentionShape};
#[cfg(test)]
pub(crate) use launch::{half_type, kv_variant, matmul_variant, mlp_variant};

/// Which attention kernel runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// The split-K decode kernel for up to 16 query rows, the prefill kernel beyond.
    #[default]
    Auto,
    /// Always the prefill kernel.
    Prefill,
    /// Always the decode kernel, with key ranges split every `keys_per_split`
    /// keys (rounded up to the 32-key tile) and then reduced.
    DecodeSplit { keys_per_split: usize },
}

/// Where dense F16/BF16 prefill GEMMs run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DensePrefill {
    /// cuBLAS when the library loads, else the tiled kernel.
    #[default]
    CublasWhenPresent,
    /// Always the hand-written tiled kernel.
    Kernels,
}

/// Where the RMSNorm before a matmul kernel runs (the cuBLAS path applies
/// it as it converts the activations), and how a decode MLP runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormPath {
    /// `rms_norm` once into scratch, then the matmul with no norm; the MLP
    /// as `matmul_glu` then `matmul_residual`. Measured on an H200
    /// (`scripts/gpu-profile.sh`, Llama-3-8B shapes at batch 1): the
    /// prologue recomputes each token's RMS in every block, so the F16 LM
    /// head took 576 µs and the fused QKV 43 µs against 11 µs for the O
    /// projection's two thirds of those bytes; the one-kernel MLP took
    /// 524 µs, its last block summing 448 blocks' partials alone.
    #[default]
    Separate,
    /// The norm as the matmul kernels' prologue, and the one-kernel MLP
    /// (`mlp_residual.cu`) where it takes the shape.
    Prologue,
}

/// Choices that change which kernels run, not what they compute: the
/// defaults are the fast ones; the others let tests reach every path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaConfig {
    pub attention: AttentionPath,
    pub dense_prefill: DensePrefill,
    pub norm: NormPath,
}

/// A CUDA GPU running the Tandem kernel set.
pub struct CudaBackend {
    config: CudaConfig,
    stream: Arc<CudaStream>,
    arch: GpuArch,
    report: DeviceReport,
    /// Streaming multiprocessors, for sizing the decode attention splits.
    sm_count: usize,
    kernels: KernelSet,
    blas: Option<Blas>,
    /// Attention split partials and half-precision copies of activations for
    /// cuBLAS; grow-only, reused across calls (stream order keeps reuse safe).
    scratch: Mutex<Scratch>,
    /// Kernels run since the backend was created (`Backend::kernel_launches`);
    /// shared with recorded graphs, which add theirs at each replay.
    pub(crate) launches: Arc<AtomicU64>,
    /// Kernels recorded by the capture in progress.
    pub(crate) captured_launches: AtomicU64,
    /// Set between `begin_capture` and `end_capture` (see `crate::graph`).
    pub(crate) capturing: AtomicBool,
    /// Set once a graph was recorded: outgrown scratch buffers are retired
    /// rather than freed from then on.
    pub(crate) recorded: AtomicBool,
    /// The GPUs of a tensor-parallel job (`Backend::join_ranks`).
    nccl: std::sync::OnceLock<crate::nccl::Nccl>,
}

impl CudaBackend {
    /// Opens GPU `device_ordinal`. Fails with a clear error, never a panic,
    /// when the driver or the device is missing; NVRTC is needed only at the
    /// first kernel launch.
    pub fn new(device_ordinal: usize) -> Result<Self> {
        Self::with_config(device_ordinal, CudaConfig::default())
    }

    pub fn with_config(device_ordinal: usize, config: CudaConfig) -> Result<Self> {
        require_driver()?;
        let devices = crate::device::list_devices()?;
        let report = devices
            .into_iter()
            .find(|d| d.ordinal == device_ordinal)
            .ok_or_else(|| {
                backend_error(format!("no CUDA device with ordinal {device_ordinal}"))
            })?;
        let ctx = CudaContext::new(device_ordinal).map_err(|e| {
            backend_error(format!(
                "creating a context on device {device_ordinal}: {e}"
            ))
        })?;
        // SAFETY: called before any buffer exists; every operation of this
        // backend goes to the one stream below, which orders them.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| backend_error(format!("creating a stream: {e}")))?;
        let arch = GpuArch {
            major: report.compute_capability.0,
            minor: report.compute_capability.1,
        };
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| backend_error(format!("reading the multiprocessor count: {e}")))?
            .max(1) as usize;
        let blas = match config.dense_prefill {
            DensePrefill::CublasWhenPresent => Blas::new(stream.clone()),
            DensePrefill::Kernels => None,
        };
        Ok(CudaBackend {
            config,
            blas,
            kernels: KernelSet::new(ctx, arch),
            stream,
            arch,
            report,
            sm_count,
            scratch: Mutex::new(Scratch::default()),
            launches: Arc::new(AtomicU64::new(0)),
            captured_launches: AtomicU64::new(0),
            capturing: AtomicBool::new(false),
            recorded: AtomicBool::new(false),
            nccl: std::sync::OnceLock::new(),
        })
    }

    pub fn device(&self) -> &DeviceReport {
        &self.report
    }

    pub fn arch(&self) -> GpuArch {
        self.arch
    }

    /// Whether dense F16/BF16 prefill GEMMs go to cuBLAS.
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Compiles (or loads from the disk cache) every kernel file now rather
    /// than at first use, e.g. before capturing a graph or timing a run; the
    /// fused matmul files for every weight format.
    pub fn compile_all(&self) -> Result<()> {
        for file in sources::KERNEL_FILES {
            if sources::PER_FORMAT_FILES.contains(&file.name) {
                for format in WeightFormat::ALL {
                    self.kernels.module(file, Some(format_stem(format)))?;
                }
            } else {
                self.kernels.module(file, None)?;
            }
        }
        Ok(())
    }

    /// Overwrites the start of `dst` with `data`.
    fn write_prefix<T: DeviceRepr>(
        &self,
        what: &str,
        dst: &mut CudaSlice<T>,
        data: &[T],
    ) -> Result<()> {
        self.refuse_while_capturing(what)?;
        check_len(&format!("{what}: destination"), dst.len(), data.len())?;
        let mut view = dst.slice_mut(..data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(|e| backend_error(format!("copy to device: {e}")))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| backend_error(format!("synchronize: {e}")))
    }

    fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capturing.load(Ordering::Acquire) {
            Err(backend_error(format!(
                "{what} during graph capture: allocate, upload and download outside the captured step"
            )))
        } else {
            Ok(())
        }
    }

    /// The kernel of `sig` that `which` names, and its entry point's name,
    /// ready for a launch of `cfg` (more dynamic shared memory than a block
    /// may use by default opted into). Only the launch functions of
    /// `crate::signatures` call this.
    pub(crate) fn kernel(
        &self,
        sig: &Signature,
        which: Which<'_>,
        cfg: &LaunchConfig,
    ) -> Result<(CudaFunction, String)> {
        let Resolved { file, unit, entry } = sig.resolve(which)?;
        let f = self.kernels.function(file, unit, &entry)?;
        let smem = cfg.shared_mem_bytes as usize;
        if smem > DEFAULT_SMEM_LIMIT {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| backend_error(format!("{entry}: {smem} bytes of shared memory: {e}")))?;
        }
        Ok((f, entry))
    }

    pub(crate) fn launch(
        &self,
        what: &str,
        args: &mut cudarc::driver::LaunchArgs<'_>,
        cfg: LaunchConfig,
    ) -> Result<()> {
        // SAFETY: every caller checks its buffer sizes against the kernel's
        // shape arguments first; the arguments are pushed by the launch
        // functions of `crate::signatures`, whose table the tests check
        // against the kernels' declarations.
        unsafe { args.launch(cfg) }
            .map(drop)
            .map_err(|e| backend_error(format!("launching {what}: {e}")))?;
        self.count_launch();
        Ok(())
    }

    /// Counts one kernel (a launch, or a cuBLAS GEMM): into the capture in
    /// progress, if any, whose graph adds it at each replay.
    fn count_launch(&self) {
        let counter = if self.capturing.load(Ordering::Acquire) {
            &self.captured_launches
        } else {
            &*self.launches
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
