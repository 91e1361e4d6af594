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
mod gpu;
pub mod shader;

#[cfg(not(target_arch = "wasm32"))]
pub use adapter::list_adapters;
pub use adapter::{
    list_adapters_async, AdapterPreference, AdapterReport, GraphicsApi, WgpuOptions,
};

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

/// f32 activations on the device.
pub struct WgpuTensor {
    buf: GpuBuffer,
    len: usize,
}

/// u32 indices on the device.
pub struct WgpuIndices {
    buf: GpuBuffer,
    len: usize,
}

/// A weight matrix in its storage format, as one buffer per range of rows.
pub struct WgpuWeight {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    chunks: Vec<WeightChunk>,
}

struct WeightChunk {
    row_start: usize,
    rows: usize,
    buf: GpuBuffer,
}

impl WgpuWeight {
    /// The f32 vector of a norm weight or bias (stored as one f32 buffer).
    fn vector(&self, len: usize, what: &str) -> Result<&GpuBuffer> {
        match self.chunks.as_slice() {
            [chunk] if self.format == WeightFormat::F32 && self.rows * self.cols >= len => {
                Ok(&chunk.buf)
            }
            _ => Err(backend_error(format!(
                "{what}: expected a vector of {len} values, got a {}x{} {} matrix",
                self.rows, self.cols, self.format
            ))),
        }
    }
}

/// Bits per code of quantized keys, in slots or per-channel blocks.
fn key_bits(layout: &KvCacheLayout) -> usize {
    match (layout.key_quant(), layout.key_blocks()) {
        (Some(slots), _) => slots.bits,
        (None, Some(blocks)) => blocks.bits,
        (None, None) => 0,
    }
}

/// One layer's paged K and V storage (layouts: `shaders/paged_kv_write.wgsl`).
pub struct WgpuKvCache {
    layout: KvCacheLayout,
    k: GpuBuffer,
    v: GpuBuffer,
    /// Storage units (f32 values, or u32 words holding two halves or
    /// quantized codes and scales) per value slot.
    slot_units: usize,
    /// Words per key slot of quantized keys in slots (INT8, INT2).
    key_slot_words: usize,
    /// Storage units of one block of keys: `block_size * slot_units`, or
    /// the per-channel INT4 key block.
    key_block_units: usize,
    /// Per-block key bounds (`shaders/kv_key_bounds.wgsl`), once tracked.
    bounds: Option<GpuBuffer>,
}

/// Activation rows up to which `matmul` takes the GEMV path (`wgsl/matmul.wgsl`).
const GEMV_MAX_ROWS: usize = 8;
/// Workgroup size of `gemv_rows` (one thread per output).
const GEMV_ROWS_WG: usize = 64;
/// Activation rows and weight rows of one `tiled` workgroup.
const TILE_ROWS: usize = 32;
const TILE_WEIGHT_ROWS: usize = 64;
/// Largest head the attention kernel holds (`src/wgsl/attention.wgsl`).
const MAX_HEAD_DIM: usize = 256;

const READ: Access = Access::Read;
const WRITE: Access = Access::ReadWrite;

/// A matmul-family kernel (`matmul` and the fused matmuls) over every chunk
/// of its weight: `wgsl/matmul_common.wgsl` says what each binding and
/// parameter is.
struct MatmulLaunch<'a> {
    variant: ShaderVariant,
    access: &'static [Access],
    x: &'a WgpuTensor,
    w: &'a WgpuWeight,
    bias: Option<&'a GpuBuffer>,
    rows: usize,
    /// Weight rows per output: 2 where an output is a gate and an up row.
    pair: usize,
    /// The bindings after the bias: the output, then the kernel's own.
    tail: &'a [&'a GpuBuffer],
    /// The parameters after the six that every matmul reads.
    extra: &'a [u32],
}

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

