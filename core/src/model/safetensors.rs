//! Hugging Face checkpoints: the safetensors reader and writer, and the loader
//! of a model directory (`config.json`, `model.safetensors` or the shards that
//! `model.safetensors.index.json` lists, `tokenizer.json`).
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
//! RoPE rotates halves ([`RopeStyle::NeoX`]).

// The directory loader needs a file system; in the browser only the parser,
// the writer and the name mapping are used.
#![cfg_attr(target_arch = "wasm32", allow(dead_code, unused_imports))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::config::{ModelConfig, RopeScaling};
use super::{check_tensors, Bytes, ModelFiles, TensorInfo, TensorStore};
use crate::backend::RopeStyle;
use crate::quant::WeightFormat;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// A parsed safetensors file.
pub struct SafetensorsFile {
    /// Names as in the file; shapes innermost first; offsets absolute and in
    /// bounds; `file` is 0.
    pub tensors: Vec<TensorInfo>,
    /// The header's `__metadata__` entries.
    pub metadata: Vec<(String, String)>,
    pub bytes: Arc<Bytes>,
}

/// Builds a safetensors file in memory.
#[derive(Default)]
pub struct SafetensorsWriter {
    tensors: Vec<PendingTensor>,
    metadata: BTreeMap<String, String>,
}

struct PendingTensor {
    name: String,
    dtype: &'static str,
    /// Outermost first, as safetensors stores it (`[rows, row_bytes]` for a
    /// quantized matrix).
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// The fields of `config.json` Tandem reads.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    sliding_window: Option<usize>,
    /// Qwen2 configs carry a `sliding_window` size that only applies when this is set.
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    /// Older configs name the kind `type`.
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

const METADATA_KEY: &str = "__metadata__";
/// `__metadata__` key prefix naming the format of a quantized tensor.
pub const FORMAT_METADATA_PREFIX: &str = "tandem.format.";
/// The safetensors dtype quantized matrices are stored as.
const QUANTIZED_DTYPE: &str = "U8";
/// The reference implementation's limit; a larger header is corrupt.
const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Weight tensors of the models Tandem runs have at most two dimensions; GGUF allows four.
const MAX_DIMS: usize = 4;
const CONFIG_FILE: &str = "config.json";
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
const TOKENIZER_FILE: &str = "tokenizer.json";

fn dtype_format(dtype: &str) -> Option<WeightFormat> {
    match dtype {
        "F32" => Some(WeightFormat::F32),
        "F16" => Some(WeightFormat::F16),
        "BF16" => Some(WeightFormat::BF16),
        _ => None,
    }
}

impl SafetensorsFile {
    /// Memory-maps and parses `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &Path) -> Result<Self> {
        Self::parse(Arc::new(Bytes::map(path)?), path)
    }

    /// Parses a whole file held in `bytes`; `path` only names it in errors.
    pub fn parse(bytes: Arc<Bytes>, path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::bad_file(path, reason);
        let file_len = bytes.len();
        let header_len = bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| {
                bad(format!(
                    "truncated: {file_len} bytes is too short for a safetensors header"
                ))
            })?;
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {header_len} exceeds {MAX_HEADER_BYTES} bytes: not a safetensors file"
            )));
        }
        let data_start = 8 + header_len as usize;
        if data_start > file_len {
            return Err(bad(format!(
                "truncated: header length {header_len} runs past the end of the file (size {file_len} bytes)"
            )));
        }
        let header: serde_json::Map<String, Value> = bytes
            .get(8..data_start)
            .ok_or_else(|| bad("header lies outside the file".into()))
            .and_then(|json| {
                serde_json::from_slice(json)
                    .map_err(|e| bad(format!("header is not a JSON object: {e}")))
            })?;
        let mut header = header;
        let data_len = (file_len - data_start) as u64;
        let metadata = match header.remove(METADATA_KEY) {
            Some(value) => parse_metadata(value).map_err(&bad)?,
            None => Vec::new(),
        };
        let mut quantized = BTreeMap::new();
        for (key, value) in &metadata {
            if let Some(tensor) = key.strip_prefix(FORMAT_METADATA_PREFIX) {
                let format = WeightFormat::from_name(value)
                    .filter(|f| f.is_quantized())
                    .ok_or_else(|| {
                        bad(format!(
                            "{key} is '{value}', not a quantized format Tandem knows"
                        ))
                    })?;
                quantized.insert(tensor.to_string(), format);
            }
        }
        if let Some(name) = quantized.keys().find(|name| !header.contains_key(*name)) {
            return Err(bad(format!(
                "{FORMAT_METADATA_PREFIX}{name} names a tensor the file does not have"
            )));
        }
        let mut tensors = Vec::with_capacity(header.len());
        for (name, value) in header {
            let entry: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| bad(format!("tensor '{name}': malformed header entry: {e}")))?;
            let format = quantized.remove(&name);
            tensors.push(check_entry(name, entry, format, data_start, data_len).map_err(&bad)?);
        }
        Ok(SafetensorsFile {
            tensors,
            metadata,
            bytes,
        })
    }
}

fn parse_metadata(value: Value) -> std::result::Result<Vec<(String, String)>, String> {
    let Value::Object(map) = value else {
        return Err(format!("{METADATA_KEY} is not a JSON object"));
    };
    map.into_iter()
        .map(|(key, value)| match value {
            Value::String(s) => Ok((key, s)),
            other => Err(format!(
                "{METADATA_KEY} entry '{key}' is {other}, not a string"
            )),
        })
        .collect()
}

