//! Hugging Face `config.json`: read into a [`ModelConfig`] for the families
//! of [`arch::FAMILIES`], and written back ([`hf_config_json`]) in the form
//! it is read.
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

use serde::Deserialize;
use serde_json::Value;

use crate::backend::RopeStyle;
use crate::model::arch::{self, Activation, Family, LayerSpec, Rope};
use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::TensorStore;
use crate::{Error, Result};

/// The fields of `config.json` Tandem reads.
#[derive(Deserialize)]
pub(super) struct HfConfig {
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

/// Hugging Face's `model_type` of each family.
fn model_type(family: &Family) -> &'static str {
    if family.is_gemma3() {
        "gemma3_text"
    } else {
        family.gguf
    }
}

/// Hugging Face's name of an activation.
fn activation_name(activation: Activation) -> &'static str {
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
        let head_dim = match self.head_dim {
            Some(d) => d,
            None => self
                .hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0),
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
        let query_scalar = match self.query_pre_attn_scalar {
            Some(s) if family.is_gemma3() => s,
            _ => head_dim as f32,
        };
        // Gemma3TextConfig ties embeddings unless told otherwise; the others do not.
        let tie = self.tie_word_embeddings.unwrap_or(family.is_gemma3());
        Ok(ModelConfig {
            arch: family.gguf.to_string(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
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
            attention_scale: 1.0 / query_scalar.sqrt(),
            layers,
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

/// `rope_scaling` as Hugging Face writes it, `None` without scaling.
fn rope_scaling_json(scaling: &RopeScaling) -> Result<Option<Value>> {
    Ok(match *scaling {
        RopeScaling::None => None,
        RopeScaling::FreqFactors(_) => {
            return Err(Error::Unsupported(
                "per-frequency RoPE factors (GGUF rope_freqs) have no Hugging Face configuration"
                    .into(),
            ))
        }
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
    })
}

/// `config.json` for `c`, in the form the directory loader reads.
pub fn hf_config_json(c: &ModelConfig) -> Result<Value> {
    let family = arch::by_gguf_name(&c.arch).ok_or_else(|| {
        Error::Unsupported(format!(
            "architecture '{}' has no Hugging Face configuration",
            c.arch
        ))
    })?;
    let global = c
        .global_rope()
        .ok_or_else(|| Error::InvalidRequest("a model without layers".into()))?;
    let mut config = serde_json::json!({
        "architectures": [family.hf],
        "model_type": model_type(family),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": global.theta,
        "max_position_embeddings": c.max_context,
        "tie_word_embeddings": c.tied_embeddings,
    });
    let activation_key = if family.is_gemma3() {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    config[activation_key] = activation_name(c.block.activation).into();
    if let Some(scaling) = rope_scaling_json(&global.scaling)? {
        config["rope_scaling"] = scaling;
    }
    if family.is_gemma3() {
        let window = c.sliding_window().unwrap_or(c.max_context);
        let local = c.layers.iter().find(|l| l.sliding_window.is_some());
        let types: Vec<&str> = c
            .layers
            .iter()
            .map(|l| match l.sliding_window {
                Some(_) => "sliding_attention",
                None => "full_attention",
            })
            .collect();
        config["sliding_window"] = window.into();
        config["layer_types"] = types.into();
        config["rope_local_base_freq"] = local.map_or(global.theta, |l| l.rope.theta).into();
        config["query_pre_attn_scalar"] = (1.0 / (c.attention_scale * c.attention_scale)).into();
    } else if let Some(window) = c.sliding_window() {
        config["sliding_window"] = window.into();
        config["use_sliding_window"] = true.into();
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": 4, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000,
                "max_position_embeddings": 256, "tie_word_embeddings": true{extra}}}"#
        )
    }

    fn parse(json: &str) -> Result<ModelConfig> {
        let hf: HfConfig = serde_json::from_str(json).unwrap();
        hf.to_model_config(&TensorStore::default(), Path::new("config.json"))
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