impl WgpuBackend {
    /// `paged_kv_write`'s K/V rows (bounds apart).
    fn write_kv_rows(
        &self,
        k: &WgpuTensor,
        v: &WgpuTensor,
        slots: &WgpuIndices,
        rows: usize,
        cache: &mut WgpuKvCache,
    ) -> Result<()> {
        let width = cache.layout.row_width();
        check_len("paged_kv_write k", k.len, rows * width)?;
        check_len("paged_kv_write v", v.len, rows * width)?;
        check_len("paged_kv_write slots", slots.len, rows)?;
        if let Some(quant) = cache.layout.value_quant() {
            let key_bits = cache.layout.key_quant().map_or(0, |k| k.bits);
            let params = [
                u32_of(rows, "rows")?,
                u32_of(quant.kv_heads, "kv_heads")?,
                u32_of(quant.head_dim, "head_dim")?,
                u32_of(quant.groups_per_head, "groups per head")?,
                u32_of(cache.layout.num_slots(), "slots")?,
                u32_of(cache.key_slot_words, "key slot width")?,
                u32_of(key_bits, "key bits")?,
                u32_of(cache.slot_units, "slot width")?,
                u32_of(quant.bits, "bits")?,
                u32::from(cache.layout.key_blocks().is_none()),
            ];
            self.dispatch(
                simple("paged_kv_write_quant"),
                "main",
                &[READ, READ, READ, WRITE, WRITE],
                &[&k.buf, &v.buf, &slots.buf, &cache.k, &cache.v],
                &params,
                (rows * quant.groups()).div_ceil(64),
            )?;
            let Some(blocks) = cache.layout.key_blocks() else {
                return Ok(());
            };
            let params = [
                u32_of(rows, "rows")?,
                u32_of(blocks.channels(), "KV width")?,
                u32_of(blocks.block_size, "block_size")?,
                u32_of(cache.layout.num_slots(), "slots")?,
                u32_of(blocks.bits, "key bits")?,
            ];
            return self.dispatch(
                simple("paged_kv_write_int4_keys"),
                "main",
                &[READ, READ, WRITE],
                &[&k.buf, &slots.buf, &cache.k],
                &params,
                (rows * blocks.words_per_token()).div_ceil(64),
            );
        }
        let params = [
            u32_of(rows, "rows")?,
            u32_of(width, "width")?,
            u32_of(cache.layout.num_slots(), "slots")?,
            u32_of(cache.slot_units, "slot width")?,
        ];
        self.dispatch(
            ShaderVariant {
                kernel: "paged_kv_write",
                format: None,
                kv_f16: cache.layout.values == KvDtype::F16,
            },
            "main",
            &[READ, READ, READ, WRITE, WRITE],
            &[&k.buf, &v.buf, &slots.buf, &cache.k, &cache.v],
            &params,
            (rows * cache.slot_units).div_ceil(256),
        )
    }

