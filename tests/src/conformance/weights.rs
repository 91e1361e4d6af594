//! Weight matrices in the conformance suite: every storage format's matmul
//! at awkward widths and row counts, activations that 8-bit quantization
//! meets exactly, and W8A8's outlier rows.

use tandem_core::backend::Backend;
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::{WeightFormat, WeightView};

use super::{matmul, HostWeight, Suite};

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    pub(super) fn matmul(&mut self) {
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
    pub(super) fn w8a8_outliers(&mut self) {
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
}
