//! The error type of the core. Every failure a user can cause (a bad file, a
//! prompt that does not fit, an unknown option) is a variant with a message
//! that names what is wrong; nothing in the core panics on bad input.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model file is malformed: `path` names the file, `reason` what is wrong with it.
    #[error("{path}: {reason}")]
    BadModelFile { path: PathBuf, reason: String },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The model is well-formed but uses something Tandem does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A request that cannot be served as asked (too long, bad parameter).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// A sequence's output constraint (grammar, JSON schema) failed or
    /// left nothing to sample.
    #[error("output constraint: {0}")]
    Constraint(String),

    /// The KV cache has no room left for the request, even after preemption.
    #[error("out of KV cache blocks: {0}")]
    KvCacheFull(String),

    /// Ranks of a distributed job could not exchange data (a rank died, or
    /// they disagree on what to run).
    #[error("communication: {0}")]
    Communication(String),

    #[error("backend {backend}: {message}")]
    Backend { backend: String, message: String },
}

impl Error {
    pub fn bad_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::BadModelFile {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub fn backend(backend: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Backend {
            backend: backend.into(),
            message: message.into(),
        }
    }
}
