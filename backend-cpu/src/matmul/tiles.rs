//! The micro-kernel interface ([`MicroKernels`], one implementation per
//! instruction set) and what drives it: the tasks that walk an output
//! block tile by tile, decoding each row tile's block heads first, and
//! storing each tile with its bias.

use half::{bf16, f16};
use tandem_core::quant::QK;

use super::formats::{self, with_block_format, BlockFormat};
use super::quantize::{BlockQuants, I8Activations, QuantRow, QuantizedActivations};
use super::{Operands, Task, PREFETCH_AHEAD, REPACK_MIN_TOKENS};
use crate::buffers::RowBytes;

/// Element type of a float weight matrix.
pub(super) trait FloatElem: Copy + Sync {
    /// Which one, for kernels that load eight at a time with intrinsics.
    #[cfg(target_arch = "x86_64")]
    const KIND: FloatKind;
    fn to_f32(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
pub(super) enum FloatKind {
    F32,
    F16,
    BF16,
}

impl FloatElem for f32 {
    #[cfg(target_arch = "x86_64")]
    const KIND: FloatKind = FloatKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl FloatElem for f16 {
    #[cfg(target_arch = "x86_64")]
    const KIND: FloatKind = FloatKind::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl FloatElem for bf16 {
    #[cfg(target_arch = "x86_64")]
    const KIND: FloatKind = FloatKind::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// The micro-kernels of one instruction set. Each computes a tile of dot
/// products of `R` weight rows with `T` activation rows.
///
/// # Safety
/// Implementations use their instruction set's intrinsics: their methods
/// may only run on a CPU that [`Isa::available`](crate::isa::Isa::available) says supports it. Every
/// weight row holds as many blocks (or elements) as each activation row.
pub(super) trait MicroKernels {
    unsafe fn f16_to_f32(bits: u16) -> f32;

    /// Asks for the cache line holding `at` to be fetched, if the
    /// instruction set can; `at` need not be readable.
    unsafe fn prefetch(at: *const u8);

    /// The heads of every run of a weight row, into `heads`
    /// (`F::HEAD_FLOATS` values per run).
    unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]);

    /// Whether [`MicroKernels::block_tile`] decodes `F`'s heads itself, with
    /// its codes: then it takes no `w_heads`, and no pass decodes them (a
    /// pass touches the rows all the same, `touch_row`).
    fn heads_in_kernel<F: BlockFormat>() -> bool {
        false
    }

    /// Whether [`MicroKernels::block_tile`] can read a row tile's weight
    /// codes as [`MicroKernels::repack_codes`] wrote them (when its
    /// `w_codes` are not empty), rather than the rows' bytes, with the same
    /// results.
    const REPACKS_CODES: bool = false;

    /// The blocks of repacked codes a row of `runs` runs of `F` takes.
    fn repacked_blocks<F: BlockFormat>(runs: usize) -> usize {
        runs
    }

    /// The codes of a weight row of `runs` runs in the layout `block_tile`
    /// reads them in, into `codes` (one block per run).
    unsafe fn repack_codes<F: BlockFormat>(_row: &[u8], _runs: usize, _codes: &mut [BlockQuants]) {}

    /// Weight runs of format `F` times quantized activations:
    /// `sum_b w_scale[b] * x_scale[b] * (w_codes_b · x_quants_b) +
    /// w_offset[b] * x_sum[b]`, with the scales and offsets read from
    /// `w_heads` and `x` (no offset term without `F::OFFSET`); with
    /// `F::HALVES`, the same per 16-element half of every run, the offsets
    /// taking the activations' sums per half.
    unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
        w: [&[u8]; R],
        w_codes: [&[BlockQuants]; R],
        w_heads: [&[f32]; R],
        x: [QuantRow<'_>; T],
    ) -> [[f32; T]; R];

    /// Float weights times f32 activations.
    unsafe fn float_tile<E: FloatElem, const R: usize, const T: usize>(
        w: [&[E]; R],
        x: [&[f32]; T],
    ) -> [[f32; T]; R];

    /// Whole-row i8 × i8 dot products, summed exactly in i32 (a row of
    /// `cols` quants of magnitude at most 127 sums below 2^31 for any
    /// `cols` under 133 000).
    unsafe fn i8_tile<const R: usize, const T: usize>(
        w: [&[i8]; R],
        x: [&[i8]; T],
    ) -> [[i32; T]; R];
}

/// Adds one run's integer dot product with token `x`'s block `b` to `acc`,
/// scaled by the run's head `[scale, offset]` and the block's activation
/// scale, plus the offset term: part `p` of the run (its half, with
/// `F::HALVES`). The portable and SIMD128 kernels share it, so their sums
/// take the same float operations in the same order.
#[inline(always)]
pub(super) fn add_run_sum<F: BlockFormat>(
    acc: &mut f32,
    sum: i32,
    head: &[f32],
    x: &QuantRow<'_>,
    b: usize,
    p: usize,
) {
    *acc += sum as f32 * (head[0] * x.stats[2 * b]);
    if F::OFFSET {
        let x_sum = if F::HALVES {
            x.half_stats[4 * b + 2 * p + 1]
        } else {
            x.stats[2 * b + 1]
        };
        *acc += head[1] * x_sum;
    }
}

/// [`MicroKernels::decode_block_heads`] in scalar code.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
pub(super) unsafe fn decode_block_heads_scalar<K: MicroKernels, F: BlockFormat>(
    row: &[u8],
    heads: &mut [f32],
) {
    let blocks = row.len().saturating_sub(F::ROW_HEAD) / F::BLOCK_BYTES;
    let per_block = F::RUNS * F::HEAD_FLOATS;
    for (k, heads) in heads.chunks_exact_mut(per_block).take(blocks).enumerate() {
        prefetch_ahead::<K, F>(row, k, 1);
        F::block_heads::<K>(row, k, heads);
    }
}

/// Prefetches the bytes [`PREFETCH_AHEAD`] past blocks `k..k + count` of
/// `row`, one request per 64 bytes of those blocks.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
pub(super) unsafe fn prefetch_ahead<K: MicroKernels, F: BlockFormat>(
    row: &[u8],
    k: usize,
    count: usize,
) {
    let ahead = row
        .as_ptr()
        .wrapping_add(F::ROW_HEAD + k * F::BLOCK_BYTES + PREFETCH_AHEAD);
    for line in (0..count * F::BLOCK_BYTES).step_by(64) {
        K::prefetch(ahead.wrapping_add(line));
    }
}

/// Loads a byte of each cache line of `row`, in order: the heads pass's
/// memory traffic, for the kernels that decode their heads themselves
/// (and the repacking of their codes, which reads the rows the same way).
/// Their loads interleave a tile's rows with much work between; a row
/// read from start to end in one go is the stream the hardware
/// prefetchers follow. Without this pass, a matrix streamed from memory
/// (decode) measured slower in the `decode_step` bench, and slower still
/// with software prefetches 4 KiB ahead of these loads (on an AMD EPYC).
#[inline(always)]
fn touch_row(row: &[u8]) {
    for line in (0..row.len()).step_by(64) {
        // SAFETY: `line` is within `row`.
        unsafe { std::ptr::read_volatile(row.as_ptr().add(line)) };
    }
}

/// A task on `K`'s micro-kernels: float weights in tiles of `FR` rows ×
/// `FT` tokens, the block formats in `QR` × `QT`, W8A8 in `WR` × `WT`.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
pub(super) unsafe fn run_tiles<
    K: MicroKernels,
    const FR: usize,
    const FT: usize,
    const QR: usize,
    const QT: usize,
    const WR: usize,
    const WT: usize,
>(
    operands: Operands<'_>,
    cols: usize,
    task: Task<'_>,
) {
    match operands {
        Operands::F32 { w, x } => float_task::<K, _, FR, FT>(w, x, cols, task),
        Operands::F16 { w, x } => float_task::<K, _, FR, FT>(w, x, cols, task),
        Operands::BF16 { w, x } => float_task::<K, _, FR, FT>(w, x, cols, task),
        Operands::Blocks { kind, w, x } => with_block_format!(kind, F => {
            quant_task::<K, F, QR, QT>(w, x, cols, task)
        }),
        Operands::W8A8 { w, x } => w8a8_task::<K, WR, WT>(w, x, cols, task),
    }
}

/// A task over a quantized weight matrix: tiles of `R` rows × `T` tokens,
/// with single-row and single-token tiles for the edges. The run heads
/// (scales and offsets) of a row tile, and its codes where the kernels
/// repack them, are decoded once into scratch and reused by every token
/// tile.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn quant_task<K: MicroKernels, F: BlockFormat, const R: usize, const T: usize>(
    w: RowBytes<'_>,
    x: &QuantizedActivations,
    cols: usize,
    mut task: Task<'_>,
) {
    let blocks = cols / QK;
    let row_bytes = F::row_bytes(blocks);
    let row_heads = if K::heads_in_kernel::<F>() {
        0
    } else {
        F::HEAD_FLOATS * blocks
    };
    let mut heads = vec![0f32; R * row_heads];
    let row_codes = if K::REPACKS_CODES && task.tokens.len() >= REPACK_MIN_TOKENS {
        K::repacked_blocks::<F>(blocks)
    } else {
        0
    };
    let mut codes = vec![BlockQuants([0; QK]); R * row_codes];
    let mut r = task.rows.start;
    while r < task.rows.end {
        let height = if task.rows.end - r >= R { R } else { 1 };
        for i in 0..height {
            let row = w.row(r + i, row_bytes);
            if row_heads > 0 {
                K::decode_block_heads::<F>(row, &mut heads[i * row_heads..][..row_heads]);
            } else {
                touch_row(row);
            }
            if row_codes > 0 {
                K::repack_codes::<F>(row, blocks, &mut codes[i * row_codes..][..row_codes]);
            }
        }
        let rows = QuantRowTile {
            w,
            row_bytes,
            first: r,
            heads: &heads,
            row_heads,
            codes: &codes,
            row_codes,
        };
        if height == R {
            quant_row_tile::<K, F, R, T>(&rows, x, &mut task);
        } else {
            quant_row_tile::<K, F, 1, T>(&rows, x, &mut task);
        }
        r += height;
    }
}

/// The weight rows of one row tile and their decoded block heads.
struct QuantRowTile<'a> {
    w: RowBytes<'a>,
    row_bytes: usize,
    first: usize,
    /// Per row, `row_heads`: `F::HEAD_FLOATS` per run (none where the
    /// kernels decode them).
    heads: &'a [f32],
    row_heads: usize,
    /// Per row, `row_codes` repacked codes (none unless the kernels repack).
    codes: &'a [BlockQuants],
    row_codes: usize,
}

/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn quant_row_tile<K: MicroKernels, F: BlockFormat, const R: usize, const T: usize>(
    rows: &QuantRowTile<'_>,
    x: &QuantizedActivations,
    task: &mut Task<'_>,
) {
    let row_heads = rows.row_heads;
    let w: [&[u8]; R] = std::array::from_fn(|i| rows.w.row(rows.first + i, rows.row_bytes));
    let w_heads: [&[f32]; R] = std::array::from_fn(|i| &rows.heads[i * row_heads..][..row_heads]);
    let w_codes: [&[BlockQuants]; R] =
        std::array::from_fn(|i| &rows.codes[i * rows.row_codes..][..rows.row_codes]);
    let mut t = task.tokens.start;
    while t < task.tokens.end {
        let width = if task.tokens.end - t >= T { T } else { 1 };
        if width == T {
            let x = std::array::from_fn(|j| x.row(t + j));
            let acc = K::block_tile::<F, R, T>(w, w_codes, w_heads, x);
            store_tile(task, rows.first, t, acc);
        } else {
            let acc = K::block_tile::<F, R, 1>(w, w_codes, w_heads, [x.row(t)]);
            store_tile(task, rows.first, t, acc);
        }
        t += width;
    }
}

/// A task over a float weight matrix: tiles of `R` rows × `T` tokens.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn float_task<K: MicroKernels, E: FloatElem, const R: usize, const T: usize>(
    w: &[E],
    x: &[f32],
    cols: usize,
    mut task: Task<'_>,
) {
    let mut r = task.rows.start;
    while r < task.rows.end {
        if task.rows.end - r >= R {
            float_row_tile::<K, E, R, T>(w, x, cols, r, &mut task);
            r += R;
        } else {
            float_row_tile::<K, E, 1, T>(w, x, cols, r, &mut task);
            r += 1;
        }
    }
}

