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
#[path = "conformance/fused.rs"]
mod fused;
#[path = "conformance/moe.rs"]
mod moe;
#[path = "conformance/scores.rs"]
mod scores;
#[path = "conformance/select.rs"]
mod select;

use tandem_core::backend::{
    AttentionIndices, AttentionParams, Backend, Glu, KvCacheLayout, KvDtype, MatmulParams,
    RmsNormParams, RopeParams, RopeStyle,
};
use tandem_core::kernels::{matmul_kernel_name, spec, MANIFEST};
use tandem_core::quant::{quantize_row, WeightFormat, WeightView};
use tandem_cpu::CpuBackend;

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

/// One sequence of an attention case: its block-table row and how many of
/// its tokens are cached before the step.
struct Sequence {
    blocks: Vec<u32>,
    cached: usize,
}

/// A write or a block copy, in the order an engine does them.
enum KvStep {
    Write {
        slots: Vec<u32>,
        k: Vec<f32>,
        v: Vec<f32>,
    },
    Copy(Vec<(u32, u32)>),
}

/// An attention step: sequences with K/V already cached, then the step's
/// rows (their K/V are written first, then they attend).
struct AttentionCase {
    layout: KvCacheLayout,
    /// Steps before everything else (earlier prefills and decode steps).
    history: Vec<KvStep>,
    heads: usize,
    window: Option<usize>,
    max_blocks: usize,
    tables: Vec<u32>,
    /// K/V rows cached before the step, and their slots.
    prefix_k: Vec<f32>,
    prefix_v: Vec<f32>,
    prefix_slots: Vec<u32>,
    /// The step's rows.
    row_seq: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    /// Block copies done before the step (copy-on-write).
    copies: Vec<(u32, u32)>,
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

