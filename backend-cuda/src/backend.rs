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

/// f32 activations on the device.
pub struct CudaTensor {
    buf: CudaSlice<f32>,
}

impl CudaTensor {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// u32 indices on the device.
pub struct CudaIndices {
    buf: CudaSlice<u32>,
}

impl CudaIndices {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// A weight matrix in its storage format, bytes exactly as in the model file.
pub struct CudaWeight {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    buf: CudaSlice<u8>,
}

impl CudaWeight {
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    fn row_bytes(&self) -> usize {
        self.format.row_head_bytes()
            + self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    fn elems(&self) -> usize {
        self.rows * self.cols
    }
}

/// One layer's paged K and V, `[num_slots, kv_heads * head_dim]` each (INT4
/// keys: `num_blocks` per-channel blocks).
pub struct CudaKvCache {
    layout: KvCacheLayout,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    /// Per-block key bounds (`kernels/kv_key_bounds.cu`), once tracked.
    bounds: Option<CudaSlice<f32>>,
}

impl CudaKvCache {
    pub fn layout(&self) -> KvCacheLayout {
        self.layout
    }
}

/// Largest head `kernels/select_kv_blocks.cu` sums queries over.
const SELECT_MAX_HEAD_DIM: usize = 256;

/// The code `kernels/common.cuh` uses for a weight format (`FMT_*`).
fn format_code(format: WeightFormat) -> i32 {
    match format {
        WeightFormat::F32 => 0,
        WeightFormat::F16 => 1,
        WeightFormat::BF16 => 2,
        WeightFormat::Q8_0 => 3,
        WeightFormat::Q4_0 => 4,
        WeightFormat::Q4_1 => 5,
        WeightFormat::Int8PerChannel => 6,
        WeightFormat::W8A8 => 7,
        WeightFormat::Int4 {
            group: Int4Group::G64,
        } => 8,
        WeightFormat::Int4 {
            group: Int4Group::G128,
        } => 9,
        WeightFormat::Q5_0 => 10,
        WeightFormat::Q5_1 => 11,
        WeightFormat::IQ4_NL => 12,
        WeightFormat::Q2_K => 13,
        WeightFormat::Q3_K => 14,
        WeightFormat::Q4_K => 15,
        WeightFormat::Q5_K => 16,
        WeightFormat::Q6_K => 17,
    }
}

/// How the kernels name a weight format's matmul entry points:
/// `matmul_STEM_*`, `matmul_rms_norm_STEM_*`, ... (`matmul_FMT.cu`'s stem;
/// `matmul_int4.cu` holds one set per group size).
pub(crate) fn format_stem(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::Int4 {
            group: Int4Group::G64,
        } => "int4_g64",
        WeightFormat::Int4 {
            group: Int4Group::G128,
        } => "int4_g128",
        other => matmul_kernel_name(other).trim_start_matches("matmul_"),
    }
}

/// Mirror of `AttentionShape` in `kernels/paged_attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionShape {
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    max_blocks: u32,
    window: u32,
    scale: f32,
    /// 1: one block table per sequence and KV head
    /// (`AttentionParams::per_head_tables`); 0: one per sequence.
    head_tables: u32,
}

// SAFETY: plain `#[repr(C)]` data with the kernel's field order and types.
unsafe impl DeviceRepr for AttentionShape {}

/// The kernel shape of an attention call (`paged_attention` and its score
/// variant), once every size is checked; `None` when there is nothing to do.
/// `out` is the output's length and the length it needs.
fn attention_shape(
    layout: &KvCacheLayout,
    idx: &AttentionIndices<'_, CudaBackend>,
    p: AttentionParams,
    q_len: usize,
    out: (usize, usize),
) -> Result<Option<AttentionShape>> {
    if p.head_dim == 0 || p.head_dim > MAX_HEAD_DIM {
        return Err(backend_error(format!(
            "paged_attention: head_dim {} outside 1..={MAX_HEAD_DIM}",
            p.head_dim
        )));
    }
    if p.kv_heads == 0 || !p.heads.is_multiple_of(p.kv_heads) {
        return Err(backend_error(format!(
            "paged_attention: {} heads do not share {} KV heads evenly",
            p.heads, p.kv_heads
        )));
    }
    if p.sliding_window == Some(0) {
        return Err(backend_error(
            "paged_attention: sliding_window must be positive",
        ));
    }
    if layout.kv_heads != p.kv_heads
        || layout.head_dim != p.head_dim
        || layout.block_size != p.block_size
    {
        return Err(backend_error(format!(
            "paged_attention: parameters {p:?} do not match the cache layout {layout:?}"
        )));
    }
    check_len("paged_attention: q", q_len, p.rows * p.heads * p.head_dim)?;
    check_len("paged_attention: out", out.0, out.1)?;
    check_len("paged_attention: row_seq", idx.row_seq.len(), p.rows)?;
    check_len("paged_attention: positions", idx.positions.len(), p.rows)?;
    // Per-head tables come whole: `kv_heads` tables of `max_blocks_per_seq`
    // per sequence (the rows' sequences are on the device, not checked).
    let per_seq = p.max_blocks_per_seq * p.tables_per_seq();
    if p.per_head_tables && per_seq != 0 && !idx.block_tables.len().is_multiple_of(per_seq) {
        return Err(backend_error(format!(
            "paged_attention: {} block-table entries are not whole sequences of {} KV heads' \
             tables of {} entries",
            idx.block_tables.len(),
            p.kv_heads,
            p.max_blocks_per_seq
        )));
    }
    if p.rows == 0 || p.heads == 0 {
        return Ok(None);
    }
    Ok(Some(AttentionShape {
        rows: to_u32(p.rows, "rows")?,
        heads: to_u32(p.heads, "heads")?,
        kv_heads: to_u32(p.kv_heads, "kv_heads")?,
        head_dim: to_u32(p.head_dim, "head_dim")?,
        block_size: to_u32(p.block_size, "block_size")?,
        max_blocks: to_u32(p.max_blocks_per_seq, "max_blocks_per_seq")?,
        window: to_u32(p.sliding_window.unwrap_or(0), "sliding_window")?,
        scale: p.scale,
        head_tables: u32::from(p.per_head_tables),
    }))
}

/// The quantized attention kernels' shape: `shape` and the cache's layout
/// (`quant`: the values' slots).
fn quant_shape(
    layout: &KvCacheLayout,
    quant: tandem_core::kv::quant::KvQuantLayout,
    shape: AttentionShape,
) -> Result<QuantAttentionShape> {
    let (slots, blocks) = (layout.key_quant(), layout.key_blocks());
    let key_bits = slots
        .map(|k| k.bits)
        .or(blocks.map(|b| b.bits))
        .unwrap_or(0);
    Ok(QuantAttentionShape {
        shape,
        groups_per_head: to_u32(quant.groups_per_head, "groups per head")?,
        bits: to_u32(quant.bits, "bits")?,
        slot_words: to_u32(quant.slot_words(), "slot words")?,
        key_channels: to_u32(blocks.map_or(0, |b| b.channels()), "KV width")?,
        key_bits: to_u32(key_bits, "key bits")?,
        key_slot_words: to_u32(slots.map_or(0, |k| k.slot_words()), "key slot words")?,
    })
}

/// Mirror of `QuantAttentionShape` in `kernels/paged_attention_quant.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct QuantAttentionShape {
    shape: AttentionShape,
    groups_per_head: u32,
    bits: u32,
    slot_words: u32,
    /// INT4: `kv_heads * head_dim`, keys in per-channel blocks; 0: keys in slots.
    key_channels: u32,
    key_bits: u32,
    key_slot_words: u32,
}

// SAFETY: plain `#[repr(C)]` data with the kernel's field order and types
// (the nested struct is all 4-byte fields, so no padding appears).
unsafe impl DeviceRepr for QuantAttentionShape {}

// ---- tuning constants, mirrored from the kernels ----

/// Tokens the decode GEMV takes (`gemv_t8`); more go to the tiled kernel or cuBLAS.
const GEMV_MAX_TOKENS: usize = 8;
/// `GEMV_ROWS` output rows per GEMV block of 128 threads (4 warps).
const GEMV_ROWS_PER_BLOCK: usize = 2;
const GEMV_THREADS: u32 = 128;
/// The unaligned GEMV: `GEMV_ROWS` rows per warp, 4 warps.
const UNALIGNED_ROWS_PER_BLOCK: usize = GEMV_ROWS_PER_BLOCK * GEMV_THREADS as usize / 32;
/// `TILE_T`, `TILE_R` of the tiled GEMM, 256 threads.
const TILE: usize = 64;
const TILE_THREADS: u32 = 256;
/// Attention: at most this many query rows use the split-K decode kernel.
const DECODE_MAX_ROWS: usize = 16;
/// Decode splits are at least this many keys long, a multiple of the key tile.
const MIN_SPLIT_KEYS: usize = 256;
const MAX_SPLITS: usize = 64;
const MAX_HEAD_DIM: usize = 256;
const KEY_TILE: usize = 32;
const PREFILL_ROWS: usize = 16;
const ATTENTION_THREADS: u32 = 128;
/// One warp per (head, row) in `paged_attention_quant`.
const WARP_THREADS: u32 = 32;
/// Static shared memory a block may use without opting in.
const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;
/// The y and z grid dimensions' limit.
const MAX_GRID_YZ: usize = 65_535;

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

