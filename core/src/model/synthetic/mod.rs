//! Models with random weights, for tests and benchmarks: a tiny model that
//! the tests write as GGUF and as safetensors, and full-size shapes (e.g.
//! Llama-3-8B) to measure a backend's speed without downloading weights.
//!
//! Weights are generated in Hugging Face's layout (Q/K rows in NeoX order);
//! the GGUF form permutes Q/K rows as llama.cpp's converter does, so both
//! files describe the same function. The tokenizer is byte-level BPE over
//! GPT-2's 256 byte symbols plus a few special tokens, padded to the
//! vocabulary size with unused tokens.

mod moe;
mod presets;

use std::path::Path;
use std::sync::Arc;

use super::arch::Rope;
use super::gguf::{GgufArray, GgufFile, GgufValue, GgufWriter};
use super::{
    expected_tensors, Bytes, ModelConfig, ModelFiles, RopeScaling, TensorInfo, TensorStore,
};
use crate::backend::RopeStyle;
use crate::quant::{quantize_row, WeightFormat, QK};
use crate::sched::Rng;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use presets::preset_config;
pub use presets::PRESETS;

/// Special tokens of the synthetic vocabulary, right after the 256 byte tokens.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A random model: its shape, the format of its matrices, and a seed.
#[derive(Clone, Debug)]
pub struct SyntheticModel {
    pub config: ModelConfig,
    pub format: WeightFormat,
    pub seed: u64,
}

/// One tensor of the model, in f32, Hugging Face layout, canonical name.
pub struct NamedTensor {
    pub name: String,
    /// Innermost first: `[cols, rows]` for a matrix, `[len]` for a vector.
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl SyntheticModel {
    /// A named shape: `tiny` (tests) and one tiny model of every other
    /// architecture variant (`tiny-llama3`, `tiny-mistral`, `tiny-qwen2`,
    /// `tiny-qwen3`, `tiny-gemma3`), and full-size `smollm2-135m`, `llama3-8b`.
    pub fn preset(name: &str, format: WeightFormat, seed: u64) -> Result<Self> {
        let config = preset_config(name).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "unknown model shape '{name}' (known: {})",
                PRESETS.join(", ")
            ))
        })?;
        Ok(Self {
            config,
            format,
            seed,
        })
    }

    /// The same model cut to its first `layers` layers (1 or more), so a
    /// large shape fits a test or a benchmark.
    pub fn with_layers(mut self, layers: usize) -> Result<Self> {
        if layers == 0 || layers > self.config.num_layers {
            return Err(Error::InvalidRequest(format!(
                "{layers} layers of a {}-layer model",
                self.config.num_layers
            )));
        }
        self.config.num_layers = layers;
        self.config.layers.truncate(layers);
        Ok(self)
    }

    /// Every tensor's canonical name and shape (innermost first), in file order.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        expected_tensors(&self.config)
    }

    /// All weights as f32 in Hugging Face layout (only sensible for small shapes).
    pub fn f32_tensors(&self) -> Vec<NamedTensor> {
        let mut rng = Rng::new(self.seed);
        self.tensor_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let data = random_values(&mut rng, &name, &shape);
                NamedTensor { name, shape, data }
            })
            .collect()
    }

    /// The model as a GGUF file: matrices in `self.format`, Q/K rows permuted
    /// for interleaved RoPE, plus the synthetic tokenizer.
    pub fn to_gguf(&self) -> Result<Vec<u8>> {
        self.to_gguf_with_formats(&|_, _| self.format)
    }

    /// [`to_gguf`](Self::to_gguf) with each matrix in the format
    /// `format_of(name, shape)` picks (vectors stay F32): a mix of formats
    /// as llama.cpp's Q4_K_M writes (Q6_K for some matrices, Q5_0 or Q8_0
    /// where a row is not a whole number of 256-element super-blocks).
    pub fn to_gguf_with_formats(
        &self,
        format_of: &dyn Fn(&str, &[usize]) -> WeightFormat,
    ) -> Result<Vec<u8>> {
        let c = &self.config;
        let mut w = GgufWriter::new();
        for (k, v) in gguf_metadata(c) {
            w.add_metadata(&k, v)?;
        }
        for t in self.f32_tensors() {
            // A vector's elements move like a matrix's rows.
            let cols = if t.shape.len() == 1 { 1 } else { t.shape[0] };
            let heads = match t.name.rsplit_once('.').map(|(stem, _)| stem) {
                Some(s) if s.ends_with("attn_q") => c.num_heads,
                Some(s) if s.ends_with("attn_k") => c.num_kv_heads,
                _ => 0,
            };
            let data = if c.rope_style == RopeStyle::Interleaved && heads > 0 {
                permute_for_interleaved_rope(&t.data, heads, cols)
            } else {
                t.data
            };
            let format = if t.shape.len() == 1 {
                WeightFormat::F32
            } else {
                format_of(&t.name, &t.shape)
            };
            let bytes = quantize_row(format, &data);
            w.add_tensor(&t.name, format, &t.shape, bytes)?;
        }
        if let Some(factors) = rope_freq_factors(c) {
            // llama.cpp's converter writes Llama 3 scaling as per-pair divisors.
            let bytes = quantize_row(WeightFormat::F32, &factors);
            w.add_tensor(
                "rope_freqs.weight",
                WeightFormat::F32,
                &[factors.len()],
                bytes,
            )?;
        }
        Ok(w.to_bytes())
    }

    /// The model in memory, ready for `Engine::new`, without an f32 copy of
    /// the weights: quantized blocks are drawn directly, so full-size shapes
    /// fit (Llama-3-8B Q4_1 is about 5 GB).
    pub fn files(&self) -> Result<ModelFiles> {
        let c = &self.config;
        let mut rng = Rng::new(self.seed);
        let format_of = |shape: &[usize]| {
            if shape.len() == 1 {
                WeightFormat::F32
            } else {
                self.format
            }
        };
        let shapes = self.tensor_shapes();
        // One allocation of the final size: growing a Vec of gigabytes
        // copies it and faults its pages in twice.
        let total: u64 = shapes
            .iter()
            .map(|(_, shape)| {
                let cols = shape[0].max(1);
                let rows = shape.iter().product::<usize>() / cols;
                format_of(shape)
                    .bytes_for(rows as u64, cols as u64)
                    .unwrap_or(0)
            })
            .sum();
        let mut infos = Vec::with_capacity(shapes.len());
        let mut bytes = Vec::with_capacity(total as usize);
        for (name, shape) in shapes {
            let format = format_of(&shape);
            let offset = bytes.len();
            random_bytes(&mut rng, format, &name, &shape, &mut bytes);
            infos.push(TensorInfo {
                name,
                format,
                shape,
                file: 0,
                offset,
                len: bytes.len() - offset,
            });
        }
        let mut tensors = TensorStore::default();
        tensors.add_file(Arc::new(Bytes::Owned(bytes)));
        for info in infos {
            tensors.insert(info);
        }
        let tokenizer = synthetic_tokenizer(c.vocab_size)?;
        Ok(ModelFiles {
            path: format!("random:{}", describe(c)).into(),
            config: c.clone(),
            tensors,
            tokenizer,
            metadata: vec![("synthetic.seed".into(), self.seed.to_string())],
        })
    }

    /// Writes `to_gguf()` to `path`.
    pub fn write_gguf(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_gguf()?).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// The per-pair divisors GGUF stores for RoPE scaling other than linear
