//! Tandem's WebGPU backend: the fused kernels of `shaders/` run through wgpu,
//! natively on Vulkan, Metal, DX12 or GL, and in the browser on WebGPU.
//!
//! Every kernel call records one or more dispatches into a pending command
//! encoder; the work is submitted once per step, when something is read back
//! (`download*`) or [`WgpuBackend::flush`] is called. Nothing else waits.
//! Weights are uploaded in their storage format, bit for bit (GGML blocks as
//! flat `u32` arrays), split by rows into several buffers where a matrix is
//! larger than the adapter's storage binding limit. Vectors (norm weights,
//! biases) are stored as f32 whatever their format.
//!
//! Shader variants: `shader-f16` and subgroup operations are used where the
//! adapter has them (each can be turned off in [`WgpuOptions`]); see
//! [`shader`] for how the variants are generated from one source per kernel.
//!
//! The fused matmuls (`Backend::fuses_matmuls`) are the matmul entry points
//! with a norm prologue and a split, gated or residual epilogue, one
//! dispatch per weight chunk, W8A8 included. One case runs unfused: a gated
//! unit whose weight is split into chunks, where a gate row and its up row
//! may lie in different buffers (`matmul_glu`).

mod adapter;
mod attention;
mod buffers;
mod gpu;
mod kernels;
mod matmul;
mod moe;
mod rows;
pub mod shader;

#[cfg(not(target_arch = "wasm32"))]
pub use adapter::list_adapters;
pub use adapter::{
    list_adapters_async, AdapterPreference, AdapterReport, GraphicsApi, WgpuOptions,
};

pub use buffers::{WgpuIndices, WgpuKvCache, WgpuTensor, WgpuWeight};

use tandem_core::backend::{
    split_error, AttentionIndices, AttentionParams, Backend, BackendInfo, BlockSelectParams, Glu,
    KvCacheLayout, KvDtype, MatmulParams, MoeCombineParams, MoeRouteParams, NormPrologue,
    RmsNormParams, RopeParams, RopeStyle, SplitOut, MAX_SPLIT,
};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::model::arch::MAX_EXPERTS_PER_TOKEN;
use tandem_core::quant::{WeightFormat, WeightView};
use tandem_core::{Error, Result};

use gpu::{backend_error, Access, Dispatch, Gpu, GpuBuffer};
use shader::{ShaderTarget, ShaderVariant};

// The parts of this crate see each other's items through this.
use buffers::*;

/// Largest head the attention kernel holds (`src/wgsl/attention.wgsl`).
const MAX_HEAD_DIM: usize = 256;

const READ: Access = Access::Read;
const WRITE: Access = Access::ReadWrite;

/// The wgpu backend. Construct it with [`WgpuBackend::new`] (native) or
/// [`WgpuBackend::new_async`] (anywhere, the browser included).
pub struct WgpuBackend {
    gpu: Gpu,
    adapter: AdapterReport,
    /// Bound as the bias of matmuls without one (and the norm weight of
    /// fused matmuls without a prologue).
    no_bias: GpuBuffer,
    /// Bound as the absent parts of a split matmul's output.
    spare_outs: [GpuBuffer; MAX_SPLIT - 1],
    /// Rows of a weight chunk are limited to this many bytes.
    max_chunk_bytes: u64,
    /// Decode-sized matmuls run `gemv_rows` rather than `gemv`.
    gemv_per_row: bool,
}

