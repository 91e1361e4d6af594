//! Precondition checks shared by the kernels.
//!
//! Every size and index a caller passes is checked here before a kernel
//! touches memory, so bad input becomes an [`Error::Backend`] that names the
//! kernel, the buffer and the sizes involved, never a panic or an
//! out-of-bounds access. Index buffers are scanned in full: that is linear in
//! the number of rows, negligible next to the kernels themselves.

use std::fmt::Display;

use tandem_core::{Error, Result};

/// Name of this backend in error messages.
pub(crate) const BACKEND: &str = "cpu";

pub(crate) fn error(kernel: &str, message: impl Display) -> Error {
    Error::backend(BACKEND, format!("{kernel}: {message}"))
}

/// The product of `dims`, or an error when it overflows `usize`.
pub(crate) fn product(kernel: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| error(kernel, format!("size {dims:?} overflows")))
}

/// `buffer` must hold at least `needed` elements.
pub(crate) fn buffer_len(kernel: &str, buffer: &str, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(error(
            kernel,
            format!("{buffer} holds {len} elements but the parameters need {needed}"),
        ));
    }
    Ok(())
}

/// Every value of `values` must be below `bound`.
pub(crate) fn indices_below(
    kernel: &str,
    buffer: &str,
    values: &[u32],
    bound: usize,
) -> Result<()> {
    match values.iter().position(|&v| v as usize >= bound) {
        Some(i) => Err(error(
            kernel,
            format!(
                "{buffer}[{i}] = {} is out of range (must be < {bound})",
                values[i]
            ),
        )),
        None => Ok(()),
    }
}

/// `value` must be positive (a zero dimension is always a caller bug here,
/// and dividing by it would panic).
pub(crate) fn positive(kernel: &str, name: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(error(kernel, format!("{name} must be positive")));
    }
    Ok(())
}