/// Checks one header entry's dtype, shape and data range; `quantized` is
/// the format `__metadata__` gives the tensor.
fn check_entry(
    name: String,
    entry: HeaderEntry,
    quantized: Option<WeightFormat>,
    data_start: usize,
    data_len: u64,
) -> std::result::Result<TensorInfo, String> {
    let HeaderEntry {
        dtype,
        shape,
        data_offsets: [begin, end],
    } = entry;
    if let Some(format) = quantized {
        return check_quantized_entry(
            name,
            format,
            &dtype,
            &shape,
            [begin, end],
            data_start,
            data_len,
        );
    }
    let format = dtype_format(&dtype).ok_or_else(|| {
        format!(
            "tensor '{name}' has dtype {dtype}, which Tandem does not read (F32, F16, BF16, \
             or U8 with a {FORMAT_METADATA_PREFIX} entry)"
        )
    })?;
    if shape.len() > MAX_DIMS {
        return Err(format!(
            "tensor '{name}' has {} dimensions (at most {MAX_DIMS})",
            shape.len()
        ));
    }
    // `TensorInfo::rows()` multiplies all but one dimension, so even with a
    // zero among them the product of the others must fit a usize.
    let nonzero_product = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
        .filter(|&p| usize::try_from(p).is_ok());
    let elems = nonzero_product.map(|p| if shape.contains(&0) { 0 } else { p });
    let len = elems
        .and_then(|elems| format.bytes_for(1, elems))
        .ok_or_else(|| format!("tensor '{name}' has absurd shape {shape:?}: its size overflows"))?;
    check_range(&name, [begin, end], data_len)?;
    if end - begin != len {
        return Err(format!(
            "tensor '{name}' ({dtype}, shape {shape:?}) needs {len} bytes, but its data_offsets span {}",
            end - begin
        ));
    }
    // Each dimension is at most `nonzero_product` and the range lies inside
    // the file, so all of them fit a usize.
    Ok(TensorInfo {
        name,
        format,
        shape: shape.iter().rev().map(|&d| d as usize).collect(),
        file: 0,
        offset: data_start + begin as usize,
        len: len as usize,
    })
}

fn check_range(
    name: &str,
    [begin, end]: [u64; 2],
    data_len: u64,
) -> std::result::Result<(), String> {
    if begin > end || end > data_len {
        return Err(format!(
            "tensor '{name}' data_offsets [{begin}, {end}] run past the end of the data \
             ({data_len} bytes): the file is truncated or corrupt"
        ));
    }
    Ok(())
}

/// Checks a quantized matrix stored as `U8 [rows, row_bytes]`.
fn check_quantized_entry(
    name: String,
    format: WeightFormat,
    dtype: &str,
    shape: &[u64],
    [begin, end]: [u64; 2],
    data_start: usize,
    data_len: u64,
) -> std::result::Result<TensorInfo, String> {
    let &[rows, row_bytes] = shape else {
        return Err(format!(
            "tensor '{name}' is {format} with shape {shape:?}; quantized tensors are stored as \
             [rows, row_bytes]"
        ));
    };
    if dtype != QUANTIZED_DTYPE {
        return Err(format!(
            "tensor '{name}' is {format} but has dtype {dtype}, not {QUANTIZED_DTYPE}"
        ));
    }
    let blocks_bytes = row_bytes.checked_sub(format.row_head_bytes() as u64);
    let cols = blocks_bytes
        .filter(|b| b % format.block_bytes() as u64 == 0)
        .map(|b| b / format.block_bytes() as u64 * format.block_elems() as u64)
        .filter(|&cols| format.bytes_for(1, cols) == Some(row_bytes))
        .ok_or_else(|| {
            format!("tensor '{name}' rows of {row_bytes} bytes are not whole rows of {format}")
        })?;
    check_range(&name, [begin, end], data_len)?;
    let len = rows.checked_mul(row_bytes);
    if len != Some(end - begin) {
        return Err(format!(
            "tensor '{name}' ({format}, {rows} rows of {row_bytes} bytes) does not match its \
             data_offsets span of {} bytes",
            end - begin
        ));
    }
    // The range lies inside the file, so rows and cols fit a usize.
    Ok(TensorInfo {
        name,
        format,
        shape: vec![cols as usize, rows as usize],
        file: 0,
        offset: data_start + begin as usize,
        len: (end - begin) as usize,
    })
}

