//! Model files and the forward pass.
//!
//! Loading produces a host-side [`ModelFiles`]: a [`ModelConfig`], a
//! [`TensorStore`] of weights under GGUF's canonical names (memory-mapped, not
//! copied), the tokenizer and the metadata `inspect` shows. `forward` uploads
//! the weights to a backend and runs batches; `recorded` replays decode
//! steps recorded on backends that can (CUDA graphs).
//!
//! Canonical tensor names (GGUF's): `token_embd.weight`, `output_norm.weight`,
//! `output.weight` (absent with tied embeddings), and per layer `blk.N.` +
//! `attn_norm`, `attn_q`, `attn_k`, `attn_v` (each `.weight`, and `.bias` for
//! Qwen2), `attn_q_norm`, `attn_k_norm` (Qwen3, Gemma 3), `attn_output`,
//! `post_attention_norm` (Gemma 3), `ffn_norm`, `ffn_gate`, `ffn_up`,
//! `ffn_down`, `post_ffw_norm` (Gemma 3). Which of them a model has follows
//! from its architecture (`arch`): [`expected_tensors`].

pub mod arch;
pub mod config;
pub mod experts;
pub mod forward;
pub mod gguf;
pub mod kv_calibration;
mod moe_layer;
mod placement;
pub mod recorded;
pub mod safetensors;
mod step_buffers;
pub mod synthetic;
#[cfg(not(target_arch = "wasm32"))]
mod synthetic_hf;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use arch::{Activation, BlockSpec, Family, LayerSpec, MoeSpec, Multipliers, Rope};
pub use config::{ModelConfig, RopeScaling};