#[derive(Default)]
struct Scratch {
    /// Attention split partials; the up half of a GLU on the cuBLAS path;
    /// the one-kernel MLP's partial sums.
    partials: Option<CudaSlice<f32>>,
    /// The one-kernel MLP's count of blocks done, zero between launches
    /// (`mlp_residual.cu` resets it).
    mlp_counter: Option<CudaSlice<u32>>,
    halves: Option<CudaSlice<u16>>,
    /// Outgrown buffers a recorded graph may still write to.
    retired_partials: Vec<CudaSlice<f32>>,
    retired_halves: Vec<CudaSlice<u16>>,
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

    /// `paged_kv_write`'s K/V rows (bounds apart).
    fn write_kv_rows(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &CudaIndices,
        rows: usize,
        cache: &mut CudaKvCache,
    ) -> Result<()> {
        let layout = cache.layout;
        let width = layout.row_width();
        check_len("paged_kv_write: k", k.len(), rows * width)?;
        check_len("paged_kv_write: v", v.len(), rows * width)?;
        check_len("paged_kv_write: slots", slots.len(), rows)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let rows32 = to_u32(rows, "rows")?;
        let num_slots = to_u32(layout.num_slots(), "KV slots")?;
        if let Some(quant) = layout.value_quant() {
            let (kv_heads, head_dim, groups_per_head) = (
                to_u32(quant.kv_heads, "kv_heads")?,
                to_u32(quant.head_dim, "head_dim")?,
                to_u32(quant.groups_per_head, "groups per head")?,
            );
            let (slot_words, bits) = (
                to_u32(quant.slot_words(), "slot words")?,
                to_u32(quant.bits, "bits")?,
            );
            let key_quant = layout.key_quant();
            let (key_slot_words, key_bits) = (
                to_u32(key_quant.map_or(0, |k| k.slot_words()), "key slot words")?,
                to_u32(key_quant.map_or(0, |k| k.bits), "key bits")?,
            );
            let keys = u32::from(layout.key_blocks().is_none());
            let grid = (blocks_for(rows * quant.groups(), 128, "KV groups")?, 1, 1);
            sig::paged_kv_write_quant(
                self,
                Which::ONE,
                config(grid, 128, 0),
                &k.buf,
                &v.buf,
                &slots.buf,
                &rows32,
                &kv_heads,
                &head_dim,
                &groups_per_head,
                &num_slots,
                &key_slot_words,
                &key_bits,
                &slot_words,
                &bits,
                &keys,
                &mut cache.k,
                &mut cache.v,
            )?;
            let Some(blocks) = layout.key_blocks() else {
                return Ok(());
            };
            let (channels, block_size, key_bits) = (
                to_u32(blocks.channels(), "KV width")?,
                to_u32(blocks.block_size, "block_size")?,
                to_u32(blocks.bits, "key bits")?,
            );
            let words = rows * blocks.words_per_token();
            let grid = (blocks_for(words, 128, "INT4 key words")?, 1, 1);
            return sig::paged_kv_write_int4_keys(
                self,
                Which::ONE,
                config(grid, 128, 0),
                &k.buf,
                &slots.buf,
                &rows32,
                &channels,
                &block_size,
                &num_slots,
                &key_bits,
                &mut cache.k,
            );
        }
        let width32 = to_u32(width, "KV width")?;
        let grid = (blocks_for(rows * width, 256, "KV elements")?, 1, 1);
        sig::paged_kv_write(
            self,
            Which::variant(kv_variant(layout.values)),
            config(grid, 256, 0),
            &k.buf,
            &v.buf,
            &slots.buf,
            &rows32,
            &width32,
            &num_slots,
            &mut cache.k,
            &mut cache.v,
        )
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

    /// A scratch buffer of at least `len` f32 for `what`'s partial sums
    /// (attention splits, the one-kernel MLP).
    fn partials(&self, len: usize, what: &str) -> Result<ScratchSlice<'_, f32>> {
        let mut guard = self.lock_scratch()?;
        let scratch = &mut *guard;
        self.grow(
            &mut scratch.partials,
            &mut scratch.retired_partials,
            len,
            what,
        )?;
        Ok(ScratchSlice {
            guard,
            pick: |s| s.partials.as_mut(),
        })
    }

    /// With `NormPath::Separate`, `rms_norm(x)` into the scratch partials
    /// for a matmul kernel to read with no norm of its own; `None` where the
    /// kernel applies `norm` itself (or there is none).
    fn separate_norm(
        &self,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        rows: usize,
        cols: usize,
    ) -> Result<Option<ScratchSlice<'_, f32>>> {
        let Some(norm) = norm.filter(|_| self.config.norm == NormPath::Separate) else {
            return Ok(None);
        };
        let mut normed = self.partials(rows * cols, "norm")?;
        let p = RmsNormParams {
            rows,
            dim: cols,
            eps: norm.eps,
        };
        self.launch_rms_norm(&x.buf, norm.weight, p, normed.slice()?)?;
        Ok(Some(normed))
    }

    /// `rms_norm.cu` over `p.rows` rows of `x` into `out`, one block a row.
    fn launch_rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (fmt, dim) = (format_code(weight.format), to_u32(p.dim, "dim")?);
        let grid = (to_u32(p.rows, "rows")?, 1, 1);
        sig::rms_norm(
            self,
            Which::ONE,
            config(grid, row_threads(p.dim), 0),
            x,
            &weight.buf,
            &fmt,
            &dim,
            &p.eps,
            out,
        )
    }

    /// The scratch of a cuBLAS matmul: at least `halves` u16 for half copies
    /// of activations and, when `floats` is not 0, that many f32 (the
    /// attention partials' buffer: the two are never in use at once).
    fn gemm_scratch(&self, halves: usize, floats: usize) -> Result<MutexGuard<'_, Scratch>> {
        let mut guard = self.lock_scratch()?;
        let scratch = &mut *guard;
        self.grow(
            &mut scratch.halves,
            &mut scratch.retired_halves,
            halves,
            "GEMM",
        )?;
        if floats > 0 {
            self.grow(
                &mut scratch.partials,
                &mut scratch.retired_partials,
                floats,
                "GEMM",
            )?;
        }
        Ok(guard)
    }

    /// The one-kernel MLP's scratch: at least `len` f32 of partials, and
    /// its counter.
    fn mlp_scratch(&self, len: usize) -> Result<MutexGuard<'_, Scratch>> {
        let ScratchSlice { mut guard, .. } = self.partials(len, "MLP")?;
        if guard.mlp_counter.is_none() {
            self.refuse_while_capturing(
                "allocating the MLP counter (run the step once before capturing)",
            )?;
            guard.mlp_counter = Some(self.alloc_raw::<u32>(1)?);
        }
        Ok(guard)
    }

    /// Grows a scratch buffer to at least `len` elements (by powers of two).
    fn grow<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &mut Option<CudaSlice<T>>,
        retired: &mut Vec<CudaSlice<T>>,
        len: usize,
        what: &str,
    ) -> Result<()> {
        if buf.as_ref().is_none_or(|b| b.len() < len) {
            self.refuse_while_capturing(&format!(
                "growing the {what} scratch buffer (run the step once before capturing)"
            ))?;
            let grown = self.alloc_raw::<T>(len.next_power_of_two())?;
            if let Some(old) = buf.replace(grown) {
                self.retire(retired, old);
            }
        }
        Ok(())
    }

    /// Keeps an outgrown scratch buffer alive if a recorded graph may name
    /// it (sizes grow by powers of two, so at most as much again is kept).
    fn retire<T>(&self, retired: &mut Vec<CudaSlice<T>>, old: CudaSlice<T>) {
        if self.recorded.load(Ordering::Acquire) {
            retired.push(old);
        }
    }

    fn lock_scratch(&self) -> Result<MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| backend_error("scratch buffer lock poisoned"))
    }

    fn alloc_raw<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        // Zero-length allocations are not allowed by the driver.
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| backend_error(format!("allocating {len} elements: {e}")))
    }
}

/// A locked scratch buffer.
struct ScratchSlice<'a, T> {
    guard: MutexGuard<'a, Scratch>,
    pick: fn(&mut Scratch) -> Option<&mut CudaSlice<T>>,
}

impl<T> ScratchSlice<'_, T> {
    fn slice(&mut self) -> Result<&mut CudaSlice<T>> {
        (self.pick)(&mut self.guard).ok_or_else(|| backend_error("scratch buffer missing"))
    }
}

