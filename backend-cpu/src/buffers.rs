//! The backend's buffer types: host memory in the layouts the kernels read.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use tandem_core::backend::WeightStorage;
use tandem_core::model::Bytes;
use tandem_core::quant::{dequantize_row, WeightFormat, WeightView};
use tandem_core::Result;

use crate::check;

/// Element types whose all-zero bytes are their zero value.
///
/// # Safety
/// An implementor must be valid, and zero, for all-zero bytes.
pub(crate) unsafe trait ZeroBits: Copy {}

// SAFETY: all-zero bytes are 0.0, 0 and +0.0.
unsafe impl ZeroBits for f32 {}
unsafe impl ZeroBits for u32 {}
unsafe impl ZeroBits for f16 {}

/// `len` zeros, or `None` when memory runs out. The memory comes zeroed
/// from the allocator (fresh pages, for large sizes) instead of being
/// written, so a page no kernel writes is never made resident: a KV pool
/// sized for the whole context costs memory only for the tokens it holds.
pub(crate) fn zeroed_vec<T: ZeroBits>(len: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout is non-empty; zero bytes are valid `T`s
    // (`ZeroBits`); the block comes from the global allocator with the
    // layout of `len` `T`s, which is what `Vec` frees it with.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<T>();
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }
}

/// f32 activations: a flat host buffer (shapes travel in kernel parameters).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tensor(Vec<f32>);

impl Tensor {
    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn into_vec(self) -> Vec<f32> {
        self.0
    }
}

impl From<Vec<f32>> for Tensor {
    fn from(values: Vec<f32>) -> Self {
        Tensor(values)
    }
}

/// u32 indices (tokens, positions, slots, block tables).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Indices(Vec<u32>);

impl Indices {
    pub fn as_slice(&self) -> &[u32] {
        &self.0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u32] {
        &mut self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn into_vec(self) -> Vec<u32> {
        self.0
    }
}

impl From<Vec<u32>> for Indices {
    fn from(values: Vec<u32>) -> Self {
        Indices(values)
    }
}

/// A `rows × cols` weight matrix (a vector is one row) in its storage format.
///
/// Block formats keep their GGML bytes unchanged, so the kernels read exactly
/// the layout documented in `tandem_core::quant`, and where the bytes lie in
/// a model file the weight reads them there ([`Weight::from_file`]). F32, F16
/// and BF16 are decoded once at upload into typed vectors: the same bits, but
/// aligned, so kernels load them directly instead of assembling
/// little-endian bytes.
#[derive(Clone, Debug)]
pub struct Weight {
    rows: usize,
    cols: usize,
    data: WeightData,
}

#[derive(Clone, Debug)]
pub(crate) enum WeightData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// Rows of any quantized format (GGML's blocks, Tandem's INT8 and INT4
    /// rows), its bytes as documented in `tandem_core::quant`.
    Blocks(WeightFormat, WeightBytes),
}

/// Most matrices one weight stacks where they lie in a model file
/// ([`Weight::from_file_stack`]): a fused Q, K and V projection.
const MAX_STACKED: usize = 3;

/// A block-format weight's bytes: a copy, or ranges of a model file, one
/// per matrix it stacks (a single one for a weight of one tensor).
#[derive(Clone)]
pub(crate) enum WeightBytes {
    Owned(Vec<u8>),
    InFile {
        file: Arc<Bytes>,
        ranges: Vec<Range<usize>>,
    },
}

impl WeightBytes {
    /// The rows as the kernels read them.
    pub(crate) fn rows(&self) -> RowBytes<'_> {
        let mut parts: [&[u8]; MAX_STACKED] = [&[]; MAX_STACKED];
        match self {
            WeightBytes::Owned(bytes) => parts[0] = bytes,
            WeightBytes::InFile { file, ranges } => {
                for (part, range) in parts.iter_mut().zip(ranges) {
                    *part = &file[range.clone()];
                }
            }
        }
        RowBytes { parts }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightBytes::Owned(bytes) => write!(f, "Owned({} bytes)", bytes.len()),
            WeightBytes::InFile { ranges, .. } => write!(f, "InFile({ranges:?})"),
        }
    }
}

/// A block-format matrix's rows: one run of bytes, or the runs of the
/// matrices a stacked weight is made of, each a whole number of rows (the
/// unused runs empty).
#[derive(Clone, Copy)]
pub(crate) struct RowBytes<'a> {
    parts: [&'a [u8]; MAX_STACKED],
}

impl<'a> RowBytes<'a> {
    /// Row `r`, of `row_bytes` bytes.
    ///
    /// # Panics
    /// If the matrix has no row `r`.
    #[inline]
    pub(crate) fn row(&self, r: usize, row_bytes: usize) -> &'a [u8] {
        let mut start = r * row_bytes;
        for part in self.parts {
            if start < part.len() {
                return &part[start..][..row_bytes];
            }
            start -= part.len();
        }
        assert!(row_bytes == 0, "row {r} is past the matrix");
        &[]
    }
}

