//! Hugging Face checkpoints: the safetensors [`file`](mod@file) reader and [`writer`],
//! the Hugging Face tensor [`names`], the [`hf`] directory loader
//! (`config.json` as [`hf_config`] reads it, `model.safetensors` or the
//! shards that `model.safetensors.index.json` lists, `tokenizer.json`) and
//! [`model_dir`], which writes such a directory.
//!
//! A safetensors file is an 8-byte little-endian header length, that many
//! bytes of JSON, then the data. The JSON maps each tensor name to `{"dtype",
//! "shape", "data_offsets": [begin, end]}` (offsets relative to the start of
//! the data, shape outermost first) and may hold a `__metadata__` map of
//! strings. As with GGUF, the reader checks the header length and every range
//! against the file before using it.
//!
//! Quantized matrices (any format of `crate::quant` with blocks: GGML's Q8_0,
//! Q4_0, Q4_1 and Tandem's INT8, W8A8, INT4_G64, INT4_G128) are stored as
//! `U8` tensors of shape `[rows, row_bytes]` holding the format's rows as
//! documented in `crate::quant`, and named in `__metadata__` by an entry
//! `"tandem.format.<tensor name>": "<format name>"` (e.g. `"INT4_G128"`);
//! the logical `[rows, cols]` follows from the row length. Other readers see
//! plain byte tensors; Tandem loads them as they are.
//!
//! Hugging Face names (`model.layers.N.self_attn.q_proj.weight`) become the
//! canonical GGUF names (`blk.N.attn_q.weight`) and shapes are reversed to
//! innermost first. The checkpoints keep Q/K rows in their original order, so
//! RoPE rotates halves ([`RopeStyle::NeoX`](crate::backend::RopeStyle::NeoX)).

pub mod file;
pub mod hf;
pub mod hf_config;
mod hf_config_write;
mod hf_moe;
mod json_fields;
pub mod model_dir;
pub mod moe_names;
pub mod names;
pub mod writer;

pub use file::SafetensorsFile;
#[cfg(not(target_arch = "wasm32"))]
pub use hf::load_hf_dir;
pub use hf_config_write::hf_config_json;
pub use model_dir::OutputTensor;
#[cfg(not(target_arch = "wasm32"))]
pub use model_dir::{rows_from_interleaved, write_model_dir, write_tokenizer_files};
pub use names::{canonical_name, hf_name};
pub use writer::SafetensorsWriter;

const METADATA_KEY: &str = "__metadata__";
/// `__metadata__` key prefix naming the format of a quantized tensor.
pub const FORMAT_METADATA_PREFIX: &str = "tandem.format.";
/// The safetensors dtype quantized matrices are stored as.
const QUANTIZED_DTYPE: &str = "U8";
const CONFIG_FILE: &str = "config.json";
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
const TOKENIZER_FILE: &str = "tokenizer.json";

/// Helpers the reader, writer and loader tests share.
#[cfg(test)]
mod testing {
    pub fn test_values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 5 % 17) as f32 - 8.0) / 4.0).collect()
    }
}
