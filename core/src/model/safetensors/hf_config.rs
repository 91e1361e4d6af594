//! Hugging Face `config.json`: read into a [`ModelConfig`] for the families
//! of [`arch::FAMILIES`] (`hf_config_write` writes it back in the form it
//! is read).
//!
//! Gemma 3 (text-only `Gemma3ForCausalLM`, `model_type` `gemma3_text`) is
//! read as Hugging Face's `modeling_gemma3.py` runs it: layer `i` is local
//! when `layer_types[i]` is `sliding_attention` (older configs:
//! `sliding_window_pattern`, layer local unless `(i + 1) % pattern == 0`);
//! local layers use `rope_local_base_freq` without scaling, global layers
//! `rope_theta` with `rope_scaling`; attention scores are scaled by
//! `query_pre_attn_scalar ** -0.5`.

// Read only by the directory loader, which the browser lacks.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use std::path::Path;

use serde_json::{Map, Value};

use super::hf_moe::HfMoe;
use super::json_fields::Fields;

use crate::backend::RopeStyle;
use crate::model::arch::{self, Activation, Family, LayerSpec, Rope};
use crate::model::config::{ModelConfig, RopeScaling, MAX_LAYERS};
use crate::model::TensorStore;
use crate::{Error, Result};

/// The fields of `config.json` Tandem reads.
pub(super) struct HfConfig {
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
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    /// Qwen2 configs carry a `sliding_window` size that only applies when this is set.
    use_sliding_window: Option<bool>,
    /// Llama-family name of the activation (`silu`).
    hidden_act: Option<String>,
    /// Gemma's name of the activation (`gelu_pytorch_tanh`).
    hidden_activation: Option<String>,
    /// Gemma 3: `sliding_attention` or `full_attention` per layer.
    layer_types: Option<Vec<String>>,
    /// Gemma 3 configs before `layer_types`: every n-th layer is global.
    sliding_window_pattern: Option<usize>,
    /// Gemma 3: RoPE base of the local layers.
    rope_local_base_freq: Option<f32>,
    /// Gemma 3: attention scores are scaled by its inverse square root.
    query_pre_attn_scalar: Option<f32>,
    /// Gemma 2's soft caps, absent (null) in Gemma 3: refused when set.
    final_logit_softcapping: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    /// Experts and Granite's factors.
    moe: HfMoe,
    /// A draft's reduced output vocabulary ([`OUTPUT_TOKENS_KEY`]).
    output_tokens: Option<Vec<u32>>,
    /// An EAGLE head ([`READS_HIDDEN_KEY`]).
    reads_hidden: Option<bool>,
}

/// The `config.json` key of [`ModelConfig::output_tokens`], Tandem's own:
/// the token id of each row of the draft's output head.
pub const OUTPUT_TOKENS_KEY: &str = "tandem_output_tokens";

/// The `config.json` key of [`ModelConfig::reads_hidden`], Tandem's own:
/// `true` for an EAGLE head that reads its target's hidden states.
pub const READS_HIDDEN_KEY: &str = "tandem_reads_hidden";

struct HfRopeScaling {
    /// `rope_type`, or `type` in older configs.
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

impl HfConfig {
    /// Reads `config.json`'s text; `path` names it in errors.
    pub(super) fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| Error::bad_file(path, "not a JSON object"))?;
        let f = Fields {
            object,
            prefix: "",
            path,
        };
        let rope_scaling = f
            .optional::<Map<String, Value>>("rope_scaling", "an object")?
            .map(|scaling| HfRopeScaling::read(&scaling, path))
            .transpose()?;
        let num_hidden_layers = f.size("num_hidden_layers")?;
        // Layers are described one by one before the configuration is validated.
        if !(1..=MAX_LAYERS).contains(&num_hidden_layers) {
            return Err(Error::bad_file(
                path,
                format!("'num_hidden_layers' is {num_hidden_layers}; it must be 1 to {MAX_LAYERS}"),
            ));
        }
        Ok(HfConfig {
            architectures: f
                .optional("architectures", "a list of strings")?
                .unwrap_or_default(),
            vocab_size: f.size("vocab_size")?,
            hidden_size: f.size("hidden_size")?,
            intermediate_size: f.size("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads: f.size("num_attention_heads")?,
            num_key_value_heads: f.optional_size("num_key_value_heads")?,
            head_dim: f.optional_size("head_dim")?,
            rms_norm_eps: f.number_where("rms_norm_eps", "between 0 and 1", |eps| {
                eps > 0.0 && eps < 1.0
            })?,
            rope_theta: f.positive("rope_theta")?,
            rope_scaling,
            max_position_embeddings: f.size("max_position_embeddings")?,
            tie_word_embeddings: f.flag("tie_word_embeddings")?,
            sliding_window: f.optional_size("sliding_window")?,
            use_sliding_window: f.flag("use_sliding_window")?,
            hidden_act: f.text("hidden_act")?,
            hidden_activation: f.text("hidden_activation")?,
            layer_types: f.optional("layer_types", "a list of strings")?,
            sliding_window_pattern: f.nonzero_size("sliding_window_pattern")?,
            rope_local_base_freq: f.positive("rope_local_base_freq")?,
            query_pre_attn_scalar: f.positive("query_pre_attn_scalar")?,
            final_logit_softcapping: f.number("final_logit_softcapping")?,
            attn_logit_softcapping: f.number("attn_logit_softcapping")?,
            moe: HfMoe::read(&f)?,
            output_tokens: f.optional(OUTPUT_TOKENS_KEY, "a list of token ids")?,
            reads_hidden: f.flag(READS_HIDDEN_KEY)?,
        })
    }
}