    /// `paged_attention`, or with `scored` its attention-score variant
    /// (`out` then holds the scores: `Backend::paged_attention_scores`).
    fn attention_kernel(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut WgpuTensor,
        scored: bool,
    ) -> Result<()> {
        let layout = &cache.layout;
        check_attention_shape("paged_attention", p, layout)?;
        let window = match p.sliding_window {
            None => 0,
            Some(0) => {
                return Err(backend_error(
                    "paged_attention: a sliding window of 0 sees nothing",
                ))
            }
            Some(w) => u32_of(w, "sliding window")?,
        };
        let n = p.rows * p.heads * p.head_dim;
        check_len("paged_attention q", q.len, n)?;
        let out_len = match scored {
            true => p.rows * p.kv_heads * p.max_blocks_per_seq,
            false => n,
        };
        check_len("paged_attention out", out.len, out_len)?;
        check_len("paged_attention row_seq", idx.row_seq.len, p.rows)?;
        check_len("paged_attention positions", idx.positions.len, p.rows)?;
        if p.rows > 0 {
            // At least one sequence's tables (kv_heads of them when per head);
            // the rows' sequences themselves are on the device.
            check_len(
                "paged_attention block_tables",
                idx.block_tables.len,
                p.tables_per_seq() * p.max_blocks_per_seq,
            )?;
        }
        // The score variant runs one workgroup per (row, KV head).
        let workgroups = p.rows * if scored { p.kv_heads } else { p.heads };
        let mut params = vec![
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.kv_heads, "kv_heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.block_size, "block_size")?,
            u32_of(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            u32_of(layout.num_blocks, "num_blocks")?,
            window,
            u32_of(cache.slot_units, "slot width")?,
            p.scale.to_bits(),
            // `head_tables`, word 10 of both attention Params structs.
            u32::from(p.per_head_tables),
        ];
        let buffers = [
            &q.buf,
            &cache.k,
            &cache.v,
            &idx.row_seq.buf,
            &idx.positions.buf,
            &idx.block_tables.buf,
            &out.buf,
        ];
        if let Some(quant) = layout.value_quant() {
            params.push(u32_of(quant.groups_per_head, "groups per head")?);
            params.push(u32_of(quant.bits, "bits")?);
            let key_channels = layout.key_blocks().map_or(0, |b| b.channels());
            params.push(u32_of(key_channels, "KV width")?);
            params.push(u32_of(cache.key_slot_words, "key slot width")?);
            params.push(u32_of(key_bits(layout), "key bits")?);
            return self.dispatch(
                simple(if scored {
                    "paged_attention_quant_scores"
                } else {
                    "paged_attention_quant"
                }),
                "main",
                &[READ, READ, READ, READ, READ, READ, WRITE],
                &buffers,
                &params,
                workgroups,
            );
        }
        self.dispatch(
            ShaderVariant {
                kernel: if scored {
                    "paged_attention_scores"
                } else {
                    "paged_attention"
                },
                format: None,
                kv_f16: layout.values == KvDtype::F16,
            },
            "main",
            &[READ, READ, READ, READ, READ, READ, WRITE],
            &buffers,
            &params,
            workgroups,
        )
    }

    /// Records `l`, one dispatch per weight chunk, each on the entry point
    /// that suits its row count and the adapter.
    fn launch_matmul(&self, l: MatmulLaunch<'_>) -> Result<()> {
        let bias = l.bias.unwrap_or(&self.no_bias);
        for chunk in &l.w.chunks {
            let mut params = vec![
                u32_of(l.rows, "rows")?,
                u32_of(l.w.cols, "cols")?,
                u32_of(l.w.rows, "n")?,
                u32_of(chunk.row_start, "row")?,
                u32_of(chunk.rows, "rows")?,
                u32::from(l.bias.is_some()),
            ];
            params.extend_from_slice(l.extra);
            let outputs = chunk.rows / l.pair;
            let (entry, workgroups) = if l.rows > GEMV_MAX_ROWS {
                let tiles = outputs.div_ceil(TILE_WEIGHT_ROWS / l.pair);
                ("tiled", l.rows.div_ceil(TILE_ROWS) * tiles)
            } else if self.gemv_per_row {
                ("gemv_rows", outputs.div_ceil(GEMV_ROWS_WG))
            } else {
                ("gemv", outputs)
            };
            let mut buffers = vec![&chunk.buf, &l.x.buf, bias];
            buffers.extend_from_slice(l.tail);
            self.dispatch(l.variant, entry, l.access, &buffers, &params, workgroups)?;
        }
        Ok(())
    }

    /// A fused matmul's norm prologue as its kernel takes it: the rows
    /// normalised ahead where the kernel runs without it, the norm's binding
    /// and its parameters (`has_norm`, `eps`; a spare binding and zeros
    /// where there is none). Decode-sized matmuls on CPU adapters run one
    /// thread per output (`gemv_rows`), where a prologue would be recomputed
    /// for every output and cost more than the launch it saves: there
    /// `rms_norm` normalises the rows once first.
    fn prologue<'a>(
        &'a self,
        kernel: &str,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'a, WgpuWeight>>,
        rows: usize,
        cols: usize,
    ) -> Result<(Option<WgpuTensor>, &'a GpuBuffer, [u32; 2])> {
        match norm {
            Some(n) if self.gemv_per_row && rows <= GEMV_MAX_ROWS => {
                let mut normed = self.scratch(rows * cols)?;
                let p = RmsNormParams {
                    rows,
                    dim: cols,
                    eps: n.eps,
                };
                self.rms_norm(x, n.weight, p, &mut normed)?;
                Ok((Some(normed), &self.no_bias, [0, 0]))
            }
            Some(n) => Ok((
                None,
                n.weight.vector(cols, &format!("{kernel} norm"))?,
                [1, n.eps.to_bits()],
            )),
            None => Ok((None, &self.no_bias, [0, 0])),
        }
    }