impl SafetensorsWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a `__metadata__` entry.
    pub fn add_metadata(&mut self, key: &str, value: &str) {
        self.metadata.insert(key.to_string(), value.to_string());
    }

    /// Adds a tensor of `shape`, outermost first as safetensors stores it
    /// (`[rows, cols]` for a matrix), in any format; a quantized one is a
    /// matrix, stored as `U8 [rows, row_bytes]` with its format named in
    /// `__metadata__`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        format: WeightFormat,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        let invalid = |reason: String| {
            Err(Error::InvalidRequest(format!(
                "safetensors tensor '{name}': {reason}"
            )))
        };
        if name == METADATA_KEY || self.tensors.iter().any(|t| t.name == name) {
            return invalid("name is reserved or already used".into());
        }
        let (rows, cols) = match shape.split_last() {
            Some((&cols, outer)) => (outer.iter().product(), cols),
            None => (1, 1),
        };
        if format.is_quantized() && shape.len() != 2 {
            return invalid(format!(
                "a {format} tensor is a matrix, but the shape is {shape:?}"
            ));
        }
        if let Some(reason) = super::data_size_mismatch(format, rows, cols, data.len()) {
            return invalid(reason);
        }
        let (dtype, shape) = if format.is_quantized() {
            self.metadata.insert(
                format!("{FORMAT_METADATA_PREFIX}{name}"),
                format.name().to_string(),
            );
            (
                QUANTIZED_DTYPE,
                vec![rows, format.row_bytes(cols).unwrap_or(0)],
            )
        } else {
            (format.name(), shape.to_vec())
        };
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dtype,
            shape,
            data,
        });
        Ok(())
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        if !self.metadata.is_empty() {
            let metadata = self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            header.insert(METADATA_KEY.to_string(), Value::Object(metadata));
        }
        let mut offset = 0usize;
        for tensor in &self.tensors {
            let end = offset + tensor.data.len();
            header.insert(
                tensor.name.clone(),
                serde_json::json!({
                    "dtype": tensor.dtype,
                    "shape": tensor.shape,
                    "data_offsets": [offset, end],
                }),
            );
            offset = end;
        }
        let mut json = Value::Object(header).to_string().into_bytes();
        // The reference writer pads the header with spaces so the data starts 8-byte aligned.
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut out = Vec::with_capacity(8 + json.len() + offset);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for tensor in &self.tensors {
            out.extend_from_slice(&tensor.data);
        }
        out
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A tensor for [`write_model_dir`]: canonical (GGUF) name, storage format,
/// `rows × cols` (a vector is one row) and its bytes in that format.
pub struct OutputTensor {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
}

/// Writes a model directory that [`load_hf_dir`] (so `tandem_core::model::load`)
/// reads: `config.json` from `source`'s configuration, the tokenizer files
/// (copied from a Hugging Face source, or written from a GGUF source's
/// tokenizer), and `model.safetensors` with `tensors` under Hugging Face
/// names plus every tensor of `source` that `tensors` does not replace,
/// copied in its own format. `metadata` goes into `__metadata__` (e.g. the
/// quantization method). A GGUF Llama's Q/K rows, permuted for interleaved
/// RoPE, are put back in Hugging Face order, which is what the directory
/// loader assumes.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_model_dir(
    source: &ModelFiles,
    tensors: Vec<OutputTensor>,
    metadata: &[(String, String)],
    dir: &Path,
) -> Result<()> {
    let c = &source.config;
    if c.rotary_dim != c.head_dim {
        return Err(Error::Unsupported(format!(
            "writing a Hugging Face directory: rotary_dim {} differs from head_dim {}",
            c.rotary_dim, c.head_dim
        )));
    }
    let mut replaced = BTreeMap::new();
    for t in tensors {
        if source.tensors.info(&t.name).is_none() {
            return Err(Error::InvalidRequest(format!(
                "tensor '{}' is not a tensor of {}",
                t.name,
                source.path.display()
            )));
        }
        replaced.insert(t.name.clone(), t);
    }
    let mut st = SafetensorsWriter::new();
    for (key, value) in metadata {
        st.add_metadata(key, value);
    }
    for info in source.tensors.tensors() {
        let (format, rows, cols, data) = match replaced.remove(&info.name) {
            Some(t) => (t.format, t.rows, t.cols, t.data),
            None => (
                info.format,
                info.rows(),
                info.cols(),
                source.tensors.bytes(info).to_vec(),
            ),
        };
        let row_bytes = format.row_bytes(cols).unwrap_or(0);
        let stem = info
            .name
            .strip_suffix(".weight")
            .or(info.name.strip_suffix(".bias"));
        let heads = match stem {
            Some(s) if s.ends_with(".attn_q") => c.num_heads,
            Some(s) if s.ends_with(".attn_k") => c.num_kv_heads,
            _ => 0,
        };
        let data = if c.rope_style == RopeStyle::Interleaved && heads > 0 {
            // A bias is a vector (of float elements): its elements move like rows.
            let unit = if info.name.ends_with(".bias") {
                format.block_bytes()
            } else {
                row_bytes
            };
            rows_from_interleaved(&data, unit, heads)
        } else {
            data
        };
        let name = hf_name(&info.name).ok_or_else(|| {
            Error::InvalidRequest(format!("tensor '{}' has no Hugging Face name", info.name))
        })?;
        let shape = if info.shape.len() == 1 {
            vec![rows * cols]
        } else {
            vec![rows, cols]
        };
        st.add_tensor(&name, format, &shape, data)?;
    }
    let io = |path: std::path::PathBuf, r: std::io::Result<()>| {
        r.map_err(|source| Error::Io { path, source })
    };
    io(dir.to_path_buf(), std::fs::create_dir_all(dir))?;
    st.write(&dir.join(SINGLE_FILE))?;
    let path = dir.join(CONFIG_FILE);
    io(
        path.clone(),
        std::fs::write(&path, hf_config_json(c)?.to_string()),
    )?;
    write_tokenizer_files(source, dir)
}