/// (`rope_freqs.weight`, as llama.cpp's converter writes Llama 3's), or
/// `None` when the model has none.
fn rope_freq_factors(c: &ModelConfig) -> Option<Vec<f32>> {
    let rope = c.global_rope()?;
    if !matches!(rope.scaling, RopeScaling::Llama3 { .. }) {
        return None;
    }
    let plain = Rope {
        theta: rope.theta,
        scaling: RopeScaling::None,
    };
    let (base, scaled) = (plain.inv_freq(c.rotary_dim), rope.inv_freq(c.rotary_dim));
    Some(base.iter().zip(&scaled).map(|(b, s)| b / s).collect())
}

/// Canonical names and shapes (innermost first) of a tied-embedding Llama of
/// these sizes, for loader tests that write their own files.
#[cfg(test)]
pub(crate) fn llama_tensor_shapes(
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    vocab: usize,
) -> Vec<(String, Vec<usize>)> {
    let mut model = SyntheticModel::preset("tiny", WeightFormat::F32, 0).expect("tiny preset");
    let c = &mut model.config;
    (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
    ) = (hidden, ffn, heads, kv_heads);
    (c.num_layers, c.vocab_size, c.head_dim, c.tied_embeddings) =
        (layers, vocab, hidden / heads, true);
    c.layers = super::arch::LayerSpec::uniform(layers, None, c.layers[0].rope.clone());
    model.tensor_shapes()
}

fn describe(c: &ModelConfig) -> String {
    format!("{}x{}x{}", c.num_layers, c.hidden_size, c.vocab_size)
}