    /// A tensor whose contents the next kernel overwrites whole.
    fn scratch(&self, len: usize) -> Result<WgpuTensor> {
        Ok(WgpuTensor {
            buf: self.gpu.pooled(4 * len as u64)?,
            len,
        })
    }

    /// `out = act(gate) * up` elementwise: the shared launch of `swiglu` and `geglu`.
    fn gated_product(
        &self,
        kernel: &'static str,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len(&format!("{kernel} gate"), gate.len, len)?;
        check_len(&format!("{kernel} up"), up.len, len)?;
        check_len(&format!("{kernel} out"), out.len, len)?;
        self.dispatch(
            simple(kernel),
            "main",
            &[READ, READ, WRITE],
            &[&gate.buf, &up.buf, &out.buf],
            &[u32_of(len, "len")?],
            len.div_ceil(256),
        )
    }
}

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type Indices = WgpuIndices;
    type Weight = WgpuWeight;
    type KvCache = WgpuKvCache;

    fn info(&self) -> BackendInfo {
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

    fn alloc(&self, len: usize) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * len as u64)?;
        self.gpu.clear(&buf, 4 * len as u64);
        Ok(WgpuTensor { buf, len })
    }

    fn upload(&self, data: &[f32]) -> Result<WgpuTensor> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytes_of_f32(data));
        Ok(WgpuTensor {
            buf,
            len: data.len(),
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download(&self, t: &WgpuTensor, len: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.download_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download(&self, _t: &WgpuTensor, _len: usize) -> Result<Vec<f32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_async",
        ))
    }

    fn upload_indices(&self, data: &[u32]) -> Result<WgpuIndices> {
        let buf = self.gpu.pooled(4 * data.len() as u64)?;
        self.gpu.write(&buf, bytemuck::cast_slice(data));
        Ok(WgpuIndices {
            buf,
            len: data.len(),
        })
    }

    fn write_indices(&self, dst: &mut WgpuIndices, data: &[u32]) -> Result<()> {
        check_len("write_indices", dst.len, data.len())?;
        // Queue writes land before the next submit: recorded kernels that
        // read the old values go first.
        self.gpu.submit()?;
        self.gpu.write(&dst.buf, bytemuck::cast_slice(data));
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn download_indices(&self, t: &WgpuIndices, len: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.download_indices_async(t, len))
    }

    #[cfg(target_arch = "wasm32")]
    fn download_indices(&self, _t: &WgpuIndices, _len: usize) -> Result<Vec<u32>> {
        Err(backend_error(
            "the browser cannot wait for the GPU: use WgpuBackend::download_indices_async",
        ))
    }

    fn upload_weight(&self, w: WeightView<'_>) -> Result<WgpuWeight> {
        let format = w.format;
        if !w.cols.is_multiple_of(format.block_elems()) {
            return Err(backend_error(format!(
                "a {format} weight needs columns in multiples of {}, got {}",
                format.block_elems(),
                w.cols
            )));
        }
        let row_bytes = w.row_bytes();
        if w.data.len() < w.rows * row_bytes {
            return Err(backend_error(format!(
                "a {}x{} {format} weight needs {} bytes, got {}",
                w.rows,
                w.cols,
                w.rows * row_bytes,
                w.data.len()
            )));
        }
        if w.rows == 1 || w.cols == 1 {
            return self.upload_vector(w.rows, w.cols, &w.to_f32());
        }
        let rows_per_chunk = (self.max_chunk_bytes / row_bytes.max(1) as u64) as usize;
        if rows_per_chunk == 0 {
            return Err(backend_error(format!(
                "one row of a {format} weight ({row_bytes} bytes) exceeds the storage binding limit"
            )));
        }
        let mut chunks = Vec::new();
        for row_start in (0..w.rows).step_by(rows_per_chunk) {
            let rows = rows_per_chunk.min(w.rows - row_start);
            let bytes = &w.data[row_start * row_bytes..(row_start + rows) * row_bytes];
            let buf = self.gpu.dedicated(bytes.len() as u64, "weight")?;
            self.gpu.write(&buf, bytes);
            chunks.push(WeightChunk {
                row_start,
                rows,
                buf,
            });
        }
        Ok(WgpuWeight {
            format,
            rows: w.rows,
            cols: w.cols,
            chunks,
        })
    }

    fn alloc_kv_cache(&self, layout: KvCacheLayout) -> Result<WgpuKvCache> {
        layout.check()?;
        let slot_units = match layout.value_quant() {
            Some(quant) => quant.slot_words(),
            None if layout.values == KvDtype::F16 => layout.row_width().div_ceil(2),
            None => layout.row_width(),
        };
        let key_slot_words = layout.key_quant().map_or(slot_units, |k| k.slot_words());
        let key_block_units = layout
            .key_blocks()
            .map_or(layout.block_size * key_slot_words, |b| b.block_words());
        let bytes = 4 * (layout.num_slots() * slot_units) as u64;
        let key_bytes = 4 * (layout.num_blocks * key_block_units) as u64;
        Ok(WgpuKvCache {
            layout,
            k: self.gpu.dedicated(key_bytes, "K cache")?,
            v: self.gpu.dedicated(bytes, "V cache")?,
            slot_units,
            key_slot_words,
            key_block_units,
            bounds: None,
        })
    }

    fn copy_kv_blocks(&self, cache: &mut WgpuKvCache, pairs: &[(u32, u32)]) -> Result<()> {
        let blocks = cache.layout.num_blocks;
        let block_bytes = 4 * (cache.layout.block_size * cache.slot_units) as u64;
        let key_block_bytes = 4 * cache.key_block_units as u64;
        if let Some(&(src, dst)) = pairs
            .iter()
            .find(|&&(src, dst)| src as usize >= blocks || dst as usize >= blocks)
        {
            return Err(backend_error(format!(
                "copy_kv_blocks: block pair ({src}, {dst}) outside a cache of {blocks} blocks"
            )));
        }
        if pairs.is_empty() || block_bytes == 0 {
            return Ok(());
        }
        // WebGPU forbids copies within one buffer: each block goes through a
        // scratch buffer, pair after pair, so chained pairs copy in order.
        let bounds_bytes = 4 * (2 * cache.layout.row_width()) as u64;
        let scratch = self
            .gpu
            .pooled(block_bytes.max(key_block_bytes).max(bounds_bytes))?;
        let mut stores = vec![(&cache.k, key_block_bytes), (&cache.v, block_bytes)];
        if let Some(bounds) = &cache.bounds {
            stores.push((bounds, bounds_bytes));
        }
        for &(src, dst) in pairs {
            for &(buf, bytes) in &stores {
                self.gpu.copy(buf, src as u64 * bytes, &scratch, 0, bytes);
                self.gpu.copy(&scratch, 0, buf, dst as u64 * bytes, bytes);
            }
        }
        Ok(())
    }

    fn supports_format(&self, _format: WeightFormat) -> bool {
        true
    }

    fn embedding(
        &self,
        table: &WgpuWeight,
        tokens: &WgpuIndices,
        rows: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("embedding tokens", tokens.len, rows)?;
        check_len("embedding out", out.len, rows * table.cols)?;
        let pieces = table.cols.div_ceil(4);
        for chunk in &table.chunks {
            let params = [
                u32_of(rows, "rows")?,
                u32_of(table.cols, "cols")?,
                u32_of(chunk.row_start, "row")?,
                u32_of(chunk.rows, "rows")?,
            ];
            self.dispatch(
                ShaderVariant {
                    kernel: "embedding",
                    format: Some(table.format),
                    kv_f16: false,
                },
                "main",
                &[READ, READ, WRITE],
                &[&chunk.buf, &tokens.buf, &out.buf],
                &params,
                (rows * pieces).div_ceil(64),
            )?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm x", x.len, n)?;
        check_len("rms_norm out", out.len, n)?;
        let w = weight.vector(p.dim, "rms_norm weight")?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.dim, "dim")?,
            p.eps.to_bits(),
        ];
        self.dispatch(
            simple("rms_norm"),
            "main",
            &[READ, READ, WRITE],
            &[&x.buf, w, &out.buf],
            &params,
            p.rows,
        )
    }

    fn rms_norm_residual(
        &self,
        residual: &mut WgpuTensor,
        delta: &WgpuTensor,
        weight: &WgpuWeight,
        p: RmsNormParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let n = p.rows * p.dim;
        check_len("rms_norm_residual residual", residual.len, n)?;
        check_len("rms_norm_residual delta", delta.len, n)?;
        check_len("rms_norm_residual out", out.len, n)?;
        let w = weight.vector(p.dim, "rms_norm_residual weight")?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.dim, "dim")?,
            p.eps.to_bits(),
        ];
        self.dispatch(
            simple("rms_norm_residual"),
            "main",
            &[WRITE, READ, READ, WRITE],
            &[&residual.buf, &delta.buf, w, &out.buf],
            &params,
            p.rows,
        )
    }

    fn matmul(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("matmul x", x.len, p.rows * w.cols)?;
        check_len("matmul out", out.len, p.rows * w.rows)?;
        let bias = bias.map(|b| b.vector(w.rows, "matmul bias")).transpose()?;
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel: matmul_kernel_name(w.format),
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE],
            x,
            w,
            bias,
            rows: p.rows,
            pair: 1,
            tail: &[&out.buf],
            extra: &[],
        })
    }

    fn fuses_matmuls(&self) -> bool {
        true
    }

    fn matmul_rms_norm(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        bias: Option<&WgpuWeight>,
        p: MatmulParams,
        outs: &mut [SplitOut<'_, WgpuTensor>],
    ) -> Result<()> {
        let kernel = "matmul_rms_norm";
        if let Some(why) = split_error(outs.iter().map(|o| o.width), w.rows) {
            return Err(backend_error(format!("{kernel}: {why}")));
        }
        check_len("matmul_rms_norm x", x.len, p.rows * w.cols)?;
        for o in outs.iter() {
            check_len("matmul_rms_norm out", o.out.len, p.rows * o.width)?;
        }
        let bias = bias
            .map(|b| b.vector(w.rows, "matmul_rms_norm bias"))
            .transpose()?;
        let (normed, norm, [has_norm, eps]) = self.prologue(kernel, x, norm, p.rows, w.cols)?;
        let x = normed.as_ref().unwrap_or(x);
        // The first features of the second and third parts (n where absent:
        // the widths sum to n).
        let mut splits = [w.rows; MAX_SPLIT - 1];
        let mut start = 0;
        for (split, o) in splits.iter_mut().zip(outs.iter()) {
            start += o.width;
            *split = start;
        }
        let part = |i: usize| match outs.get(i) {
            Some(o) => &o.out.buf,
            None => &self.spare_outs[i - 1],
        };
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel,
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE, READ, WRITE, WRITE],
            x,
            w,
            bias,
            rows: p.rows,
            pair: 1,
            tail: &[part(0), norm, part(1), part(2)],
            extra: &[
                has_norm,
                eps,
                u32_of(splits[0], "split")?,
                u32_of(splits[1], "split")?,
            ],
        })
    }

    fn matmul_glu(
        &self,
        x: &WgpuTensor,
        norm: Option<NormPrologue<'_, WgpuWeight>>,
        w: &WgpuWeight,
        glu: Glu,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        let kernel = "matmul_glu";
        if !w.rows.is_multiple_of(2) {
            return Err(backend_error(format!(
                "{kernel}: a [gate; up] weight has an even number of rows, not {}",
                w.rows
            )));
        }
        let f = w.rows / 2;
        check_len("matmul_glu x", x.len, p.rows * w.cols)?;
        check_len("matmul_glu out", out.len, p.rows * f)?;
        if w.chunks.len() > 1 {
            // A gate row and its up row may lie in different chunks, which
            // one dispatch cannot read together: the halves are split into
            // scratch, then the unfused activation runs.
            let mut gate = self.scratch(p.rows * f)?;
            let mut up = self.scratch(p.rows * f)?;
            let mut halves = [
                SplitOut {
                    out: &mut gate,
                    width: f,
                },
                SplitOut {
                    out: &mut up,
                    width: f,
                },
            ];
            self.matmul_rms_norm(x, norm, w, None, p, &mut halves)?;
            return match glu {
                Glu::SwiGlu => self.swiglu(&gate, &up, p.rows * f, out),
                Glu::GeGlu => self.geglu(&gate, &up, p.rows * f, out),
            };
        }
        let (normed, norm, [has_norm, eps]) = self.prologue(kernel, x, norm, p.rows, w.cols)?;
        let x = normed.as_ref().unwrap_or(x);
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel,
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE, READ],
            x,
            w,
            bias: None,
            rows: p.rows,
            pair: 2,
            tail: &[&out.buf, norm],
            extra: &[has_norm, eps, u32::from(glu == Glu::GeGlu)],
        })
    }

    fn matmul_residual(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        p: MatmulParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("matmul_residual x", x.len, p.rows * w.cols)?;
        check_len("matmul_residual out", out.len, p.rows * w.rows)?;
        self.launch_matmul(MatmulLaunch {
            variant: ShaderVariant {
                kernel: "matmul_residual",
                format: Some(w.format),
                kv_f16: false,
            },
            access: &[READ, READ, READ, WRITE],
            x,
            w,
            bias: None,
            rows: p.rows,
            pair: 1,
            tail: &[&out.buf],
            extra: &[],
        })
    }

    fn kernel_launches(&self) -> Option<u64> {
        Some(self.gpu.launches())
    }

    fn rope(
        &self,
        x: &mut WgpuTensor,
        positions: &WgpuIndices,
        inv_freq: &WgpuTensor,
        p: RopeParams,
    ) -> Result<()> {
        if !p.rotary_dim.is_multiple_of(2) || p.rotary_dim > p.head_dim {
            return Err(backend_error(format!(
                "rope: rotary_dim {} must be even and at most head_dim {}",
                p.rotary_dim, p.head_dim
            )));
        }
        check_len("rope x", x.len, p.rows * p.heads * p.head_dim)?;
        check_len("rope positions", positions.len, p.rows)?;
        check_len("rope inv_freq", inv_freq.len, p.rotary_dim / 2)?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.rotary_dim, "rotary_dim")?,
            u32::from(p.style == RopeStyle::NeoX),
        ];
        self.dispatch(
            simple("rope"),
            "main",
            &[WRITE, READ, READ],
            &[&x.buf, &positions.buf, &inv_freq.buf],
            &params,
            (p.rows * p.heads * (p.rotary_dim / 2)).div_ceil(64),
        )
    }

    fn paged_kv_write(
        &self,
        k: &WgpuTensor,
        v: &WgpuTensor,
        slots: &WgpuIndices,
        rows: usize,
        cache: &mut WgpuKvCache,
    ) -> Result<()> {
        self.write_kv_rows(k, v, slots, rows, cache)?;
        let Some(bounds) = &cache.bounds else {
            return Ok(());
        };
        let layout = &cache.layout;
        let params = [
            u32_of(rows, "rows")?,
            u32_of(layout.row_width(), "KV width")?,
            u32_of(layout.head_dim, "head_dim")?,
            u32_of(layout.block_size, "block_size")?,
            u32_of(layout.num_slots(), "slots")?,
        ];
        self.dispatch(
            simple("kv_key_bounds"),
            "main",
            &[READ, READ, WRITE],
            &[&k.buf, &slots.buf, bounds],
            &params,
            (rows * layout.row_width()).div_ceil(64),
        )
    }

    fn track_key_bounds(&self, cache: &mut WgpuKvCache) -> Result<()> {
        if cache.bounds.is_none() {
            let l = &cache.layout;
            let bytes = 4 * (l.num_blocks * 2 * l.row_width()) as u64;
            cache.bounds = Some(self.gpu.dedicated(bytes, "key bounds")?);
        }
        Ok(())
    }

    fn select_kv_blocks(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        select: BlockSelectParams,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "select_kv_blocks: its input is one block table per sequence \
                 (it writes one per KV head); per-head input tables are refused",
            ));
        }
        let bounds = cache.bounds.as_ref().ok_or_else(|| {
            backend_error("select_kv_blocks: the cache keeps no key bounds (track_key_bounds)")
        })?;
        check_attention_shape("select_kv_blocks", p, &cache.layout)?;
        if p.max_blocks_per_seq == 0 || select.top_blocks == 0 {
            return Err(backend_error(format!(
                "select_kv_blocks: {} table columns and {} top blocks: both must be positive",
                p.max_blocks_per_seq, select.top_blocks
            )));
        }
        let seqs = idx.block_tables.len / p.max_blocks_per_seq;
        check_len("select_kv_blocks q", q.len, p.rows * p.heads * p.head_dim)?;
        check_len("select_kv_blocks row_seq", idx.row_seq.len, p.rows)?;
        check_len("select_kv_blocks positions", idx.positions.len, p.rows)?;
        // One table per sequence and KV head.
        let out_len = seqs * p.kv_heads * p.max_blocks_per_seq;
        check_len("select_kv_blocks out", out.len, out_len)?;
        let scratch = self
            .gpu
            .pooled(4 * (seqs * p.kv_heads * p.max_blocks_per_seq).max(1) as u64)?;
        let params = [
            u32_of(p.rows, "rows")?,
            u32_of(p.heads, "heads")?,
            u32_of(p.kv_heads, "kv_heads")?,
            u32_of(p.head_dim, "head_dim")?,
            u32_of(p.block_size, "block_size")?,
            u32_of(p.max_blocks_per_seq, "max_blocks_per_seq")?,
            u32_of(seqs, "sequences")?,
            u32_of(select.top_blocks, "top blocks")?,
            u32_of(select.sink_blocks, "sink blocks")?,
            u32_of(select.recent_blocks, "recent blocks")?,
        ];
        self.dispatch(
            simple("select_kv_blocks"),
            "main",
            &[READ, READ, READ, READ, READ, WRITE, WRITE],
            &[
                &q.buf,
                &idx.row_seq.buf,
                &idx.positions.buf,
                &idx.block_tables.buf,
                bounds,
                &scratch,
                &out.buf,
            ],
            &params,
            seqs,
        )
    }

    fn paged_attention(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.attention_kernel(q, cache, idx, p, out, false)
    }

    fn paged_attention_scores(
        &self,
        q: &WgpuTensor,
        cache: &WgpuKvCache,
        idx: AttentionIndices<'_, Self>,
        p: AttentionParams,
        scores: &mut WgpuTensor,
    ) -> Result<()> {
        if p.per_head_tables {
            return Err(backend_error(
                "paged_attention_scores: per-head block tables are not supported; \
                 one table per sequence",
            ));
        }
        self.attention_kernel(q, cache, idx, p, scores, true)
    }

    fn swiglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("swiglu", gate, up, len, out)
    }

    fn geglu(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        len: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        self.gated_product("geglu", gate, up, len, out)
    }

    fn scale(&self, x: &mut WgpuTensor, len: usize, factor: f32) -> Result<()> {
        check_len("scale x", x.len, len)?;
        self.dispatch(
            simple("scale"),
            "main",
            &[WRITE],
            &[&x.buf],
            &[u32_of(len, "len")?, factor.to_bits()],
            len.div_ceil(256),
        )
    }

    fn gather_rows(
        &self,
        x: &WgpuTensor,
        rows: &WgpuIndices,
        n: usize,
        width: usize,
        out: &mut WgpuTensor,
    ) -> Result<()> {
        check_len("gather_rows rows", rows.len, n)?;
        check_len("gather_rows out", out.len, n * width)?;
        let src_rows = x.len.checked_div(width).unwrap_or(0);
        let params = [
            u32_of(n, "n")?,
            u32_of(width, "width")?,
            u32_of(src_rows, "rows")?,
        ];
        self.dispatch(
            simple("gather_rows"),
            "main",
            &[READ, READ, WRITE],
            &[&x.buf, &rows.buf, &out.buf],
            &params,
            (n * width).div_ceil(256),
        )
    }

    fn moe_route(
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

    fn moe_combine(
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

    fn argmax(
        &self,
        x: &WgpuTensor,
        rows: usize,
        width: usize,
        out: &mut WgpuIndices,
    ) -> Result<()> {
        check_len("argmax x", x.len, rows * width)?;
        check_len("argmax out", out.len, rows)?;
        self.dispatch(
            simple("argmax"),
            "main",
            &[READ, WRITE],
            &[&x.buf, &out.buf],
            &[u32_of(rows, "rows")?, u32_of(width, "width")?],
            rows,
        )
    }
}