impl Scratch {
    /// The partials and the counter that `CudaBackend::mlp_scratch` made.
    fn partials_and_counter(&mut self) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<u32>)> {
        match (self.partials.as_mut(), self.mlp_counter.as_mut()) {
            (Some(partials), Some(counter)) => Ok((partials, counter)),
            _ => Err(backend_error("scratch buffer missing")),
        }
    }

    /// The half and f32 buffers that `CudaBackend::gemm_scratch` grew.
    fn halves_and_floats(&mut self) -> Result<(&mut CudaSlice<u16>, Option<&mut CudaSlice<f32>>)> {
        let halves = self
            .halves
            .as_mut()
            .ok_or_else(|| backend_error("scratch buffer missing"))?;
        Ok((halves, self.partials.as_mut()))
    }
}

fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        Err(backend_error(format!(
            "{what} holds {have} elements, {need} needed"
        )))
    } else {
        Ok(())
    }
}

fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        backend_error(format!(
            "{what} = {v} does not fit the kernels' 32-bit sizes"
        ))
    })
}

fn grid_yz(v: usize, what: &str) -> Result<u32> {
    if v > MAX_GRID_YZ {
        Err(backend_error(format!(
            "{what} = {v} exceeds the {MAX_GRID_YZ} a launch grid allows"
        )))
    } else {
        to_u32(v, what)
    }
}

fn blocks_for(items: usize, per_block: usize, what: &str) -> Result<u32> {
    to_u32(items.div_ceil(per_block).max(1), what)
}

fn config(grid: (u32, u32, u32), threads: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    }
}