/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn float_row_tile<K: MicroKernels, E: FloatElem, const R: usize, const T: usize>(
    w: &[E],
    x: &[f32],
    cols: usize,
    first: usize,
    task: &mut Task<'_>,
) {
    let w: [&[E]; R] = std::array::from_fn(|i| &w[(first + i) * cols..][..cols]);
    let row = |t: usize| &x[t * cols..][..cols];
    let mut t = task.tokens.start;
    while t < task.tokens.end {
        if task.tokens.end - t >= T {
            let acc = K::float_tile::<E, R, T>(w, std::array::from_fn(|j| row(t + j)));
            store_tile(task, first, t, acc);
            t += T;
        } else {
            let acc = K::float_tile::<E, R, 1>(w, [row(t)]);
            store_tile(task, first, t, acc);
            t += 1;
        }
    }
}

/// A task over a W8A8 matrix: tiles of `R` rows × `T` tokens of whole-row
/// integer dot products, each scaled by the row's and the token's scale.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn w8a8_task<K: MicroKernels, const R: usize, const T: usize>(
    w: RowBytes<'_>,
    x: &I8Activations,
    cols: usize,
    mut task: Task<'_>,
) {
    let row_bytes = formats::Int8Rows::row_bytes(cols / QK);
    let mut r = task.rows.start;
    while r < task.rows.end {
        if task.rows.end - r >= R {
            w8a8_row_tile::<K, R, T>(w, x, row_bytes, r, &mut task);
            r += R;
        } else {
            w8a8_row_tile::<K, 1, T>(w, x, row_bytes, r, &mut task);
            r += 1;
        }
    }
}

