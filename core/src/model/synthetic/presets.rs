//! The named shapes of [`SyntheticModel::preset`]: a tiny model of every
//! supported architecture for tests, and full-size shapes (Llama-3-8B,
//! Mixtral, OLMoE, ...) for benchmarks without downloaded weights.

#[cfg(doc)]
use super::SyntheticModel;
use crate::backend::RopeStyle;
use crate::model::arch::{self, BlockSpec, LayerSpec, Multipliers, Rope};
use crate::model::{ModelConfig, RopeScaling};

/// The names [`SyntheticModel::preset`] knows.
pub const PRESETS: [&str; 17] = [
    "tiny",
    "tiny-llama3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
    "smollm2-135m",
    "llama3-8b",
    "tiny-mixtral",
    "tiny-qwen2moe",
    "tiny-qwen3moe",
    "tiny-olmoe",
    "tiny-granitemoe",
    "olmoe-1b-7b",
    "olmoe-1b-7b-dense",
    "qwen1.5-moe-a2.7b",
    "mixtral-8x7b",
];

pub(super) fn preset_config(name: &str) -> Option<ModelConfig> {
    let rope = |theta: f32| Rope {
        theta,
        scaling: RopeScaling::None,
    };
    let tiny = ModelConfig {
        arch: "llama".into(),
        vocab_size: 320,
        hidden_size: 64,
        intermediate_size: 160,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rotary_dim: 16,
        rms_eps: 1e-5,
        rope_style: RopeStyle::Interleaved,
        max_context: 512,
        tied_embeddings: false,
        qkv_bias: false,
        block: BlockSpec::LLAMA,
        attention_scale: 0.25,
        layers: LayerSpec::uniform(2, None, rope(10000.0)),
        moe: None,
        multipliers: Multipliers::default(),
        output_tokens: None,
        reads_hidden: false,
    };
    // The tiny models of the other families: awkward head sizes (Q wider
    // than the hidden size), windows shorter than the test prompts.
    let family = |name: &str, layers: usize, head_dim: usize| {
        let family = arch::by_gguf_name(name).expect("a known family");
        ModelConfig {
            arch: name.into(),
            num_layers: layers,
            head_dim,
            rotary_dim: head_dim,
            rope_style: family.gguf_rope_style,
            qkv_bias: family.qkv_bias,
            block: family.block,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            layers: LayerSpec::uniform(layers, None, rope(10000.0)),
            ..tiny.clone()
        }
    };
    let config = match name {
        "tiny" => tiny,
        "tiny-llama3" => ModelConfig {
            layers: LayerSpec::uniform(
                3,
                None,
                Rope {
                    theta: 500000.0,
                    scaling: RopeScaling::Llama3 {
                        factor: 8.0,
                        low_freq_factor: 1.0,
                        high_freq_factor: 4.0,
                        original_max_position: 64,
                    },
                },
            ),
            ..family("llama", 3, 16)
        },
        "tiny-mistral" => ModelConfig {
            layers: LayerSpec::uniform(2, Some(5), rope(10000.0)),
            ..family("mistral", 2, 16)
        },
        "tiny-qwen2" => family("qwen2", 2, 16),
        "tiny-qwen3" => ModelConfig {
            tied_embeddings: true,
            ..family("qwen3", 3, 24)
        },
        "tiny-gemma3" => {
            let global = Rope {
                theta: 1_000_000.0,
                scaling: RopeScaling::Linear { factor: 2.0 },
            };
            ModelConfig {
                num_heads: 2,
                num_kv_heads: 1,
                rms_eps: 1e-6,
                tied_embeddings: true,
                layers: arch::gemma3_layers(
                    7,
                    5,
                    &global,
                    arch::GEMMA3_LOCAL_ROPE_THETA,
                    arch::gemma3_is_local,
                ),
                ..family("gemma3", 7, 48)
            }
        }
        "smollm2-135m" => ModelConfig {
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rotary_dim: 64,
            max_context: 8192,
            tied_embeddings: true,
            attention_scale: 0.125,
            layers: LayerSpec::uniform(30, None, rope(100000.0)),
            ..tiny
        },
        "llama3-8b" => ModelConfig {
            vocab_size: 128256,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rotary_dim: 128,
            max_context: 8192,
            attention_scale: 1.0 / 128f32.sqrt(),
            layers: LayerSpec::uniform(32, None, rope(500000.0)),
            ..tiny
        },
        _ => return super::moe::moe_preset(name, &tiny),
    };
    Some(config)
}