impl Weight {
    /// Copies `view` after checking that its byte length matches its shape.
    pub fn from_view(view: WeightView<'_>) -> Result<Self> {
        check_view(&view)?;
        let pairs = || view.data.chunks_exact(2).map(|b| [b[0], b[1]]);
        let data = match view.format {
            WeightFormat::F32 => WeightData::F32(
                view.data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            WeightFormat::F16 => WeightData::F16(pairs().map(f16::from_le_bytes).collect()),
            WeightFormat::BF16 => WeightData::BF16(pairs().map(bf16::from_le_bytes).collect()),
            format => WeightData::Blocks(format, WeightBytes::Owned(view.data.to_vec())),
        };
        Ok(Weight {
            rows: view.rows,
            cols: view.cols,
            data,
        })
    }

    /// A block-format `view` that lies in `file` is read there, without a
    /// copy; any other is copied ([`Weight::from_view`]).
    pub fn from_file(view: WeightView<'_>, file: &Arc<Bytes>) -> Result<(Self, WeightStorage)> {
        let range = file
            .range_of(view.data)
            .filter(|_| view.format.is_quantized());
        let Some(range) = range else {
            return Ok((Weight::from_view(view)?, WeightStorage::Copied));
        };
        check_view(&view)?;
        let bytes = WeightBytes::InFile {
            file: Arc::clone(file),
            ranges: vec![range],
        };
        let weight = Weight {
            rows: view.rows,
            cols: view.cols,
            data: WeightData::Blocks(view.format, bytes),
        };
        Ok((weight, WeightStorage::InFile))
    }

    /// Quantized matrices of one format and width that lie in `file`,
    /// stacked row after row as one weight read where each lies; `None`
    /// where they do not qualify (the loader then concatenates a copy).
    pub fn from_file_stack(parts: &[WeightView<'_>], file: &Arc<Bytes>) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.len() > MAX_STACKED
            || !first.format.is_quantized()
            || parts
                .iter()
                .any(|v| v.format != first.format || v.cols != first.cols)
        {
            return Ok(None);
        }
        let Some(ranges) = parts.iter().map(|v| file.range_of(v.data)).collect() else {
            return Ok(None);
        };
        parts.iter().try_for_each(check_view)?;
        Ok(Some(Weight {
            rows: parts.iter().map(|v| v.rows).sum(),
            cols: first.cols,
            data: WeightData::Blocks(
                first.format,
                WeightBytes::InFile {
                    file: Arc::clone(file),
                    ranges,
                },
            ),
        }))
    }

    pub fn format(&self) -> WeightFormat {
        match self.data {
            WeightData::F32(_) => WeightFormat::F32,
            WeightData::F16(_) => WeightFormat::F16,
            WeightData::BF16(_) => WeightFormat::BF16,
            WeightData::Blocks(format, _) => format,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn data(&self) -> &WeightData {
        &self.data
    }

    /// Decodes rows `range` into `out` (`range.len() * cols` values).
    pub(crate) fn dequantize_rows(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        let elems = range.start * self.cols..range.end * self.cols;
        match &self.data {
            WeightData::F32(values) => out.copy_from_slice(&values[elems]),
            WeightData::F16(values) => values[elems].convert_to_f32_slice(out),
            WeightData::BF16(values) => values[elems].convert_to_f32_slice(out),
            WeightData::Blocks(format, bytes) => {
                let format = *format;
                let row_bytes = format.row_bytes(self.cols).unwrap_or(0);
                let rows = bytes.rows();
                for (r, dst) in range.zip(out.chunks_exact_mut(self.cols.max(1))) {
                    dequantize_row(format, rows.row(r, row_bytes), dst);
                }
            }
        }
    }

    /// All elements as f32, checked to be at least `needed` long: norm
    /// weights and biases, which are small vectors (borrowed when F32).
    pub(crate) fn vector(&self, kernel: &str, name: &str, needed: usize) -> Result<Cow<'_, [f32]>> {
        check::buffer_len(kernel, name, self.len(), needed)?;
        Ok(match &self.data {
            WeightData::F32(values) => Cow::Borrowed(&values[..needed]),
            _ => {
                let mut values = vec![0.0; self.len()];
                self.dequantize_rows(0..self.rows, &mut values);
                values.truncate(needed);
                Cow::Owned(values)
            }
        })
    }
}

/// Checks that `view`'s byte length matches its shape.
fn check_view(view: &WeightView<'_>) -> Result<()> {
    let kernel = "upload_weight";
    check::product(kernel, &[view.rows, view.cols])?;
    let expected = view
        .format
        .bytes_for(view.rows as u64, view.cols as u64)
        .ok_or_else(|| {
            check::error(
                kernel,
                format!(
                    "{} rows of {} columns are not whole {} blocks of {} elements",
                    view.rows,
                    view.cols,
                    view.format,
                    view.format.block_elems()
                ),
            )
        })?;
    if view.data.len() as u64 != expected {
        return Err(check::error(
            kernel,
            format!(
                "{} weight of {}×{} needs {expected} bytes, got {}",
                view.format,
                view.rows,
                view.cols,
                view.data.len()
            ),
        ));
    }
    Ok(())
}
