//! The cross-backend kernel suite, written once: every kernel of the manifest
//! runs on a backend under test and on the CPU reference with the same random
//! inputs of awkward sizes (not multiples of any workgroup or tile, rows 1, 3
//! and 17 and past one tile, odd widths for float formats, quantized widths of
//! 32·k with k odd, sequences over several KV blocks with a partly filled last
//! block, several sequences per call, a prefill chunk starting mid-sequence,
//! grouped-query heads 9/3, sliding windows, F32, F16, INT8 and INT4 KV
//! caches, quantized heads not a multiple of the 32-element group). Results
//! must agree within the manifest's tolerance as `|x - ref| / (1 + |ref|)`.
//!
//! Each backend's test instantiates it: `run_conformance(&backend)` returns a
//! per-kernel [`Report`]; [`Report::problems`] lists failed cases and manifest
//! entries no case exercised.

use std::collections::BTreeMap;
use std::fmt;

// An explicit path: `web/kernel-tests` includes this file by `#[path]`,
// where a bare `mod moe;` would be looked for beside it.
#[path = "conformance/attention.rs"]
mod attention;
#[path = "conformance/calls.rs"]
mod calls;
#[path = "conformance/fused.rs"]
mod fused;
#[path = "conformance/moe.rs"]
mod moe;
#[path = "conformance/scores.rs"]
mod scores;
#[path = "conformance/select.rs"]
mod select;
#[path = "conformance/weights.rs"]
mod weights;

use tandem_core::backend::{
    AttentionIndices, AttentionParams, Backend, KvCacheLayout, KvDtype, RmsNormParams, RopeParams,
    RopeStyle,
};
use tandem_core::kernels::{spec, MANIFEST};
use tandem_core::quant::{quantize_row, WeightFormat, WeightView};
use tandem_cpu::CpuBackend;

use calls::{
    argmax, embedding, gather_rows, geglu, matmul, rms_norm, rms_norm_residual, rope, scale,
    swiglu, swiglu_or_geglu, vector,
};

/// The manifest entry of a KV kernel (`paged_kv_write`, `paged_attention`)
/// for a cache dtype: quantized caches have entries of their own.
fn kv_kernel(method: &'static str, dtype: KvDtype) -> &'static str {
    match (method, dtype) {
        ("paged_kv_write", KvDtype::Int8 | KvDtype::Int4 | KvDtype::Int2) => "paged_kv_write_quant",
        ("paged_attention", KvDtype::Int8 | KvDtype::Int4 | KvDtype::Int2) => {
            "paged_attention_quant"
        }
        _ => method,
    }
}

/// How one kernel fared.
#[derive(Clone, Debug)]
pub struct KernelReport {
    pub kernel: &'static str,
    pub cases: usize,
    /// Largest `|x - ref| / (1 + |ref|)` over all cases that ran.
    pub max_error: f32,
    pub tolerance: f32,
    /// One line per failed case: what it was and how it failed.
    pub failures: Vec<String>,
}

/// The outcome of the suite on one backend.
#[derive(Clone, Debug)]
pub struct Report {
    /// `BackendInfo` of the backend under test, in words.
    pub backend: String,
    pub kernels: Vec<KernelReport>,
}

impl Report {
    /// Failed cases, and manifest entries that no case exercised.
    pub fn problems(&self) -> Vec<String> {
        let mut problems: Vec<String> = self
            .kernels
            .iter()
            .flat_map(|k| k.failures.iter().map(move |f| format!("{}: {f}", k.kernel)))
            .collect();
        for entry in MANIFEST {
            if !self
                .kernels
                .iter()
                .any(|k| k.kernel == entry.name && k.cases > 0)
            {
                problems.push(format!(
                    "{}: no case exercised this manifest entry",
                    entry.name
                ));
            }
        }
        problems
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kernel conformance of {} against the CPU reference",
            self.backend
        )?;
        for k in &self.kernels {
            writeln!(
                f,
                "  {:<18} {:>3} cases  max error {:<10.3e} tolerance {:<8.1e} {}",
                k.kernel,
                k.cases,
                k.max_error,
                k.tolerance,
                if k.failures.is_empty() {
                    "ok"
                } else {
                    "FAILED"
                }
            )?;
        }
        Ok(())
    }
}

