//! The GGUF loader: a parsed file's architecture, configuration, checked
//! tensors, tokenizer and the metadata `inspect` shows.

use std::path::Path;

use super::{GgufArray, GgufFile, GgufValue};
use crate::model::arch::{self, LayerSpec, Rope};
use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::{check_tensors, ModelFiles, TensorInfo, TensorStore};
use crate::quant::WeightFormat;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Arrays longer than this are shown in `inspect` by their length only.
const INSPECT_MAX_ARRAY: usize = 16;
/// Strings longer than this (chat templates) are shown in `inspect` by their length only.
const INSPECT_MAX_STRING: usize = 120;

/// Maps, parses and checks a GGUF model file.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_gguf(path: &Path) -> Result<ModelFiles> {
    model_from_gguf(GgufFile::open(path)?, path)
}

/// Builds the model from a parsed file: its configuration, checked tensors, tokenizer and metadata.
pub fn model_from_gguf(file: GgufFile, path: &Path) -> Result<ModelFiles> {
    let config = config_from_gguf(&file, path)?;
    config.validate().map_err(|e| match e {
        Error::Unsupported(reason) => {
            Error::bad_file(path, format!("bad model configuration: {reason}"))
        }
        other => other,
    })?;
    let mut tensors = TensorStore::default();
    tensors.add_file(file.bytes.clone());
    for info in &file.tensors {
        tensors.insert(info.clone());
    }
    check_tensors(&config, &tensors, path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let metadata = inspect_metadata(&file);
    Ok(ModelFiles {
        path: path.to_path_buf(),
        config,
        tensors,
        tokenizer,
        metadata,
    })
}

/// Reads `{arch}.*` keys, telling a missing key from one of the wrong type.
struct ArchKeys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
    path: &'a Path,
}

impl ArchKeys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn typed<T>(
        &self,
        suffix: &str,
        expected: &str,
        convert: impl Fn(&GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let key = self.key(suffix);
        let Some(value) = self.file.get(&key) else {
            return Ok(None);
        };
        convert(value).map(Some).ok_or_else(|| {
            Error::bad_file(
                self.path,
                format!(
                    "metadata key '{key}' is {}, expected {expected}",
                    value.brief()
                ),
            )
        })
    }

    fn usize(&self, suffix: &str) -> Result<Option<usize>> {
        self.typed(suffix, "a non-negative integer", GgufValue::as_usize)
    }

    fn f32(&self, suffix: &str) -> Result<Option<f32>> {
        self.typed(suffix, "a float", GgufValue::as_f32)
    }

    fn str(&self, suffix: &str) -> Result<Option<&str>> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(other) => Err(Error::bad_file(
                self.path,
                format!(
                    "metadata key '{key}' is {}, expected a string",
                    other.brief()
                ),
            )),
        }
    }

    fn required<T>(&self, suffix: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| {
            Error::bad_file(
                self.path,
                format!("missing metadata key '{}'", self.key(suffix)),
            )
        })
    }

    fn required_usize(&self, suffix: &str) -> Result<usize> {
        self.required(suffix, self.usize(suffix)?)
    }
}