impl HfRopeScaling {
    fn read(object: &Map<String, Value>, path: &Path) -> Result<Self> {
        let f = Fields {
            object,
            prefix: "rope_scaling.",
            path,
        };
        Ok(HfRopeScaling {
            kind: f
                .text("rope_type")?
                .map_or_else(|| f.text("type"), |t| Ok(Some(t)))?,
            factor: f.positive("factor")?,
            low_freq_factor: f.positive("low_freq_factor")?,
            high_freq_factor: f.positive("high_freq_factor")?,
            original_max_position_embeddings: f.nonzero_size("original_max_position_embeddings")?,
        })
    }
}

/// Hugging Face's name of an activation.
pub(super) fn activation_name(activation: Activation) -> &'static str {
    match activation {
        Activation::Silu => "silu",
        Activation::GeluTanh => "gelu_pytorch_tanh",
    }
}

/// Hugging Face's defaults for Gemma 3 (`Gemma3TextConfig`).
const GEMMA3_DEFAULT_PATTERN: usize = arch::GEMMA3_PATTERN;
const GEMMA3_DEFAULT_ROPE_THETA: f32 = 1_000_000.0;

impl HfConfig {
    /// The family `architectures` names.
    pub(super) fn family(&self, config_path: &Path) -> Result<&'static Family> {
        let class = self.architectures.first().map(String::as_str);
        class.and_then(arch::by_hf_class).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: architecture {class:?} (Tandem runs {})",
                config_path.display(),
                arch::known_names(|f| f.hf)
            ))
        })
    }

    /// The model's configuration; `tensors` (under canonical names) tell
    /// biases and a stored output matrix.
    pub(super) fn to_model_config(
        &self,
        tensors: &TensorStore,
        config_path: &Path,
    ) -> Result<ModelConfig> {
        let family = self.family(config_path)?;
        let bad = |message: String| Err(Error::bad_file(config_path, message));
        let expected = activation_name(family.block.activation);
        if let Some(act) = self.hidden_activation.as_ref().or(self.hidden_act.as_ref()) {
            if act != expected {
                return Err(Error::Unsupported(format!(
                    "{}: activation '{act}' ({} uses {expected})",
                    config_path.display(),
                    family.hf
                )));
            }
        }
        if let Some(cap) = self.final_logit_softcapping.or(self.attn_logit_softcapping) {
            return Err(Error::Unsupported(format!(
                "{}: logit soft-capping ({cap}) is not supported",
                config_path.display()
            )));
        }
        let heads = self.num_attention_heads;
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if heads > 0 && !self.hidden_size.is_multiple_of(heads) => {
                return bad(format!(
                    "'hidden_size' {} is not a multiple of 'num_attention_heads' {heads}, \
                     and no 'head_dim' gives the head size",
                    self.hidden_size
                ));
            }
            None => self.hidden_size.checked_div(heads).unwrap_or(0),
        };
        let n = self.num_hidden_layers;
        let layers = if family.is_gemma3() {
            let global = Rope {
                theta: self.rope_theta.unwrap_or(GEMMA3_DEFAULT_ROPE_THETA),
                scaling: rope_scaling(self.rope_scaling.as_ref(), config_path)?,
            };
            let Some(window) = self.sliding_window else {
                return bad("Gemma 3 config without sliding_window".into());
            };
            let local = self.local_layers(config_path)?;
            let local_theta = self
                .rope_local_base_freq
                .unwrap_or(arch::GEMMA3_LOCAL_ROPE_THETA);
            arch::gemma3_layers(n, window, &global, local_theta, |i| local[i])
        } else {
            let rope = Rope {
                theta: self.rope_theta.unwrap_or(10000.0),
                scaling: rope_scaling(self.rope_scaling.as_ref(), config_path)?,
            };
            let window = match self.use_sliding_window {
                Some(false) => None,
                _ => self.sliding_window,
            };
            LayerSpec::uniform(n, window, rope)
        };
        if layers.iter().any(|layer| layer.sliding_window == Some(0)) {
            return bad("'sliding_window' is 0; a window must hold at least 1 token".into());
        }
        let query_scalar = match self.query_pre_attn_scalar {
            Some(s) if family.is_gemma3() => s,
            _ => head_dim as f32,
        };
        // Gemma3TextConfig ties embeddings unless told otherwise; the others do not.
        let tie = self.tie_word_embeddings.unwrap_or(family.is_gemma3());
        let (moe, expert_ffn) = self.moe.spec(family, config_path)?;
        let attention_scale = self
            .moe
            .attention_multiplier()
            .unwrap_or(1.0 / query_scalar.sqrt());
        Ok(ModelConfig {
            arch: family.gguf.to_string(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: expert_ffn.unwrap_or(self.intermediate_size),
            num_layers: n,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rotary_dim: head_dim,
            rms_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_style: RopeStyle::NeoX,
            max_context: self.max_position_embeddings,
            // Some checkpoints with tied embeddings still ship a copy as `lm_head.weight`; use it then.
            tied_embeddings: tie && tensors.info("output.weight").is_none(),
            qkv_bias: family.qkv_bias || tensors.info("blk.0.attn_q.bias").is_some(),
            block: family.block,
            attention_scale,
            layers,
            moe,
            multipliers: self.moe.multipliers(),
            output_tokens: self.output_tokens.clone(),
            reads_hidden: self.reads_hidden.unwrap_or(false),
        })
    }

    /// Which of Gemma 3's layers are local: `layer_types`, else the pattern.
    fn local_layers(&self, config_path: &Path) -> Result<Vec<bool>> {
        let n = self.num_hidden_layers;
        let Some(types) = &self.layer_types else {
            let pattern = self
                .sliding_window_pattern
                .unwrap_or(GEMMA3_DEFAULT_PATTERN);
            if pattern == 0 {
                return Err(Error::bad_file(config_path, "sliding_window_pattern is 0"));
            }
            return Ok((0..n).map(|i| (i + 1) % pattern != 0).collect());
        };
        if types.len() != n {
            return Err(Error::bad_file(
                config_path,
                format!("layer_types has {} entries for {n} layers", types.len()),
            ));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(Error::bad_file(
                    config_path,
                    format!("layer_types entry '{other}' is neither sliding_attention nor full_attention"),
                )),
            })
            .collect()
    }
}