/// Undoes llama.cpp's Q/K permutation: within each of `heads` heads,
/// interleaved row `2i` goes back to row `i` and row `2i + 1` to `i + d/2`.
/// A row is `unit` bytes.
fn rows_from_interleaved(data: &[u8], unit: usize, heads: usize) -> Vec<u8> {
    let rows = data.len() / unit.max(1);
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for (dst, src) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                let (d, s) = ((h * head_dim + dst) * unit, (h * head_dim + src) * unit);
                out[d..d + unit].copy_from_slice(&data[s..s + unit]);
            }
        }
    }
    out
}

/// `config.json` for `c`, in the form [`load_hf_dir`] reads.
pub fn hf_config_json(c: &ModelConfig) -> Result<Value> {
    let architecture = match c.arch.as_str() {
        "llama" => "LlamaForCausalLM",
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        other => {
            return Err(Error::Unsupported(format!(
                "architecture '{other}' has no Hugging Face configuration"
            )))
        }
    };
    let mut config = serde_json::json!({
        "architectures": [architecture],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_context,
        "tie_word_embeddings": c.tied_embeddings,
    });
    let scaling =
        match c.rope_scaling {
            RopeScaling::None => None,
            RopeScaling::FreqFactors(_) => return Err(Error::Unsupported(
                "per-frequency RoPE factors (GGUF rope_freqs) have no Hugging Face configuration"
                    .into(),
            )),
            RopeScaling::Linear { factor } => {
                Some(serde_json::json!({"rope_type": "linear", "factor": factor}))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => Some(serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position,
            })),
        };
    if let Some(scaling) = scaling {
        config["rope_scaling"] = scaling;
    }
    if let Some(window) = c.sliding_window {
        config["sliding_window"] = window.into();
        config["use_sliding_window"] = true.into();
    }
    Ok(config)
}

/// Hugging Face tokenizer files that travel with a model directory.
const TOKENIZER_FILES: [&str; 5] = [
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Copies `source`'s tokenizer files when it is a Hugging Face directory;
/// otherwise writes them from its tokenizer (BOS/EOS, chat template).
#[cfg(not(target_arch = "wasm32"))]
fn write_tokenizer_files(source: &ModelFiles, dir: &Path) -> Result<()> {
    let io = |path: &Path, r: std::io::Result<()>| {
        r.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    if source.path.is_dir() {
        for file in TOKENIZER_FILES {
            let from = source.path.join(file);
            if from.is_file() {
                io(&from, std::fs::copy(&from, dir.join(file)).map(drop))?;
            }
        }
        return Ok(());
    }
    let tokenizer = &source.tokenizer;
    let path = dir.join(TOKENIZER_FILE);
    io(&path, std::fs::write(&path, tokenizer.to_hf_json()?))?;
    let text = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id));
    let mut config = serde_json::json!({ "add_bos_token": tokenizer.adds_bos() });
    if let Some(bos) = text(tokenizer.bos_token()) {
        config["bos_token"] = bos.into();
    }
    if let Some(eos) = text(tokenizer.eos_tokens().first().copied()) {
        config["eos_token"] = eos.into();
    }
    if let Some(template) = tokenizer.chat_template() {
        config["chat_template"] = template.into();
    }
    let path = dir.join("tokenizer_config.json");
    io(&path, std::fs::write(&path, config.to_string()))?;
    let generation = serde_json::json!({ "eos_token_id": tokenizer.eos_tokens() });
    let path = dir.join("generation_config.json");
    io(&path, std::fs::write(&path, generation.to_string()))
}

/// The canonical (GGUF) name of a Hugging Face Llama-family tensor, or `None`
/// for a tensor the model does not use (such as a stored `rotary_emb.inv_freq`).
pub fn canonical_name(hf_name: &str) -> Option<String> {
    if let Some((_, canonical)) = HF_GLOBAL_NAMES.iter().find(|(hf, _)| *hf == hf_name) {
        return Some(canonical.to_string());
    }
    let (layer, rest) = hf_name.strip_prefix("model.layers.")?.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (module, kind) = rest.rsplit_once('.')?;
    let (_, module) = HF_LAYER_MODULES.iter().find(|(hf, _)| *hf == module)?;
    matches!(kind, "weight" | "bias").then(|| format!("blk.{layer}.{module}.{kind}"))
}