/// Threads for a one-block-per-row kernel over `width` values: about four
/// values per thread, a whole number of warps, at most 1024.
fn row_threads(width: usize) -> u32 {
    (width.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// The matmul kernel for `rows` tokens by an `n` x `cols` weight in
/// `format`: its entry point's suffix (`gemv_t{1,2,4,8}`, `gemv_unaligned`,
/// `tiled`) and launch shape, the same for the plain and the fused matmuls.
/// The kernels walk the weight's rows in pairs (a GLU's gate and up rows
/// interleaved), so the grids count its rows whatever the output's width.
pub(crate) fn matmul_variant(
    format: WeightFormat,
    n: usize,
    cols: usize,
    rows: usize,
) -> Result<(String, LaunchConfig)> {
    let vector_rows = format.is_quantized() || cols.is_multiple_of(8);
    if rows <= GEMV_MAX_TOKENS && vector_rows {
        let grid = (blocks_for(n, GEMV_ROWS_PER_BLOCK, "rows of w")?, 1, 1);
        let tokens = rows.next_power_of_two();
        Ok((format!("gemv_t{tokens}"), config(grid, GEMV_THREADS, 0)))
    } else if rows <= GEMV_MAX_TOKENS {
        let grid = (blocks_for(n, UNALIGNED_ROWS_PER_BLOCK, "rows of w")?, 1, 1);
        Ok(("gemv_unaligned".to_string(), config(grid, GEMV_THREADS, 0)))
    } else {
        let grid = (
            blocks_for(n, TILE, "rows of w")?,
            grid_yz(rows.div_ceil(TILE), "token tiles")?,
            1,
        );
        Ok(("tiled".to_string(), config(grid, TILE_THREADS, 0)))
    }
}

/// Intermediate features per block of the one-kernel MLP (`MLP_SLICE`).
const MLP_SLICE: usize = 32;
/// Threads per block of the one-kernel MLP (`MLP_THREADS`).
const MLP_THREADS: u32 = 256;

/// The one-kernel MLP's variant (`t1`, `t8`: the most tokens it takes) and
/// launch shape, or `None` for what it does not take: prefill, weights of two
/// formats or W8A8 (whose matmul quantizes the activations), `f` not a whole
/// number of slices, float rows not 16-byte aligned.
pub(crate) fn mlp_variant(
    [format, down_format]: [WeightFormat; 2],
    dim: usize,
    f: usize,
    rows: usize,
) -> Option<(String, LaunchConfig)> {
    let takes = rows <= GEMV_MAX_TOKENS
        && down_format == format
        && format != WeightFormat::W8A8
        && f.is_multiple_of(MLP_SLICE)
        && (format.is_quantized() || dim.is_multiple_of(8));
    let grid = u32::try_from(f / MLP_SLICE).ok().filter(|_| takes)?;
    let tokens = if rows == 1 { 1 } else { GEMV_MAX_TOKENS };
    Some((format!("t{tokens}"), config((grid, 1, 1), MLP_THREADS, 0)))
}

/// The variant of the float KV cache's kernels (`paged_kv_write_*`,
/// `paged_attention_{decode,prefill,scores}_*`); the quantized caches have
/// kernels of their own.
pub(crate) fn kv_variant(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F16 => "f16",
        KvDtype::F32 | KvDtype::Int8 | KvDtype::Int4 | KvDtype::Int2 => "f32",
    }
}

/// The half type of the weight formats whose prefill GEMMs may go to cuBLAS.
pub(crate) fn half_type(format: WeightFormat) -> Option<HalfType> {
    match format {
        WeightFormat::F16 => Some(HalfType::F16),
        WeightFormat::BF16 => Some(HalfType::BF16),
        _ => None,
    }
}

/// The kernels' activation code: GLU_SWIGLU and GLU_GEGLU in common.cuh.
fn glu_code(glu: Glu) -> i32 {
    match glu {
        Glu::SwiGlu => 0,
        Glu::GeGlu => 1,
    }
}

/// The norm prologue's kernel arguments: weight format code and eps (the
/// kernels ignore both when the norm pointer is null).
fn norm_args(norm: Option<&NormPrologue<'_, CudaWeight>>) -> (i32, f32) {
    norm.map_or((0, 0.0), |n| (format_code(n.weight.format), n.eps))
}

fn check_norm(
    kernel: &str,
    norm: Option<&NormPrologue<'_, CudaWeight>>,
    cols: usize,
) -> Result<()> {
    match norm {
        Some(n) => check_len(&format!("{kernel}: norm weight"), n.weight.elems(), cols),
        None => Ok(()),
    }
}

impl CudaBackend {
    /// `out = act(gate) * up` elementwise: the shared launch of `swiglu` and `geglu`.
    fn gated_product(
        &self,
        glu: Glu,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let kernel = match glu {
            Glu::SwiGlu => "swiglu",
            Glu::GeGlu => "geglu",
        };
        check_len(&format!("{kernel}: gate"), gate.len(), len)?;
        check_len(&format!("{kernel}: up"), up.len(), len)?;
        check_len(&format!("{kernel}: out"), out.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let len64 = len as u64;
        // A grid-stride loop: enough blocks to fill the GPU, not one per element.
        let grid = (blocks_for(len, 256, "len")?.min(1 << 16), 1, 1);
        let (one, cfg) = (Which::ONE, config(grid, 256, 0));
        match glu {
            Glu::SwiGlu => sig::swiglu(self, one, cfg, &gate.buf, &up.buf, &len64, &mut out.buf),
            Glu::GeGlu => sig::geglu(self, one, cfg, &gate.buf, &up.buf, &len64, &mut out.buf),
        }
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Indices = CudaIndices;
    type Weight = CudaWeight;
    type KvCache = CudaKvCache;

    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: BACKEND_NAME.to_string(),
            device: self.report.to_string(),
        }
    }

    fn alloc(&self, len: usize) -> Result<CudaTensor> {
        self.refuse_while_capturing("alloc")?;
        Ok(CudaTensor {
            buf: self.alloc_raw(len)?,
        })
    }

    fn upload(&self, data: &[f32]) -> Result<CudaTensor> {
        let mut t = self.alloc(data.len())?;
        self.write_prefix("upload", &mut t.buf, data)?;
        Ok(t)
    }

    fn download(&self, t: &CudaTensor, len: usize) -> Result<Vec<f32>> {
        self.refuse_while_capturing("download")?;
        download(&self.stream, &t.buf, len)
    }

    fn upload_indices(&self, data: &[u32]) -> Result<CudaIndices> {
        self.refuse_while_capturing("upload_indices")?;
        let mut t = CudaIndices {
            buf: self.alloc_raw(data.len())?,
        };
        self.write_indices(&mut t, data)?;
        Ok(t)
    }

    fn download_indices(&self, t: &CudaIndices, len: usize) -> Result<Vec<u32>> {
        self.refuse_while_capturing("download_indices")?;
        download(&self.stream, &t.buf, len)
    }

    fn write_indices(&self, dst: &mut CudaIndices, data: &[u32]) -> Result<()> {
        self.write_prefix("write_indices", &mut dst.buf, data)
    }

    fn join_ranks(&self, comm: &dyn tandem_core::parallel::Communicator) -> Result<()> {
        if self.nccl.get().is_none() {
            let nccl = crate::nccl::Nccl::join(Arc::clone(&self.stream), comm)?;
            let _ = self.nccl.set(nccl);
        }
        Ok(())
    }

    fn all_reduce_sum(
        &self,
        t: &mut CudaTensor,
        len: usize,
        comm: &dyn tandem_core::parallel::Communicator,
    ) -> Result<()> {
        self.refuse_while_capturing("all_reduce_sum")?;
        check_len("all_reduce_sum", t.buf.len(), len)?;
        match self.nccl.get() {
            Some(nccl) if nccl.size() == comm.size() => nccl.all_reduce_sum(&mut t.buf, len),
            _ => {
                let mut host = download(&self.stream, &t.buf, len)?;
                comm.all_reduce_sum(&mut host)?;
                self.write_prefix("all_reduce_sum", &mut t.buf, &host)
            }
        }
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<CudaWeight> {
        self.refuse_while_capturing("upload_weight")?;
        if !w.cols.is_multiple_of(w.format.block_elems()) {
            return Err(backend_error(format!(
                "a {} weight needs columns in multiples of {}, got {}",
                w.format,
                w.format.block_elems(),
                w.cols
            )));
        }
        let expected = w.format.bytes_for(w.rows as u64, w.cols as u64);
        if expected != Some(w.data.len() as u64) {
            return Err(backend_error(format!(
                "weight of {}x{} {} needs whole blocks per row and {:?} bytes, got {}",
                w.rows,
                w.cols,
                w.format,
                expected,
                w.data.len()
            )));
        }
        let mut buf = self.alloc_raw::<u8>(w.data.len())?;
        if !w.data.is_empty() {
            let mut view = buf.slice_mut(..w.data.len());
            self.stream
                .memcpy_htod(w.data, &mut view)
                .map_err(|e| backend_error(format!("copy weight to device: {e}")))?;
        }
        Ok(CudaWeight {
            format: w.format,
            rows: w.rows,
            cols: w.cols,
            buf,
        })
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<CudaKvCache> {
        self.refuse_while_capturing("alloc_kv_cache")?;
        layout.check()?;
        let bytes = |block_bytes: usize| {
            layout
                .num_blocks
                .checked_mul(block_bytes)
                .ok_or_else(|| backend_error("KV cache size overflows"))
        };
        Ok(CudaKvCache {
            layout,
            k: self.alloc_raw(bytes(layout.key_block_bytes())?)?,
            v: self.alloc_raw(bytes(layout.value_block_bytes())?)?,
            bounds: None,
        })
    }

    fn copy_kv_blocks(&self, cache: &mut CudaKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        let layout = cache.layout;
        // Quantized blocks carry their scales, so whole blocks copy everything.
        let (key_bytes, value_bytes) = (layout.key_block_bytes(), layout.value_block_bytes());
        for &(src, dst) in pairs {
            if src as usize >= layout.num_blocks || dst as usize >= layout.num_blocks {
                return Err(backend_error(format!(
                    "copy_kv_blocks: block pair ({src}, {dst}) outside {} blocks",
                    layout.num_blocks
                )));
            }
        }
        let bounds_bytes = 4 * 2 * layout.row_width();
        let mut stores = vec![
            (cache.k.device_ptr(&self.stream), key_bytes),
            (cache.v.device_ptr(&self.stream), value_bytes),
        ];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds.device_ptr(&self.stream), bounds_bytes));
        }
        for ((base, _sync), block_bytes) in &stores {
            let (base, block_bytes) = (*base, *block_bytes);
            for &(src, dst) in pairs {
                // SAFETY: both ranges lie inside `buf` (checked above) and the
                // copy is ordered on the backend's stream.
                unsafe {
                    driver_result::memcpy_dtod_async(
                        base + (dst as usize * block_bytes) as u64,
                        base + (src as usize * block_bytes) as u64,
                        block_bytes,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| backend_error(format!("copy_kv_blocks: {e}")))?;
            }
        }
        Ok(())
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn can_record(&self) -> bool {
        true
    }

    fn begin_capture(&self) -> Result<()> {
        self.begin_graph_capture()
    }

    fn end_capture(&self) -> Result<Box<dyn RecordedStep>> {
        Ok(Box::new(self.end_graph_capture()?))
    }

    fn embedding(
        &self,
        table: &CudaWeight,
        tokens: &CudaIndices,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let dim = table.cols;
        check_len("embedding: tokens", tokens.len(), rows)?;
        check_len("embedding: out", out.len(), rows * dim)?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (fmt, row_bytes) = (format_code(table.format), table.row_bytes() as u64);
        let (vocab, dim32) = (to_u32(table.rows, "vocabulary")?, to_u32(dim, "dim")?);
        let grid = (blocks_for(dim, 256, "dim")?, grid_yz(rows, "rows")?, 1);
        sig::embedding(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &table.buf,
            &fmt,
            &row_bytes,
            &vocab,
            &tokens.buf,
            &dim32,
            &mut out.buf,
        )
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_len("rms_norm: x", x.len(), p.rows * p.dim)?;
        check_len("rms_norm: out", out.len(), p.rows * p.dim)?;
        check_len("rms_norm: weight", weight.elems(), p.dim)?;
        if p.rows == 0 || p.dim == 0 {
            return Ok(());
        }
        self.launch_rms_norm(&x.buf, weight, p, &mut out.buf)
    }

    fn rms_norm_residual(
        &self,
        residual: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaWeight,
        p: RmsNormParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm_residual: residual", residual.len(), n)?;
        check_len("rms_norm_residual: delta", delta.len(), n)?;
        check_len("rms_norm_residual: out", out.len(), n)?;
        check_len("rms_norm_residual: weight", weight.elems(), p.dim)?;
        if p.rows == 0 || p.dim == 0 {
            return Ok(());
        }
        let (fmt, dim) = (format_code(weight.format), to_u32(p.dim, "dim")?);
        let grid = (to_u32(p.rows, "rows")?, 1, 1);
        sig::rms_norm_residual(
            self,
            Which::ONE,
            config(grid, row_threads(p.dim), 0),
            &mut residual.buf,
            &delta.buf,
            &weight.buf,
            &fmt,
            &dim,
            &p.eps,
            &mut out.buf,
        )
    }

    fn matmul(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        check_len("matmul: x", x.len(), rows * cols)?;
        check_len("matmul: out", out.len(), rows * n)?;
        if let Some(b) = bias {
            check_len("matmul: bias", b.elems(), n)?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        match self.cublas_for(w, rows) {
            Some((blas, ty)) => self.matmul_cublas(blas, ty, x, w, bias, rows, out),
            None => self.matmul_kernel(x, w, bias, rows, out),
        }
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &CudaTensor,
        norm: Option<NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, CudaTensor>],
    ) -> Result<()> {
        let kernel = "matmul_rms_norm";
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        if let Some(why) = split_error(outs.iter().map(|o| o.width), n) {
            return Err(backend_error(format!("{kernel}: {why}")));
        }
        check_len("matmul_rms_norm: x", x.len(), rows * cols)?;
        for (i, o) in outs.iter().enumerate() {
            check_len(
                &format!("{kernel}: output {i}"),
                o.out.len(),
                rows * o.width,
            )?;
        }
        if let Some(b) = bias {
            check_len("matmul_rms_norm: bias", b.elems(), n)?;
        }
        check_norm(kernel, norm.as_ref(), cols)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            return self.rms_norm_cublas(blas, ty, x, norm.as_ref(), w, bias, rows, outs);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let mut normed = self.separate_norm(x, norm.as_ref(), rows, cols)?;
        let (x, norm) = match normed.as_mut() {
            Some(normed) => (&*normed.slice()?, None),
            None => (&x.buf, norm),
        };
        let (norm_fmt, eps) = norm_args(norm.as_ref());
        let bias_fmt = bias.map_or(0, |b| format_code(b.format));
        // Where parts 0 and 1 end (n for an absent part).
        let mut ends = [n; MAX_SPLIT];
        let mut end = 0;
        for (e, o) in ends.iter_mut().zip(outs.iter()) {
            end += o.width;
            *e = end;
        }
        let (end0, end1) = (to_u32(ends[0], "split")?, to_u32(ends[1], "split")?);
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(n, "n")?,
            to_u32(cols, "cols")?,
        );
        // The parts' outputs in order, null for an absent part.
        const _: () = assert!(MAX_SPLIT == 3, "matmul_rms_norm takes three outputs");
        let mut parts = outs.iter_mut().map(|o| &mut o.out.buf);
        let (out0, out1, out2) = (parts.next(), parts.next(), parts.next());
        sig::matmul_rms_norm(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            x,
            norm.as_ref().map(|n| &n.weight.buf),
            &norm_fmt,
            &eps,
            bias.map(|b| &b.buf),
            &bias_fmt,
            out0,
            out1,
            out2,
            &end0,
            &end1,
            &tokens,
            &n32,
            &cols32,
        )
    }

    fn matmul_glu(
        &self,
        x: &CudaTensor,
        norm: Option<NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        glu: Glu,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let kernel = "matmul_glu";
        if !w.rows.is_multiple_of(2) {
            return Err(backend_error(format!(
                "{kernel}: a [gate; up] weight has an even number of rows, not {}",
                w.rows
            )));
        }
        let (rows, f, cols) = (p.rows, w.rows / 2, w.cols);
        check_len("matmul_glu: x", x.len(), rows * cols)?;
        check_len("matmul_glu: out", out.len(), rows * f)?;
        check_norm(kernel, norm.as_ref(), cols)?;
        if rows == 0 || f == 0 {
            return Ok(());
        }
        let act = glu_code(glu);
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            return self.glu_cublas(blas, ty, x, norm.as_ref(), w, act, rows, out);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let mut normed = self.separate_norm(x, norm.as_ref(), rows, cols)?;
        let (x, norm) = match normed.as_mut() {
            Some(normed) => (&*normed.slice()?, None),
            None => (&x.buf, norm),
        };
        let (norm_fmt, eps) = norm_args(norm.as_ref());
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(w.rows, "n")?,
            to_u32(cols, "cols")?,
        );
        sig::matmul_glu(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            x,
            norm.as_ref().map(|n| &n.weight.buf),
            &norm_fmt,
            &eps,
            &act,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
    }

    fn matmul_residual(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        p: MatmulParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (rows, n, cols) = (p.rows, w.rows, w.cols);
        check_len("matmul_residual: x", x.len(), rows * cols)?;
        check_len("matmul_residual: out", out.len(), rows * n)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        if let Some((blas, ty)) = self.cublas_for(w, rows) {
            // cuBLAS adds into out itself (beta = 1): no epilogue kernel.
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, None, rows, cols, halves)?;
            return self.half_gemms(blas, ty, halves, w, 0..n, rows, &mut out.buf, true);
        }
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(n, "n")?,
            to_u32(cols, "cols")?,
        );
        sig::matmul_residual(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            &x.buf,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
    }

    fn mlp_residual(
        &self,
        residual: &mut CudaTensor,
        norm: NormPrologue<'_, CudaWeight>,
        gate_up: &CudaWeight,
        down: &CudaWeight,
        glu: Glu,
        p: MatmulParams,
        act: &mut CudaTensor,
    ) -> Result<()> {
        let kernel = "mlp_residual";
        let (rows, dim, f) = (p.rows, gate_up.cols, gate_up.rows / 2);
        if !gate_up.rows.is_multiple_of(2) || down.rows != dim || down.cols != f {
            return Err(backend_error(format!(
                "{kernel}: [gate; up] of [{}, {dim}] and down of [{}, {}] (it must be [dim, f] for 2f rows of [gate; up])",
                gate_up.rows, down.rows, down.cols
            )));
        }
        check_len("mlp_residual: residual", residual.len(), rows * dim)?;
        check_norm(kernel, Some(&norm), dim)?;
        if rows == 0 || f == 0 || dim == 0 {
            return Ok(());
        }
        let formats = [gate_up.format, down.format];
        let one_kernel = match self.config.norm {
            NormPath::Separate => None,
            NormPath::Prologue => mlp_variant(formats, dim, f, rows),
        };
        let Some((variant, cfg)) = one_kernel else {
            return mlp_composed(self, residual, norm, gate_up, down, glu, p, act);
        };
        let (norm_fmt, eps) = norm_args(Some(&norm));
        let act = glu_code(glu);
        let (tokens, dim32, f32_) = (to_u32(rows, "rows")?, to_u32(dim, "dim")?, to_u32(f, "f")?);
        let mut scratch = self.mlp_scratch(f / MLP_SLICE * rows * dim)?;
        let (partials, counter) = scratch.partials_and_counter()?;
        sig::mlp_residual(
            self,
            Which::format_variant(gate_up.format, &variant),
            cfg,
            &gate_up.buf,
            &down.buf,
            &mut residual.buf,
            &norm.weight.buf,
            &norm_fmt,
            &eps,
            &act,
            partials,
            counter,
            &tokens,
            &dim32,
            &f32_,
        )
    }

    fn kernel_launches(&self) -> Option<u64> {
        Some(self.launches.load(Ordering::Relaxed))
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &CudaIndices,
        inv_freq: &CudaTensor,
        p: RopeParams,
    ) -> Result<()> {
        if p.rotary_dim > p.head_dim || !p.rotary_dim.is_multiple_of(2) {
            return Err(backend_error(format!(
                "rope: rotary_dim {} must be even and at most head_dim {}",
                p.rotary_dim, p.head_dim
            )));
        }
        check_len("rope: x", x.len(), p.rows * p.heads * p.head_dim)?;
        check_len("rope: positions", positions.len(), p.rows)?;
        check_len("rope: inv_freq", inv_freq.len(), p.rotary_dim / 2)?;
        let pairs = p.rows * p.heads * (p.rotary_dim / 2);
        if pairs == 0 {
            return Ok(());
        }
        let (rows, heads) = (to_u32(p.rows, "rows")?, to_u32(p.heads, "heads")?);
        let (head_dim, rotary_dim) = (
            to_u32(p.head_dim, "head_dim")?,
            to_u32(p.rotary_dim, "rotary_dim")?,
        );
        let style: i32 = match p.style {
            RopeStyle::Interleaved => 0,
            RopeStyle::NeoX => 1,
        };
        let grid = (blocks_for(pairs, 256, "rope pairs")?, 1, 1);
        sig::rope(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &mut x.buf,
            &positions.buf,
            &inv_freq.buf,
            &rows,
            &heads,
            &head_dim,
            &rotary_dim,
            &style,
        )
    }

    fn paged_kv_write(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &CudaIndices,
        rows: usize,
        cache: &mut CudaKvCache,
    ) -> Result<()> {
        self.write_kv_rows(k, v, slots, rows, cache)?;
        let layout = cache.layout;
        let (Some(bounds), true) = (&mut cache.bounds, rows > 0) else {
            return Ok(());
        };
        let channels = layout.row_width();
        let grid = (
            blocks_for(rows * channels, 128, "key bound elements")?,
            1,
            1,
        );
        sig::kv_key_bounds(
            self,
            Which::ONE,
            config(grid, 128, 0),
            &k.buf,
            &slots.buf,
            &to_u32(rows, "rows")?,
            &to_u32(channels, "KV width")?,
            &to_u32(layout.head_dim, "head_dim")?,
            &to_u32(layout.block_size, "block_size")?,
            &to_u32(layout.num_slots(), "KV slots")?,
            bounds,
        )
    }

    fn track_key_bounds(&self, cache: &mut CudaKvCache) -> Result<()> {
        self.refuse_while_capturing("track_key_bounds")?;
        if cache.bounds.is_none() {
            let l = cache.layout;
            cache.bounds = Some(self.alloc_raw(l.num_blocks * 2 * l.row_width())?);
        }
        Ok(())
    }

    fn select_kv_blocks(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut CudaIndices,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "select_kv_blocks: per-head block tables are not supported as input; \
                 one table per sequence",
            ));
        }
        let bounds = cache.bounds.as_ref().ok_or_else(|| {
            backend_error("select_kv_blocks: the cache keeps no key bounds (track_key_bounds)")
        })?;
        let layout = cache.layout;
        if p.kv_heads == 0
            || !p.heads.is_multiple_of(p.kv_heads)
            || (p.kv_heads, p.head_dim, p.block_size)
                != (layout.kv_heads, layout.head_dim, layout.block_size)
            || p.head_dim > SELECT_MAX_HEAD_DIM
            || p.max_blocks_per_seq == 0
            || select.top_blocks == 0
        {
            return Err(backend_error(format!(
                "select_kv_blocks: {} heads over {} KV heads of {} dims in blocks of {}, top {}, \
                 do not fit a cache of {} KV heads of {} dims in blocks of {} \
                 (at most {SELECT_MAX_HEAD_DIM} dims, one block)",
                p.heads,
                p.kv_heads,
                p.head_dim,
                p.block_size,
                select.top_blocks,
                layout.kv_heads,
                layout.head_dim,
                layout.block_size
            )));
        }
        let seqs = idx.block_tables.len() / p.max_blocks_per_seq;
        check_len(
            "select_kv_blocks: q",
            q.len(),
            p.rows * p.heads * p.head_dim,
        )?;
        check_len("select_kv_blocks: row_seq", idx.row_seq.len(), p.rows)?;
        check_len("select_kv_blocks: positions", idx.positions.len(), p.rows)?;
        // One table per sequence and KV head.
        check_len(
            "select_kv_blocks: out",
            out.len(),
            seqs * p.kv_heads * p.max_blocks_per_seq,
        )?;
        if seqs == 0 {
            return Ok(());
        }
        let mut scratch =
            self.partials(seqs * p.kv_heads * p.max_blocks_per_seq, "block bounds")?;
        let scratch = scratch.slice()?;
        sig::select_kv_blocks(
            self,
            Which::ONE,
            config((to_u32(seqs, "sequences")?, 1, 1), 128, 0),
            &q.buf,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            bounds,
            &to_u32(p.rows, "rows")?,
            &to_u32(p.heads, "heads")?,
            &to_u32(p.kv_heads, "kv_heads")?,
            &to_u32(p.head_dim, "head_dim")?,
            &to_u32(p.block_size, "block_size")?,
            &to_u32(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            &to_u32(select.top_blocks, "top blocks")?,
            &to_u32(select.sink_blocks, "sink blocks")?,
            &to_u32(select.recent_blocks, "recent blocks")?,
            scratch,
            &mut out.buf,
        )
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let layout = cache.layout;
        let out_len = (out.len(), p.rows * p.heads * p.head_dim);
        let Some(shape) = attention_shape(&layout, &idx, p, q.len(), out_len)? else {
            return Ok(());
        };
        if let Some(quant) = layout.value_quant() {
            let shape = quant_shape(&layout, quant, shape)?;
            let grid = (to_u32(p.heads, "heads")?, grid_yz(p.rows, "rows")?, 1);
            return sig::paged_attention_quant(
                self,
                Which::ONE,
                config(grid, WARP_THREADS, 0),
                &q.buf,
                &cache.k,
                &cache.v,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &shape,
                &mut out.buf,
            );
        }
        let suffix = kv_variant(layout.values);
        match self.config.attention {
            AttentionPath::Auto if p.rows <= DECODE_MAX_ROWS => {
                let max_context = p.max_blocks_per_seq * p.block_size;
                let splits = decode_splits(max_context, p.heads * p.rows, self.sm_count);
                self.attention_decode(
                    q,
                    cache,
                    &idx,
                    p,
                    shape,
                    suffix,
                    max_context.div_ceil(splits),
                    out,
                )
            }
            AttentionPath::Auto | AttentionPath::Prefill => {
                self.attention_prefill(q, cache, &idx, p, shape, suffix, out)
            }
            AttentionPath::DecodeSplit { keys_per_split } => {
                self.attention_decode(q, cache, &idx, p, shape, suffix, keys_per_split.max(1), out)
            }
        }
    }

    fn paged_attention_scores(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut CudaTensor,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "paged_attention_scores: per-head block tables are not supported; \
                 one table per sequence",
            ));
        }
        let layout = cache.layout;
        let scores_len = (scores.len(), p.rows * p.kv_heads * p.max_blocks_per_seq);
        let Some(shape) = attention_shape(&layout, &idx, p, q.len(), scores_len)? else {
            return Ok(());
        };
        // One warp per (KV head, row).
        let grid = (to_u32(p.kv_heads, "kv_heads")?, grid_yz(p.rows, "rows")?, 1);
        let cfg = config(grid, WARP_THREADS, 0);
        match layout.value_quant() {
            Some(quant) => sig::paged_attention_quant_scores(
                self,
                Which::ONE,
                cfg,
                &q.buf,
                &cache.k,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &quant_shape(&layout, quant, shape)?,
                &mut scores.buf,
            ),
            None => sig::paged_attention_scores(
                self,
                Which::variant(kv_variant(layout.values)),
                cfg,
                &q.buf,
                &cache.k,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                &shape,
                &mut scores.buf,
            ),
        }
    }

    fn swiglu(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.gated_product(Glu::SwiGlu, gate, up, len, out)
    }

    fn geglu(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        len: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.gated_product(Glu::GeGlu, gate, up, len, out)
    }

    fn scale(&self, x: &mut CudaTensor, len: usize, factor: f32) -> Result<()> {
        check_len("scale: x", x.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let len64 = len as u64;
        let grid = (blocks_for(len, 256, "len")?.min(1 << 16), 1, 1);
        sig::scale(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &mut x.buf,
            &len64,
            &factor,
        )
    }

    fn gather_rows(
        &self,
        x: &CudaTensor,
        rows: &CudaIndices,
        n: usize,
        width: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_len("gather_rows: rows", rows.len(), n)?;
        check_len("gather_rows: out", out.len(), n * width)?;
        if n == 0 || width == 0 {
            return Ok(());
        }
        // The source rows are device data: the kernel trusts them to lie in
        // `x`, as the CPU reference's indexing does.
        let width32 = to_u32(width, "width")?;
        let grid = (blocks_for(width, 256, "width")?, grid_yz(n, "rows")?, 1);
        sig::gather_rows(
            self,
            Which::ONE,
            config(grid, 256, 0),
            &x.buf,
            &rows.buf,
            &width32,
            &mut out.buf,
        )
    }

    fn moe_route(
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

    fn moe_combine(
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

    fn argmax(
        &self,
        x: &CudaTensor,
        rows: usize,
        width: usize,
        out: &mut CudaIndices,
    ) -> Result<()> {
        check_len("argmax: x", x.len(), rows * width)?;
        check_len("argmax: out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let width32 = to_u32(width, "width")?;
        let grid = (to_u32(rows, "rows")?, 1, 1);
        sig::argmax(
            self,
            Which::ONE,
            config(grid, row_threads(width), 0),
            &x.buf,
            &width32,
            &mut out.buf,
        )
    }
}

impl CudaBackend {
    /// Decode GEMV for up to `GEMV_MAX_TOKENS` rows, the tiled kernel beyond.
    fn matmul_kernel(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (variant, cfg) = matmul_variant(w.format, w.rows, w.cols, rows)?;
        let bias_fmt = bias.map_or(0, |b| format_code(b.format));
        let (tokens, n32, cols32) = (
            to_u32(rows, "rows")?,
            to_u32(w.rows, "n")?,
            to_u32(w.cols, "cols")?,
        );
        sig::matmul(
            self,
            Which::format_variant(w.format, &variant),
            cfg,
            &w.buf,
            &x.buf,
            bias.map(|b| &b.buf),
            &bias_fmt,
            &mut out.buf,
            &tokens,
            &n32,
            &cols32,
        )
    }

    /// cuBLAS and the half type when a matmul of `rows` tokens by `w` goes
    /// to cuBLAS: dense F16/BF16 prefill. Decode (at most `GEMV_MAX_TOKENS`
    /// rows, the only steps recorded as graphs) never does, so the scratch
    /// these paths grow is never needed during a capture.
    fn cublas_for(&self, w: &CudaWeight, rows: usize) -> Option<(&Blas, HalfType)> {
        let ty = half_type(w.format)?;
        let blas = self.blas.as_ref()?;
        (rows > GEMV_MAX_TOKENS && w.cols > 0).then_some((blas, ty))
    }

    /// Dense prefill GEMM on tensor cores: the activations are rounded to the
    /// weight's half type (bf16 as a hi + lo pair, see `matmul_bf16.cu`),
    /// cuBLAS multiplies with f32 accumulation, then the bias is added.
    #[allow(clippy::too_many_arguments)]
    fn matmul_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        {
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * w.cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, None, rows, w.cols, halves)?;
            self.half_gemms(blas, ty, halves, w, 0..w.rows, rows, &mut out.buf, false)?;
        }
        if let Some(b) = bias {
            let bias_fmt = format_code(b.format);
            let (rows32, n32) = (to_u32(rows, "rows")?, to_u32(w.rows, "n")?);
            let grid = (
                blocks_for(rows * w.rows, 256, "out elements")?.min(1 << 16),
                1,
                1,
            );
            sig::matmul_add_bias(
                self,
                Which::format(w.format),
                config(grid, 256, 0),
                &mut out.buf,
                &b.buf,
                &bias_fmt,
                &rows32,
                &n32,
            )?;
        }
        Ok(())
    }

    /// `x`, through the norm when there is one, in the GEMM's half type into
    /// `halves`: f16, or bf16 as hi then lo (`rows * cols` each).
    fn half_activations(
        &self,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        rows: usize,
        cols: usize,
        halves: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let len = rows * cols;
        check_len("GEMM scratch", halves.len(), HALF_PARTS * len)?;
        if let Some(norm) = norm {
            // One block per row: the row's inverse RMS, then its halves.
            let (fmt, cols32) = (format_code(norm.weight.format), to_u32(cols, "cols")?);
            let cfg = config((to_u32(rows, "rows")?, 1, 1), row_threads(cols), 0);
            let (mut hi, mut lo) = halves.split_at_mut(len);
            let (x, weight, eps) = (&x.buf, &norm.weight.buf, &norm.eps);
            // Units of matmul_rms_norm.cu, each has both; the half format's.
            return match ty {
                HalfType::F16 => sig::matmul_rms_norm_f16_split_x(
                    self,
                    Which::format(WeightFormat::F16),
                    cfg,
                    x,
                    weight,
                    &fmt,
                    eps,
                    &cols32,
                    &mut hi,
                    &mut lo,
                ),
                HalfType::BF16 => sig::matmul_rms_norm_bf16_split_x(
                    self,
                    Which::format(WeightFormat::BF16),
                    cfg,
                    x,
                    weight,
                    &fmt,
                    eps,
                    &cols32,
                    &mut hi,
                    &mut lo,
                ),
            };
        }
        let len64 = len as u64;
        let cfg = config(
            (blocks_for(len, 256, "x elements")?.min(1 << 16), 1, 1),
            256,
            0,
        );
        let (mut hi, mut lo) = halves.split_at_mut(len);
        match ty {
            HalfType::F16 => {
                sig::matmul_f16_split_x(self, Which::ONE, cfg, &x.buf, &mut hi, &mut lo, &len64)
            }
            HalfType::BF16 => {
                sig::matmul_bf16_split_x(self, Which::ONE, cfg, &x.buf, &mut hi, &mut lo, &len64)
            }
        }
    }

    /// `out (+)= x · w[w_rows]ᵀ` on cuBLAS from the half activations that
    /// `half_activations` wrote: one GEMM per half matrix (hi, then lo
    /// accumulated). `out` is `[rows, w_rows.len()]`.
    #[allow(clippy::too_many_arguments)]
    fn half_gemms(
        &self,
        blas: &Blas,
        ty: HalfType,
        halves: &CudaSlice<u16>,
        w: &CudaWeight,
        w_rows: Range<usize>,
        rows: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let (n, cols) = (w_rows.len(), w.cols);
        let len = rows * cols;
        if w_rows.end > w.rows {
            return Err(backend_error(format!(
                "GEMM of weight rows {w_rows:?} of {}",
                w.rows
            )));
        }
        check_len("GEMM scratch", halves.len(), HALF_PARTS * len)?;
        check_len("GEMM output", out.len(), rows * n)?;
        if n == 0 {
            return Ok(());
        }
        let (w_ptr, _w_sync) = w.buf.device_ptr(&self.stream);
        let (x_ptr, _x_sync) = halves.device_ptr(&self.stream);
        let (out_ptr, _out_sync) = out.device_ptr_mut(&self.stream);
        for part in 0..HALF_PARTS {
            let gemm = HalfGemm {
                ty,
                w: w_ptr + (w_rows.start * cols * 2) as u64,
                x: x_ptr + (part * len * 2) as u64,
                out: out_ptr,
                rows,
                n,
                cols,
                accumulate: accumulate || part > 0,
            };
            // SAFETY: the weight rows lie in w (cols halves each, whole rows
            // checked at upload), the scratch holds `parts * len` halves and
            // out `rows * n` f32 (all checked above).
            unsafe { blas.half_gemm(&gemm) }?;
            self.count_launch();
        }
        Ok(())
    }

    /// `matmul_rms_norm` on cuBLAS, composed: the normalised activations in
    /// half precision (one kernel), one GEMM per part straight into its
    /// output (that part's rows of w), then each part's slice of the bias.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        outs: &mut [SplitOut<'_, CudaTensor>],
    ) -> Result<()> {
        {
            let mut scratch = self.gemm_scratch(HALF_PARTS * rows * w.cols, 0)?;
            let (halves, _) = scratch.halves_and_floats()?;
            self.half_activations(ty, x, norm, rows, w.cols, halves)?;
            let mut start = 0;
            for o in outs.iter_mut() {
                let part = start..start + o.width;
                self.half_gemms(blas, ty, halves, w, part, rows, &mut o.out.buf, false)?;
                start += o.width;
            }
        }
        let Some(b) = bias else {
            return Ok(());
        };
        let (bias_fmt, rows32) = (format_code(b.format), to_u32(rows, "rows")?);
        let mut start = 0;
        for o in outs.iter_mut() {
            let (width, start32) = (to_u32(o.width, "width")?, to_u32(start, "split")?);
            start += o.width;
            if o.width == 0 {
                continue;
            }
            let grid = (
                blocks_for(rows * o.width, 256, "out elements")?.min(1 << 16),
                1,
                1,
            );
            sig::matmul_rms_norm_add_bias(
                self,
                Which::format(w.format),
                config(grid, 256, 0),
                &mut o.out.buf,
                &b.buf,
                &bias_fmt,
                &rows32,
                &width,
                &start32,
            )?;
        }
        Ok(())
    }

    /// `matmul_glu` on cuBLAS, composed: the (normalised) activations in
    /// half precision, the gate GEMM into `out`, the up GEMM into scratch,
    /// then `matmul_glu_gate` (out = act(out) * up).
    #[allow(clippy::too_many_arguments)]
    fn glu_cublas(
        &self,
        blas: &Blas,
        ty: HalfType,
        x: &CudaTensor,
        norm: Option<&NormPrologue<'_, CudaWeight>>,
        w: &CudaWeight,
        act: i32,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (f, cols) = (w.rows / 2, w.cols);
        let len = rows * f;
        let mut scratch = self.gemm_scratch(HALF_PARTS * rows * cols, len)?;
        let (halves, up) = scratch.halves_and_floats()?;
        let up = up.ok_or_else(|| backend_error("scratch buffer missing"))?;
        self.half_activations(ty, x, norm, rows, cols, halves)?;
        self.half_gemms(blas, ty, halves, w, 0..f, rows, &mut out.buf, false)?;
        self.half_gemms(blas, ty, halves, w, f..2 * f, rows, up, false)?;
        let len64 = len as u64;
        let grid = (blocks_for(len, 256, "out elements")?.min(1 << 16), 1, 1);
        sig::matmul_glu_gate(
            self,
            Which::format(w.format),
            config(grid, 256, 0),
            &mut out.buf,
            &*up,
            &len64,
            &act,
        )
    }

    /// Split-K decode attention: a block per (head, row, split of
    /// `keys_per_split` keys), then the reduction when there is more than one
    /// split.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: &AttentionIndices<'_, Self>,
        p: AttentionParams,
        shape: AttentionShape,
        suffix: &str,
        keys_per_split: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let max_context = p.max_blocks_per_seq * p.block_size;
        let split_keys = keys_per_split.div_ceil(KEY_TILE).max(1) * KEY_TILE;
        let splits = max_context.div_ceil(split_keys).max(1);
        let split_keys = to_u32(split_keys, "split length")?;
        let grid = (
            to_u32(p.heads, "heads")?,
            grid_yz(p.rows, "rows")?,
            grid_yz(splits, "splits")?,
        );
        let partial_len = p.rows * p.heads * splits * (p.head_dim + 2);
        let mut partials = self.partials(if splits > 1 { partial_len } else { 1 }, "attention")?;
        let partials = partials.slice()?;
        sig::paged_attention_decode(
            self,
            Which::variant(suffix),
            config(grid, ATTENTION_THREADS, 0),
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &shape,
            &split_keys,
            &mut *partials,
            &mut out.buf,
        )?;
        if splits > 1 {
            let (heads, head_dim, splits32) =
                (shape.heads, shape.head_dim, to_u32(splits, "splits")?);
            let grid = (shape.heads, grid_yz(p.rows, "rows")?, 1);
            sig::paged_attention_reduce(
                self,
                Which::ONE,
                config(grid, ATTENTION_THREADS, 0),
                &*partials,
                &heads,
                &head_dim,
                &splits32,
                &mut out.buf,
            )?;
        }
        Ok(())
    }

    /// Prefill attention: a block per (16 query rows, head), K/V tiles
    /// staged in shared memory.
    #[allow(clippy::too_many_arguments)]
    fn attention_prefill(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        idx: &AttentionIndices<'_, Self>,
        p: AttentionParams,
        shape: AttentionShape,
        suffix: &str,
        out: &mut CudaTensor,
    ) -> Result<()> {
        // More shared memory than the default is opted into by
        // `CudaBackend::kernel`.
        let smem = prefill_shared_bytes(p.head_dim);
        let grid = (
            blocks_for(p.rows, PREFILL_ROWS, "rows")?,
            grid_yz(p.heads, "heads")?,
            1,
        );
        sig::paged_attention_prefill(
            self,
            Which::variant(suffix),
            config(grid, ATTENTION_THREADS, smem as u32),
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &shape,
            &mut out.buf,
        )
    }
}

