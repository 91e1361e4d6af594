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
//!    instruction set ([`tiles::MicroKernels`]): AVX2 and AVX-512 (runs in quads,
//!    `avx512` says how, the nibble formats' and Q8_0's codes kept bytes against byte
//!    planes of the activations; on both, with two tokens or more a row
//!    tile's codes are unpacked once into scratch for all of them), wasm SIMD128 (the
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
mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_heads;

use std::cell::OnceCell;
use std::ops::Range;

use half::{bf16, f16};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::WeightFormat;
use tandem_core::Result;

use crate::buffers::{RowBytes, Weight, WeightData};
use crate::check;
use crate::isa::{Isa, IsaKind};
use crate::workers::Workers;
use formats::BlockKind;
use quantize::{
    quantize_activations, quantize_activations_i8, ActivationForm, I8Activations,
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
/// the weight bytes ahead ([`tiles::MicroKernels::prefetch`]). The pass is the
/// first to touch every block of a row tile, and without the requests it
/// stalls on each cache miss, most when the matrix streams from memory
/// (decode). Distances from 2 to 8 KiB, and one row tile, measure alike.
const PREFETCH_AHEAD: usize = 4096;

/// Fewest tokens for which kernels that can read repacked weight codes
/// ([`tiles::MicroKernels::REPACKS_CODES`]) get them: one token reads each code
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
    let quantized: [OnceCell<QuantizedActivations>; ActivationForm::COUNT] = Default::default();
    let quantize = |form: ActivationForm| {
        quantized[form.index()]
            .get_or_init(|| quantize_activations(workers, isa, x, rows, cols, form))
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
                w: w.rows(),
                x: quantized_i8
                    .get_or_init(|| quantize_activations_i8(workers, isa, x, rows, cols)),
            },
            WeightData::Blocks(format, w) => {
                let kind = BlockKind::of(*format).ok_or_else(|| {
                    check::error(kernel, format!("{format} weights have no matmul kernels"))
                })?;
                Operands::Blocks {
                    kind,
                    w: w.rows(),
                    x: quantize(activation_form(isa, kind)),
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

/// The form `isa`'s kernels take the activations of `kind`'s weights in.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn activation_form(isa: Isa, kind: BlockKind) -> ActivationForm {
    #[cfg(target_arch = "x86_64")]
    if isa.kind() == IsaKind::Avx512Vnni
        && formats::with_block_format!(kind, F => avx512::takes_plane_kernel::<F>())
    {
        return ActivationForm::Planes;
    }
    ActivationForm::Blocks {
        half_sums: kind.needs_half_sums(),
    }
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
        w: RowBytes<'a>,
        x: &'a QuantizedActivations,
    },
    W8A8 {
        w: RowBytes<'a>,
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

#[cfg(test)]
mod tests;
