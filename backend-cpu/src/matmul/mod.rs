//! `out[t, r] = x[t] · w[r] (+ bias[r])` for every weight format, without
//! ever dequantizing the whole matrix.
//!
//! One call:
//! 1. Quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the
//!    k-quants Q2_K to Q6_K): the activation rows are
//!    quantized once to 16-bit blocks ([`quantize`]), so each block product
//!    is an integer dot product scaled by the two block scales, as in
//!    llama.cpp (which uses 8-bit activations; [`quantize`] says why 16).
//!    The 4-bit formats' offset (`m`, or `-8 * d` for Q4_0, whose nibbles
//!    are used unsigned) adds `offset * scale_x * sum(quants_x)` per
//!    block, from the block heads `[scale, offset]` decoded once per row
//!    and the activation stats `[scale, scale * sum]`. Tandem's INT8 and
//!    INT4 formats go the same way: every 32-element run of their rows is
//!    one such block whose `[scale, offset]` head comes from the row's scale
//!    (INT8) or its group's `[d, m]` (INT4), and so are the k-quants' runs,
//!    with heads from their quantized sub-block scales; sub-blocks of 16
//!    (Q2_K, Q3_K, Q6_K) split a run's dot product in two halves with their
//!    own heads ([`formats`] describes every format). W8A8 instead quantizes each
//!    activation row to INT8 with one scale per token (what SmoothQuant
//!    prescribes, `tandem_core::quant::quantize_activation_row_i8`) and sums
//!    whole-row i8 × i8 products in i32, scaled once by the two scales.
//!    Float weights (F32, F16, BF16) multiply the f32 activations directly.
//! 2. The output is split into tasks: by output rows when there are few
//!    tokens (decode: the matrix is streamed from memory once, each thread
//!    reading its share of rows), by token ranges when there are many
//!    (prefill: each task walks the whole matrix, from cache, and reuses
//!    every weight block across its tokens).
//! 3. Inside a task, a micro-kernel computes tiles of `R` weight rows × `T`
//!    tokens: each weight block is decoded once per `T` tokens and each
//!    activation block loaded once per `R` rows. The micro-kernels exist per
//!    instruction set ([`MicroKernels`]): AVX2 and AVX-512 (runs in pairs,
//!    `avx512` says how; on both, with two tokens or more a row tile's codes
//!    are unpacked once into scratch for all of them), wasm SIMD128 (the
//!    integer block formats; `simd128`), and portable Rust. Within one
//!    instruction set every output element is computed with the same
//!    arithmetic in the same order whatever tile it falls in, so results do
//!    not depend on the thread count. The block heads of a row tile are
//!    decoded in a pass of their own before its dot products; that pass is
//!    the first to touch the tile's weights and prefetches those of the
//!    rows ahead.

#[cfg(target_arch = "x86_64")]
mod avx512;
mod formats;
mod portable;
mod quantize;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_heads;

use std::cell::OnceCell;
use std::ops::Range;

use half::{bf16, f16};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::{WeightFormat, QK};
use tandem_core::Result;

use crate::buffers::{Weight, WeightData};
use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::workers::Workers;
use formats::{with_block_format, BlockFormat, BlockKind};
use quantize::{
    quantize_activations, quantize_activations_i8, BlockQuants, I8Activations, QuantRow,
    QuantizedActivations,
};

/// A call with at least this many tokens per thread splits tokens across
/// threads; below, it splits output rows.
const TOKEN_SPLIT_MIN_TOKENS_PER_THREAD: usize = 16;
/// Token ranges of token-split tasks are multiples of this (a multiple of
/// every micro-kernel's `T`), so only the last range has a partial tile.
const TOKEN_CHUNK_UNIT: usize = 4;
/// Row ranges of row-split tasks are multiples of this (every `R`).
const ROW_CHUNK_UNIT: usize = 4;
/// Fewest multiply-adds worth a task of their own.
const MIN_TASK_MACS: usize = 64 * 1024;
/// How far past the block whose heads it decodes the heads pass asks for
/// the weight bytes ahead ([`MicroKernels::prefetch`]). The pass is the
/// first to touch every block of a row tile, and without the requests it
/// stalls on each cache miss, most when the matrix streams from memory
/// (decode). Distances from 2 to 8 KiB, and one row tile, measure alike.
const PREFETCH_AHEAD: usize = 4096;

