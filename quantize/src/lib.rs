//! Weight quantization: turns a model's matrices into integer codes with
//! scales, choosing the codes with calibration text where the method uses it.
//!
//! The pipeline reads top-down: [`dense`] runs a plain f32 forward pass over
//! the model's (dequantized) weights; [`calib`] runs it over calibration text
//! and gathers, for the input of every linear layer, the Hessian `XᵀX`, the
//! per-channel mean and max of `|x|`, and a few sample rows. The methods work
//! on one f32 matrix at a time and return a [`grid::QuantizedMatrix`]:
//! [`rtn`] (round to nearest, the baseline), [`gptq`] (second-order error
//! compensation), [`awq`] (activation-aware channel scaling) and
//! [`smoothquant`] (activation outliers migrated into the weights for W8A8).
//! Scales that AWQ and SmoothQuant move across a layer boundary are folded
//! into the operation before it ([`fold`]), so the float model is unchanged.
//! [`mixed`] measures each layer's sensitivity and picks F16 / INT8 / INT4 per
//! layer under a bits-per-weight budget; [`plan`] applies a method to a whole
//! model and returns the tensors to write.

pub mod awq;
pub mod calib;
pub mod dense;
pub mod fold;
pub mod gptq;
pub mod grid;
pub mod linalg;
pub mod mixed;
pub mod plan;
pub mod rtn;
pub mod smoothquant;

/// What can go wrong while quantizing; every message names the bad input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option or input that cannot be used as given.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Core(#[from] tandem_core::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid<T>(message: impl Into<String>) -> Result<T> {
    Err(Error::Invalid(message.into()))
}