fn config_from_gguf(file: &GgufFile, path: &Path) -> Result<ModelConfig> {
    let arch = match file.get("general.architecture") {
        Some(GgufValue::String(arch)) => arch.as_str(),
        Some(other) => {
            return Err(Error::bad_file(
                path,
                format!(
                    "general.architecture is {}, expected a string",
                    other.brief()
                ),
            ))
        }
        None => {
            return Err(Error::bad_file(
                path,
                "missing metadata key 'general.architecture'",
            ))
        }
    };
    let family = arch::by_gguf_name(arch).ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: architecture '{arch}' (Tandem runs {})",
            path.display(),
            arch::known_names(|f| f.gguf)
        ))
    })?;
    let keys = ArchKeys { file, arch, path };
    let hidden_size = keys.required_usize("embedding_length")?;
    let num_heads = keys.required_usize("attention.head_count")?;
    let num_kv_heads = keys.usize("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = match keys.usize("attention.key_length")? {
        Some(d) => d,
        None if num_heads == 0 => 0,
        None => hidden_size / num_heads,
    };
    if let Some(value_dim) = keys.usize("attention.value_length")? {
        if value_dim != head_dim {
            return Err(Error::Unsupported(format!(
                "{}: value head size {value_dim} differs from key head size {head_dim}",
                path.display()
            )));
        }
    }
    let vocab_size = match keys.usize("vocab_size")? {
        Some(v) => v,
        None => file
            .tensor("token_embd.weight")
            .map(TensorInfo::rows)
            .ok_or_else(|| Error::bad_file(path, "missing tensor 'token_embd.weight'"))?,
    };
    let rotary_dim = keys.usize("rope.dimension_count")?.unwrap_or(head_dim);
    let rms_eps = keys.f32("attention.layer_norm_rms_epsilon")?;
    let num_layers = keys.required_usize("block_count")?;
    let rope = Rope {
        theta: keys.f32("rope.freq_base")?.unwrap_or(10000.0),
        scaling: rope_scaling(file, &keys, rotary_dim)?,
    };
    let layers = if family.is_gemma3() {
        // llama.cpp reads the window as required for gemma3, and its rope
        // scaling (`rope.scaling.*`) applies to the global layers only.
        let window = keys.required_usize("attention.sliding_window")?;
        arch::gemma3_layers(
            num_layers,
            window,
            &rope,
            arch::GEMMA3_LOCAL_ROPE_THETA,
            arch::gemma3_is_local,
        )
    } else {
        LayerSpec::uniform(num_layers, keys.usize("attention.sliding_window")?, rope)
    };
    Ok(ModelConfig {
        arch: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: keys.required_usize("feed_forward_length")?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        rms_eps: keys.required("attention.layer_norm_rms_epsilon", rms_eps)?,
        rope_style: family.gguf_rope_style,
        max_context: keys.required_usize("context_length")?,
        tied_embeddings: file.tensor("output.weight").is_none(),
        qkv_bias: family.qkv_bias || file.tensor("blk.0.attn_q.bias").is_some(),
        block: family.block,
        attention_scale: gguf_attention_scale(family, num_layers, hidden_size, num_heads, head_dim),
        layers,
    })
}

/// llama.cpp's attention scale: `1/sqrt(head_dim)`, except Gemma 3 27B
/// (62 layers), which scales by `1/sqrt(n_embd / n_head)` (its
/// `query_pre_attn_scalar`; llama-model.cpp, `f_attention_scale`).
fn gguf_attention_scale(
    family: &arch::Family,
    num_layers: usize,
    hidden_size: usize,
    num_heads: usize,
    head_dim: usize,
) -> f32 {
    const GEMMA3_27B_LAYERS: usize = 62;
    let query_scalar = if family.is_gemma3() && num_layers == GEMMA3_27B_LAYERS {
        hidden_size.checked_div(num_heads).unwrap_or(0)
    } else {
        head_dim
    };
    1.0 / (query_scalar as f32).sqrt()
}

/// `rope_freqs.weight` (per-pair divisors) or `rope.scaling.type` linear.
fn rope_scaling(file: &GgufFile, keys: &ArchKeys, rotary_dim: usize) -> Result<RopeScaling> {
    let path = keys.path;
    let linear = match keys.str("rope.scaling.type")? {
        None | Some("none") => None,
        Some("linear") => {
            let factor = keys.f32("rope.scaling.factor")?;
            let factor = keys.required("rope.scaling.factor", factor)?;
            if factor.is_nan() || factor <= 0.0 {
                return Err(Error::bad_file(
                    path,
                    format!("rope scaling factor {factor} must be positive"),
                ));
            }
            Some(factor)
        }
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "{}: RoPE scaling '{other}' (Tandem supports linear and per-frequency factors)",
                path.display()
            )))
        }
    };
    let Some(info) = file.tensor("rope_freqs.weight") else {
        return Ok(linear.map_or(RopeScaling::None, |factor| RopeScaling::Linear { factor }));
    };
    if linear.is_some() {
        return Err(Error::Unsupported(format!(
            "{}: both linear RoPE scaling and rope_freqs.weight",
            path.display()
        )));
    }
    let pairs = rotary_dim / 2;
    if info.format != WeightFormat::F32 || info.elems() != pairs {
        return Err(Error::bad_file(
            path,
            format!(
                "tensor 'rope_freqs.weight' is {} of shape {:?}, expected F32 of shape [{pairs}]",
                info.format, info.shape
            ),
        ));
    }
    let data = file
        .tensor_data(info)
        .ok_or_else(|| Error::bad_file(path, "tensor 'rope_freqs.weight' lies outside the file"))?;
    let factors = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(RopeScaling::FreqFactors(factors))
}