/// How many splits a decode attention call uses: enough blocks to cover the
/// GPU twice, but no split shorter than `MIN_SPLIT_KEYS` keys.
fn decode_splits(max_context: usize, head_rows: usize, sm_count: usize) -> usize {
    let by_length = max_context.div_ceil(MIN_SPLIT_KEYS).max(1);
    let by_occupancy = (2 * sm_count).div_ceil(head_rows.max(1)).max(1);
    by_length.min(by_occupancy).min(MAX_SPLITS)
}

/// Dynamic shared memory of `paged_attention_prefill_*` (see the kernel):
/// q, K (padded) and V tiles of f32, then the tile's slots as i64.
fn prefill_shared_bytes(head_dim: usize) -> usize {
    let floats = PREFILL_ROWS * head_dim + KEY_TILE * (head_dim + 1) + KEY_TILE * head_dim;
    floats * 4 + KEY_TILE * 8
}

fn download<T: DeviceRepr + Default + Clone>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    len: usize,
) -> Result<Vec<T>> {
    check_len("download: source", buf.len(), len)?;
    let mut host = vec![T::default(); len];
    if len > 0 {
        stream
            .memcpy_dtoh(&buf.slice(..len), &mut host)
            .map_err(|e| backend_error(format!("copy to host: {e}")))?;
    }
    stream
        .synchronize()
        .map_err(|e| backend_error(format!("synchronize: {e}")))?;
    Ok(host)
}