/// Runs the whole suite on `backend` against `CpuBackend`.
pub fn run_conformance<B: Backend>(backend: &B) -> Report {
    compare_backends(backend, &CpuBackend::new(2))
}

/// Runs the whole suite on `backend` against `reference`.
pub fn compare_backends<B: Backend, R: Backend>(backend: &B, reference: &R) -> Report {
    let info = backend.info();
    let mut suite = Suite {
        backend,
        reference,
        rng: Rng(0x7a6e_d3a1_5eed_0001),
        reports: BTreeMap::new(),
    };
    suite.embedding();
    suite.rms_norm();
    suite.rms_norm_residual();
    suite.matmul();
    suite.w8a8_outliers();
    suite.fused_matmuls();
    suite.rope();
    suite.paged_kv_write();
    suite.paged_attention();
    suite.attention_with_holes();
    suite.sparse_selection();
    suite.int4_key_blocks();
    suite.swiglu();
    suite.geglu();
    suite.scale();
    suite.gather_rows();
    suite.moe_route();
    suite.moe_combine();
    suite.argmax();
    // Manifest order, so reports read like the manifest.
    let mut reports = suite.reports;
    let mut kernels: Vec<KernelReport> = MANIFEST
        .iter()
        .filter_map(|entry| reports.remove(entry.name))
        .collect();
    kernels.extend(reports.into_values());
    Report {
        backend: format!("{} ({})", info.name, info.device),
        kernels,
    }
}

/// SplitMix64: reproducible inputs without a dependency (the browser's
/// fused-layer bench draws its weights from it too).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-scale, scale)`.
    fn value(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    pub(crate) fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.value(scale)).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `0..n` in random order.
    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

/// A weight matrix in its storage format, on the host.
struct HostWeight {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl HostWeight {
    fn new(format: WeightFormat, rows: usize, cols: usize, values: &[f32]) -> Self {
        let data = values
            .chunks(cols)
            .flat_map(|row| quantize_row(format, row))
            .collect();
        HostWeight {
            format,
            rows,
            cols,
            data,
        }
    }