/// The Hugging Face name of a canonical tensor name (the inverse of [`canonical_name`]).
pub fn hf_name(canonical: &str) -> Option<String> {
    if let Some((hf, _)) = HF_GLOBAL_NAMES.iter().find(|(_, c)| *c == canonical) {
        return Some(hf.to_string());
    }
    let (layer, rest) = canonical.strip_prefix("blk.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let (hf, _) = HF_LAYER_MODULES.iter().find(|(_, c)| *c == module)?;
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// `(Hugging Face name, canonical name)` of the tensors outside the layers.
const HF_GLOBAL_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// `(Hugging Face module, canonical module)` inside each layer.
const HF_LAYER_MODULES: [(&str, &str); 9] = [
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Loads a Hugging Face model directory.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_hf_dir(dir: &Path) -> Result<ModelFiles> {
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.is_file() {
        return Err(Error::bad_file(
            dir,
            format!("no {CONFIG_FILE} in the model directory"),
        ));
    }
    let config_text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
        path: config_path.clone(),
        source,
    })?;
    let hf_config: HfConfig = serde_json::from_str(&config_text)
        .map_err(|e| Error::bad_file(&config_path, e.to_string()))?;

    let mut tensors = TensorStore::default();
    let mut file_metadata = Vec::new();
    for shard in weight_files(dir)? {
        let path = dir.join(&shard);
        let file = SafetensorsFile::open(&path)?;
        let index = tensors.add_file(file.bytes.clone());
        for info in file.tensors {
            let Some(name) = canonical_name(&info.name) else {
                continue;
            };
            if tensors.info(&name).is_some() {
                return Err(Error::bad_file(
                    &path,
                    format!("tensor '{}' appears in more than one file", info.name),
                ));
            }
            tensors.insert(TensorInfo {
                name,
                file: index,
                ..info
            });
        }
        // Per-tensor formats show in the tensors themselves, not as metadata.
        file_metadata.extend(
            file.metadata
                .into_iter()
                .filter(|(k, _)| !k.starts_with(FORMAT_METADATA_PREFIX))
                .map(|(k, v)| (format!("{shard}: {k}"), v)),
        );
    }

    let config = config_from_hf(&hf_config, &tensors, &config_path)?;
    config.validate().map_err(|e| match e {
        Error::Unsupported(reason) => {
            Error::bad_file(&config_path, format!("bad model configuration: {reason}"))
        }
        other => other,
    })?;
    check_tensors(&config, &tensors, dir)?;
    if !dir.join(TOKENIZER_FILE).is_file() {
        return Err(Error::bad_file(
            dir,
            format!("no {TOKENIZER_FILE} in the model directory"),
        ));
    }
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let mut metadata = config_metadata(&config_text);
    metadata.extend(file_metadata);
    Ok(ModelFiles {
        path: dir.to_path_buf(),
        config,
        tensors,
        tokenizer,
        metadata,
    })
}

/// The safetensors files of a directory: the shards its index lists, or `model.safetensors`.
#[cfg(not(target_arch = "wasm32"))]
fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index_path = dir.join(INDEX_FILE);
    if !index_path.is_file() {
        if dir.join(SINGLE_FILE).is_file() {
            return Ok(vec![SINGLE_FILE.to_string()]);
        }
        return Err(Error::bad_file(
            dir,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in the model directory"),
        ));
    }
    let text = std::fs::read_to_string(&index_path).map_err(|source| Error::Io {
        path: index_path.clone(),
        source,
    })?;
    let index: ShardIndex =
        serde_json::from_str(&text).map_err(|e| Error::bad_file(&index_path, e.to_string()))?;
    let shards: BTreeSet<String> = index.weight_map.into_values().collect();
    // A shard name is a file beside the index, never a path out of the directory.
    if let Some(bad) = shards
        .iter()
        .find(|s| s.is_empty() || s.contains(['/', '\\']) || s.as_str() == "..")
    {
        return Err(Error::bad_file(
            &index_path,
            format!("shard name '{bad}' is not a file name in the model directory"),
        ));
    }
    Ok(shards.into_iter().collect())
}

fn config_from_hf(hf: &HfConfig, tensors: &TensorStore, config_path: &Path) -> Result<ModelConfig> {
    let architecture = hf.architectures.first().map(String::as_str);
    let arch = match architecture {
        Some("LlamaForCausalLM") => "llama",
        Some("MistralForCausalLM") => "mistral",
        Some("Qwen2ForCausalLM") => "qwen2",
        other => {
            return Err(Error::Unsupported(format!(
                "{}: architecture {other:?} (Tandem runs LlamaForCausalLM, \
                 MistralForCausalLM and Qwen2ForCausalLM)",
                config_path.display()
            )))
        }
    };
    let head_dim = match hf.head_dim {
        Some(d) => d,
        None => hf
            .hidden_size
            .checked_div(hf.num_attention_heads)
            .unwrap_or(0),
    };
    let sliding_window = match hf.use_sliding_window {
        Some(false) => None,
        _ => hf.sliding_window,
    };
    Ok(ModelConfig {
        arch: arch.to_string(),
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        intermediate_size: hf.intermediate_size,
        num_layers: hf.num_hidden_layers,
        num_heads: hf.num_attention_heads,
        num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim,
        rotary_dim: head_dim,
        rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
        rope_theta: hf.rope_theta.unwrap_or(10000.0),
        rope_scaling: rope_scaling(hf.rope_scaling.as_ref(), config_path)?,
        rope_style: RopeStyle::NeoX,
        max_context: hf.max_position_embeddings,
        // Some checkpoints with tied embeddings still ship a copy as `lm_head.weight`; use it then.
        tied_embeddings: hf.tie_word_embeddings && tensors.info("output.weight").is_none(),
        qkv_bias: tensors.info("blk.0.attn_q.bias").is_some(),
        sliding_window,
    })
}

fn rope_scaling(scaling: Option<&HfRopeScaling>, config_path: &Path) -> Result<RopeScaling> {
    let Some(scaling) = scaling else {
        return Ok(RopeScaling::None);
    };
    let field = |name: &str, value: Option<f32>| {
        value.filter(|v| *v > 0.0).ok_or_else(|| {
            Error::bad_file(
                config_path,
                format!("rope_scaling.{name} is missing or not positive"),
            )
        })
    };
    match scaling.rope_type.as_deref().or(scaling.kind.as_deref()) {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: field("factor", scaling.factor)?,
        }),
        Some("llama3") => Ok(RopeScaling::Llama3 {
            factor: field("factor", scaling.factor)?,
            low_freq_factor: field("low_freq_factor", scaling.low_freq_factor)?,
            high_freq_factor: field("high_freq_factor", scaling.high_freq_factor)?,
            original_max_position: scaling
                .original_max_position_embeddings
                .filter(|&p| p > 0)
                .ok_or_else(|| {
                    Error::bad_file(
                        config_path,
                        "rope_scaling.original_max_position_embeddings is missing or zero",
                    )
                })?,
        }),
        Some(other) => Err(Error::Unsupported(format!(
            "{}: rope_scaling type '{other}' (Tandem supports linear and llama3)",
            config_path.display()
        ))),
    }
}