fn rope_scaling(scaling: Option<&HfRopeScaling>, config_path: &Path) -> Result<RopeScaling> {
    let Some(scaling) = scaling else {
        return Ok(RopeScaling::None);
    };
    // `HfRopeScaling::read` checked that the values given are finite and positive.
    let required = |name: &str, value: Option<f32>| {
        value.ok_or_else(|| Error::bad_file(config_path, format!("missing 'rope_scaling.{name}'")))
    };
    match scaling.kind.as_deref() {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: required("factor", scaling.factor)?,
        }),
        Some("llama3") => {
            let low_freq_factor = required("low_freq_factor", scaling.low_freq_factor)?;
            let high_freq_factor = required("high_freq_factor", scaling.high_freq_factor)?;
            // Frequencies between the two are interpolated over their difference.
            if high_freq_factor <= low_freq_factor {
                return Err(Error::bad_file(
                    config_path,
                    format!(
                        "'rope_scaling.high_freq_factor' {high_freq_factor} must be above \
                         'rope_scaling.low_freq_factor' {low_freq_factor}"
                    ),
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: required("factor", scaling.factor)?,
                low_freq_factor,
                high_freq_factor,
                original_max_position: scaling.original_max_position_embeddings.ok_or_else(
                    || {
                        Error::bad_file(
                            config_path,
                            "missing 'rope_scaling.original_max_position_embeddings'",
                        )
                    },
                )?,
            })
        }
        Some(other) => Err(Error::Unsupported(format!(
            "{}: rope_scaling type '{other}' (Tandem supports linear and llama3)",
            config_path.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::safetensors::hf_config_json;

    fn config_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": 4, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000,
                "max_position_embeddings": 256, "tie_word_embeddings": true{extra}}}"#
        )
    }

    fn parse(json: &str) -> Result<ModelConfig> {
        let path = Path::new("config.json");
        HfConfig::from_json(json, path)?.to_model_config(&TensorStore::default(), path)
    }

    #[test]
    fn hugging_face_config_options_are_read() {
        let qwen = config_json(
            r#", "sliding_window": 4096, "use_sliding_window": false, "rope_scaling": {"type": "linear", "factor": 2}"#,
        )
        .replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        let c = parse(&qwen).unwrap();
        assert_eq!((c.arch.as_str(), c.sliding_window()), ("qwen2", None));
        assert!(c.qkv_bias);
        assert_eq!(
            c.layers[1].rope.scaling,
            RopeScaling::Linear { factor: 2.0 }
        );

        let mistral = config_json(r#", "sliding_window": 4096, "head_dim": 16"#)
            .replace("LlamaForCausalLM", "MistralForCausalLM");
        let c = parse(&mistral).unwrap();
        assert_eq!(
            (c.sliding_window(), c.head_dim, c.rotary_dim),
            (Some(4096), 16, 16)
        );
        assert_eq!(c.attention_scale, 0.25);

        let qwen3 = config_json(r#", "head_dim": 48, "hidden_act": "silu""#)
            .replace("LlamaForCausalLM", "Qwen3ForCausalLM");
        let c = parse(&qwen3).unwrap();
        assert!(c.block.qk_norm && !c.block.post_norms && !c.qkv_bias);
        assert_eq!((c.head_dim, c.q_dim()), (48, 96));

        let message = parse(&config_json("").replace("LlamaForCausalLM", "GemmaForCausalLM"))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("GemmaForCausalLM") && message.contains("Gemma3ForCausalLM"),
            "{message}"
        );
        let yarn = config_json(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#);
        let message = parse(&yarn).unwrap_err().to_string();
        assert!(message.contains("rope_scaling type 'yarn'"), "{message}");
        let gelu = config_json(r#", "hidden_act": "gelu""#);
        let message = parse(&gelu).unwrap_err().to_string();
        assert!(message.contains("activation 'gelu'"), "{message}");
    }

    #[test]
    fn degenerate_values_are_refused_naming_the_key() {
        let llama3 = |low: f32, high: f32, original: usize| {
            format!(
                r#", "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": {low},
                    "high_freq_factor": {high}, "original_max_position_embeddings": {original}}}"#
            )
        };
        let cases = [
            (
                config_json(r#", "sliding_window": 0"#).replace("Llama", "Mistral"),
                "'sliding_window' is 0; a window must hold at least 1 token",
            ),
            (
                config_json("").replace(
                    r#""num_hidden_layers": 2"#,
                    r#""num_hidden_layers": 1073741824"#,
                ),
                "'num_hidden_layers' is 1073741824; it must be 1 to 1024",
            ),
            (
                config_json(r#", "sliding_window": -1"#),
                "'sliding_window' is -1, expected a non-negative integer",
            ),
            (
                config_json(r#", "rope_scaling": {"rope_type": "linear", "factor": 1e39}"#),
                "'rope_scaling.factor' is inf; it must be finite and above 0",
            ),
            (
                config_json(r#", "rope_scaling": {"type": "linear", "factor": -2}"#),
                "'rope_scaling.factor' is -2; it must be finite and above 0",
            ),
            (
                config_json(r#", "rope_scaling": {"type": "linear"}"#),
                "missing 'rope_scaling.factor'",
            ),
            (
                config_json(&llama3(1.0, 1.0, 8192)),
                "'rope_scaling.high_freq_factor' 1 must be above 'rope_scaling.low_freq_factor' 1",
            ),
            (
                config_json(&llama3(1.0, 4.0, 0)),
                "'rope_scaling.original_max_position_embeddings' is 0; it must be at least 1",
            ),
            (
                config_json("").replace(r#""rope_theta": 500000"#, r#""rope_theta": 0"#),
                "'rope_theta' is 0; it must be finite and above 0",
            ),
            (
                config_json("").replace(r#""rms_norm_eps": 1e-5"#, r#""rms_norm_eps": 2"#),
                "'rms_norm_eps' is 2; it must be between 0 and 1",
            ),
            (
                config_json("").replace(r#""vocab_size": 4"#, r#""vocab_size": "4""#),
                r#"'vocab_size' is "4", expected a non-negative integer"#,
            ),
            (
                config_json("")
                    .replace(r#""num_attention_heads": 2"#, r#""num_attention_heads": 3"#),
                "'hidden_size' 64 is not a multiple of 'num_attention_heads' 3",
            ),
            (
                gemma3_json(r#", "query_pre_attn_scalar": 0"#),
                "'query_pre_attn_scalar' is 0; it must be finite and above 0",
            ),
            (
                gemma3_json("").replace(r#""sliding_window": 16"#, r#""sliding_window": 0"#),
                "'sliding_window' is 0; a window must hold at least 1 token",
            ),
            (
                gemma3_json("").replace(
                    r#""rope_local_base_freq": 10000.0"#,
                    r#""rope_local_base_freq": 1e40"#,
                ),
                "'rope_local_base_freq' is inf; it must be finite and above 0",
            ),
        ];
        for (json, expected) in cases {
            let message = parse(&json).unwrap_err().to_string();
            assert!(message.starts_with("config.json: "), "{message}");
            assert!(message.contains(expected), "{message}");
        }
        // Qwen2's window is not used unless use_sliding_window says so.
        let unused = config_json(r#", "sliding_window": 0, "use_sliding_window": false"#)
            .replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        assert_eq!(parse(&unused).unwrap().sliding_window(), None);
    }

    fn gemma3_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 4,
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 48,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "max_position_embeddings": 1024, "sliding_window": 16,
                "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null{extra}}}"#
        )
    }

    #[test]
    fn gemma3_layers_ropes_and_scale_are_read() {
        let scaling = r#", "query_pre_attn_scalar": 64, "sliding_window_pattern": 3,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}"#;
        let c = parse(&gemma3_json(scaling)).unwrap();
        assert_eq!(c.arch, "gemma3");
        assert!(c.tied_embeddings, "Gemma 3 ties embeddings by default");
        assert_eq!(c.attention_scale, 0.125);
        let windows: Vec<Option<usize>> = c.layers.iter().map(|l| l.sliding_window).collect();
        let (l, g) = (Some(16), None);
        assert_eq!(windows, [l, l, g, l, l, g, l, l]);
        assert_eq!(
            c.layers[2].rope.scaling,
            RopeScaling::Linear { factor: 8.0 }
        );
        assert_eq!(c.layers[2].rope.theta, 1e6);
        assert_eq!(c.layers[3].rope.scaling, RopeScaling::None);
        assert_eq!(c.layers[3].rope.theta, 1e4);
        assert_eq!(c.embedding_scale(), Some(8.0));

        let types = r#", "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
            "sliding_attention"]"#;
        let c = parse(&gemma3_json(types)).unwrap();
        let globals: Vec<usize> = (0..8)
            .filter(|&i| c.layers[i].sliding_window.is_none())
            .collect();
        assert_eq!(globals, [0, 6]);
        assert_eq!(
            c.attention_scale,
            1.0 / 48f32.sqrt(),
            "head_dim without query_pre_attn_scalar"
        );

        let c = parse(&gemma3_json("")).unwrap();
        assert_eq!(c.layers[5].sliding_window, None, "the default pattern is 6");

        let json = hf_config_json(&c).unwrap().to_string();
        assert_eq!(parse(&json).unwrap(), c, "{json}");

        let short = r#", "layer_types": ["full_attention"]"#;
        let message = parse(&gemma3_json(short)).unwrap_err().to_string();
        assert!(
            message.contains("layer_types has 1 entries for 8 layers"),
            "{message}"
        );
        let capped = gemma3_json("").replace(
            r#""final_logit_softcapping": null"#,
            r#""final_logit_softcapping": 30.0"#,
        );
        let message = parse(&capped).unwrap_err().to_string();
        assert!(message.contains("soft-capping"), "{message}");
    }
}
