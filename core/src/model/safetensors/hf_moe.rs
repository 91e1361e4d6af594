//! The Mixture-of-Experts and Granite fields of `config.json`, read into a
//! [`MoeSpec`] and [`Multipliers`], and written back.
//!
//! Each family names its counts its own way (Hugging Face configuration
//! classes): Mixtral and Granite-MoE `num_local_experts`, the others
//! `num_experts`; all `num_experts_per_tok`. Each expert's width is
//! `moe_intermediate_size` (Qwen2-MoE, Qwen3-MoE) or `intermediate_size`
//! (Mixtral, OLMoE, Granite-MoE). Qwen2-MoE's shared expert is
//! `shared_expert_intermediate_size` wide.

// Read only by the directory loader, which the browser lacks.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use serde_json::Value;

use super::json_fields::Fields;
use crate::model::arch::{Family, MoeSpec, Multipliers};
use crate::model::ModelConfig;
use crate::{Error, Result};

/// The MoE and Granite fields Tandem reads.
#[derive(Default)]
pub(super) struct HfMoe {
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    /// Qwen MoE: every n-th layer is sparse; Tandem runs 1 only.
    decoder_sparse_step: Option<usize>,
    /// Qwen MoE: layers with a dense FFN; Tandem runs none.
    mlp_only_layers: Option<Vec<usize>>,
    embedding_multiplier: Option<f32>,
    residual_multiplier: Option<f32>,
    attention_multiplier: Option<f32>,
    logits_scaling: Option<f32>,
}

impl HfMoe {
    pub(super) fn read(f: &Fields) -> Result<Self> {
        Ok(Self {
            num_local_experts: f.optional_size("num_local_experts")?,
            num_experts: f.optional_size("num_experts")?,
            num_experts_per_tok: f.optional_size("num_experts_per_tok")?,
            moe_intermediate_size: f.optional_size("moe_intermediate_size")?,
            shared_expert_intermediate_size: f.optional_size("shared_expert_intermediate_size")?,
            norm_topk_prob: f.flag("norm_topk_prob")?,
            decoder_sparse_step: f.optional_size("decoder_sparse_step")?,
            mlp_only_layers: f.optional("mlp_only_layers", "a list of layer numbers")?,
            embedding_multiplier: f.positive("embedding_multiplier")?,
            residual_multiplier: f.positive("residual_multiplier")?,
            attention_multiplier: f.positive("attention_multiplier")?,
            logits_scaling: f.positive("logits_scaling")?,
        })
    }

    /// The experts of `family` (`None` for a dense family) and the width of
    /// each expert in place of `intermediate_size` where the family has one.
    pub(super) fn spec(
        &self,
        family: &Family,
        path: &std::path::Path,
    ) -> Result<(Option<MoeSpec>, Option<usize>)> {
        let Some(routing) = family.moe_routing else {
            return Ok((None, None));
        };
        let bad = |m: String| Err(Error::bad_file(path, m));
        let (experts_key, experts) = match (self.num_local_experts, self.num_experts) {
            (Some(n), _) => ("num_local_experts", n),
            (None, Some(n)) => ("num_experts", n),
            (None, None) => {
                return bad(format!(
                    "{} config without 'num_experts' or 'num_local_experts'",
                    family.hf
                ))
            }
        };
        let Some(used) = self.num_experts_per_tok else {
            return bad("missing 'num_experts_per_tok'".into());
        };
        if self.decoder_sparse_step.is_some_and(|step| step != 1) {
            return Err(Error::Unsupported(format!(
                "{}: 'decoder_sparse_step' {:?} (Tandem runs MoE models whose every layer is sparse)",
                path.display(),
                self.decoder_sparse_step
            )));
        }
        if self.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty()) {
            return Err(Error::Unsupported(format!(
                "{}: 'mlp_only_layers' {:?} (Tandem runs MoE models whose every layer is sparse)",
                path.display(),
                self.mlp_only_layers
            )));
        }
        let spec = MoeSpec {
            experts,
            experts_per_token: used,
            normalize_weights: match routing.hf_norm_topk_prob {
                Some(default) => self.norm_topk_prob.unwrap_or(default),
                None => true,
            },
            shared_ffn: self.shared_expert_intermediate_size,
            group_rows: true,
        };
        if let Err(e) = spec.validate() {
            return bad(format!(
                "'{experts_key}' {experts} and 'num_experts_per_tok' {used}: {e}"
            ));
        }
        Ok((Some(spec), self.moe_intermediate_size))
    }

    /// Granite's factors.
    pub(super) fn multipliers(&self) -> Multipliers {
        Multipliers {
            embedding: self.embedding_multiplier,
            residual: self.residual_multiplier,
            logits: self.logits_scaling,
        }
    }

    /// Granite's attention scale, replacing `1/sqrt(head_dim)`.
    pub(super) fn attention_multiplier(&self) -> Option<f32> {
        self.attention_multiplier
    }
}

