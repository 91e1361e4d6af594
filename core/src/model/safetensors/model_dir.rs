//! Writing a model directory that the [`hf`](super::hf) loader reads, as
//! `tandem quantize` does.

#![cfg_attr(target_arch = "wasm32", allow(dead_code, unused_imports))]

use std::collections::BTreeMap;
use std::path::Path;

use super::names::hf_name;
use super::{hf_config_json, SafetensorsWriter, CONFIG_FILE, SINGLE_FILE, TOKENIZER_FILE};
use crate::backend::RopeStyle;
use crate::model::{arch, ModelFiles};
use crate::quant::{quantize_row, WeightFormat};
use crate::{Error, Result};

/// A tensor for [`write_model_dir`]: canonical (GGUF) name, storage format,
/// `rows × cols` (a vector is one row) and its bytes in that format.
pub struct OutputTensor {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
}

/// Writes a model directory that [`load_hf_dir`](super::hf::load_hf_dir) (so `tandem_core::model::load`)
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
    let family = arch::by_gguf_name(&c.arch).ok_or_else(|| {
        Error::Unsupported(format!(
            "architecture '{}' has no Hugging Face form",
            c.arch
        ))
    })?;
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
        // Hugging Face Gemma stores norm weights as offsets from 1.
        let (format, data) = if family.hf_norm_offset && info.name.ends_with("norm.weight") {
            let view = crate::quant::WeightView {
                format,
                rows,
                cols,
                data: &data,
            };
            let offsets = view.to_f32().iter().map(|w| w - 1.0).collect::<Vec<f32>>();
            (WeightFormat::F32, quantize_row(WeightFormat::F32, &offsets))
        } else {
            (format, data)
        };
        let name = hf_name(&info.name, c.block.post_norms).ok_or_else(|| {
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

/// Undoes llama.cpp's Q/K permutation (`synthetic::permute_for_interleaved_rope`
/// does it): within each of `heads` heads, interleaved row `2i` goes back to
/// row `i` and row `2i + 1` to `i + d/2`. A row is `unit` elements (bytes of
/// a quantized matrix, or floats).
pub fn rows_from_interleaved<T: Copy>(data: &[T], unit: usize, heads: usize) -> Vec<T> {
    let rows = data.len() / unit.max(1);
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = data.to_vec();
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

/// Hugging Face tokenizer files that travel with a model directory.
const TOKENIZER_FILES: [&str; 5] = [
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Copies `source`'s tokenizer files when it is a Hugging Face directory;
/// otherwise writes them from its tokenizer (BOS/EOS, chat template). Also
/// for directories of models derived from `source` (`tandem distill`).
#[cfg(not(target_arch = "wasm32"))]
pub fn write_tokenizer_files(source: &ModelFiles, dir: &Path) -> Result<()> {
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
