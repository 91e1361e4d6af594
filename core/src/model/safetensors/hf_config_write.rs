//! Writing `config.json` back from a [`ModelConfig`], in the form
//! [`hf_config`](super::hf_config) reads it: what `tandem quantize`, the
//! synthetic model directories and `tandem-distill` ship beside their
//! weights, so that Tandem and Hugging Face's loaders read them alike.

use serde_json::Value;

use super::hf_config::{activation_name, OUTPUT_TOKENS_KEY, READS_HIDDEN_KEY};
use super::hf_moe::write_moe_fields;

use crate::model::arch::{self, Family};
use crate::model::config::{ModelConfig, RopeScaling};
use crate::{Error, Result};

/// Hugging Face's `model_type` of each family.
fn model_type(family: &Family) -> &'static str {
    match family.hf {
        "Gemma3ForCausalLM" => "gemma3_text",
        "MixtralForCausalLM" => "mixtral",
        "Qwen2MoeForCausalLM" => "qwen2_moe",
        "Qwen3MoeForCausalLM" => "qwen3_moe",
        _ => family.gguf,
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
    let family = arch::by_gguf_name_moe(&c.arch, c.moe.is_some()).ok_or_else(|| {
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
    write_moe_fields(c, family, &mut config);
    if let Some(tokens) = &c.output_tokens {
        config[OUTPUT_TOKENS_KEY] = tokens.as_slice().into();
    }
    if c.reads_hidden {
        config[READS_HIDDEN_KEY] = true.into();
    }
    Ok(config)
}
