//! Draft distillation: a small student model trained to predict what the
//! target model predicts, written as an ordinary model directory that
//! `--speculate draft:DIR` loads.
//!
//! The student starts from a few of the target's own layers (its embedding
//! and output head copied and kept frozen) and is trained on the KL
//! divergence from the target's next-token distribution. The target's
//! logits come from Tandem's own engine on the CPU backend, window by
//! window, streamed to the trainer through a bounded channel ([`teacher`]);
//! the evaluation text is never trained on ([`corpus`]). A draft may keep
//! only the corpus' most frequent tokens in its output head ([`vocab`]),
//! which makes each drafted token cheaper.
//!
//! Gradients come from candle (`candle-core` + `candle-nn`), not a
//! hand-written autograd: it is the smallest real autograd library in Rust
//! that trains on the CPU (its default build has no C or GPU dependency, so
//! the crate adds pure-Rust code only: gemm and candle), reads and writes
//! the same f32 row-major tensors as Tandem, and runs on CUDA behind this
//! crate's `cuda` feature. burn would bring a larger tree for the same work.
//!
//! Modules, in the order a run uses them: [`target_weights`] (the target's
//! tensors in f32), [`responses`] (training text in the target's own
//! words: its answers to chat instructions), [`corpus`] (training and
//! evaluation windows),
//! [`vocab`] (a reduced output vocabulary),
//! [`teacher`] (the target's logits), [`student`] (the candle model),
//! [`loss`] (KL and agreement), [`train`] (the loop, progress, checkpoints)
//! and [`write`](mod@write) (the model directory).

pub mod corpus;
pub mod loss;
pub mod responses;
pub mod student;
pub mod target_weights;
pub mod teacher;
pub mod train;
pub mod vocab;
pub mod write;

/// Where the student lives and trains: `Device::Cpu`, or a CUDA device
/// with the `cuda` feature.
pub use candle_core::Device;
pub use corpus::Corpus;
pub use student::Student;
pub use train::{distill, Options, Progress, Summary};

/// What can go wrong while distilling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target cannot be distilled this way (its architecture or shape).
    #[error("cannot distill this model: {0}")]
    Unsupported(String),
    /// A tensor the student needs is not in the target.
    #[error("the target has no tensor '{0}'")]
    MissingTensor(String),
    /// A bad option or input (layers, lengths, text too short).
    #[error("{0}")]
    InvalidInput(String),
    #[error(transparent)]
    Core(#[from] tandem_core::Error),
    #[error("training: {0}")]
    Candle(#[from] candle_core::Error),
    /// Writing a checkpoint failed.
    #[error("writing a checkpoint: {0}")]
    Checkpoint(String),
    /// The thread computing the target's logits stopped.
    #[error("the target's forward pass stopped: {0}")]
    Teacher(String),
}

pub type Result<T> = std::result::Result<T, Error>;