/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn w8a8_row_tile<K: MicroKernels, const R: usize, const T: usize>(
    w: RowBytes<'_>,
    x: &I8Activations,
    row_bytes: usize,
    first: usize,
    task: &mut Task<'_>,
) {
    let rows: [&[u8]; R] = std::array::from_fn(|i| w.row(first + i, row_bytes));
    let scales: [f32; R] = std::array::from_fn(|i| {
        let head = &rows[i][..formats::Int8Rows::ROW_HEAD];
        f32::from_le_bytes([head[0], head[1], head[2], head[3]])
    });
    // SAFETY: `i8` and `u8` have the same size and alignment.
    let quants: [&[i8]; R] = std::array::from_fn(|i| {
        let q = &rows[i][formats::Int8Rows::ROW_HEAD..];
        std::slice::from_raw_parts(q.as_ptr().cast::<i8>(), q.len())
    });
    let scaled = |sums: [[i32; T]; R], t: usize| -> [[f32; T]; R] {
        std::array::from_fn(|i| {
            std::array::from_fn(|j| sums[i][j] as f32 * (scales[i] * x.scale(t + j)))
        })
    };
    let mut t = task.tokens.start;
    while t < task.tokens.end {
        if task.tokens.end - t >= T {
            let sums = K::i8_tile::<R, T>(quants, std::array::from_fn(|j| x.row(t + j)));
            store_tile(task, first, t, scaled(sums, t));
            t += T;
        } else {
            let sums = K::i8_tile::<R, 1>(quants, [x.row(t)]);
            let acc: [[f32; 1]; R] =
                std::array::from_fn(|i| [sums[i][0] as f32 * (scales[i] * x.scale(t))]);
            store_tile(task, first, t, acc);
            t += 1;
        }
    }
}

/// Writes tile `acc` (weight rows from `r`, tokens from `t`) to the task's
/// output, adding the bias.
#[inline(always)]
fn store_tile<const R: usize, const T: usize>(
    task: &mut Task<'_>,
    r: usize,
    t: usize,
    acc: [[f32; T]; R],
) {
    for (i, acc) in acc.iter().enumerate() {
        let bias = task.bias.map_or(0.0, |b| b[r + i]);
        for (j, &value) in acc.iter().enumerate() {
            let at = (t + j - task.tokens.start) * task.stride + (r + i - task.rows.start);
            task.out[at] = value + bias;
        }
    }
}