/// Fewest tokens for which kernels that can read repacked weight codes
/// ([`MicroKernels::REPACKS_CODES`]) get them: one token reads each code
/// once, and unpacking it straight into registers saves a store and a load.
const REPACK_MIN_TOKENS: usize = 2;

/// `out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r])` for `rows` tokens.
pub(crate) fn matmul(
    workers: &Workers,
    isa: Isa,
    x: &[f32],
    w: &Weight,
    bias: Option<&Weight>,
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    matmuls(workers, isa, x, rows, &mut [(w, bias, out)])
}

/// One weight of [`matmuls`], its optional bias and its output.
pub(crate) type Target<'a> = (&'a Weight, Option<&'a Weight>, &'a mut [f32]);

/// [`matmul`] of one input by several weights of as many columns, the
/// activations quantized once for all of them (once per form the weights'
/// kernels take).
pub(crate) fn matmuls(
    workers: &Workers,
    isa: Isa,
    x: &[f32],
    rows: usize,
    targets: &mut [Target<'_>],
) -> Result<()> {
    let Some(cols) = targets.first().map(|(w, _, _)| w.cols()) else {
        return Ok(());
    };
    let quantized = [OnceCell::new(), OnceCell::new()];
    let quantize = |half_sums: bool| {
        quantized[half_sums as usize]
            .get_or_init(|| quantize_activations(workers, isa, x, rows, cols, half_sums))
    };
    let quantized_i8 = OnceCell::new();
    for (w, bias, out) in targets.iter_mut() {
        let kernel = matmul_kernel_name(w.format());
        if w.cols() != cols {
            return Err(check::error(
                kernel,
                format!(
                    "weights of {cols} and {} columns cannot share one input",
                    w.cols()
                ),
            ));
        }
        let n = w.rows();
        let x_len = check::product(kernel, &[rows, cols])?;
        let out_len = check::product(kernel, &[rows, n])?;
        check::buffer_len(kernel, "x", x.len(), x_len)?;
        check::buffer_len(kernel, "out", out.len(), out_len)?;
        let bias = bias.map(|b| b.vector(kernel, "bias", n)).transpose()?;
        let (x, out) = (&x[..x_len], &mut out[..out_len]);
        if rows == 0 || n == 0 {
            continue;
        }
        let operands = match w.data() {
            WeightData::F32(w) => Operands::F32 { w, x },
            WeightData::F16(w) => Operands::F16 { w, x },
            WeightData::BF16(w) => Operands::BF16 { w, x },
            WeightData::Blocks(WeightFormat::W8A8, w) => Operands::W8A8 {
                w,
                x: quantized_i8
                    .get_or_init(|| quantize_activations_i8(workers, isa, x, rows, cols)),
            },
            WeightData::Blocks(format, w) => {
                let kind = BlockKind::of(*format).ok_or_else(|| {
                    check::error(kernel, format!("{format} weights have no matmul kernels"))
                })?;
                Operands::Blocks {
                    kind,
                    w,
                    x: quantize(kind.needs_half_sums()),
                }
            }
        };
        let job = Job {
            isa,
            operands,
            cols,
            bias: bias.as_deref(),
        };
        run_tasks(workers, &job, rows, n, out);
    }
    Ok(())
}

/// The weight matrix with the activations in the form its kernels take.
#[derive(Clone, Copy)]
enum Operands<'a> {
    F32 {
        w: &'a [f32],
        x: &'a [f32],
    },
    F16 {
        w: &'a [f16],
        x: &'a [f32],
    },
    BF16 {
        w: &'a [bf16],
        x: &'a [f32],
    },
    /// Every integer block format ([`formats`]).
    Blocks {
        kind: BlockKind,
        w: &'a [u8],
        x: &'a QuantizedActivations,
    },
    W8A8 {
        w: &'a [u8],
        x: &'a I8Activations,
    },
}