/// The metadata `inspect` shows: scalars and short strings as they are, long
/// strings and arrays (the tokenizer's vocabulary) by their length.
fn inspect_metadata(file: &GgufFile) -> Vec<(String, String)> {
    let mut shown = vec![("gguf.version".to_string(), file.version.to_string())];
    shown.extend(
        file.metadata
            .iter()
            .map(|(key, value)| (key.clone(), describe_value(value))),
    );
    shown
}

fn describe_value(value: &GgufValue) -> String {
    match value {
        GgufValue::U8(v) => v.to_string(),
        GgufValue::I8(v) => v.to_string(),
        GgufValue::U16(v) => v.to_string(),
        GgufValue::I16(v) => v.to_string(),
        GgufValue::U32(v) => v.to_string(),
        GgufValue::I32(v) => v.to_string(),
        GgufValue::U64(v) => v.to_string(),
        GgufValue::I64(v) => v.to_string(),
        GgufValue::F32(v) => v.to_string(),
        GgufValue::F64(v) => v.to_string(),
        GgufValue::Bool(v) => v.to_string(),
        GgufValue::String(s) if s.len() <= INSPECT_MAX_STRING => s.clone(),
        GgufValue::String(s) => format!("({} bytes of text)", s.len()),
        GgufValue::Array(items) => {
            let item_type = items.element_type_name();
            let nested = matches!(items, GgufArray::Array(_));
            let shown = (items.len() <= INSPECT_MAX_ARRAY && !nested).then(|| {
                (0..items.len())
                    .filter_map(|i| items.get(i))
                    .map(|item| describe_value(&item))
                    .collect::<Vec<_>>()
            });
            match shown {
                Some(shown) => format!("[{}]", shown.join(", ")),
                None => format!("({} × {item_type})", items.len()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::super::testing::test_values;
    use super::super::GgufWriter;
    use super::*;
    use crate::backend::RopeStyle;
    use crate::model::synthetic::{llama_tensor_shapes, SyntheticModel};
    use crate::model::Bytes;
    use crate::quant::quantize_row;

    /// A tiny llama-family model described as metadata and tensor shapes, so
    /// tests can break one thing before writing it.
    struct TinyModel {
        metadata: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<usize>)>,
    }

    const HIDDEN: usize = 64;
    const FFN: usize = 96;
    const HEADS: usize = 2;
    const KV_HEADS: usize = 1;
    const HEAD_DIM: usize = HIDDEN / HEADS;
    const LAYERS: usize = 2;
    const TOKENS: [&str; 8] = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "Ġa", "bc"];

    impl TinyModel {
        fn new(arch: &str) -> Self {
            let strings =
                |items: &[&str]| GgufValue::Array(GgufArray::String(items.iter().collect()));
            let key = |suffix: &str| format!("{arch}.{suffix}");
            let metadata = vec![
                (
                    "general.architecture".into(),
                    GgufValue::String(arch.into()),
                ),
                (key("context_length"), GgufValue::U32(256)),
                (key("embedding_length"), GgufValue::U32(HIDDEN as u32)),
                (key("feed_forward_length"), GgufValue::U32(FFN as u32)),
                (key("block_count"), GgufValue::U32(LAYERS as u32)),
                (key("attention.head_count"), GgufValue::U32(HEADS as u32)),
                (
                    key("attention.head_count_kv"),
                    GgufValue::U32(KV_HEADS as u32),
                ),
                (
                    key("attention.layer_norm_rms_epsilon"),
                    GgufValue::F32(1e-5),
                ),
                (key("rope.freq_base"), GgufValue::F32(100000.0)),
                (
                    "tokenizer.ggml.model".into(),
                    GgufValue::String("gpt2".into()),
                ),
                (
                    "tokenizer.ggml.pre".into(),
                    GgufValue::String("gpt-2".into()),
                ),
                ("tokenizer.ggml.tokens".into(), strings(&TOKENS)),
                (
                    "tokenizer.ggml.merges".into(),
                    strings(&["a b", "Ġ a", "b c"]),
                ),
                ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(0)),
            ];
            let vocab = TOKENS.len();
            let tensors = llama_tensor_shapes(HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, vocab);
            TinyModel { metadata, tensors }
        }

        fn set(&mut self, key: &str, value: GgufValue) {
            self.metadata.retain(|(k, _)| k != key);
            self.metadata.push((key.to_string(), value));
        }

        fn shape_of(&mut self, name: &str) -> &mut Vec<usize> {
            let (_, shape) = self.tensors.iter_mut().find(|(n, _)| n == name).unwrap();
            shape
        }

        /// Writes every tensor as F32 (Q8_0 for the matrices when `quantize`).
        fn to_bytes(&self, quantize: bool) -> Vec<u8> {
            let mut w = GgufWriter::new();
            for (key, value) in &self.metadata {
                w.add_metadata(key, value.clone()).unwrap();
            }
            for (name, shape) in &self.tensors {
                let format = if quantize && shape.len() == 2 {
                    WeightFormat::Q8_0
                } else {
                    WeightFormat::F32
                };
                let data = quantize_row(format, &test_values(shape.iter().product()));
                w.add_tensor(name, format, shape, data).unwrap();
            }
            w.to_bytes()
        }

        fn load(&self) -> Result<ModelFiles> {
            let bytes = Arc::new(Bytes::Owned(self.to_bytes(true)));
            let path = Path::new("tiny.gguf");
            model_from_gguf(GgufFile::parse(bytes, path)?, path)
        }

        fn load_error(&self) -> String {
            match self.load() {
                Ok(_) => panic!("loaded a bad model"),
                Err(e) => e.to_string(),
            }
        }
    }

    #[test]
    fn tiny_llama_loads() {
        let model = TinyModel::new("llama").load().unwrap();
        let c = &model.config;
        assert_eq!(c.arch, "llama");
        assert_eq!(c.vocab_size, TOKENS.len());
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.num_layers),
            (HIDDEN, FFN, LAYERS)
        );
        assert_eq!(
            (c.num_heads, c.num_kv_heads, c.head_dim),
            (HEADS, KV_HEADS, HEAD_DIM)
        );
        assert_eq!(c.rotary_dim, HEAD_DIM);
        assert_eq!(
            (c.rms_eps, c.layers[1].rope.theta, c.max_context),
            (1e-5, 100000.0, 256)
        );
        assert_eq!(c.rope_style, RopeStyle::Interleaved);
        assert_eq!(c.layers[0].rope.scaling, RopeScaling::None);
        assert!(c.tied_embeddings && !c.qkv_bias);
        assert_eq!(c.sliding_window(), None);
        let q = model.tensors.view("blk.1.attn_q.weight").unwrap();
        assert_eq!(
            (q.format, q.rows, q.cols),
            (WeightFormat::Q8_0, HIDDEN, HIDDEN)
        );
        assert!(model.tokenizer.encode("ab", false).is_ok());
        let shown: HashMap<_, _> = model.metadata.into_iter().collect();
        assert_eq!(shown["llama.block_count"], "2");
        assert_eq!(
            shown["tokenizer.ggml.tokens"],
            "[<|endoftext|>, a, b, c, Ġ, ab, Ġa, bc]"
        );
    }

    #[test]
    fn qwen2_has_biases_and_neox_rope() {
        let mut tiny = TinyModel::new("qwen2");
        for layer in 0..LAYERS {
            tiny.tensors.extend([
                (format!("blk.{layer}.attn_q.bias"), vec![HIDDEN]),
                (format!("blk.{layer}.attn_k.bias"), vec![HEAD_DIM]),
                (format!("blk.{layer}.attn_v.bias"), vec![HEAD_DIM]),
            ]);
        }
        tiny.tensors
            .push(("output.weight".into(), vec![HIDDEN, TOKENS.len()]));
        let model = tiny.load().unwrap();
        assert_eq!(model.config.rope_style, RopeStyle::NeoX);
        assert!(model.config.qkv_bias && !model.config.tied_embeddings);

        tiny.tensors.retain(|(n, _)| n != "blk.1.attn_v.bias");
        let message = tiny.load_error();
        assert!(
            message.contains("missing tensor 'blk.1.attn_v.bias'"),
            "{message}"
        );
    }

    #[test]
    fn rope_options_are_read() {
        let mut tiny = TinyModel::new("mistral");
        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("linear".into()),
        );
        tiny.set("mistral.rope.scaling.factor", GgufValue::F32(4.0));
        tiny.set("mistral.attention.sliding_window", GgufValue::U32(128));
        tiny.set("mistral.rope.dimension_count", GgufValue::U32(16));
        let c = tiny.load().unwrap().config;
        assert_eq!(
            c.layers[0].rope.scaling,
            RopeScaling::Linear { factor: 4.0 }
        );
        assert_eq!((c.sliding_window(), c.rotary_dim), (Some(128), 16));

        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("none".into()),
        );
        tiny.tensors.push(("rope_freqs.weight".into(), vec![8]));
        let c = tiny.load().unwrap().config;
        assert_eq!(
            c.layers[1].rope.scaling,
            RopeScaling::FreqFactors(test_values(8))
        );

        tiny.set(
            "mistral.rope.scaling.type",
            GgufValue::String("yarn".into()),
        );
        let message = tiny.load_error();
        assert!(message.contains("RoPE scaling 'yarn'"), "{message}");
    }

    #[test]
    fn missing_tensor_is_named() {
        let mut tiny = TinyModel::new("llama");
        tiny.tensors.retain(|(n, _)| n != "blk.1.ffn_up.weight");
        let message = tiny.load_error();
        assert!(
            message.contains("missing tensor 'blk.1.ffn_up.weight' (expected shape [64, 96])"),
            "{message}"
        );
    }

    #[test]
    fn wrong_tensor_shape_is_named() {
        let mut tiny = TinyModel::new("llama");
        *tiny.shape_of("blk.0.attn_k.weight") = vec![HIDDEN, HIDDEN];
        let message = tiny.load_error();
        assert!(
            message.contains("tensor 'blk.0.attn_k.weight' has shape [64, 64], expected [64, 32]"),
            "{message}"
        );
    }

    #[test]
    fn absurd_config_is_named() {
        let mut tiny = TinyModel::new("llama");
        tiny.set("llama.attention.head_count", GgufValue::U32(0));
        let message = tiny.load_error();
        assert!(
            message.contains("num_heads = 0 is out of range"),
            "{message}"
        );

        let mut tiny = TinyModel::new("llama");
        tiny.set("llama.block_count", GgufValue::String("two".into()));
        let message = tiny.load_error();
        assert!(
            message.contains(
                "'llama.block_count' is String(\"two\"), expected a non-negative integer"
            ),
            "{message}"
        );

        let mut tiny = TinyModel::new("llama");
        tiny.metadata.retain(|(k, _)| k != "llama.embedding_length");
        let message = tiny.load_error();
        assert!(
            message.contains("missing metadata key 'llama.embedding_length'"),
            "{message}"
        );

        let tiny = TinyModel::new("gemma");
        let message = tiny.load_error();
        assert!(message.contains("architecture 'gemma'"), "{message}");
    }

    /// A synthetic model's GGUF file, rewritten without the tensor `drop`
    /// and with `key` set to `value` (or removed when `value` is `None`).
    fn edited_preset(
        preset: &str,
        drop: &str,
        key: &str,
        value: Option<GgufValue>,
    ) -> Result<ModelFiles> {
        let model = SyntheticModel::preset(preset, WeightFormat::F32, 4).unwrap();
        let path = Path::new("edited.gguf");
        let bytes = Arc::new(Bytes::Owned(model.to_gguf().unwrap()));
        let file = GgufFile::parse(bytes, path).unwrap();
        let mut w = GgufWriter::new();
        for (k, v) in &file.metadata {
            if k != key {
                w.add_metadata(k, v.clone()).unwrap();
            }
        }
        if let Some(value) = value {
            w.add_metadata(key, value).unwrap();
        }
        for info in file.tensors.iter().filter(|t| t.name != drop) {
            let data = file.tensor_data(info).unwrap().to_vec();
            w.add_tensor(&info.name, info.format, &info.shape, data)
                .unwrap();
        }
        let bytes = Arc::new(Bytes::Owned(w.to_bytes()));
        model_from_gguf(GgufFile::parse(bytes, path)?, path)
    }

    fn edited_error(preset: &str, drop: &str, key: &str, value: Option<GgufValue>) -> String {
        match edited_preset(preset, drop, key, value) {
            Ok(_) => panic!("loaded a bad {preset}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_preset_architecture_reads_back_its_configuration() {
        for name in ["tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"] {
            let model = SyntheticModel::preset(name, WeightFormat::F32, 4).unwrap();
            let loaded = edited_preset(name, "", "", None).unwrap();
            assert_eq!(loaded.config, model.config, "{name}");
        }
        let gemma = edited_preset("tiny-gemma3", "", "", None).unwrap().config;
        let globals: Vec<usize> = (0..gemma.num_layers)
            .filter(|&i| gemma.layers[i].sliding_window.is_none())
            .collect();
        assert_eq!(globals, [5]);
        assert_eq!(gemma.layers[0].rope.theta, arch::GEMMA3_LOCAL_ROPE_THETA);
        assert_eq!(gemma.layers[0].rope.scaling, RopeScaling::None);
        assert_eq!(
            gemma.layers[5].rope.scaling,
            RopeScaling::Linear { factor: 2.0 }
        );
        assert_eq!(gemma.rope_style, RopeStyle::NeoX);
        assert!(gemma.block.post_norms && gemma.block.qk_norm);
        assert_eq!(gemma.q_dim(), 96, "key_length, not hidden / heads");
    }

    #[test]
    fn missing_architecture_tensors_and_keys_are_named() {
        let message = edited_error("tiny-gemma3", "blk.3.post_ffw_norm.weight", "", None);
        assert!(
            message.contains("missing tensor 'blk.3.post_ffw_norm.weight' (expected shape [64])"),
            "{message}"
        );
        let message = edited_error("tiny-qwen3", "blk.2.attn_k_norm.weight", "", None);
        assert!(
            message.contains("missing tensor 'blk.2.attn_k_norm.weight' (expected shape [24])"),
            "{message}"
        );
        let message = edited_error("tiny-qwen2", "blk.0.attn_q.bias", "", None);
        assert!(
            message.contains("missing tensor 'blk.0.attn_q.bias'"),
            "{message}"
        );
        let window = "gemma3.attention.sliding_window";
        let message = edited_error("tiny-gemma3", "", window, None);
        assert!(
            message.contains("missing metadata key 'gemma3.attention.sliding_window'"),
            "{message}"
        );
        let text = Some(GgufValue::String("512".into()));
        let message = edited_error("tiny-gemma3", "", window, text);
        assert!(
            message.contains("'gemma3.attention.sliding_window' is String(\"512\"), expected a non-negative integer"),
            "{message}"
        );
        let float = Some(GgufValue::U32(7));
        let message = edited_error("tiny-qwen3", "", "qwen3.rope.freq_base", float);
        assert!(
            message.contains("'qwen3.rope.freq_base' is U32(7), expected a float"),
            "{message}"
        );
    }

    #[test]
    fn gemma3_27b_scales_attention_by_its_query_pre_attn_scalar() {
        let gemma = arch::by_gguf_name("gemma3").unwrap();
        let llama = arch::by_gguf_name("llama").unwrap();
        assert_eq!(gguf_attention_scale(gemma, 26, 1152, 4, 256), 1.0 / 16.0);
        assert_eq!(
            gguf_attention_scale(gemma, 62, 5376, 32, 128),
            1.0 / 168f32.sqrt()
        );
        assert_eq!(
            gguf_attention_scale(llama, 62, 5376, 32, 128),
            1.0 / 128f32.sqrt()
        );
    }
}