/// The `{arch}.*` and `tokenizer.ggml.*` keys of a synthetic model.
pub fn gguf_metadata(c: &ModelConfig) -> Vec<(String, GgufValue)> {
    let u = |v: usize| GgufValue::U32(v as u32);
    let global = c.global_rope().cloned().unwrap_or(Rope {
        theta: 10000.0,
        scaling: RopeScaling::None,
    });
    let mut m = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String(c.arch.clone()),
        ),
        (
            "general.name".to_string(),
            GgufValue::String("tandem synthetic".into()),
        ),
        (format!("{}.context_length", c.arch), u(c.max_context)),
        (format!("{}.embedding_length", c.arch), u(c.hidden_size)),
        (
            format!("{}.feed_forward_length", c.arch),
            u(c.intermediate_size),
        ),
        (format!("{}.block_count", c.arch), u(c.num_layers)),
        (format!("{}.attention.head_count", c.arch), u(c.num_heads)),
        (
            format!("{}.attention.head_count_kv", c.arch),
            u(c.num_kv_heads),
        ),
        (format!("{}.attention.key_length", c.arch), u(c.head_dim)),
        (
            format!("{}.attention.layer_norm_rms_epsilon", c.arch),
            GgufValue::F32(c.rms_eps),
        ),
        (
            format!("{}.rope.freq_base", c.arch),
            GgufValue::F32(global.theta),
        ),
        (format!("{}.rope.dimension_count", c.arch), u(c.rotary_dim)),
        (format!("{}.vocab_size", c.arch), u(c.vocab_size)),
    ];
    if let RopeScaling::Linear { factor } = global.scaling {
        m.extend([
            (
                format!("{}.rope.scaling.type", c.arch),
                GgufValue::String("linear".into()),
            ),
            (
                format!("{}.rope.scaling.factor", c.arch),
                GgufValue::F32(factor),
            ),
        ]);
    }
    if let Some(window) = c.sliding_window() {
        m.push((format!("{}.attention.sliding_window", c.arch), u(window)));
    }
    m.extend(moe::moe_gguf_metadata(c));
    m.extend(tokenizer_metadata(c.vocab_size));
    m
}

/// GPT-2's reversible map from bytes to printable characters.
fn byte_symbols() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("latin-1 is valid")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("below the surrogates")
            }
        })
        .collect()
}

/// `tokenizer.ggml.*` keys of the synthetic byte-level vocabulary.
pub fn tokenizer_metadata(vocab_size: usize) -> Vec<(String, GgufValue)> {
    let symbols = byte_symbols();
    let mut tokens: Vec<String> = symbols.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    for s in SPECIAL_TOKENS {
        tokens.push(s.to_string());
        types.push(3);
    }
    // A few merges so encoding exercises BPE, not just byte lookup.
    let sp = symbols[b' ' as usize];
    let merges = [(sp, 't'), ('h', 'e'), (sp, 'a'), ('i', 'n')];
    let mut merge_strings = Vec::new();
    for (a, b) in merges {
        tokens.push(format!("{a}{b}"));
        types.push(1);
        merge_strings.push(format!("{a} {b}"));
    }
    while tokens.len() < vocab_size {
        tokens.push(format!("<unused_{}>", tokens.len()));
        types.push(5);
    }
    let strings = |v: Vec<String>| GgufValue::Array(GgufArray::String(v.iter().collect()));
    vec![
        (
            "tokenizer.ggml.model".into(),
            GgufValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            GgufValue::String("smollm".into()),
        ),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(types)),
        ),
        ("tokenizer.ggml.merges".into(), strings(merge_strings)),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(256)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(256)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            GgufValue::Bool(false),
        ),
    ]
}

pub(super) fn synthetic_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    let file = GgufFile {
        version: 3,
        metadata: tokenizer_metadata(vocab_size),
        tensors: Vec::new(),
        bytes: Arc::new(Bytes::Owned(Vec::new())),
    };
    Tokenizer::from_gguf(&file)
}

/// Reorders each head's rows from NeoX order (halves) to interleaved pairs,
/// as llama.cpp's converter does: row `2i` ← row `i`, row `2i+1` ← row `i + d/2`.
pub fn permute_for_interleaved_rope(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for (dst, src) in [(2 * i, i), (2 * i + 1, i + half)] {
                let d = (h * head_dim + dst) * cols;
                let s = (h * head_dim + src) * cols;
                out[d..d + cols].copy_from_slice(&w[s..s + cols]);
            }
        }
    }
    out
}

/// Norm weights near 1, biases small, matrices scaled by 1/sqrt(fan-in) so
/// activations stay in a realistic range through many layers.
fn random_values(rng: &mut Rng, name: &str, shape: &[usize]) -> Vec<f32> {
    random_run(rng, name, shape, shape.iter().product())
}

/// About how many values `random_bytes` draws and quantizes at a time.
const RANDOM_RUN_VALUES: usize = 1 << 16;

