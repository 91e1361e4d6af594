//! Hugging Face tensor names and the canonical (GGUF) names they map to.
//!
//! Most modules are named alike in every family; the norms are not. Llama's
//! layer has two (`input_layernorm` before attention, and
//! `post_attention_layernorm` before the FFN); Gemma 3's has four, and there
//! `post_attention_layernorm` is the norm *after* attention
//! (`post_attention_norm`), with `pre_feedforward_layernorm` before the FFN.
//! `post_norms` (the model's `BlockSpec::post_norms`) says which applies.

/// The canonical (GGUF) name of a Hugging Face tensor, or `None` for a
/// tensor the model does not use (such as a stored `rotary_emb.inv_freq`).
pub fn canonical_name(hf_name: &str, post_norms: bool) -> Option<String> {
    if let Some((_, canonical)) = HF_GLOBAL_NAMES.iter().find(|(hf, _)| *hf == hf_name) {
        return Some(canonical.to_string());
    }
    let (layer, rest) = hf_name.strip_prefix("model.layers.")?.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if let Some(canonical) = super::moe_names::canonical_moe_name(layer, rest) {
        return Some(canonical);
    }
    let (module, kind) = rest.rsplit_once('.')?;
    let (_, module) = layer_modules(post_norms).find(|(hf, _)| *hf == module)?;
    matches!(kind, "weight" | "bias").then(|| format!("blk.{layer}.{module}.{kind}"))
}

/// The Hugging Face name of a canonical tensor name (the inverse of [`canonical_name`]).
pub fn hf_name(canonical: &str, post_norms: bool) -> Option<String> {
    if let Some((hf, _)) = HF_GLOBAL_NAMES.iter().find(|(_, c)| *c == canonical) {
        return Some(hf.to_string());
    }
    let (layer, rest) = canonical.strip_prefix("blk.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let (hf, _) = layer_modules(post_norms).find(|(_, c)| *c == module)?;
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// `(Hugging Face module, canonical module)` inside each layer of a model
/// with or without post-norms.
fn layer_modules(post_norms: bool) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let norms: &[(&str, &str)] = if post_norms {
        &GEMMA_NORMS
    } else {
        &LLAMA_NORMS
    };
    norms.iter().chain(&HF_LAYER_MODULES)
}

/// `(Hugging Face name, canonical name)` of the tensors outside the layers.
const HF_GLOBAL_NAMES: [(&str, &str); 5] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    // Tandem's EAGLE heads (`ModelConfig::reads_hidden`).
    ("model.eagle_norm.weight", "eagle_norm.weight"),
    ("model.eagle_fc.weight", "eagle_fc.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// A Llama layer's norms: before attention, before the FFN.
const LLAMA_NORMS: [(&str, &str); 2] = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
];

/// A Gemma 3 layer's norms: before and after attention, before and after the FFN.
const GEMMA_NORMS: [(&str, &str); 4] = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];

/// `(Hugging Face module, canonical module)` inside each layer, norms apart.
const HF_LAYER_MODULES: [(&str, &str); 9] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

#[cfg(test)]
mod tests {
    use super::*;

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
            assert_eq!(canonical_name(hf, false).as_deref(), canonical, "{hf}");
            if let Some(canonical) = canonical {
                assert_eq!(hf_name(canonical, false).as_deref(), Some(hf));
            }
        }
        let gemma = [
            (
                "model.layers.2.post_attention_layernorm.weight",
                "blk.2.post_attention_norm.weight",
            ),
            (
                "model.layers.2.pre_feedforward_layernorm.weight",
                "blk.2.ffn_norm.weight",
            ),
            (
                "model.layers.0.post_feedforward_layernorm.weight",
                "blk.0.post_ffw_norm.weight",
            ),
            (
                "model.layers.7.self_attn.k_norm.weight",
                "blk.7.attn_k_norm.weight",
            ),
            (
                "model.layers.1.input_layernorm.weight",
                "blk.1.attn_norm.weight",
            ),
        ];
        for (hf, canonical) in gemma {
            assert_eq!(canonical_name(hf, true).as_deref(), Some(canonical), "{hf}");
            assert_eq!(hf_name(canonical, true).as_deref(), Some(hf));
        }
        // Llama has no pre-FFN norm of that name, Gemma no `ffn_norm` under Llama's.
        assert_eq!(
            canonical_name("model.layers.0.pre_feedforward_layernorm.weight", false),
            None
        );
        assert_eq!(
            canonical_name("model.layers.0.post_attention_layernorm.weight", true).as_deref(),
            Some("blk.0.post_attention_norm.weight")
        );
    }
}
