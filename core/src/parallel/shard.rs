//! A rank's slice of one weight, cut as the file is read: a mapped file's
//! pages outside the slice are never touched, so no rank reads (or holds)
//! the whole model.
//!
//! A row range of a matrix is a contiguous byte range of the file (every
//! format stores whole rows). A column range keeps each row's head (the
//! per-row scale of INT8/W8A8) and the blocks inside the range; a range
//! that cuts through a quantization block (a 448-column slice of a Q4_K
//! matrix, blocks of 256) is dequantized to F32 instead, which is exact,
//! so that rank's slice costs more memory but computes the same sums.

use std::borrow::Cow;
use std::ops::Range;

use super::plan::Split;
use crate::quant::{WeightFormat, WeightView};
use crate::{Error, Result};

/// A weight slice: borrowed from the file when it is one range of it.
#[derive(Debug)]
pub struct ShardView<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Cow<'a, [u8]>,
}

impl<'a> ShardView<'a> {
    /// The whole of `view`, borrowed.
    pub fn whole(view: WeightView<'a>) -> Self {
        borrowed(view, view.rows, view.cols, view.data)
    }

    pub fn view(&self) -> WeightView<'_> {
        WeightView {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        }
    }
}

/// `view` cut by `split`; a vector (norm weight or bias) is cut by elements.
pub fn shard<'a>(view: WeightView<'a>, split: &Split, name: &str) -> Result<ShardView<'a>> {
    let out_of_range = |r: &Range<usize>, len: usize, what: &str| {
        Error::InvalidRequest(format!(
            "{name}: {what} {r:?} of a tensor with {len} {what}"
        ))
    };
    let is_vector = view.rows == 1;
    match split {
        Split::Whole => Ok(ShardView::whole(view)),
        Split::Rows(r) if is_vector => {
            if r.end > view.cols {
                return Err(out_of_range(r, view.cols, "elements"));
            }
            Ok(f32_shard(1, r.len(), view.to_f32()[r.clone()].to_vec()))
        }
        Split::Rows(r) => {
            if r.end > view.rows {
                return Err(out_of_range(r, view.rows, "rows"));
            }
            let rb = view.row_bytes();
            let data = &view.data[r.start * rb..r.end * rb];
            Ok(borrowed(view, r.len(), view.cols, data))
        }
        Split::Cols(c) => {
            if c.end > view.cols || is_vector {
                return Err(out_of_range(c, view.cols, "columns"));
            }
            Ok(columns(view, c.clone()))
        }
    }
}

fn borrowed<'a>(view: WeightView<'_>, rows: usize, cols: usize, data: &'a [u8]) -> ShardView<'a> {
    ShardView {
        format: view.format,
        rows,
        cols,
        data: Cow::Borrowed(data),
    }
}

fn f32_shard(rows: usize, cols: usize, values: Vec<f32>) -> ShardView<'static> {
    ShardView {
        format: WeightFormat::F32,
        rows,
        cols,
        data: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

/// Columns `c` of every row: whole blocks in the file's format, else F32.
fn columns(view: WeightView<'_>, c: Range<usize>) -> ShardView<'static> {
    let block = view.format.block_elems();
    let head = view.format.row_head_bytes();
    if c.start.is_multiple_of(block) && (c.end.is_multiple_of(block) || c.end == view.cols) {
        let bytes = view.format.block_bytes();
        let blocks = c.start / block * bytes..c.end.div_ceil(block) * bytes;
        let mut data = Vec::with_capacity(view.rows * (head + blocks.len()));
        for r in 0..view.rows {
            let row = view.row(r);
            data.extend_from_slice(&row[..head]);
            data.extend_from_slice(&row[head + blocks.start..head + blocks.end]);
        }
        return ShardView {
            format: view.format,
            rows: view.rows,
            cols: c.len(),
            data: Cow::Owned(data),
        };
    }
    let mut row = vec![0.0; view.cols];
    let mut values = Vec::with_capacity(view.rows * c.len());
    for r in 0..view.rows {
        crate::quant::dequantize_row(view.format, view.row(r), &mut row);
        values.extend_from_slice(&row[c.clone()]);
    }
    f32_shard(view.rows, c.len(), values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_matrix;

    fn matrix(format: WeightFormat, rows: usize, cols: usize) -> (Vec<f32>, Vec<u8>) {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
            .collect();
        let data = quantize_matrix(format, cols, &values);
        (values, data)
    }

    /// Every slice holds exactly the elements the whole matrix gives there.
    #[test]
    fn slices_dequantize_to_the_whole_matrix_elements() {
        let formats = [
            WeightFormat::F32,
            WeightFormat::F16,
            WeightFormat::Q8_0,
            WeightFormat::Q4_1,
            WeightFormat::Q4_K,
            WeightFormat::Q6_K,
            WeightFormat::Int8PerChannel,
        ];
        for format in formats {
            let (rows, cols) = (5, 512);
            let (_, data) = matrix(format, rows, cols);
            let whole = WeightView {
                format,
                rows,
                cols,
                data: &data,
            };
            let reference = whole.to_f32();
            for split in [
                Split::Rows(1..4),
                Split::Cols(256..512),
                Split::Cols(0..448),
                Split::Cols(64..96),
                Split::Whole,
            ] {
                let s = shard(whole, &split, "w").unwrap();
                let got = s.view().to_f32();
                let (r, c) = match &split {
                    Split::Rows(r) => (r.clone(), 0..cols),
                    Split::Cols(c) => (0..rows, c.clone()),
                    Split::Whole => (0..rows, 0..cols),
                };
                let want: Vec<f32> = r
                    .flat_map(|i| reference[i * cols + c.start..i * cols + c.end].to_vec())
                    .collect();
                assert_eq!(got, want, "{format} {split:?}");
                let kept = c.start % format.block_elems() == 0 && c.end % format.block_elems() == 0;
                assert_eq!(s.format == format, kept, "{format} {split:?}");
            }
        }
    }

    #[test]
    fn a_row_slice_borrows_the_file() {
        let (_, data) = matrix(WeightFormat::Q4_1, 8, 64);
        let whole = WeightView {
            format: WeightFormat::Q4_1,
            rows: 8,
            cols: 64,
            data: &data,
        };
        let s = shard(whole, &Split::Rows(2..6), "w").unwrap();
        assert!(matches!(s.data, Cow::Borrowed(_)));
        assert_eq!(s.data.len(), data.len() / 2);
    }

    #[test]
    fn ranges_past_the_tensor_are_refused() {
        let (_, data) = matrix(WeightFormat::F32, 2, 8);
        let whole = WeightView {
            format: WeightFormat::F32,
            rows: 2,
            cols: 8,
            data: &data,
        };
        let err = shard(whole, &Split::Rows(0..3), "blk.0.attn_q.weight").unwrap_err();
        assert!(
            err.to_string().contains("blk.0.attn_q.weight: rows 0..3"),
            "{err}"
        );
        assert!(shard(whole, &Split::Cols(4..9), "w").is_err());
        let vector = WeightView {
            format: WeightFormat::F32,
            rows: 1,
            cols: 8,
            data: &data[..32],
        };
        let s = shard(vector, &Split::Rows(2..5), "b").unwrap();
        assert_eq!((s.rows, s.cols), (1, 3));
    }
}
