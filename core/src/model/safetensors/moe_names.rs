//! Hugging Face names of Mixture-of-Experts tensors, per family, and the
//! canonical (llama.cpp) names they map to.
//!
//! Mixtral: `block_sparse_moe.gate` (router), `block_sparse_moe.experts.E.w1`
//! (gate), `w3` (up), `w2` (down). Qwen2-MoE, Qwen3-MoE, OLMoE: `mlp.gate`,
//! `mlp.experts.E.{gate,up,down}_proj`; Qwen2-MoE's shared expert
//! `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate`.
//! Granite-MoE stacks its experts: `block_sparse_moe.router.layer` (router),
//! `block_sparse_moe.input_linear` (`[experts, 2·ffn, hidden]`: each
//! expert's gate rows, then its up rows, Hugging Face `GraniteMoeMoE`
//! chunks them in that order) and `block_sparse_moe.output_linear`
//! (`[experts, hidden, ffn]`, llama.cpp's `ffn_down_exps` as it is).

use crate::model::experts::ExpertMatrix;

/// Granite's stacked gate and up matrices, under a canonical name until
/// the loader splits them per expert.
pub const GATE_UP_EXPS: &str = "ffn_gate_up_exps";

/// The canonical name of a MoE tensor of a layer, `rest` its Hugging Face
/// name after `model.layers.N.`.
pub fn canonical_moe_name(layer: &str, rest: &str) -> Option<String> {
    let fixed = [
        ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
        ("mlp.gate.weight", "ffn_gate_inp.weight"),
        (
            "block_sparse_moe.router.layer.weight",
            "ffn_gate_inp.weight",
        ),
        ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
        (
            "mlp.shared_expert.gate_proj.weight",
            "ffn_gate_shexp.weight",
        ),
        ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
        (
            "mlp.shared_expert.down_proj.weight",
            "ffn_down_shexp.weight",
        ),
        (
            "block_sparse_moe.input_linear.weight",
            "ffn_gate_up_exps.weight",
        ),
        (
            "block_sparse_moe.output_linear.weight",
            "ffn_down_exps.weight",
        ),
    ];
    if let Some((_, canonical)) = fixed.iter().find(|(hf, _)| *hf == rest) {
        return Some(format!("blk.{layer}.{canonical}"));
    }
    let experts = rest
        .strip_prefix("block_sparse_moe.experts.")
        .or_else(|| rest.strip_prefix("mlp.experts."))?;
    let (expert, module) = experts.split_once('.')?;
    if expert.is_empty() || !expert.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let stem = match module {
        "w1.weight" | "gate_proj.weight" => "ffn_gate",
        "w3.weight" | "up_proj.weight" => "ffn_up",
        "w2.weight" | "down_proj.weight" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{stem}.{expert}.weight"))
}

/// The Hugging Face name of expert `expert`'s matrix `m` in layer `layer`
/// of the family `hf_class` (Mixtral or the `mlp.experts` families).
pub fn hf_expert_name(hf_class: &str, layer: usize, m: ExpertMatrix, expert: usize) -> String {
    let module = match (hf_class, m) {
        ("MixtralForCausalLM", ExpertMatrix::Gate) => "block_sparse_moe.experts.{e}.w1",
        ("MixtralForCausalLM", ExpertMatrix::Up) => "block_sparse_moe.experts.{e}.w3",
        ("MixtralForCausalLM", ExpertMatrix::Down) => "block_sparse_moe.experts.{e}.w2",
        (_, ExpertMatrix::Gate) => "mlp.experts.{e}.gate_proj",
        (_, ExpertMatrix::Up) => "mlp.experts.{e}.up_proj",
        (_, ExpertMatrix::Down) => "mlp.experts.{e}.down_proj",
    };
    format!(
        "model.layers.{layer}.{}.weight",
        module.replace("{e}", &expert.to_string())
    )
}

/// The Hugging Face name of a layer's router, shared expert or shared gate
/// (`canonical_module` as in `blk.N.<canonical_module>.weight`), for `hf_class`.
pub fn hf_moe_module_name(hf_class: &str, layer: usize, canonical_module: &str) -> Option<String> {
    let module = match (hf_class, canonical_module) {
        ("MixtralForCausalLM", "ffn_gate_inp") => "block_sparse_moe.gate",
        ("GraniteMoeForCausalLM", "ffn_gate_inp") => "block_sparse_moe.router.layer",
        ("GraniteMoeForCausalLM", "ffn_gate_up_exps") => "block_sparse_moe.input_linear",
        ("GraniteMoeForCausalLM", "ffn_down_exps") => "block_sparse_moe.output_linear",
        (_, "ffn_gate_inp") => "mlp.gate",
        (_, "ffn_gate_inp_shexp") => "mlp.shared_expert_gate",
        (_, "ffn_gate_shexp") => "mlp.shared_expert.gate_proj",
        (_, "ffn_up_shexp") => "mlp.shared_expert.up_proj",
        (_, "ffn_down_shexp") => "mlp.shared_expert.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}.weight"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_s_expert_names_map_both_ways() {
        for class in [
            "MixtralForCausalLM",
            "Qwen2MoeForCausalLM",
            "OlmoeForCausalLM",
        ] {
            for m in ExpertMatrix::ALL {
                let hf = hf_expert_name(class, 3, m, 12);
                let rest = hf.strip_prefix("model.layers.3.").unwrap();
                assert_eq!(
                    canonical_moe_name("3", rest),
                    Some(m.per_expert_name(3, 12))
                );
            }
            let router = hf_moe_module_name(class, 1, "ffn_gate_inp").unwrap();
            let rest = router.strip_prefix("model.layers.1.").unwrap();
            assert_eq!(
                canonical_moe_name("1", rest).as_deref(),
                Some("blk.1.ffn_gate_inp.weight")
            );
        }
        assert_eq!(canonical_moe_name("0", "mlp.experts.x.w1.weight"), None);
        assert_eq!(canonical_moe_name("0", "mlp.experts.1.w4.weight"), None);
    }
}