/// Compiled kernel modules, one per kernel file (per file and weight format
/// for `sources::PER_FORMAT_FILES`), and their functions.
struct KernelSet {
    ctx: Arc<CudaContext>,
    arch: GpuArch,
    disk: Option<KernelCache>,
    /// By unit: the file's name, or `NAME.STEM` for one format of a file.
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl KernelSet {
    fn new(ctx: Arc<CudaContext>, arch: GpuArch) -> Self {
        KernelSet {
            ctx,
            arch,
            disk: cache::default_dir().map(KernelCache::new),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    /// Kernel `entry` of `file`; of its unit for the format named `stem`
    /// when the file is compiled per format.
    fn function(
        &self,
        file: &'static str,
        stem: Option<&str>,
        entry: &str,
    ) -> Result<CudaFunction> {
        let mut functions = self
            .functions
            .lock()
            .map_err(|_| backend_error("kernel table lock poisoned"))?;
        if let Some(f) = functions.get(entry) {
            return Ok(f.clone());
        }
        let kernel_file = sources::kernel_file(file)
            .ok_or_else(|| backend_error(format!("no kernel file {file}.cu")))?;
        let f = self
            .module(kernel_file, stem)?
            .load_function(entry)
            .map_err(|e| backend_error(format!("{file}.cu has no kernel {entry}: {e}")))?;
        functions.insert(entry.to_string(), f.clone());
        Ok(f)
    }

    fn module(&self, file: &KernelFile, stem: Option<&str>) -> Result<Arc<CudaModule>> {
        let unit = match stem {
            Some(stem) => format!("{}.{stem}", file.name),
            None => file.name.to_string(),
        };
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| backend_error("kernel module lock poisoned"))?;
        if let Some(m) = modules.get(&unit) {
            return Ok(m.clone());
        }
        let source = match stem {
            Some(stem) => sources::format_unit(file.name, file.source, stem),
            None => sources::translation_unit(file.name, file.source),
        };
        let cubin = self.cubin(&unit, &source)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| backend_error(format!("loading {unit}.cu for {}: {e}", self.arch)))?;
        modules.insert(unit, module.clone());
        Ok(module)
    }

    /// The CUBIN of a translation unit: from the disk cache, else compiled
    /// (and then cached).
    fn cubin(&self, unit: &str, source: &str) -> Result<Vec<u8>> {
        let options = CompileOptions::new(self.arch);
        let args = options.to_args();
        let key = CacheKey {
            kernel: unit,
            source,
            arch: self.arch,
            options: &args,
            nvrtc_version: nvrtc::nvrtc_version()?,
        };
        if let Some(cubin) = self.disk.as_ref().and_then(|d| d.load(&key)) {
            return Ok(cubin);
        }
        let compiled = nvrtc::compile(unit, source, &options)?;
        if let Some(disk) = &self.disk {
            // A cache that cannot be written only means compiling again next time.
            let _ = disk.store(&key, &compiled.cubin);
        }
        Ok(compiled.cubin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_fill_the_gpu_without_tiny_splits() {
        // One sequence, 32 heads, 4K context, 132 SMs: 9 splits fill 2 x 132 SMs.
        assert_eq!(decode_splits(4096, 32, 132), 9);
        // Short context: never shorter than MIN_SPLIT_KEYS.
        assert_eq!(decode_splits(300, 32, 132), 2);
        assert_eq!(decode_splits(100, 32, 132), 1);
        // Many rows already fill the GPU.
        assert_eq!(decode_splits(4096, 32 * 16, 132), 1);
        // Very long contexts are capped.
        assert_eq!(decode_splits(1 << 20, 1, 132), MAX_SPLITS);
    }

    #[test]
    fn prefill_shared_memory_matches_the_kernel_layout() {
        // head_dim 128: 16*128 + 32*129 + 32*128 floats, then 32 i64 slots.
        assert_eq!(prefill_shared_bytes(128), (2048 + 4128 + 4096) * 4 + 256);
        assert!(prefill_shared_bytes(128) <= DEFAULT_SMEM_LIMIT);
        assert!(prefill_shared_bytes(256) > DEFAULT_SMEM_LIMIT);
    }

    #[test]
    fn matmul_entry_points_are_named_as_the_kernels_declare_them() {
        for format in WeightFormat::ALL {
            let stem = format_stem(format);
            let fmt = format!("FMT_{}", stem.to_ascii_uppercase());
            // The fused files' entry points, and their per-format units.
            assert!(
                sources::COMMON_HEADER.contains(&format!("M({stem}, {fmt})")),
                "{format}: common.cuh lists no {stem}"
            );
            let file = sources::kernel_file(matmul_kernel_name(format)).unwrap();
            assert!(
                file.source
                    .contains(&format!("DEFINE_MATMUL(matmul_{stem}, {fmt})")),
                "{format}: {}.cu declares no matmul_{stem}_* entry points",
                file.name
            );
            let unaligned = format!("DEFINE_MATMUL_UNALIGNED(matmul_{stem}, {fmt})");
            assert_eq!(
                file.source.contains(&unaligned),
                !format.is_quantized(),
                "{format}: an unaligned GEMV exactly for float formats"
            );
        }
    }

    #[test]
    fn the_one_kernel_mlp_takes_decode_shapes_of_one_f32_activation_format() {
        let q4 = WeightFormat::Q4_K;
        let entry = |formats: [WeightFormat; 2], dim, f, rows| {
            mlp_variant(formats, dim, f, rows).map(|(variant, cfg)| {
                let which = Which::format_variant(formats[0], &variant);
                (
                    sig::MLP_RESIDUAL.resolve(which).unwrap().entry,
                    cfg.grid_dim.0,
                )
            })
        };
        assert_eq!(
            entry([q4; 2], 256, 512, 1),
            Some(("mlp_residual_q4_k_t1".into(), 16))
        );
        assert_eq!(
            entry([q4; 2], 256, 512, 3),
            Some(("mlp_residual_q4_k_t8".into(), 16))
        );
        assert_eq!(
            entry([WeightFormat::F16; 2], 48, 64, 8),
            Some(("mlp_residual_f16_t8".into(), 2))
        );
        assert_eq!(entry([q4; 2], 256, 512, 9), None);
        assert_eq!(entry([q4, WeightFormat::Q6_K], 256, 512, 1), None);
        assert_eq!(entry([WeightFormat::W8A8; 2], 64, 32, 1), None);
        assert_eq!(entry([WeightFormat::F32; 2], 48, 37, 1), None);
        assert_eq!(entry([WeightFormat::F32; 2], 45, 64, 1), None);
    }

    #[test]
    fn matmul_variants_follow_the_tokens_and_the_row_alignment() {
        let variant = |format, cols, rows| {
            let (name, cfg) = matmul_variant(format, 101, cols, rows).unwrap();
            (name, cfg.grid_dim, cfg.block_dim.0)
        };
        let gemv = |t: usize| (format!("gemv_t{t}"), (51, 1, 1), GEMV_THREADS);
        assert_eq!(variant(WeightFormat::Q4_K, 256, 1), gemv(1));
        assert_eq!(variant(WeightFormat::Q4_K, 256, 3), gemv(4));
        assert_eq!(variant(WeightFormat::F32, 48, 8), gemv(8));
        // Rows of 45 floats are not 16-byte aligned: 8 rows per block.
        assert_eq!(
            variant(WeightFormat::F32, 45, 8),
            ("gemv_unaligned".to_string(), (13, 1, 1), GEMV_THREADS)
        );
        assert_eq!(
            variant(WeightFormat::F16, 45, 130),
            ("tiled".to_string(), (2, 3, 1), TILE_THREADS)
        );
    }

    #[test]
    fn row_kernels_use_whole_warps() {
        assert_eq!(row_threads(1), 32);
        assert_eq!(row_threads(576), 160);
        assert_eq!(row_threads(4096), 1024);
        assert_eq!(row_threads(1 << 20), 1024);
    }

    #[test]
    fn device_discovery_answers_with_or_without_a_driver() {
        if crate::driver_present() {
            // A driver with or without devices: a list, possibly empty.
            crate::list_devices().unwrap();
        } else {
            let err = CudaBackend::new(0)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("no CUDA driver found"), "{err}");
            let err = crate::list_devices()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("no CUDA driver found"), "{err}");
        }
    }
}
