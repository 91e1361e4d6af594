//! Helpers shared by the integration tests: a seeded generator, weights in
//! any format, and the manifest's tolerance check.

#![allow(dead_code)] // each test binary uses its own subset

use tandem_core::kernels::spec;
use tandem_core::quant::{quantize_matrix, WeightFormat, WeightView};
use tandem_cpu::CpuBackend;

/// SplitMix64: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-scale, scale)`.
    pub fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(scale)).collect()
    }
}

/// A `rows × cols` matrix of random values in `[-scale, scale)`, stored in `format`.
pub struct RandomWeight {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

impl RandomWeight {
    pub fn new(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize, scale: f32) -> Self {
        let values = rng.vec(rows * cols, scale);
        RandomWeight {
            format,
            rows,
            cols,
            bytes: quantize_matrix(format, cols, &values),
        }
    }

    pub fn view(&self) -> WeightView<'_> {
        WeightView {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.bytes,
        }
    }
}

/// Asserts `|got - want| / (1 + |want|) <= tolerance of kernel` everywhere.
pub fn assert_close(kernel: &str, got: &[f32], want: &[f32]) {
    let tolerance = spec(kernel)
        .unwrap_or_else(|| panic!("{kernel} is not in the manifest"))
        .tolerance;
    assert_eq!(got.len(), want.len(), "{kernel}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let error = (g - w).abs() / (1.0 + w.abs());
        let both_nan = g.is_nan() && w.is_nan();
        assert!(
            both_nan || error <= tolerance,
            "{kernel}[{i}]: got {g}, want {w} (error {error:e} > {tolerance:e})"
        );
    }
}

/// Formats whose rows are whole 32-element blocks.
pub fn is_block_format(format: WeightFormat) -> bool {
    format.block_elems() > 1
}

/// One thread, and more threads than this machine may have, so both the
/// serial and the split paths run.
pub fn backends() -> Vec<CpuBackend> {
    vec![CpuBackend::new(1), CpuBackend::new(3)]
}
