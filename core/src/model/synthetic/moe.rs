//! The tiny random Mixture-of-Experts models of every MoE family, the
//! published MoE shapes, and their GGUF metadata.

use crate::model::arch::{self, LayerSpec, MoeSpec, Multipliers, Rope};
use crate::model::config::RopeScaling;
use crate::model::gguf::GgufValue;
use crate::model::ModelConfig;

/// The configuration of a MoE preset, from `dense` (the family's tiny
/// dense shape: attention sizes, vocabulary) or `None` for another name.
pub fn moe_preset(name: &str, tiny: &ModelConfig) -> Option<ModelConfig> {
    if let Some(real) = real_moe_shape(name) {
        return Some(real);
    }
    let (gguf, experts, k, shared_ffn) = match name {
        "tiny-mixtral" => ("llama", 4, 2, None),
        // An odd expert count and a shared expert wider than the routed ones.
        "tiny-qwen2moe" => ("qwen2moe", 5, 2, Some(128)),
        "tiny-qwen3moe" => ("qwen3moe", 6, 3, None),
        "tiny-olmoe" => ("olmoe", 8, 2, None),
        "tiny-granitemoe" => ("granitemoe", 4, 2, None),
        _ => return None,
    };
    let family = arch::by_gguf_name_moe(gguf, true)?;
    let head_dim = if family.block.qk_norm { 24 } else { 16 };
    let multipliers = match gguf {
        "granitemoe" => Multipliers {
            embedding: Some(4.0),
            residual: Some(0.5),
            logits: Some(2.0),
        },
        _ => Multipliers::default(),
    };
    Some(ModelConfig {
        arch: gguf.into(),
        intermediate_size: 64,
        num_layers: 2,
        head_dim,
        rotary_dim: head_dim,
        rope_style: family.gguf_rope_style,
        qkv_bias: family.qkv_bias,
        block: family.block,
        attention_scale: match gguf {
            "granitemoe" => 0.2,
            _ => 1.0 / (head_dim as f32).sqrt(),
        },
        moe: Some(MoeSpec {
            experts,
            experts_per_token: k,
            normalize_weights: family.moe_routing.is_some_and(|r| r.gguf_normalize),
            shared_ffn,
            group_rows: true,
        }),
        multipliers,
        ..tiny.clone()
    })
}

/// The shapes of published MoE checkpoints, at full depth, from their
/// `config.json`: `olmoe-1b-7b` (allenai/OLMoE-1B-7B-0924),
/// `qwen1.5-moe-a2.7b` (Qwen/Qwen1.5-MoE-A2.7B), `mixtral-8x7b`
/// (mistralai/Mixtral-8x7B-v0.1); and `olmoe-1b-7b-dense`, OLMoE's
/// attention with one dense FFN as wide as its 8 active experts together
/// (the same active parameters but the router), to benchmark against.
fn real_moe_shape(name: &str) -> Option<ModelConfig> {
    // (arch, hidden, expert width, layers, heads, KV heads, vocab, context,
    //  RoPE theta, RMS eps, experts, per token, shared expert width)
    let (
        gguf,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        vocab,
        context,
        theta,
        eps,
        experts,
        k,
        shared,
    ) = match name {
        "olmoe-1b-7b" | "olmoe-1b-7b-dense" => (
            "olmoe", 2048, 1024, 16, 16, 16, 50304, 4096, 10_000.0, 1e-5, 64, 8, None,
        ),
        "qwen1.5-moe-a2.7b" => (
            "qwen2moe",
            2048,
            1408,
            24,
            16,
            16,
            151936,
            8192,
            1e6,
            1e-6,
            60,
            4,
            Some(5632),
        ),
        "mixtral-8x7b" => (
            "llama", 4096, 14336, 32, 32, 8, 32000, 32768, 1e6, 1e-5, 8, 2, None,
        ),
        _ => return None,
    };
    let family = arch::by_gguf_name_moe(gguf, true)?;
    let head_dim = hidden / heads;
    let moe = MoeSpec {
        experts,
        experts_per_token: k,
        normalize_weights: family.moe_routing.is_some_and(|r| r.gguf_normalize),
        shared_ffn: shared,
        group_rows: true,
    };
    let dense = name.ends_with("-dense");
    Some(ModelConfig {
        arch: gguf.into(),
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: if dense { k * ffn } else { ffn },
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rotary_dim: head_dim,
        rms_eps: eps,
        rope_style: family.gguf_rope_style,
        max_context: context,
        tied_embeddings: false,
        qkv_bias: family.qkv_bias,
        block: family.block,
        attention_scale: 1.0 / (head_dim as f32).sqrt(),
        layers: LayerSpec::uniform(
            layers,
            None,
            Rope {
                theta,
                scaling: RopeScaling::None,
            },
        ),
        moe: (!dense).then_some(moe),
        multipliers: Multipliers::default(),
        output_tokens: None,
        reads_hidden: false,
    })
}

/// The `{arch}.*` keys of `c`'s experts and Granite factors, as llama.cpp's
/// converter writes them.
pub fn moe_gguf_metadata(c: &ModelConfig) -> Vec<(String, GgufValue)> {
    let key = |k: &str| format!("{}.{k}", c.arch);
    let u = |v: usize| GgufValue::U32(v as u32);
    let mut m = Vec::new();
    if let Some(moe) = &c.moe {
        m.extend([
            (key("expert_count"), u(moe.experts)),
            (key("expert_used_count"), u(moe.experts_per_token)),
            (key("expert_feed_forward_length"), u(c.intermediate_size)),
        ]);
        if let Some(width) = moe.shared_ffn {
            m.push((key("expert_shared_feed_forward_length"), u(width)));
        }
        if Some(moe.normalize_weights)
            != arch::by_gguf_name_moe(&c.arch, true)
                .and_then(|f| f.moe_routing)
                .map(|r| r.gguf_normalize)
        {
            m.push((
                key("expert_weights_norm"),
                GgufValue::Bool(moe.normalize_weights),
            ));
        }
    }
    let factors = [
        ("embedding_scale", c.multipliers.embedding),
        ("residual_scale", c.multipliers.residual),
        ("logit_scale", c.multipliers.logits),
    ];
    for (name, factor) in factors {
        if let Some(f) = factor {
            m.push((key(name), GgufValue::F32(f)));
        }
    }
    if c.arch == "granitemoe" {
        m.push((key("attention.scale"), GgufValue::F32(c.attention_scale)));
    }
    m
}