impl WgpuBackend {
    /// Opens the best adapter allowed by `options` (blocking).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(options: WgpuOptions) -> Result<Self> {
        pollster::block_on(Self::new_async(options))
    }

    pub async fn new_async(options: WgpuOptions) -> Result<Self> {
        let open = adapter::open(&options).await?;
        let target = ShaderTarget {
            f16: open.f16,
            subgroups: open.subgroups,
            browser: cfg!(target_arch = "wasm32"),
        };
        let gpu = Gpu::new(open.device, open.queue, target);
        let no_bias = gpu.dedicated(16, "no bias")?;
        let spare_outs = [
            gpu.dedicated(16, "spare output")?,
            gpu.dedicated(16, "spare output")?,
        ];
        let binding_limit = gpu.limits.max_storage_buffer_binding_size;
        let max_chunk_bytes = options
            .max_weight_chunk_bytes
            .map_or(binding_limit, |cap| cap.min(binding_limit));
        let gemv_per_row = options.gemv_per_row.unwrap_or(open.report.software);
        Ok(WgpuBackend {
            gpu,
            adapter: open.report,
            no_bias,
            spare_outs,
            max_chunk_bytes,
            gemv_per_row,
        })
    }

    /// The adapter in use.
    pub fn adapter(&self) -> &AdapterReport {
        &self.adapter
    }

    /// Whether the shaders use `f16` (the adapter has it and it was not disabled).
    pub fn uses_f16(&self) -> bool {
        self.gpu.target.f16
    }

    /// Whether the shaders use subgroup operations.
    pub fn uses_subgroups(&self) -> bool {
        self.gpu.target.subgroups
    }

    /// `Backend::info`: the adapter and the shader features in use.
    fn backend_info(&self) -> BackendInfo {
        let on_off = |b: bool| if b { "on" } else { "off" };
        BackendInfo {
            name: "wgpu".into(),
            device: format!(
                "{} ({}, f16 {}, subgroups {})",
                self.adapter.name,
                self.adapter.backend,
                on_off(self.uses_f16()),
                on_off(self.uses_subgroups())
            ),
        }
    }

    /// Submits the work recorded so far without waiting for it.
    pub fn flush(&self) -> Result<()> {
        self.gpu.submit()
    }

    /// [`Backend::download`] without blocking (the form the browser needs).
    pub async fn download_async(&self, t: &WgpuTensor, len: usize) -> Result<Vec<f32>> {
        check_len("download", t.len, len)?;
        let bytes = self.gpu.read(&t.buf, 4 * len as u64).await?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// [`Backend::download_indices`] without blocking.
    pub async fn download_indices_async(&self, t: &WgpuIndices, len: usize) -> Result<Vec<u32>> {
        check_len("download_indices", t.len, len)?;
        let bytes = self.gpu.read(&t.buf, 4 * len as u64).await?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    fn dispatch(
        &self,
        variant: ShaderVariant,
        entry: &'static str,
        access: &'static [Access],
        buffers: &[&GpuBuffer],
        params: &[u32],
        workgroups: usize,
    ) -> Result<()> {
        let workgroups = u32::try_from(workgroups).map_err(|_| {
            backend_error(format!(
                "{}: {workgroups} workgroups is too many",
                variant.kernel
            ))
        })?;
        self.gpu.dispatch(Dispatch {
            variant,
            entry,
            access,
            buffers,
            params,
            workgroups,
        })
    }

    /// A `rows x cols` matrix with one of them 1, stored as f32.
    fn upload_vector(&self, rows: usize, cols: usize, values: &[f32]) -> Result<WgpuWeight> {
        let buf = self
            .gpu
            .dedicated(4 * values.len() as u64, "vector weight")?;
        self.gpu.write(&buf, bytes_of_f32(values));
        Ok(WgpuWeight {
            format: WeightFormat::F32,
            rows,
            cols,
            chunks: vec![WeightChunk {
                row_start: 0,
                rows,
                buf,
            }],
        })
    }
}

fn simple(kernel: &'static str) -> ShaderVariant {
    ShaderVariant {
        kernel,
        format: None,
        kv_f16: false,
    }
}

fn bytes_of_f32(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        backend_error(format!(
            "{what} = {n} does not fit the kernels' 32-bit indices"
        ))
    })
}

/// `kernel`'s heads, head size and block size fit the cache and the
/// attention kernels' largest head.
fn check_attention_shape(kernel: &str, p: AttentionParams, layout: &KvCacheLayout) -> Result<()> {
    if p.kv_heads == 0
        || !p.heads.is_multiple_of(p.kv_heads)
        || p.kv_heads != layout.kv_heads
        || p.head_dim != layout.head_dim
        || p.block_size != layout.block_size
    {
        return Err(backend_error(format!(
            "{kernel}: {} heads over {} KV heads of {} dims in blocks of {} do not \
             fit a cache of {} KV heads of {} dims in blocks of {}",
            p.heads,
            p.kv_heads,
            p.head_dim,
            p.block_size,
            layout.kv_heads,
            layout.head_dim,
            layout.block_size
        )));
    }
    if p.head_dim > MAX_HEAD_DIM {
        return Err(backend_error(format!(
            "{kernel}: head_dim {} exceeds the kernel's {MAX_HEAD_DIM}",
            p.head_dim
        )));
    }
    Ok(())
}

/// `have >= need` elements, or an error naming the operand.
fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::backend(
            "wgpu",
            format!("{what}: needs {need} elements, the buffer holds {have}"),
        ));
    }
    Ok(())
}