    fn matmul(&mut self) {
        for format in WeightFormat::ALL {
            let kernel = matmul_kernel_name(format);
            let block = format.block_elems();
            // K-quant widths: one, two and nine super-blocks (2304: not a
            // multiple of a GEMV workgroup's stride), each on every path.
            let widths: &[usize] = if format.is_k_quant() {
                &[256, 512, 2304]
            } else if format.is_quantized() {
                &[3 * block, 5 * block]
            } else {
                &[45, 161]
            };
            let shapes = [(1, 67), (3, 5), (17, 67), (33, 67), (40, 67)];
            let cases: Vec<((usize, usize), usize)> = if format.is_k_quant() {
                shapes
                    .iter()
                    .flat_map(|&shape| widths.iter().map(move |&cols| (shape, cols)))
                    .collect()
            } else {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &shape)| (shape, widths[i % widths.len()]))
                    .collect()
            };
            // Rows 1 and 3 take GEMV paths, 17, 33 and 40 tiled ones (33 and 40
            // cross a 32-row tile); 67 outputs: one full 64-row tile and a ragged one.
            for (i, ((rows, n), cols)) in cases.into_iter().enumerate() {
                let w = HostWeight::new(format, n, cols, &self.rng.values(n * cols, 1.0));
                let x = if format.is_quantized() {
                    self.q8_exact_activations(rows * cols)
                } else {
                    self.rng.values(rows * cols, 1.0)
                };
                let bias = (i % 2 == 0).then(|| self.rng.values(n, 1.0));
                let got = matmul(self.backend, &x, &w, bias.as_deref(), rows);
                let want = matmul(self.reference, &x, &w, bias.as_deref(), rows);
                let with = if bias.is_some() { " + bias" } else { "" };
                self.check(
                    kernel,
                    format!("{rows}x{cols} by {n}x{cols}{with}"),
                    got,
                    want,
                );
            }
        }
        // A k-quant row must be whole super-blocks: 320 columns is an error
        // that says so, on the backend as on the reference.
        for format in WeightFormat::ALL.into_iter().filter(|f| f.is_k_quant()) {
            let (n, cols) = (3, 320);
            let data = vec![0u8; n * 2 * format.block_bytes()];
            let view = WeightView {
                format,
                rows: n,
                cols,
                data: &data,
            };
            let kernel = matmul_kernel_name(format);
            let case = format!("{n}x{cols} {format} weight refused");
            let outcomes = [
                ("", self.backend.upload_weight(view).map(drop)),
                ("reference: ", self.reference.upload_weight(view).map(drop)),
            ];
            let report = self.report(kernel);
            report.cases += 1;
            for (who, outcome) in outcomes {
                match outcome {
                    Ok(()) => report.failures.push(format!("{case}: {who}accepted")),
                    Err(e) if !e.to_string().contains("256") => report
                        .failures
                        .push(format!("{case}: {who}the error does not name 256: {e}")),
                    Err(_) => {}
                }
            }
        }
        // Matrices with a single row or column (a backend may store them as vectors).
        for (format, n, cols) in [(WeightFormat::Q8_0, 1, 96), (WeightFormat::F16, 5, 1)] {
            let w = HostWeight::new(format, n, cols, &self.rng.values(n * cols, 1.0));
            let x = self.q8_exact_activations(3 * cols);
            let got = matmul(self.backend, &x, &w, None, 3);
            let want = matmul(self.reference, &x, &w, None, 3);
            let kernel = matmul_kernel_name(format);
            self.check(kernel, format!("3x{cols} by {n}x{cols}"), got, want);
        }
        // More output rows than one dispatch dimension holds workgroups (65535 on most GPUs).
        let (n, cols) = (70_001, 33);
        let w = HostWeight::new(WeightFormat::F16, n, cols, &self.rng.values(n * cols, 1.0));
        let x = self.rng.values(cols, 1.0);
        let got = matmul(self.backend, &x, &w, None, 1);
        let want = matmul(self.reference, &x, &w, None, 1);
        self.check("matmul_f16", format!("1x{cols} by {n}x{cols}"), got, want);
    }

    /// W8A8 with activation rows dominated by a few outlier channels (what
    /// SmoothQuant is for): per-token INT8 then keeps the small channels at
    /// a coarse step, which every backend must reproduce. The values are
    /// whole steps of their row's scale, so that no backend's rounding of
    /// `127 / max|x|` can move a quant across a rounding boundary.
    fn w8a8_outliers(&mut self) {
        let (n, cols) = (13, 256);
        let w = HostWeight::new(WeightFormat::W8A8, n, cols, &self.rng.values(n * cols, 1.0));
        for rows in [1, 17] {
            let mut x = Vec::with_capacity(rows * cols);
            for t in 0..rows {
                let amax = 60.0 * (t + 1) as f32;
                let step = amax / 127.0;
                let mut row: Vec<f32> = (0..cols)
                    .map(|_| (self.rng.below(7) as f32 - 3.0) * step)
                    .collect();
                row[7] = amax;
                row[200] = -0.75 * amax;
                x.extend(row);
            }
            let got = matmul(self.backend, &x, &w, None, rows);
            let want = matmul(self.reference, &x, &w, None, rows);
            self.check(
                "matmul_w8a8",
                format!("{rows}x{cols} with outliers by {n}x{cols}"),
                got,
                want,
            );
        }
    }

    /// Activations that Q8 block quantization represents exactly: multiples
    /// of 1/128 with each 32-value block reaching ±127/128. A backend may
    /// quantize activations for quantized weights (the CPU backend does, as
    /// llama.cpp does); on these inputs that costs nothing, so the comparison
    /// measures the kernels rather than that approximation, whose error grows
    /// with the width and would exceed the manifest's tolerance on its own.
    fn q8_exact_activations(&mut self, n: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n)
            .map(|_| (self.rng.below(255) as f32 - 127.0) / 128.0)
            .collect();
        for block in x.chunks_mut(32) {
            let at = self.rng.below(block.len());
            block[at] = if self.rng.below(2) == 0 {
                127.0
            } else {
                -127.0
            } / 128.0;
        }
        x
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

    /// A window of one makes every query read exactly the V row written at
    /// its own position, so the output is the written values themselves,
    /// through scattered slots and a copied block.
    fn paged_kv_write(&mut self) {
        use KvDtype::*;
        for (keys, values, head_dim) in [
            (F32, F32, 7),
            (F16, F16, 7),
            (Int8, Int8, 7),
            (Int8, Int8, 40),
            (Int4, Int4, 7),
            (Int4, Int4, 72),
            (Int2, Int2, 40),
            (Int8, Int2, 40),
            (Int4, Int8, 7),
            (Int2, Int4, 72),
        ] {
            let layout = KvCacheLayout {
                num_blocks: 9,
                block_size: 5,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let rows = 6;
            let max_blocks = 3;
            // Row t is sequence t at a random position in a block of its own.
            // The last row's block is then copied (copy-on-write) to a spare
            // block, and its table points at the copy.
            let blocks = self.rng.permutation(layout.num_blocks);
            let mut tables = vec![0u32; rows * max_blocks];
            let mut positions = Vec::new();
            let mut slots = Vec::new();
            for (t, &block) in blocks.iter().take(rows).enumerate() {
                let pos = self.rng.below(max_blocks * layout.block_size);
                tables[t * max_blocks + pos / layout.block_size] = block as u32;
                positions.push(pos as u32);
                slots.push((block * layout.block_size + pos % layout.block_size) as u32);
            }
            let last = (rows - 1) * max_blocks + positions[rows - 1] as usize / layout.block_size;
            let copy = (tables[last], blocks[rows] as u32);
            tables[last] = copy.1;
            let width = layout.row_width();
            let case = AttentionCase {
                layout,
                history: Vec::new(),
                heads: 3,
                window: Some(1),
                max_blocks,
                tables,
                prefix_k: self.rng.values(rows * width, 1.0),
                prefix_v: self.rng.values(rows * width, 1.0),
                prefix_slots: slots,
                row_seq: (0..rows as u32).collect(),
                positions,
                slots: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                q: self.rng.values(rows * 3 * layout.head_dim, 1.0),
                copies: vec![copy],
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            self.check(
                kv_kernel("paged_kv_write", values),
                format!("{keys}/{values} cache, head_dim {head_dim}, {rows} scattered rows"),
                got,
                want,
            );
        }
    }

    fn paged_attention(&mut self) {
        use KvDtype::*;
        for (keys, values, head_dim, window) in [
            (F32, F32, 16, None),
            (F16, F16, 16, None),
            (F32, F32, 24, Some(4)),
            (F32, F32, 72, None),
            (Int8, Int8, 16, None),
            (Int8, Int8, 72, Some(4)),
            (Int4, Int4, 40, None),
            (Int4, Int4, 64, Some(4)),
            (Int2, Int2, 40, None),
            (Int8, Int2, 16, None),
            (Int4, Int2, 72, Some(4)),
            (Int2, Int8, 40, None),
        ] {
            // Sequence 0: 6 tokens cached, a prefill chunk of 5 (positions
            // 6..11, last block partly filled). Sequence 1: 6 cached, one
            // decode row. Sequence 2: a fresh 1-token prompt. Sequence 3: 70
            // cached (past one 64-key tile), one decode row.
            let layout = KvCacheLayout {
                num_blocks: 32,
                block_size: 4,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let heads = 9;
            let lengths: [(usize, usize); 4] = [(6, 5), (6, 1), (0, 1), (70, 1)];
            let max_blocks = 18;
            let mut free = self.rng.permutation(layout.num_blocks).into_iter();
            let seqs: Vec<Sequence> = lengths
                .iter()
                .map(|&(cached, new)| Sequence {
                    blocks: (0..(cached + new).div_ceil(layout.block_size))
                        .map(|_| free.next().unwrap_or(0) as u32)
                        .collect(),
                    cached,
                })
                .collect();
            let mut tables = vec![0u32; seqs.len() * max_blocks];
            for (s, seq) in seqs.iter().enumerate() {
                tables[s * max_blocks..][..seq.blocks.len()].copy_from_slice(&seq.blocks);
            }
            let slot = |seq: &Sequence, pos: usize| {
                seq.blocks[pos / layout.block_size] * layout.block_size as u32
                    + (pos % layout.block_size) as u32
            };
            let mut prefix_slots = Vec::new();
            for seq in &seqs {
                prefix_slots.extend((0..seq.cached).map(|p| slot(seq, p)));
            }
            // The step's rows, interleaving the sequences.
            let mut rows: Vec<(usize, usize)> = Vec::new();
            for (s, &(cached, new)) in lengths.iter().enumerate() {
                rows.extend((cached..cached + new).map(|p| (s, p)));
            }
            // Interleaved, except for INT4, whose key blocks take a
            // sequence's rows consecutively (as the engine batches them).
            if layout.key_blocks().is_none() {
                rows.swap(0, 5);
                rows.swap(2, 7);
            }
            let width = layout.row_width();
            let n = rows.len();
            let case = AttentionCase {
                layout,
                history: Vec::new(),
                heads,
                window,
                max_blocks,
                tables,
                prefix_k: self.rng.values(prefix_slots.len() * width, 1.0),
                prefix_v: self.rng.values(prefix_slots.len() * width, 1.0),
                prefix_slots,
                row_seq: rows.iter().map(|&(s, _)| s as u32).collect(),
                positions: rows.iter().map(|&(_, p)| p as u32).collect(),
                slots: rows.iter().map(|&(s, p)| slot(&seqs[s], p)).collect(),
                k: self.rng.values(n * width, 1.0),
                v: self.rng.values(n * width, 1.0),
                q: self.rng.values(n * heads * head_dim, 1.0),
                copies: Vec::new(),
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            let window = window.map_or(String::new(), |w| format!(", window {w}"));
            self.check(
                kv_kernel("paged_attention", values),
                format!("{keys}/{values} cache, {heads}/3 heads of {head_dim}, {n} rows of 4 sequences{window}"),
                got,
                want,
            );
        }
    }

    /// INT4 and INT2 keys, quantized per channel over each block, through an
    /// engine's life: one prefill call for two sequences, decode steps one
    /// token per sequence, a rollback rewriting three positions (stale tokens
    /// past the first), a fork whose copied block holds the parent's later
    /// tokens (a stale tail for the child), then attention over partly
    /// filled blocks. Awkward widths (21 and 120 channels: a last code word
    /// half used) and blocks of 5 and 16.
    fn int4_key_blocks(&mut self) {
        use KvDtype::{Int2, Int4, Int8};
        for (keys, values, head_dim, block_size) in [
            (Int4, Int4, 7, 5),
            (Int4, Int4, 40, 5),
            (Int4, Int4, 9, 16),
            (Int2, Int2, 7, 5),
            (Int2, Int8, 40, 16),
        ] {
            let layout = KvCacheLayout {
                num_blocks: 12,
                block_size,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let width = layout.row_width();
            let max_blocks = 4;
            let free = self.rng.permutation(layout.num_blocks);
            // Sequences A, B and C (a fork of A); table rows of max_blocks.
            let mut tables = vec![0u32; 3 * max_blocks];
            for b in 0..max_blocks {
                tables[b] = free[b] as u32;
                tables[max_blocks + b] = free[max_blocks + b] as u32;
            }
            let slot = |tables: &[u32], seq: usize, pos: usize| {
                tables[seq * max_blocks + pos / block_size] * block_size as u32
                    + (pos % block_size) as u32
            };
            let step = |rng: &mut Rng, rows: &[(usize, usize)], tables: &[u32]| KvStep::Write {
                slots: rows.iter().map(|&(s, p)| slot(tables, s, p)).collect(),
                k: rng.values(rows.len() * width, 1.0),
                v: rng.values(rows.len() * width, 1.0),
            };
            let prefill: Vec<_> = (0..12)
                .map(|p| (0, p))
                .chain((0..3).map(|p| (1, p)))
                .collect();
            let mut history = vec![step(&mut self.rng, &prefill, &tables)];
            for i in 0..4 {
                history.push(step(&mut self.rng, &[(0, 12 + i), (1, 3 + i)], &tables));
            }
            // Rollback of A to 13 tokens (14 and 15 stay behind, stale):
            // position 13 again, then 14 and 15 in one step.
            history.push(step(&mut self.rng, &[(0, 13)], &tables));
            history.push(step(&mut self.rng, &[(0, 14), (0, 15)], &tables));
            // C shares A's first 14 tokens; the block of position 13 is copied.
            let shared = 13 / block_size;
            tables.copy_within(..max_blocks, 2 * max_blocks);
            let copy = (tables[shared], free[2 * max_blocks] as u32);
            tables[2 * max_blocks + shared] = copy.1;
            history.push(KvStep::Copy(vec![copy]));
            history.push(step(&mut self.rng, &[(2, 14), (0, 16)], &tables));
            let rows: [(u32, u32); 5] = [(0, 16), (0, 7), (1, 6), (2, 14), (2, 3)];
            let heads = 6;
            let case = AttentionCase {
                layout,
                history,
                heads,
                window: None,
                max_blocks,
                tables,
                prefix_k: Vec::new(),
                prefix_v: Vec::new(),
                prefix_slots: Vec::new(),
                row_seq: rows.iter().map(|&(s, _)| s).collect(),
                positions: rows.iter().map(|&(_, p)| p).collect(),
                slots: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                q: self.rng.values(rows.len() * heads * head_dim, 2.0),
                copies: Vec::new(),
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            self.check(
                "paged_kv_write_int4_keys",
                format!(
                    "{keys}/{values}, 3 KV heads of {head_dim} in blocks of {block_size}: \
                     prefill, decode, rollback, fork"
                ),
                got,
                want,
            );
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

fn vector<X: Backend>(be: &X, values: &[f32]) -> tandem_core::Result<X::Weight> {
    HostWeight::new(WeightFormat::F32, 1, values.len(), values).upload(be)
}

fn embedding<X: Backend>(be: &X, table: &HostWeight, tokens: &[u32]) -> Out {
    let w = table.upload(be)?;
    let ids = be.upload_indices(tokens)?;
    let mut out = be.alloc(tokens.len() * table.cols)?;
    be.embedding(&w, &ids, tokens.len(), &mut out)?;
    be.download(&out, tokens.len() * table.cols)
}

fn rms_norm<X: Backend>(be: &X, x: &[f32], weight: &[f32], p: RmsNormParams) -> Out {
    let xs = be.upload(x)?;
    let w = vector(be, weight)?;
    let mut out = be.alloc(x.len())?;
    be.rms_norm(&xs, &w, p, &mut out)?;
    be.download(&out, x.len())
}

/// The normalized rows followed by the updated residual.
fn rms_norm_residual<X: Backend>(
    be: &X,
    residual: &[f32],
    delta: &[f32],
    weight: &[f32],
    p: RmsNormParams,
) -> Out {
    let mut res = be.upload(residual)?;
    let d = be.upload(delta)?;
    let w = vector(be, weight)?;
    let mut out = be.alloc(residual.len())?;
    be.rms_norm_residual(&mut res, &d, &w, p, &mut out)?;
    let mut all = be.download(&out, residual.len())?;
    all.extend(be.download(&res, residual.len())?);
    Ok(all)
}

fn matmul<X: Backend>(be: &X, x: &[f32], w: &HostWeight, bias: Option<&[f32]>, rows: usize) -> Out {
    let xs = be.upload(x)?;
    let weight = w.upload(be)?;
    let b = bias.map(|b| vector(be, b)).transpose()?;
    let mut out = be.alloc(rows * w.rows)?;
    be.matmul(&xs, &weight, b.as_ref(), MatmulParams { rows }, &mut out)?;
    be.download(&out, rows * w.rows)
}

fn rope<X: Backend>(be: &X, x: &[f32], positions: &[u32], inv_freq: &[f32], p: RopeParams) -> Out {
    let mut xs = be.upload(x)?;
    let pos = be.upload_indices(positions)?;
    let freq = be.upload(inv_freq)?;
    be.rope(&mut xs, &pos, &freq, p)?;
    be.download(&xs, x.len())
}

/// Writes the prefix, copies blocks, writes the step's K/V, then attends.
fn attention<X: Backend>(be: &X, c: &AttentionCase) -> Out {
    let mut cache = be.alloc_kv_cache(c.layout)?;
    let write = |cache: &mut X::KvCache, k: &[f32], v: &[f32], slots: &[u32]| {
        if slots.is_empty() {
            return Ok(());
        }
        let (k, v, s) = (be.upload(k)?, be.upload(v)?, be.upload_indices(slots)?);
        be.paged_kv_write(&k, &v, &s, slots.len(), cache)
    };
    for step in &c.history {
        match step {
            KvStep::Write { slots, k, v } => write(&mut cache, k, v, slots)?,
            KvStep::Copy(pairs) => be.copy_kv_blocks(&mut cache, pairs)?,
        }
    }
    write(&mut cache, &c.prefix_k, &c.prefix_v, &c.prefix_slots)?;
    if !c.copies.is_empty() {
        be.copy_kv_blocks(&mut cache, &c.copies)?;
    }
    write(&mut cache, &c.k, &c.v, &c.slots)?;
    let rows = c.row_seq.len();
    let q = be.upload(&c.q)?;
    let row_seq = be.upload_indices(&c.row_seq)?;
    let positions = be.upload_indices(&c.positions)?;
    let block_tables = be.upload_indices(&c.tables)?;
    let n = rows * c.heads * c.layout.head_dim;
    let mut out = be.alloc(n)?;
    let p = AttentionParams {
        rows,
        heads: c.heads,
        kv_heads: c.layout.kv_heads,
        head_dim: c.layout.head_dim,
        block_size: c.layout.block_size,
        max_blocks_per_seq: c.max_blocks,
        scale: 1.0 / (c.layout.head_dim as f32).sqrt(),
        sliding_window: c.window,
        per_head_tables: false,
    };
    let idx = AttentionIndices {
        row_seq: &row_seq,
        positions: &positions,
        block_tables: &block_tables,
    };
    be.paged_attention(&q, &cache, idx, p, &mut out)?;
    be.download(&out, n)
}

fn swiglu<X: Backend>(be: &X, gate: &[f32], up: &[f32]) -> Out {
    let (g, u) = (be.upload(gate)?, be.upload(up)?);
    let mut out = be.alloc(gate.len())?;
    be.swiglu(&g, &u, gate.len(), &mut out)?;
    be.download(&out, gate.len())
}

fn geglu<X: Backend>(be: &X, gate: &[f32], up: &[f32]) -> Out {
    let (g, u) = (be.upload(gate)?, be.upload(up)?);
    let mut out = be.alloc(gate.len())?;
    be.geglu(&g, &u, gate.len(), &mut out)?;
    be.download(&out, gate.len())
}

fn swiglu_or_geglu<X: Backend>(be: &X, glu: Glu, gate: &[f32], up: &[f32]) -> Out {
    match glu {
        Glu::SwiGlu => swiglu(be, gate, up),
        Glu::GeGlu => geglu(be, gate, up),
    }
}

fn scale<X: Backend>(be: &X, x: &[f32], len: usize, factor: f32) -> Out {
    let mut xs = be.upload(x)?;
    be.scale(&mut xs, len, factor)?;
    be.download(&xs, x.len())
}

fn gather_rows<X: Backend>(be: &X, x: &[f32], picks: &[u32], width: usize) -> Out {
    let xs = be.upload(x)?;
    let rows = be.upload_indices(picks)?;
    let mut out = be.alloc(picks.len() * width)?;
    be.gather_rows(&xs, &rows, picks.len(), width, &mut out)?;
    be.download(&out, picks.len() * width)
}

fn argmax<X: Backend>(be: &X, x: &[f32], rows: usize, width: usize) -> Out {
    let xs = be.upload(x)?;
    let mut out = be.upload_indices(&vec![u32::MAX; rows])?;
    be.argmax(&xs, rows, width, &mut out)?;
    Ok(be
        .download_indices(&out, rows)?
        .into_iter()
        .map(|i| i as f32)
        .collect())
}
