//! Quantization grids: how a matrix's elements map to integer codes.
//!
//! Two schemes, matching the storage formats the kernels read:
//! - groups of `group` consecutive elements of a row, each with its own
//!   `scale` and `min`, codes `0..=2^bits-1`, value `scale * q + min`
//!   (asymmetric; 3-bit codes use the 4-bit container);
//! - INT8 per output channel: one `scale` per row, codes `-127..=127`,
//!   value `scale * q` (symmetric).
//!
//! Group scales and mins are rounded to f16 (as stored) before codes are
//! chosen, so the values the algorithms see are exactly the values the
//! kernels compute; per-channel INT8 scales are stored as f32.

use half::f16;

use crate::{invalid, Result};

/// Group sizes the INT4 storage format has kernels for.
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Asymmetric groups along each row.
    Groups { bits: u32, group: usize },
    /// Symmetric INT8, one scale per output channel.
    Int8PerChannel,
}

impl Scheme {
    /// The scheme for `bits` (3, 4: groups of `group`; 8: per channel).
    pub fn new(bits: u32, group: usize) -> Result<Self> {
        match bits {
            8 => Ok(Scheme::Int8PerChannel),
            3 | 4 if GROUP_SIZES.contains(&group) => Ok(Scheme::Groups { bits, group }),
            3 | 4 => invalid(format!(
                "group size {group} is not supported (supported: 32, 64, 128)"
            )),
            _ => invalid(format!(
                "{bits}-bit weights are not supported (supported: 3 and 4 with groups, 8 per channel)"
            )),
        }
    }

    /// Elements that share one scale in a row of `cols`.
    pub fn group_len(self, cols: usize) -> usize {
        match self {
            Scheme::Groups { group, .. } => group,
            Scheme::Int8PerChannel => cols,
        }
    }

    /// Checks that rows of `cols` elements split into whole groups.
    pub fn check_cols(self, name: &str, cols: usize) -> Result<()> {
        let g = self.group_len(cols);
        if cols == 0 || !cols.is_multiple_of(g) {
            return invalid(format!(
                "group size {g} does not divide the {cols} columns of {name}"
            ));
        }
        Ok(())
    }

    /// Checks that `len` weights make a `rows × cols` matrix this scheme
    /// can group.
    pub fn check_matrix(self, name: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
        self.check_cols(name, cols)?;
        if len != rows * cols {
            return invalid(format!(
                "{name}: {len} weights for a {rows} × {cols} matrix"
            ));
        }
        Ok(())
    }
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The scale and offset of one group, and the range of its codes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    pub scale: f32,
    pub min: f32,
    lo: f32,
    hi: f32,
}

impl Step {
    /// The round-to-nearest step covering `values` (the whole range, no clipping).
    pub fn covering(scheme: Scheme, values: &[f32]) -> Step {
        let (lo, hi) = values
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        Step::for_range(scheme, lo, hi)
    }

    /// The step for values in `[lo, hi]`.
    pub fn for_range(scheme: Scheme, lo: f32, hi: f32) -> Step {
        match scheme {
            Scheme::Groups { bits, .. } => {
                let maxq = ((1u32 << bits) - 1) as f32;
                let min = round_f16(lo);
                let scale = round_f16(((hi - min) / maxq).max(0.0));
                Step {
                    scale,
                    min,
                    lo: 0.0,
                    hi: maxq,
                }
            }
            Scheme::Int8PerChannel => Step {
                scale: lo.abs().max(hi.abs()) / 127.0,
                min: 0.0,
                lo: -127.0,
                hi: 127.0,
            },
        }
    }

    /// The nearest code for `w`.
    pub fn code(&self, w: f32) -> f32 {
        if self.scale > 0.0 {
            ((w - self.min) / self.scale)
                .round()
                .clamp(self.lo, self.hi)
        } else {
            self.lo.max(0.0)
        }
    }

    pub fn value(&self, code: f32) -> f32 {
        self.scale * code + self.min
    }

    /// `w` rounded to the grid.
    pub fn snap(&self, w: f32) -> f32 {
        self.value(self.code(w))
    }
}

/// A `rows × cols` matrix as codes plus one [`Step`] per group.
#[derive(Clone, Debug)]
pub struct QuantizedMatrix {
    pub scheme: Scheme,
    pub rows: usize,
    pub cols: usize,
    /// One code per element, row-major (`0..=15` for groups, `-127..=127` per channel).
    pub codes: Vec<i8>,
    /// Row-major: `cols / group_len` steps per row.
    pub steps: Vec<Step>,
}

impl QuantizedMatrix {
    pub fn group_len(&self) -> usize {
        self.scheme.group_len(self.cols)
    }

    pub fn step(&self, row: usize, col: usize) -> Step {
        let per_row = self.cols / self.group_len();
        self.steps[row * per_row + col / self.group_len()]
    }

    /// The values the kernels compute from this matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let i = r * self.cols + c;
                out[i] = self.step(r, c).value(self.codes[i] as f32);
            }
        }
        out
    }

    pub fn scales(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.scale).collect()
    }

    pub fn mins(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.min).collect()
    }
}