/// `config.json`'s scalar fields, for `inspect`.
fn config_metadata(config_text: &str) -> Vec<(String, String)> {
    let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(config_text) else {
        return Vec::new();
    };
    fields
        .into_iter()
        .filter_map(|(key, value)| match value {
            Value::String(s) => Some((key, s)),
            Value::Number(_) | Value::Bool(_) => Some((key, value.to_string())),
            Value::Array(items) if items.iter().all(Value::is_string) => {
                let names: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
                Some((key, names.join(", ")))
            }
            Value::Object(_) if key == "rope_scaling" => Some((key, value.to_string())),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::synthetic::llama_tensor_shapes;
    use crate::quant::quantize_row;

    fn parse(bytes: Vec<u8>) -> Result<SafetensorsFile> {
        SafetensorsFile::parse(Arc::new(Bytes::Owned(bytes)), Path::new("test.safetensors"))
    }

    fn parse_error(bytes: Vec<u8>) -> String {
        match parse(bytes) {
            Err(e @ Error::BadModelFile { .. }) => e.to_string(),
            Err(other) => panic!("expected a BadModelFile error, got {other}"),
            Ok(_) => panic!("parsed a bad file"),
        }
    }

    /// A file with `header` as its JSON and `data_len` zero bytes of data.
    fn raw_file(header: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    fn test_values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 5 % 17) as f32 - 8.0) / 4.0).collect()
    }

    #[test]
    fn round_trip_keeps_tensors_and_metadata() {
        let mut w = SafetensorsWriter::new();
        w.add_metadata("format", "pt");
        let mut written = Vec::new();
        for (format, shape) in [
            (WeightFormat::F32, vec![2, 3]),
            (WeightFormat::F16, vec![5]),
            (WeightFormat::BF16, vec![2, 2, 2]),
        ] {
            let data = quantize_row(format, &test_values(shape.iter().product()));
            let name = format!("w.{format}");
            w.add_tensor(&name, format, &shape, data.clone()).unwrap();
            written.push((name, format, shape, data));
        }
        assert!(w
            .add_tensor("q", WeightFormat::Q8_0, &[32], vec![0; 34])
            .is_err());
        assert!(w
            .add_tensor("short", WeightFormat::F32, &[2], vec![0; 4])
            .is_err());
        let bytes = w.to_bytes();
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()) % 8, 0);
        let file = parse(bytes).unwrap();
        assert_eq!(
            file.metadata,
            vec![("format".to_string(), "pt".to_string())]
        );
        assert_eq!(file.tensors.len(), 3);
        for (name, format, shape, data) in written {
            let info = file.tensors.iter().find(|t| t.name == name).unwrap();
            assert_eq!(info.format, format);
            let innermost_first: Vec<usize> = shape.iter().rev().copied().collect();
            assert_eq!(info.shape, innermost_first);
            assert_eq!(
                &file.bytes[info.offset..info.offset + info.len],
                data.as_slice()
            );
        }
    }

    #[test]
    fn quantized_tensors_round_trip_as_bytes_with_their_format() {
        let mut w = SafetensorsWriter::new();
        let (rows, cols) = (3, 128);
        let values = test_values(rows * cols);
        let mut written = Vec::new();
        for format in WeightFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            let data = crate::quant::quantize_matrix(format, cols, &values);
            let name = format!("w.{format}");
            w.add_tensor(&name, format, &[rows, cols], data.clone())
                .unwrap();
            written.push((name, format, data));
        }
        let int8 = WeightFormat::Int8PerChannel;
        let one_row = crate::quant::quantize_row(int8, &values[..cols]);
        assert!(w.add_tensor("flat", int8, &[cols], one_row).is_err());
        let file = parse(w.to_bytes()).unwrap();
        assert!(file.metadata.contains(&(
            format!("{FORMAT_METADATA_PREFIX}w.INT4_G128"),
            "INT4_G128".to_string()
        )));
        for (name, format, data) in written {
            let info = file.tensors.iter().find(|t| t.name == name).unwrap();
            assert_eq!(
                (info.format, info.cols(), info.rows()),
                (format, cols, rows)
            );
            assert_eq!(
                &file.bytes[info.offset..info.offset + info.len],
                data.as_slice()
            );
        }
    }

    #[test]
    fn bad_quantized_entries_are_named() {
        let meta = |format: &str, tensor: &str| {
            format!(r#""__metadata__": {{"{FORMAT_METADATA_PREFIX}{tensor}": "{format}"}}"#)
        };
        let entry = r#""w": {"dtype": "U8", "shape": [2, 68], "data_offsets": [0, 136]}"#;
        let ok = format!("{{{}, {entry}}}", meta("INT8", "w"));
        let file = parse(raw_file(&ok, 136)).unwrap();
        assert_eq!(file.tensors[0].shape, vec![64, 2]);
        let cases = [
            (meta("INT8", "v"), "names a tensor the file does not have"),
            (
                meta("Q4_0", "w"),
                "rows of 68 bytes are not whole rows of Q4_0",
            ),
            (meta("F16", "w"), "not a quantized format Tandem knows"),
            (meta("INT9", "w"), "not a quantized format Tandem knows"),
        ];
        for (metadata, expected) in cases {
            let message = parse_error(raw_file(&format!("{{{metadata}, {entry}}}"), 136));
            assert!(message.contains(expected), "{message}");
        }
        let f32_entry = r#""w": {"dtype": "F32", "shape": [2, 17], "data_offsets": [0, 136]}"#;
        let message = parse_error(raw_file(
            &format!("{{{}, {f32_entry}}}", meta("INT8", "w")),
            136,
        ));
        assert!(message.contains("has dtype F32, not U8"), "{message}");
        let short = r#""w": {"dtype": "U8", "shape": [2, 68], "data_offsets": [0, 100]}"#;
        let message = parse_error(raw_file(
            &format!("{{{}, {short}}}", meta("INT8", "w")),
            136,
        ));
        assert!(
            message.contains("does not match its data_offsets span of 100"),
            "{message}"
        );
    }

    #[test]
    fn bad_header_length_is_named() {
        let message = parse_error(vec![1, 2, 3]);
        assert!(message.contains("3 bytes is too short"), "{message}");
        let mut bytes = raw_file("{}", 0);
        bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let message = parse_error(bytes.clone());
        assert!(
            message.contains("header length 18446744073709551615 exceeds"),
            "{message}"
        );
        bytes[..8].copy_from_slice(&1000u64.to_le_bytes());
        let message = parse_error(bytes);
        assert!(
            message.contains(
                "truncated: header length 1000 runs past the end of the file (size 10 bytes)"
            ),
            "{message}"
        );
        let message = parse_error(raw_file("[1, 2]", 0));
        assert!(message.contains("header is not a JSON object"), "{message}");
    }

    #[test]
    fn offsets_past_the_end_are_named() {
        let header = r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}"#;
        assert!(parse(raw_file(header, 32)).is_ok());
        let message = parse_error(raw_file(header, 31));
        assert!(
            message.contains(
                "tensor 'w' data_offsets [16, 32] run past the end of the data (31 bytes)"
            ),
            "{message}"
        );
        let header = r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(
            message.contains("needs 16 bytes, but its data_offsets span 8"),
            "{message}"
        );
        let header = r#"{"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 1099511627776], "data_offsets": [0, 8]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(message.contains("absurd shape"), "{message}");
    }

    #[test]
    fn unsupported_dtype_is_named() {
        let header = r#"{"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}"#;
        let message = parse_error(raw_file(header, 16));
        assert!(message.contains("tensor 'ids' has dtype I64"), "{message}");
        let header = r#"{"w": {"dtype": "F32", "shape": [2]}}"#;
        let message = parse_error(raw_file(header, 8));
        assert!(
            message.contains("tensor 'w': malformed header entry"),
            "{message}"
        );
    }

    #[test]
    fn hugging_face_names_map_to_canonical_ones() {
        let cases = [
            ("model.embed_tokens.weight", Some("token_embd.weight")),
            ("model.norm.weight", Some("output_norm.weight")),
            ("lm_head.weight", Some("output.weight")),
            (
                "model.layers.0.input_layernorm.weight",
                Some("blk.0.attn_norm.weight"),
            ),
            (
                "model.layers.3.self_attn.q_proj.weight",
                Some("blk.3.attn_q.weight"),
            ),
            (
                "model.layers.3.self_attn.q_proj.bias",
                Some("blk.3.attn_q.bias"),
            ),
            (
                "model.layers.12.self_attn.k_proj.bias",
                Some("blk.12.attn_k.bias"),
            ),
            (
                "model.layers.1.self_attn.v_proj.weight",
                Some("blk.1.attn_v.weight"),
            ),
            (
                "model.layers.1.self_attn.o_proj.weight",
                Some("blk.1.attn_output.weight"),
            ),
            (
                "model.layers.1.post_attention_layernorm.weight",
                Some("blk.1.ffn_norm.weight"),
            ),
            (
                "model.layers.1.mlp.gate_proj.weight",
                Some("blk.1.ffn_gate.weight"),
            ),
            (
                "model.layers.1.mlp.up_proj.weight",
                Some("blk.1.ffn_up.weight"),
            ),
            (
                "model.layers.1.mlp.down_proj.weight",
                Some("blk.1.ffn_down.weight"),
            ),
            ("model.layers.1.self_attn.rotary_emb.inv_freq", None),
            ("model.layers.x.mlp.up_proj.weight", None),
            ("model.layers.1.mlp.up_proj.scales", None),
            ("model.layers..mlp.up_proj.weight", None),
        ];
        for (hf, canonical) in cases {
            assert_eq!(canonical_name(hf).as_deref(), canonical, "{hf}");
        }
    }

    /// A directory removed when the test ends.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn write(&self, file: &str, contents: impl AsRef<[u8]>) {
            std::fs::write(self.0.join(file), contents).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const HIDDEN: usize = 64;
    const FFN: usize = 96;
    const KV_DIM: usize = 32;
    const VOCAB: usize = 4;
    const LAYERS: usize = 2;

    const TOKENIZER_JSON: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "post_processor": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}, "merges": ["a b"]}
    }"#;

    fn config_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": {VOCAB}, "hidden_size": {HIDDEN},
                "intermediate_size": {FFN}, "num_hidden_layers": {LAYERS}, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000,
                "max_position_embeddings": 256, "tie_word_embeddings": true{extra}}}"#
        )
    }

    /// The tensors of a tiny Llama under Hugging Face names, shapes outermost first.
    fn hf_tensors() -> Vec<(String, Vec<usize>)> {
        let heads = HIDDEN / KV_DIM;
        llama_tensor_shapes(HIDDEN, FFN, heads, 1, LAYERS, VOCAB)
            .into_iter()
            .map(|(name, shape)| (hf_name(&name).unwrap(), shape.into_iter().rev().collect()))
            .collect()
    }

    fn safetensors_bytes(tensors: &[(String, Vec<usize>)]) -> Vec<u8> {
        let mut w = SafetensorsWriter::new();
        for (name, shape) in tensors {
            let data = quantize_row(WeightFormat::BF16, &test_values(shape.iter().product()));
            w.add_tensor(name, WeightFormat::BF16, shape, data).unwrap();
        }
        w.to_bytes()
    }

    #[test]
    fn hugging_face_directory_loads() {
        let dir = TempDir::new("hf-single");
        let scaling = r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        dir.write(CONFIG_FILE, config_json(scaling));
        dir.write(SINGLE_FILE, safetensors_bytes(&hf_tensors()));
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(
            message.contains("no tokenizer.json in the model directory"),
            "{message}"
        );

        dir.write(TOKENIZER_FILE, TOKENIZER_JSON);
        let model = load_hf_dir(&dir.0).unwrap();
        let c = &model.config;
        assert_eq!(c.arch, "llama");
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (2, 1, 32));
        assert_eq!((c.rope_theta, c.rope_style), (500000.0, RopeStyle::NeoX));
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }
        );
        assert!(c.tied_embeddings && !c.qkv_bias);
        let k = model.tensors.view("blk.1.attn_k.weight").unwrap();
        assert_eq!(
            (k.format, k.rows, k.cols),
            (WeightFormat::BF16, KV_DIM, HIDDEN)
        );
        assert!(model
            .metadata
            .contains(&("architectures".to_string(), "LlamaForCausalLM".to_string())));
    }

    #[test]
    fn sharded_directory_loads_and_checks_tensors() {
        let dir = TempDir::new("hf-sharded");
        let untied = config_json("").replace(
            r#""tie_word_embeddings": true"#,
            r#""tie_word_embeddings": false"#,
        );
        dir.write(CONFIG_FILE, untied);
        dir.write(TOKENIZER_FILE, TOKENIZER_JSON);
        let mut tensors = hf_tensors();
        tensors.push(("lm_head.weight".into(), vec![VOCAB, HIDDEN]));
        let (first, second) = tensors.split_at(tensors.len() / 2);
        dir.write("model-00001-of-00002.safetensors", safetensors_bytes(first));
        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(second),
        );
        let weight_map: serde_json::Map<String, Value> = tensors
            .iter()
            .enumerate()
            .map(|(i, (name, _))| {
                let shard = if i < first.len() { 1 } else { 2 };
                (
                    name.clone(),
                    format!("model-0000{shard}-of-00002.safetensors").into(),
                )
            })
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        dir.write(INDEX_FILE, index.to_string());
        let model = load_hf_dir(&dir.0).unwrap();
        assert!(!model.config.tied_embeddings);
        assert!(model.tensors.info("output.weight").is_some());

        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(&second[1..]),
        );
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(message.contains("missing tensor 'blk."), "{message}");

        let mut broken = second.to_vec();
        let matrix = broken
            .iter_mut()
            .find(|(_, s)| s.len() == 2 && s[0] != s[1])
            .unwrap();
        matrix.1.reverse();
        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(&broken),
        );
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(message.contains("has shape"), "{message}");
    }

    #[test]
    fn hugging_face_config_options_are_read() {
        let tensors = TensorStore::default();
        let path = Path::new(CONFIG_FILE);
        let parse = |json: String| -> Result<ModelConfig> {
            let hf: HfConfig = serde_json::from_str(&json).unwrap();
            config_from_hf(&hf, &tensors, path)
        };
        let qwen = config_json(
            r#", "sliding_window": 4096, "use_sliding_window": false, "rope_scaling": {"type": "linear", "factor": 2}"#,
        )
        .replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        let c = parse(qwen).unwrap();
        assert_eq!((c.arch.as_str(), c.sliding_window), ("qwen2", None));
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });

        let mistral = config_json(r#", "sliding_window": 4096, "head_dim": 16"#)
            .replace("LlamaForCausalLM", "MistralForCausalLM");
        let c = parse(mistral).unwrap();
        assert_eq!(
            (c.sliding_window, c.head_dim, c.rotary_dim),
            (Some(4096), 16, 16)
        );

        let message = parse(config_json("").replace("LlamaForCausalLM", "GemmaForCausalLM"))
            .err()
            .unwrap()
            .to_string();
        assert!(message.contains("GemmaForCausalLM"), "{message}");
        let yarn = config_json(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#);
        let message = parse(yarn).err().unwrap().to_string();
        assert!(message.contains("rope_scaling type 'yarn'"), "{message}");
    }
}