/// The next `n` values of tensor `name` (of `shape`): its values drawn in
/// runs give what one draw gives.
pub(super) fn random_run(rng: &mut Rng, name: &str, shape: &[usize], n: usize) -> Vec<f32> {
    let uniform = |rng: &mut Rng| (rng.next_f64() * 2.0 - 1.0) as f32;
    if name.contains("norm") {
        (0..n).map(|_| 1.0 + 0.1 * uniform(rng)).collect()
    } else if name.ends_with(".bias") {
        (0..n).map(|_| 0.1 * uniform(rng)).collect()
    } else {
        let scale = (3.0 / shape[0] as f32).sqrt();
        (0..n).map(|_| scale * uniform(rng)).collect()
    }
}

/// Appends random data in `format` to `out`: blocks of Q8_0, Q4_0, Q4_1
/// and Tandem's formats get a plausible scale and random codes; other
/// formats quantize random values a few rows at a time. So no f32 copy of a
/// large tensor is ever made.
fn random_bytes(
    rng: &mut Rng,
    format: WeightFormat,
    name: &str,
    shape: &[usize],
    out: &mut Vec<u8>,
) {
    let drawn_directly = matches!(
        format,
        WeightFormat::Q8_0
            | WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Int8PerChannel
            | WeightFormat::W8A8
            | WeightFormat::Int4 { .. }
    );
    let elems: usize = shape.iter().product();
    if !drawn_directly {
        // Whole rows per run, so the blocks are those of one whole draw.
        let cols = shape[0].max(1);
        let run = cols * (RANDOM_RUN_VALUES / cols).max(1);
        let mut done = 0;
        while done < elems {
            let n = run.min(elems - done);
            out.extend(quantize_row(format, &random_run(rng, name, shape, n)));
            done += n;
        }
        return;
    }
    let blocks = elems / QK;
    let scale = (3.0 / shape[0] as f32).sqrt();
    let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let random_fill = |rng: &mut Rng, n: usize, out: &mut Vec<u8>| {
        for _ in 0..n / 8 {
            out.extend(rng.next_u64().to_le_bytes());
        }
    };
    if format.ggml_type().is_none() {
        let rows = elems / shape[0].max(1);
        for _ in 0..rows {
            if format.row_head_bytes() > 0 {
                out.extend((scale / 127.0).to_le_bytes());
            }
            for _ in 0..shape[0] / format.block_elems() {
                let mut head = 0;
                if matches!(format, WeightFormat::Int4 { .. }) {
                    out.extend(half(2.0 * scale / 15.0));
                    out.extend(half(-scale));
                    head = 4;
                }
                random_fill(rng, format.block_bytes() - head, out);
            }
        }
        return;
    }
    for _ in 0..blocks {
        let bits = rng.next_u64().to_le_bytes();
        let more = rng.next_u64().to_le_bytes();
        match format {
            WeightFormat::Q8_0 => {
                out.extend(half(scale / 127.0));
                for _ in 0..4 {
                    out.extend(rng.next_u64().to_le_bytes());
                }
            }
            WeightFormat::Q4_0 => {
                out.extend(half(scale / 8.0));
                out.extend(bits);
                out.extend(more);
            }
            WeightFormat::Q4_1 => {
                out.extend(half(2.0 * scale / 15.0));
                out.extend(half(-scale));
                out.extend(bits);
                out.extend(more);
            }
            _ => unreachable!("handled above"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QK_K;

    #[test]
    fn the_vocabulary_builds_at_every_size() {
        // Below 263 tokens (bytes, specials, merges) the list once lost its
        // merge tokens while keeping the merges, and failed to build.
        for vocab_size in [0, 259, 262, 263, 320] {
            let tokenizer = synthetic_tokenizer(vocab_size).unwrap();
            assert_eq!(tokenizer.vocab_size(), vocab_size.max(263), "{vocab_size}");
        }
    }

    #[test]
    fn permutation_moves_halves_to_pairs() {
        // One head of dim 4, one column: rows [a0, a1, b0, b1] -> [a0, b0, a1, b1].
        assert_eq!(
            permute_for_interleaved_rope(&[0.0, 1.0, 2.0, 3.0], 1, 1),
            vec![0.0, 2.0, 1.0, 3.0]
        );
    }

    #[test]
    fn random_bytes_have_the_format_size() {
        let m = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 1).unwrap();
        for format in WeightFormat::ALL {
            let mut rng = Rng::new(0);
            let mut b = vec![7];
            random_bytes(&mut rng, format, "x.weight", &[QK_K, 3], &mut b);
            b.remove(0);
            assert_eq!(
                b.len() as u64,
                format.bytes_for(3, QK_K as u64).unwrap(),
                "{format}"
            );
        }
        assert!(m.tensor_shapes().len() > 10);
    }
}