    fn upload<X: Backend>(&self, be: &X) -> tandem_core::Result<X::Weight> {
        be.upload_weight(WeightView {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        })
    }
}

struct Suite<'a, B: Backend, R: Backend> {
    backend: &'a B,
    reference: &'a R,
    rng: Rng,
    reports: BTreeMap<&'static str, KernelReport>,
}

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    fn report(&mut self, kernel: &'static str) -> &mut KernelReport {
        let tolerance = spec(kernel).map_or(0.0, |s| s.tolerance);
        self.reports.entry(kernel).or_insert_with(|| KernelReport {
            kernel,
            cases: 0,
            max_error: 0.0,
            tolerance,
            failures: Vec::new(),
        })
    }

    /// Records one case of `kernel`: the backend's result against the reference's.
    fn check(
        &mut self,
        kernel: &'static str,
        case: String,
        got: tandem_core::Result<Vec<f32>>,
        want: tandem_core::Result<Vec<f32>>,
    ) {
        let report = self.report(kernel);
        report.cases += 1;
        let (got, want) = match (got, want) {
            (Ok(g), Ok(w)) => (g, w),
            (Err(e), _) => return report.failures.push(format!("{case}: {e}")),
            (_, Err(e)) => {
                return report
                    .failures
                    .push(format!("{case}: reference failed: {e}"))
            }
        };
        if got.len() != want.len() {
            return report.failures.push(format!(
                "{case}: {} values, the reference has {}",
                got.len(),
                want.len()
            ));
        }
        let mut worst: Option<(usize, f32)> = None;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = if g.is_nan() || w.is_nan() {
                if g.is_nan() == w.is_nan() {
                    0.0
                } else {
                    f32::INFINITY
                }
            } else {
                (g - w).abs() / (1.0 + w.abs())
            };
            if worst.is_none_or(|(_, e)| err > e) {
                worst = Some((i, err));
            }
        }
        if let Some((i, err)) = worst {
            report.max_error = report.max_error.max(err);
            if err > report.tolerance {
                let tolerance = report.tolerance;
                report.failures.push(format!(
                    "{case}: element {i} is {}, the reference {} (error {err:.3e} > {tolerance:.1e})",
                    got[i], want[i]
                ));
            }
        }
    }

    fn embedding(&mut self) {
        for format in WeightFormat::ALL {
            let (vocab, dim) = if format.is_quantized() {
                (37, 3 * format.block_elems())
            } else {
                (37, 13)
            };
            let table = HostWeight::new(format, vocab, dim, &self.rng.values(vocab * dim, 1.0));
            for rows in [1, 3, 17, 33] {
                let tokens: Vec<u32> = (0..rows).map(|_| self.rng.below(vocab) as u32).collect();
                let got = embedding(self.backend, &table, &tokens);
                let want = embedding(self.reference, &table, &tokens);
                self.check(
                    "embedding",
                    format!("{format} table {vocab}x{dim}, {rows} rows"),
                    got,
                    want,
                );
            }
        }
    }

    fn rms_norm(&mut self) {
        for (rows, dim) in [(1, 7), (3, 129), (17, 300)] {
            let x = self.rng.values(rows * dim, 2.0);
            let w = self.rng.values(dim, 1.0);
            let p = RmsNormParams {
                rows,
                dim,
                eps: 1e-5,
            };
            let got = rms_norm(self.backend, &x, &w, p);
            let want = rms_norm(self.reference, &x, &w, p);
            self.check("rms_norm", format!("{rows}x{dim}"), got, want);
        }
    }

    fn rms_norm_residual(&mut self) {
        for (rows, dim) in [(1, 7), (3, 129), (17, 300)] {
            let residual = self.rng.values(rows * dim, 2.0);
            let delta = self.rng.values(rows * dim, 1.0);
            let w = self.rng.values(dim, 1.0);
            let p = RmsNormParams {
                rows,
                dim,
                eps: 1e-6,
            };
            let got = rms_norm_residual(self.backend, &residual, &delta, &w, p);
            let want = rms_norm_residual(self.reference, &residual, &delta, &w, p);
            self.check("rms_norm_residual", format!("{rows}x{dim}"), got, want);
        }
    }

    fn rope(&mut self) {
        for style in [RopeStyle::Interleaved, RopeStyle::NeoX] {
            for (rows, rotary_dim) in [(1, 16), (3, 10), (17, 16)] {
                let (heads, head_dim) = (3, 16);
                let p = RopeParams {
                    rows,
                    heads,
                    head_dim,
                    rotary_dim,
                    style,
                };
                let x = self.rng.values(rows * heads * head_dim, 1.0);
                let positions: Vec<u32> = (0..rows).map(|_| self.rng.below(700) as u32).collect();
                let inv_freq: Vec<f32> = (0..rotary_dim / 2)
                    .map(|i| 10000f32.powf(-2.0 * i as f32 / rotary_dim as f32))
                    .collect();
                let got = rope(self.backend, &x, &positions, &inv_freq, p);
                let want = rope(self.reference, &x, &positions, &inv_freq, p);
                self.check(
                    "rope",
                    format!("{style:?} {rows} rows, rotary {rotary_dim} of {head_dim}"),
                    got,
                    want,
                );
            }
        }
    }

    fn swiglu(&mut self) {
        for len in [1, 17, 1000] {
            let gate = self.rng.values(len, 10.0);
            let up = self.rng.values(len, 2.0);
            let got = swiglu(self.backend, &gate, &up);
            let want = swiglu(self.reference, &gate, &up);
            self.check("swiglu", format!("{len} values"), got, want);
        }
    }

    fn geglu(&mut self) {
        // Gates far out on both sides too, where tanh saturates.
        for (len, range) in [(1, 3.0), (17, 10.0), (1000, 10.0), (70_001, 60.0)] {
            let gate = self.rng.values(len, range);
            let up = self.rng.values(len, 2.0);
            let got = geglu(self.backend, &gate, &up);
            let want = geglu(self.reference, &gate, &up);
            self.check("geglu", format!("{len} values in ±{range}"), got, want);
        }
    }

    fn scale(&mut self) {
        // The buffer is longer than `len`: the tail must stay as it was.
        for (len, tail, factor) in [(1, 0, -3.5), (33, 7, 25.298), (5_000, 300, 0.125)] {
            let x = self.rng.values(len + tail, 4.0);
            let got = scale(self.backend, &x, len, factor);
            let want = scale(self.reference, &x, len, factor);
            self.check(
                "scale",
                format!("{len} of {} values by {factor}", len + tail),
                got,
                want,
            );
        }
    }

    fn gather_rows(&mut self) {
        for (src_rows, width, picks) in [
            (1, 1, vec![0]),
            (20, 13, vec![3, 3, 19, 0, 7]),
            (5, 300, vec![4, 1, 2]),
        ] {
            let x = self.rng.values(src_rows * width, 1.0);
            let got = gather_rows(self.backend, &x, &picks, width);
            let want = gather_rows(self.reference, &x, &picks, width);
            self.check(
                "gather_rows",
                format!("{} of {src_rows} rows of {width}", picks.len()),
                got,
                want,
            );
        }
    }

    fn argmax(&mut self) {
        for (rows, width) in [(1, 1), (3, 5), (17, 1000), (2, 49_157)] {
            let mut x = self.rng.values(rows * width, 1.0);
            // Ties: each row's maximum appears twice (the lower index must win).
            for r in 0..rows {
                let row = &mut x[r * width..(r + 1) * width];
                let (a, b) = (self.rng.below(width), self.rng.below(width));
                row[a] = 1.5;
                row[b] = 1.5;
            }
            let got = argmax(self.backend, &x, rows, width);
            let want = argmax(self.reference, &x, rows, width);
            self.check(
                "argmax",
                format!("{rows} rows of {width} with tied maxima"),
                got,
                want,
            );
        }
    }
}

