//! Tandem's hardware-neutral core.
//!
//! Everything here runs on any target (wasm32 included) and names no backend:
//! model files and configuration (`model`), the tokenizer, the kernel manifest
//! (`kernels`), weight block layouts (`quant`), the paged KV cache (`kv`),
//! sampling and scheduling (`sched`), and the `Engine` that drives a forward
//! pass written once over the [`backend::Backend`] trait.

pub mod backend;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod parallel;
pub mod quant;
pub mod sched;
pub mod spec;
pub mod tokenizer;

pub use backend::Backend;
pub use error::{Error, Result};
