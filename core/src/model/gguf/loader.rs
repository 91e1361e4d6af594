//! The GGUF loader: a parsed file's architecture, configuration, checked
//! tensors, tokenizer and the metadata `inspect` shows.

use std::path::Path;

use super::{GgufArray, GgufFile, GgufValue};
use crate::model::arch::{self, LayerSpec, Rope};
use crate::model::arch::{MoeSpec, Multipliers};
use crate::model::config::{ModelConfig, RopeScaling, MAX_LAYERS};
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
    check_vocabulary(&file, &config, path)?;
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

/// llama.cpp's rule: one embedding row per token of the list, no more, no
/// fewer (its loader creates `token_embd.weight` as `[n_embd, n_tokens]`;
/// the converter pads the list of a padded embedding, as Qwen's, with
/// `[PAD…]` tokens). A token without a row would index past the table.
fn check_vocabulary(file: &GgufFile, config: &ModelConfig, path: &Path) -> Result<()> {
    const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
    // Without a token list the tokenizer's own error names what is missing.
    let Some(tokens) = file.get_array(TOKENS_KEY) else {
        return Ok(());
    };
    if tokens.len() != config.vocab_size {
        return Err(Error::bad_file(
            path,
            format!(
                "'{TOKENS_KEY}' has {} tokens but 'token_embd.weight' has {} rows: \
                 the vocabulary and the embedding must match (as llama.cpp requires)",
                tokens.len(),
                config.vocab_size
            ),
        ));
    }
    Ok(())
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

    /// A count or size that must be at least 1 (a window of 0 tokens would
    /// fail every request later).
    fn positive_usize(&self, suffix: &str) -> Result<Option<usize>> {
        self.typed(suffix, "an integer of at least 1", |value| {
            value.as_usize().filter(|&n| n > 0)
        })
    }

    /// A float that must be finite and above 0 (a RoPE base or factor).
    fn positive_f32(&self, suffix: &str) -> Result<Option<f32>> {
        self.typed(suffix, "a finite number above 0", |value| {
            value.as_f32().filter(|x| x.is_finite() && *x > 0.0)
        })
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
    // A `llama` file with experts is Mixtral.
    let has_experts = file
        .get_usize(&format!("{arch}.expert_count"))
        .is_some_and(|n| n > 0);
    let family = arch::by_gguf_name_moe(arch, has_experts).ok_or_else(|| {
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
        None if !hidden_size.is_multiple_of(num_heads) => {
            return Err(Error::bad_file(
                path,
                format!(
                    "'{}' {hidden_size} is not a multiple of '{}' {num_heads}, and no '{}' \
                     gives the head size",
                    keys.key("embedding_length"),
                    keys.key("attention.head_count"),
                    keys.key("attention.key_length"),
                ),
            ))
        }
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
    let rms_eps = keys.typed(
        "attention.layer_norm_rms_epsilon",
        "a number between 0 and 1",
        |value| value.as_f32().filter(|eps| *eps > 0.0 && *eps < 1.0),
    )?;
    let layers_expected = format!("an integer from 1 to {MAX_LAYERS}");
    let num_layers = keys.typed("block_count", &layers_expected, |value| {
        value.as_usize().filter(|n| (1..=MAX_LAYERS).contains(n))
    })?;
    let num_layers = keys.required("block_count", num_layers)?;
    let rope = Rope {
        theta: keys.positive_f32("rope.freq_base")?.unwrap_or(10000.0),
        scaling: rope_scaling(file, &keys, rotary_dim)?,
    };
    let layers = if family.is_gemma3() {
        // llama.cpp reads the window as required for gemma3, and its rope
        // scaling (`rope.scaling.*`) applies to the global layers only.
        let window = keys.positive_usize("attention.sliding_window")?;
        let window = keys.required("attention.sliding_window", window)?;
        arch::gemma3_layers(
            num_layers,
            window,
            &rope,
            arch::GEMMA3_LOCAL_ROPE_THETA,
            arch::gemma3_is_local,
        )
    } else {
        let window = keys.positive_usize("attention.sliding_window")?;
        LayerSpec::uniform(num_layers, window, rope)
    };
    let moe = moe_from_gguf(family, &keys)?;
    // MoE families give each expert's width apart from a dense one
    // (`expert_feed_forward_length`); Mixtral's `feed_forward_length` is it.
    let expert_ffn = match moe {
        Some(_) => keys.positive_usize("expert_feed_forward_length")?,
        None => None,
    };
    let intermediate_size = match expert_ffn {
        Some(width) => width,
        None => keys.required_usize("feed_forward_length")?,
    };
    let multipliers = Multipliers {
        embedding: keys.positive_f32("embedding_scale")?,
        residual: keys.positive_f32("residual_scale")?,
        logits: keys.positive_f32("logit_scale")?,
    };
    let attention_scale = match keys.positive_f32("attention.scale")? {
        Some(scale) => scale,
        None => gguf_attention_scale(family, num_layers, hidden_size, num_heads, head_dim),
    };
    Ok(ModelConfig {
        arch: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size,
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
        attention_scale,
        layers,
        moe,
        multipliers,
        output_tokens: None,
        reads_hidden: false,
    })
}

/// The experts of a MoE family's file (`{arch}.expert_count`,
/// `expert_used_count`, `expert_shared_feed_forward_length`,
/// `expert_weights_norm`, as llama.cpp names them); `None` for a dense one.
/// Counts that disagree with each other fail here, naming the key; counts
/// that disagree with the tensors fail in `check_tensors`.
fn moe_from_gguf(family: &arch::Family, keys: &ArchKeys) -> Result<Option<MoeSpec>> {
    let Some(routing) = family.moe_routing else {
        return Ok(None);
    };
    let experts = keys.required_usize("expert_count")?;
    let used = keys.required_usize("expert_used_count")?;
    let shared_ffn = keys.positive_usize("expert_shared_feed_forward_length")?;
    let normalize = keys.typed("expert_weights_norm", "a boolean", |v| match v {
        GgufValue::Bool(b) => Some(*b),
        _ => None,
    })?;
    let spec = MoeSpec {
        experts,
        experts_per_token: used,
        normalize_weights: normalize.unwrap_or(routing.gguf_normalize),
        shared_ffn,
        group_rows: true,
    };
    spec.validate().map_err(|e| {
        Error::bad_file(
            keys.path,
            format!(
                "'{}' {experts} and '{}' {used}: {e}",
                keys.key("expert_count"),
                keys.key("expert_used_count")
            ),
        )
    })?;
    Ok(Some(spec))
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
            let factor = keys.positive_f32("rope.scaling.factor")?;
            Some(keys.required("rope.scaling.factor", factor)?)
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
    let factors: Vec<f32> = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // Each divides a frequency: zero, negative or not finite makes it meaningless.
    if let Some((pair, factor)) = factors
        .iter()
        .enumerate()
        .find(|(_, f)| !(f.is_finite() && **f > 0.0))
    {
        return Err(Error::bad_file(
            path,
            format!(
                "tensor 'rope_freqs.weight' holds {factor} for pair {pair}; \
                 its factors must be finite and above 0"
            ),
        ));
    }
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
mod tests;