// One function per kernel, generic over the backend, each returning what the
// kernel produced (as f32 for comparison).

type Out = tandem_core::Result<Vec<f32>>;

/// The parameters of `rows` query rows of `heads` heads attending over a
/// cache of `layout` through one table of `max_blocks` entries per sequence.
fn attention_params(
    layout: KvCacheLayout,
    rows: usize,
    heads: usize,
    max_blocks: usize,
    sliding_window: Option<usize>,
) -> AttentionParams {
    AttentionParams {
        rows,
        heads,
        kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        block_size: layout.block_size,
        max_blocks_per_seq: max_blocks,
        scale: 1.0 / (layout.head_dim as f32).sqrt(),
        sliding_window,
        per_head_tables: false,
    }
}

/// An attention call's index buffers on a backend.
struct IndexBuffers<X: Backend> {
    row_seq: X::Indices,
    positions: X::Indices,
    block_tables: X::Indices,
}

impl<X: Backend> IndexBuffers<X> {
    fn upload(
        be: &X,
        row_seq: &[u32],
        positions: &[u32],
        block_tables: &[u32],
    ) -> tandem_core::Result<Self> {
        Ok(Self {
            row_seq: be.upload_indices(row_seq)?,
            positions: be.upload_indices(positions)?,
            block_tables: be.upload_indices(block_tables)?,
        })
    }

    fn view(&self) -> AttentionIndices<'_, X> {
        AttentionIndices {
            row_seq: &self.row_seq,
            positions: &self.positions,
            block_tables: &self.block_tables,
        }
    }
}