/// Adds `c`'s MoE and Granite fields to its `config.json`, in the form
/// [`HfMoe::read`] reads for its family.
pub(super) fn write_moe_fields(c: &ModelConfig, family: &Family, config: &mut Value) {
    if let Some(moe) = &c.moe {
        let experts_key = match family.hf {
            "MixtralForCausalLM" | "GraniteMoeForCausalLM" => "num_local_experts",
            _ => "num_experts",
        };
        config[experts_key] = moe.experts.into();
        config["num_experts_per_tok"] = moe.experts_per_token.into();
        if family
            .moe_routing
            .is_some_and(|r| r.hf_norm_topk_prob.is_some())
        {
            config["norm_topk_prob"] = moe.normalize_weights.into();
        }
        if matches!(family.gguf, "qwen2moe" | "qwen3moe") {
            config["moe_intermediate_size"] = c.intermediate_size.into();
            config["decoder_sparse_step"] = 1.into();
            config["mlp_only_layers"] = Value::Array(Vec::new());
        }
        if let Some(width) = moe.shared_ffn {
            config["shared_expert_intermediate_size"] = width.into();
        }
    }
    let m = &c.multipliers;
    let factors = [
        ("embedding_multiplier", m.embedding),
        ("residual_multiplier", m.residual),
        ("logits_scaling", m.logits),
    ];
    for (key, factor) in factors {
        if let Some(f) = factor {
            config[key] = f.into();
        }
    }
    if family.gguf == "granitemoe" {
        config["attention_multiplier"] = c.attention_scale.into();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::model::safetensors::hf_config::HfConfig;
    use crate::model::TensorStore;

    /// Whether a config.json of `class` with the fields `extra` renormalises.
    fn normalizes(class: &str, extra: &str) -> bool {
        let json = format!(
            r#"{{"architectures": ["{class}"], "vocab_size": 4, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000,
                "max_position_embeddings": 256, "tie_word_embeddings": true,
                "num_experts_per_tok": 2{extra}}}"#
        );
        let path = Path::new("config.json");
        let config = HfConfig::from_json(&json, path)
            .and_then(|c| c.to_model_config(&TensorStore::default(), path))
            .unwrap();
        config.moe.unwrap().normalize_weights
    }

    #[test]
    fn each_family_renormalises_as_its_reference_does() {
        let experts = r#", "num_experts": 8"#;
        for class in [
            "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM",
            "OlmoeForCausalLM",
        ] {
            assert!(!normalizes(class, experts), "{class}: default");
            let asked = format!(r#"{experts}, "norm_topk_prob": true"#);
            assert!(normalizes(class, &asked), "{class}: norm_topk_prob");
        }
        // Mixtral and Granite-MoE renormalise whatever the config says.
        let local = r#", "num_local_experts": 8, "norm_topk_prob": false"#;
        for class in ["MixtralForCausalLM", "GraniteMoeForCausalLM"] {
            assert!(normalizes(class, local), "{class}");
        }
    }
}
