//! What a launch needs besides its kernel: the shapes passed to the
//! kernels, tuning constants mirrored from them, the variant of a kernel
//! a call takes, and the size checks done before any launch.

use super::*;

/// Largest head `kernels/select_kv_blocks.cu` sums queries over.
pub(super) const SELECT_MAX_HEAD_DIM: usize = 256;

/// The code `kernels/common.cuh` uses for a weight format (`FMT_*`).
pub(super) fn format_code(format: WeightFormat) -> i32 {
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
    pub(super) rows: u32,
    pub(super) heads: u32,
    pub(super) kv_heads: u32,
    pub(super) head_dim: u32,
    pub(super) block_size: u32,
    pub(super) max_blocks: u32,
    pub(super) window: u32,
    pub(super) scale: f32,
    /// 1: one block table per sequence and KV head
    /// (`AttentionParams::per_head_tables`); 0: one per sequence.
    pub(super) head_tables: u32,
}

// SAFETY: plain `#[repr(C)]` data with the kernel's field order and types.
unsafe impl DeviceRepr for AttentionShape {}

/// The kernel shape of an attention call (`paged_attention` and its score
/// variant), once every size is checked; `None` when there is nothing to do.
/// `out` is the output's length and the length it needs.
pub(super) fn attention_shape(
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
pub(super) fn quant_shape(
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
    pub(super) shape: AttentionShape,
    pub(super) groups_per_head: u32,
    pub(super) bits: u32,
    pub(super) slot_words: u32,
    /// INT4: `kv_heads * head_dim`, keys in per-channel blocks; 0: keys in slots.
    pub(super) key_channels: u32,
    pub(super) key_bits: u32,
    pub(super) key_slot_words: u32,
}

// SAFETY: plain `#[repr(C)]` data with the kernel's field order and types
// (the nested struct is all 4-byte fields, so no padding appears).
unsafe impl DeviceRepr for QuantAttentionShape {}

// ---- tuning constants, mirrored from the kernels ----

/// Tokens the decode GEMV takes (`gemv_t8`); more go to the tiled kernel or cuBLAS.
pub(super) const GEMV_MAX_TOKENS: usize = 8;
/// `GEMV_ROWS` output rows per GEMV block of 128 threads (4 warps).
pub(super) const GEMV_ROWS_PER_BLOCK: usize = 2;
pub(super) const GEMV_THREADS: u32 = 128;
/// The unaligned GEMV: `GEMV_ROWS` rows per warp, 4 warps.
pub(super) const UNALIGNED_ROWS_PER_BLOCK: usize = GEMV_ROWS_PER_BLOCK * GEMV_THREADS as usize / 32;
/// `TILE_T`, `TILE_R` of the tiled GEMM, 256 threads.
pub(super) const TILE: usize = 64;
pub(super) const TILE_THREADS: u32 = 256;
/// Attention: at most this many query rows use the split-K decode kernel.
pub(super) const DECODE_MAX_ROWS: usize = 16;
/// Decode splits are at least this many keys long, a multiple of the key tile.
pub(super) const MIN_SPLIT_KEYS: usize = 256;
pub(super) const MAX_SPLITS: usize = 64;
pub(super) const MAX_HEAD_DIM: usize = 256;
pub(super) const KEY_TILE: usize = 32;
pub(super) const PREFILL_ROWS: usize = 16;
pub(super) const ATTENTION_THREADS: u32 = 128;
/// One warp per (head, row) in `paged_attention_quant`.
pub(super) const WARP_THREADS: u32 = 32;
/// Static shared memory a block may use without opting in.
pub(super) const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;
/// The y and z grid dimensions' limit.
pub(super) const MAX_GRID_YZ: usize = 65_535;

pub(super) fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        Err(backend_error(format!(
            "{what} holds {have} elements, {need} needed"
        )))
    } else {
        Ok(())
    }
}

pub(super) fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        backend_error(format!(
            "{what} = {v} does not fit the kernels' 32-bit sizes"
        ))
    })
}

pub(super) fn grid_yz(v: usize, what: &str) -> Result<u32> {
    if v > MAX_GRID_YZ {
        Err(backend_error(format!(
            "{what} = {v} exceeds the {MAX_GRID_YZ} a launch grid allows"
        )))
    } else {
        to_u32(v, what)
    }
}

pub(super) fn blocks_for(items: usize, per_block: usize, what: &str) -> Result<u32> {
    to_u32(items.div_ceil(per_block).max(1), what)
}

pub(super) fn config(grid: (u32, u32, u32), threads: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    }
}

/// Threads for a one-block-per-row kernel over `width` values: about four
/// values per thread, a whole number of warps, at most 1024.
pub(super) fn row_threads(width: usize) -> u32 {
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
pub(super) const MLP_SLICE: usize = 32;
/// Threads per block of the one-kernel MLP (`MLP_THREADS`).
pub(super) const MLP_THREADS: u32 = 256;

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
pub(super) fn glu_code(glu: Glu) -> i32 {
    match glu {
        Glu::SwiGlu => 0,
        Glu::GeGlu => 1,
    }
}

/// The norm prologue's kernel arguments: weight format code and eps (the
/// kernels ignore both when the norm pointer is null).
pub(super) fn norm_args(norm: Option<&NormPrologue<'_, CudaWeight>>) -> (i32, f32) {
    norm.map_or((0, 0.0), |n| (format_code(n.weight.format), n.eps))
}

pub(super) fn check_norm(
    kernel: &str,
    norm: Option<&NormPrologue<'_, CudaWeight>>,
    cols: usize,
) -> Result<()> {
    match norm {
        Some(n) => check_len(&format!("{kernel}: norm weight"), n.weight.elems(), cols),
        None => Ok(()),
    }
}

/// How many splits a decode attention call uses: enough blocks to cover the
/// GPU twice, but no split shorter than `MIN_SPLIT_KEYS` keys.
pub(super) fn decode_splits(max_context: usize, head_rows: usize, sm_count: usize) -> usize {
    let by_length = max_context.div_ceil(MIN_SPLIT_KEYS).max(1);
    let by_occupancy = (2 * sm_count).div_ceil(head_rows.max(1)).max(1);
    by_length.min(by_occupancy).min(MAX_SPLITS)
}

/// Dynamic shared memory of `paged_attention_prefill_*` (see the kernel):
/// q, K (padded) and V tiles of f32, then the tile's slots as i64.
pub(super) fn prefill_shared_bytes(head_dim: usize) -> usize {
    let floats = PREFILL_ROWS * head_dim + KEY_TILE * (head_dim + 1) + KEY_TILE * head_dim;
    floats * 4 + KEY_TILE * 8
}