/// Everything a task needs besides the part of the output it computes.
struct Job<'a> {
    isa: Isa,
    operands: Operands<'a>,
    cols: usize,
    bias: Option<&'a [f32]>,
}

/// Splits the `[tokens, n]` output into tasks and runs them on the pool.
fn run_tasks(workers: &Workers, job: &Job<'_>, tokens: usize, n: usize, out: &mut [f32]) {
    if tokens >= TOKEN_SPLIT_MIN_TOKENS_PER_THREAD * workers.threads() {
        let per_task = workers.chunk_len(tokens, 1, TOKEN_SPLIT_MIN_TOKENS_PER_THREAD);
        let per_task = per_task.next_multiple_of(TOKEN_CHUNK_UNIT);
        workers.for_each_chunk(out, per_task * n, |i, out| {
            let first = i * per_task;
            job.run(0..n, first..first + out.len() / n, out, n);
        });
        return;
    }
    let min_rows = MIN_TASK_MACS.div_ceil(job.cols.max(1) * tokens);
    let per_task = workers
        .chunk_len(n, 1, min_rows)
        .next_multiple_of(ROW_CHUNK_UNIT);
    if tokens == 1 {
        workers.for_each_chunk(out, per_task, |i, out| {
            let first = i * per_task;
            job.run(first..first + out.len(), 0..1, out, out.len());
        });
        return;
    }
    // Each task's rows for all tokens are strided in `out`: tasks fill
    // `[tokens, rows of the task]` blocks of `partial`, copied out after.
    let mut partial = vec![0f32; tokens * n];
    workers.for_each_chunk(&mut partial, per_task * tokens, |i, part| {
        let first = i * per_task;
        let count = part.len() / tokens;
        job.run(first..first + count, 0..tokens, part, count);
    });
    for (i, part) in partial.chunks(per_task * tokens).enumerate() {
        let count = part.len() / tokens;
        for (t, values) in part.chunks_exact(count).enumerate() {
            out[t * n + i * per_task..][..count].copy_from_slice(values);
        }
    }
}

/// What one task computes: `out[(t - tokens.start) * stride + r - rows.start]`
/// for weight rows `rows` and tokens `tokens`.
struct Task<'a> {
    rows: Range<usize>,
    tokens: Range<usize>,
    bias: Option<&'a [f32]>,
    out: &'a mut [f32],
    stride: usize,
}

impl Job<'_> {
    fn run(&self, rows: Range<usize>, tokens: Range<usize>, out: &mut [f32], stride: usize) {
        let task = Task {
            rows,
            tokens,
            bias: self.bias,
            out,
            stride,
        };
        let cols = self.cols;
        match self.isa.kind() {
            // SAFETY: an `Isa` exists only for instruction sets the CPU has.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512Vnni => unsafe { x86::run_vnni(self.operands, cols, task) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => unsafe { x86::run_avx2(self.operands, cols, task) },
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            IsaKind::Simd128 => simd128::run(self.operands, cols, task),
            IsaKind::Portable => portable::run(self.operands, cols, task),
        }
    }
}