use crate::quant::{WeightFormat, WeightView};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Bytes of a model file: memory-mapped natively, owned in the browser.
pub enum Bytes {
    #[cfg(not(target_arch = "wasm32"))]
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            #[cfg(not(target_arch = "wasm32"))]
            Bytes::Mmap(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl Bytes {
    /// Maps `path` read-only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn map(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only; a file truncated underneath us is the
        // user's doing and is the same hazard every mmap-based loader accepts.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Bytes::Mmap(map))
    }

    /// Where `data` lies in these bytes, if it lies inside them.
    pub fn range_of(&self, data: &[u8]) -> Option<std::ops::Range<usize>> {
        let (start, base) = (data.as_ptr() as usize, self.as_ptr() as usize);
        (base <= start && start + data.len() <= base + self.len())
            .then(|| start - base..start - base + data.len())
    }

    /// Drops this process's resident pages of `range` (bytes of a mapped
    /// file; owned bytes stay as they are). Once a weight is copied to its
    /// backend, its mapped pages would be a second resident copy for the
    /// rest of the run. The page cache keeps them, and reading the range
    /// again faults them back in.
    pub fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Bytes::Mmap(map) = self {
            // SAFETY: a read-only map holds no changes of its own, so
            // MADV_DONTNEED only drops pages that are read again from the
            // file on the next access. A failure leaves them resident.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = range;
    }
}

/// Where one tensor lives: a byte range of one file, already checked to be in bounds.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub format: WeightFormat,
    /// Dimensions innermost first (GGUF order): `[cols, rows]` for a matrix.
    pub shape: Vec<usize>,
    pub file: usize,
    pub offset: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn cols(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    pub fn rows(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// The weights of a model, by canonical name, over one or more mapped files.
#[derive(Default)]
pub struct TensorStore {
    files: Vec<Arc<Bytes>>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl TensorStore {
    pub fn add_file(&mut self, bytes: Arc<Bytes>) -> usize {
        self.files.push(bytes);
        self.files.len() - 1
    }

    /// Adds a tensor; the caller has checked that its range lies inside its file.
    pub fn insert(&mut self, info: TensorInfo) {
        debug_assert!(info.offset + info.len <= self.files[info.file].len());
        self.index.insert(info.name.clone(), self.tensors.len());
        self.tensors.push(info);
    }

    /// Puts `info` in place of the tensor of the same name (a loader's
    /// converted copy); the caller has checked its range.
    pub fn replace(&mut self, info: TensorInfo) {
        match self.index.get(&info.name) {
            Some(&i) => self.tensors[i] = info,
            None => self.insert(info),
        }
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The file `data` lies in, if it lies in one of them (a converted or
    /// concatenated copy does not).
    pub fn file_of(&self, data: &[u8]) -> Option<&Arc<Bytes>> {
        self.files.iter().find(|file| file.range_of(data).is_some())
    }

    /// Releases the mapped pages under `data` (see [`Bytes::release`]), if
    /// `data` lies in one of the files.
    pub fn release(&self, data: &[u8]) {
        for file in &self.files {
            if let Some(range) = file.range_of(data) {
                file.release(range);
                return;
            }
        }
    }

    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.files[info.file][info.offset..info.offset + info.len]
    }

    /// The tensor as a `rows × cols` matrix (a vector is one row).
    pub fn view(&self, name: &str) -> Option<WeightView<'_>> {
        let info = self.info(name)?;
        Some(WeightView {
            format: info.format,
            rows: info.rows(),
            cols: info.cols(),
            data: self.bytes(info),
        })
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// Every tensor `config` needs, in file order: canonical name and shape
/// (innermost first).
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (hidden, q_dim, kv_dim) = (config.hidden_size, config.q_dim(), config.kv_dim());
    let (ffn, vocab, head_dim) = (config.intermediate_size, config.vocab_size, config.head_dim);
    let block = config.block;
    let mut expected = vec![("token_embd.weight".to_string(), vec![hidden, vocab])];
    if config.reads_hidden {
        expected.extend([
            ("eagle_norm.weight".to_string(), vec![hidden]),
            ("eagle_fc.weight".to_string(), vec![hidden, hidden]),
        ]);
    }
    for layer in 0..config.num_layers {
        let name = |tensor: &str| format!("blk.{layer}.{tensor}");
        expected.extend([
            (name("attn_norm.weight"), vec![hidden]),
            (name("attn_q.weight"), vec![hidden, q_dim]),
            (name("attn_k.weight"), vec![hidden, kv_dim]),
            (name("attn_v.weight"), vec![hidden, kv_dim]),
        ]);
        if config.qkv_bias {
            expected.extend([
                (name("attn_q.bias"), vec![q_dim]),
                (name("attn_k.bias"), vec![kv_dim]),
                (name("attn_v.bias"), vec![kv_dim]),
            ]);
        }
        if block.qk_norm {
            let (q_norm, k_norm) = match block.qk_norm_whole {
                true => (q_dim, kv_dim),
                false => (head_dim, head_dim),
            };
            expected.extend([
                (name("attn_q_norm.weight"), vec![q_norm]),
                (name("attn_k_norm.weight"), vec![k_norm]),
            ]);
        }
        expected.push((name("attn_output.weight"), vec![q_dim, hidden]));
        if block.post_norms {
            expected.push((name("post_attention_norm.weight"), vec![hidden]));
        }
        expected.push((name("ffn_norm.weight"), vec![hidden]));
        if config.moe.is_some() {
            expected.extend(experts::expected_moe_tensors(config, layer));
        } else {
            expected.extend([
                (name("ffn_gate.weight"), vec![hidden, ffn]),
                (name("ffn_up.weight"), vec![hidden, ffn]),
                (name("ffn_down.weight"), vec![ffn, hidden]),
            ]);
        }
        if block.post_norms {
            expected.push((name("post_ffw_norm.weight"), vec![hidden]));
        }
    }
    expected.push(("output_norm.weight".to_string(), vec![hidden]));
    if !config.tied_embeddings {
        expected.push((
            "output.weight".to_string(),
            vec![hidden, config.logit_width()],
        ));
    }
    expected
}

/// Checks that every tensor `config` needs is in `tensors`, with the expected
/// shape (innermost first) and a format the forward pass reads; the error
/// names the tensor. Both file formats share it.
pub fn check_tensors(config: &ModelConfig, tensors: &TensorStore, path: &Path) -> Result<()> {
    // A vector stored as `[n, 1]` is the same tensor as `[n]`.
    let significant = |shape: &[usize]| -> Vec<usize> {
        let keep = shape.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
        shape[..keep].to_vec()
    };
    for (name, shape) in expected_tensors(config) {
        if tensors.info(&name).is_none() {
            if let Some((layer, matrix)) = experts::parse_stacked(&name) {
                check_per_expert(tensors, layer, matrix, &shape, &name, path)?;
                continue;
            }
        }
        let info = tensors.info(&name).ok_or_else(|| {
            Error::bad_file(
                path,
                format!("missing tensor '{name}' (expected shape {shape:?})"),
            )
        })?;
        if significant(&info.shape) != significant(&shape) {
            return Err(Error::bad_file(
                path,
                format!(
                    "tensor '{name}' has shape {:?}, expected {shape:?} (innermost dimension first)",
                    info.shape
                ),
            ));
        }
        if shape.len() == 1 && info.format.is_quantized() {
            return Err(Error::bad_file(
                path,
                format!(
                    "tensor '{name}' is {}; vectors must be F32, F16 or BF16",
                    info.format
                ),
            ));
        }
    }
    Ok(())
}

/// Checks the one-tensor-per-expert form of the stacked tensor `stacked`
/// (`shape` `[cols, rows, experts]`): every expert's matrix present, of
/// `[cols, rows]`, and no more experts than the configuration says.
fn check_per_expert(
    tensors: &TensorStore,
    layer: usize,
    matrix: experts::ExpertMatrix,
    shape: &[usize],
    stacked: &str,
    path: &Path,
) -> Result<()> {
    let (matrix_shape, count) = (&shape[..2], shape[2]);
    for e in 0..count {
        let name = matrix.per_expert_name(layer, e);
        let info = tensors.info(&name).ok_or_else(|| {
            Error::bad_file(
                path,
                format!(
                    "missing tensor '{stacked}' (expected shape {shape:?}) or its per-expert \
                     form '{name}' (expected shape {matrix_shape:?})"
                ),
            )
        })?;
        if info.shape != matrix_shape {
            return Err(Error::bad_file(
                path,
                format!(
                    "tensor '{name}' has shape {:?}, expected {matrix_shape:?} (innermost dimension first)",
                    info.shape
                ),
            ));
        }
    }
    let extra = matrix.per_expert_name(layer, count);
    if tensors.info(&extra).is_some() {
        return Err(Error::bad_file(
            path,
            format!("tensor '{extra}' exists, but the configuration has {count} experts"),
        ));
    }
    Ok(())
}

/// Why `len` bytes cannot hold a `rows × cols` tensor in `format`, or `None`
/// when they can.
pub(crate) fn data_size_mismatch(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    len: usize,
) -> Option<String> {
    let expected = format.bytes_for(rows as u64, cols as u64);
    (expected != Some(len as u64))
        .then(|| format!("{len} bytes of data, but {rows}×{cols} in {format} needs {expected:?}"))
}

/// A model as read from disk, before it is put on a backend.
pub struct ModelFiles {
    /// The file or directory it came from, for messages.
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tensors: TensorStore,
    pub tokenizer: Tokenizer,
    /// Key/value pairs worth showing in `inspect` (metadata of the file).
    pub metadata: Vec<(String, String)>,
}

/// Loads a GGUF file or a Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json`).
#[cfg(not(target_arch = "wasm32"))]
pub fn load(path: &Path) -> Result<ModelFiles> {
    if path.is_dir() {
        safetensors::load_hf_dir(path)
    } else if path.exists() {
        gguf::load_gguf(path)
    } else {
        Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        })
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn released_pages_of_a_mapped_file_read_back_unchanged() {
        let path = std::env::temp_dir().join(format!("tandem-release-{}", std::process::id()));
        let data: Vec<u8> = (0..3 * 4096 + 123).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let bytes = Arc::new(Bytes::map(&path).unwrap());
        let mut store = TensorStore::default();
        store.add_file(bytes.clone());
        // A range inside the file, one cutting pages, and one elsewhere.
        store.release(&bytes[100..5000]);
        store.release(&bytes[..]);
        store.release(&data[..10]);
        assert_eq!(&bytes[..], &data[..]);
        std::fs::remove_file(&path).unwrap();
    }
}