/// Element type of a float weight matrix.
trait FloatElem: Copy + Sync {
    /// Which one, for kernels that load eight at a time with intrinsics.
    #[cfg(target_arch = "x86_64")]
    const KIND: FloatKind;
    fn to_f32(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
enum FloatKind {
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
/// may only run on a CPU that [`Isa::available`] says supports it. Every
/// weight row holds as many blocks (or elements) as each activation row.
trait MicroKernels {
    unsafe fn f16_to_f32(bits: u16) -> f32;

    /// Asks for the cache line holding `at` to be fetched, if the
    /// instruction set can; `at` need not be readable.
    unsafe fn prefetch(at: *const u8);

    /// The heads of every run of a weight row, into `heads`
    /// (`F::HEAD_FLOATS` values per run).
    unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]);

    /// Whether [`MicroKernels::block_tile`] can read a row tile's weight
    /// codes as [`MicroKernels::repack_codes`] wrote them (when its
    /// `w_codes` are not empty), rather than the rows' bytes, with the same
    /// results.
    const REPACKS_CODES: bool = false;

    /// The codes of a weight row of `runs` runs in the layout `block_tile`
    /// reads them in, into `codes` (two blocks per pair of runs).
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
fn add_run_sum<F: BlockFormat>(
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
unsafe fn decode_block_heads_scalar<K: MicroKernels, F: BlockFormat>(
    row: &[u8],
    heads: &mut [f32],
) {
    let blocks = row.len().saturating_sub(F::ROW_HEAD) / F::BLOCK_BYTES;
    let per_block = F::RUNS * F::HEAD_FLOATS;
    for (k, heads) in heads.chunks_exact_mut(per_block).take(blocks).enumerate() {
        prefetch_ahead::<K, F>(row, k);
        F::block_heads::<K>(row, k, heads);
    }
}

/// Prefetches the bytes [`PREFETCH_AHEAD`] past block `k` of `row`, one
/// request per cache line of a block.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn prefetch_ahead<K: MicroKernels, F: BlockFormat>(row: &[u8], k: usize) {
    let ahead = row
        .as_ptr()
        .wrapping_add(F::ROW_HEAD + k * F::BLOCK_BYTES + PREFETCH_AHEAD);
    for line in (0..F::BLOCK_BYTES).step_by(64) {
        K::prefetch(ahead.wrapping_add(line));
    }
}

/// A task on `K`'s micro-kernels: float weights in tiles of `FR` rows ×
/// `FT` tokens, the block formats in `QR` × `QT`, W8A8 in `WR` × `WT`.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
#[inline(always)]
unsafe fn run_tiles<
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
    w: &[u8],
    x: &QuantizedActivations,
    cols: usize,
    mut task: Task<'_>,
) {
    let blocks = cols / QK;
    let row_bytes = F::row_bytes(blocks);
    let row_heads = F::HEAD_FLOATS * blocks;
    let mut heads = vec![0f32; R * row_heads];
    let row_codes = if K::REPACKS_CODES && task.tokens.len() >= REPACK_MIN_TOKENS {
        2 * blocks.div_ceil(2)
    } else {
        0
    };
    let mut codes = vec![BlockQuants([0; QK]); R * row_codes];
    let mut r = task.rows.start;
    while r < task.rows.end {
        let height = if task.rows.end - r >= R { R } else { 1 };
        for i in 0..height {
            let row = &w[(r + i) * row_bytes..][..row_bytes];
            K::decode_block_heads::<F>(row, &mut heads[i * row_heads..][..row_heads]);
            if row_codes > 0 {
                K::repack_codes::<F>(row, blocks, &mut codes[i * row_codes..][..row_codes]);
            }
        }
        let rows = QuantRowTile {
            w,
            row_bytes,
            blocks,
            first: r,
            heads: &heads,
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
    w: &'a [u8],
    row_bytes: usize,
    blocks: usize,
    first: usize,
    /// Per row, `F::HEAD_FLOATS` per run.
    heads: &'a [f32],
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
    let row_heads = F::HEAD_FLOATS * rows.blocks;
    let w: [&[u8]; R] =
        std::array::from_fn(|i| &rows.w[(rows.first + i) * rows.row_bytes..][..rows.row_bytes]);
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
    w: &[u8],
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
    w: &[u8],
    x: &I8Activations,
    row_bytes: usize,
    first: usize,
    task: &mut Task<'_>,
) {
    let rows: [&[u8]; R] = std::array::from_fn(|i| &w[(first + i) * row_bytes..][..row_bytes]);
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

#[cfg(test)]
mod tests;
