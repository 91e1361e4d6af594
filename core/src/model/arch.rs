//! Architectures as data: what a model family's layers do beyond the sizes
//! in [`ModelConfig`](super::ModelConfig), so that one forward pass runs
//! them all.
//!
//! [`FAMILIES`] names every architecture Tandem runs, under its GGUF
//! `general.architecture` and its Hugging Face class, with the wiring both
//! loaders give it ([`BlockSpec`]). What varies from layer to layer (the
//! attention window and the RoPE frequencies) is a [`LayerSpec`] per layer.
//!
//! The one layer, with the optional parts in brackets:
//!
//! ```text
//! x = attn_norm(h)
//! q, k, v = x·Wq [+ bq], x·Wk [+ bk], x·Wv [+ bv]
//! [q, k = attn_q_norm(q), attn_k_norm(k)]      per head, over head_dim
//! q, k = rope(q), rope(k)                      this layer's frequencies
//! a = attention(q, k, v)                       global or sliding window
//! o = a·Wo;  [o = post_attention_norm(o)]
//! h = h + o
//! x = ffn_norm(h)
//! f = (act(x·Wgate) * x·Wup)·Wdown;  [f = post_ffw_norm(f)]
//! h = h + f
//! ```
//!
//! with `h` starting as the token's embedding row [times `sqrt(hidden_size)`].
//!
//! A Mixture-of-Experts model ([`MoeSpec`]) replaces the one FFN by
//! `experts` FFNs of the same shape and a router: each row goes through the
//! `experts_per_token` experts its router scores highest, their outputs
//! weighted by the routing weights, [plus a shared expert gated by
//! `sigmoid(x·Wgate_shexp)`]. Granite's [`Multipliers`] scale the
//! embedding, each residual branch and the logits.

use super::config::{inv_freq, RopeScaling};
use crate::backend::RopeStyle;

/// The activation of the feed-forward gate: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Mistral, Qwen.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma (Hugging Face's
    /// `gelu_pytorch_tanh`, llama.cpp's `LLM_FFN_GELU`).
    GeluTanh,
}

/// How every layer of a model is wired, beyond Llama's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSpec {
    /// Per-head RMSNorm of Q and K before RoPE (`attn_q_norm`, `attn_k_norm`
    /// of `[head_dim]`): Qwen3, Gemma 3.
    pub qk_norm: bool,
    /// The Q/K norms span all heads (`[heads * head_dim]` weights, one RMS
    /// over the whole projection) instead of one head: OLMoE (Hugging Face
    /// `OlmoeAttention` norms `q_proj(x)` before splitting heads).
    pub qk_norm_whole: bool,
    /// RMSNorm of the attention output and of the FFN output before each
    /// residual add (`post_attention_norm`, `post_ffw_norm`): Gemma 3.
    pub post_norms: bool,
    pub activation: Activation,
    /// Embedding rows are multiplied by `sqrt(hidden_size)`: Gemma.
    pub scaled_embedding: bool,
}

impl BlockSpec {
    /// The plain Llama layer.
    pub const LLAMA: BlockSpec = BlockSpec {
        qk_norm: false,
        qk_norm_whole: false,
        post_norms: false,
        activation: Activation::Silu,
        scaled_embedding: false,
    };
}

/// RoPE frequencies: base and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

impl Rope {
    /// `rotary_dim / 2` inverse frequencies, scaling applied.
    pub fn inv_freq(&self, rotary_dim: usize) -> Vec<f32> {
        inv_freq(self.theta, &self.scaling, rotary_dim)
    }
}

/// The routed feed-forward of a Mixture-of-Experts model. Every expert is
/// a SwiGLU FFN of width `ModelConfig::intermediate_size`.
///
/// Routing, per row, as every supported family defines it: softmax over the
/// `experts` router logits, the `experts_per_token` largest kept (ties to
/// the lower index) and, where `normalize_weights`, divided by their sum.
/// Hugging Face: `MixtralSparseMoeBlock` (always renormalised),
/// `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`, `OlmoeSparseMoeBlock`
/// (renormalised when `norm_topk_prob`), `GraniteMoeTopKGating` (softmax of
/// the top-k logits: the same as renormalising); llama.cpp `build_moe_ffn`
/// with `norm_w`. Which family does which: [`MoeRouting`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    pub experts: usize,
    pub experts_per_token: usize,
    pub normalize_weights: bool,
    /// Width of the shared expert, which every row goes through, its output
    /// scaled by `sigmoid(x·ffn_gate_inp_shexp)` (Hugging Face
    /// `Qwen2MoeSparseMoeBlock.shared_expert_gate`); `None` without one.
    pub shared_ffn: Option<usize>,
    /// How the routed rows go through an expert: all of them in one call,
    /// each expert's matrices read once per step (`true`, what every loader
    /// sets), or one row per call (`false`: the baseline `tandem bench
    /// --ungrouped-experts` measures grouping against). Not in any file.
    pub group_rows: bool,
}

/// Most experts a row may be routed to: the routing kernels keep the chosen
/// experts in a fixed array of this size.
pub const MAX_EXPERTS_PER_TOKEN: usize = 16;
/// Most experts a layer may have.
pub const MAX_EXPERTS: usize = 1024;

impl MoeSpec {
    /// Checks the counts: at least one expert per token, no more than there
    /// are experts, within the kernels' limits.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |m: String| Err(crate::Error::Unsupported(m));
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad(format!(
                "expert count {} is out of range (1..={MAX_EXPERTS})",
                self.experts
            ));
        }
        let k = self.experts_per_token;
        if k == 0 || k > self.experts || k > MAX_EXPERTS_PER_TOKEN {
            return bad(format!(
                "experts per token {k} is out of range (1..={}: at most the {} experts \
                 and at most {MAX_EXPERTS_PER_TOKEN})",
                self.experts.min(MAX_EXPERTS_PER_TOKEN),
                self.experts
            ));
        }
        if self.shared_ffn == Some(0) {
            return bad("shared expert width 0".into());
        }
        Ok(())
    }

    /// Routing slots per row: the routed experts, then the shared one.
    pub fn slots(&self) -> usize {
        self.experts_per_token + usize::from(self.shared_ffn.is_some())
    }

    /// Router outputs per row: one logit per expert, then the shared
    /// expert's gate.
    pub fn router_width(&self) -> usize {
        self.experts + usize::from(self.shared_ffn.is_some())
    }
}

/// Granite's scaling factors (Hugging Face `GraniteMoeConfig`
/// `embedding_multiplier`, `residual_multiplier`, `logits_scaling`; GGUF
/// `{arch}.embedding_scale`, `residual_scale`, `logit_scale`). Its
/// `attention_multiplier` is the attention scale. `None`: factor 1.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Multipliers {
    /// Embedding rows are multiplied by it.
    pub embedding: Option<f32>,
    /// Each attention and FFN output is multiplied by it before the residual add.
    pub residual: Option<f32>,
    /// Logits are divided by it.
    pub logits: Option<f32>,
}

/// What one layer does that another may not.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// `None`: the layer attends to the whole prefix; `Some(w)`: to the
    /// last `w` positions (a local, sliding-window layer).
    pub sliding_window: Option<usize>,
    pub rope: Rope,
}

impl LayerSpec {
    /// `n` layers alike: a model without per-layer variation.
    pub fn uniform(n: usize, sliding_window: Option<usize>, rope: Rope) -> Vec<LayerSpec> {
        vec![
            LayerSpec {
                sliding_window,
                rope
            };
            n
        ]
    }
}

/// A model family Tandem runs.
#[derive(Debug)]
pub struct Family {
    /// GGUF `general.architecture`, and the prefix of its keys.
    pub gguf: &'static str,
    /// Hugging Face `architectures[0]`.
    pub hf: &'static str,
    /// RoPE pairing in GGUF files: llama.cpp's converter permutes Q/K rows
    /// of `llama` models for adjacent pairs; the others it leaves in
    /// Hugging Face order (llama.cpp's `LLAMA_ROPE_TYPE_NEOX`).
    pub gguf_rope_style: RopeStyle,
    /// Q, K and V projections have biases (Qwen2); other families may have
    /// them too, which the tensors then show.
    pub qkv_bias: bool,
    pub block: BlockSpec,
    /// Hugging Face norm weights are offsets from 1 (Gemma's RMSNorm computes
    /// `x * (1 + w)`); llama.cpp's converter adds the 1, and so does the
    /// safetensors loader, so a model holds the GGUF convention.
    pub hf_norm_offset: bool,
    /// `Some` for a Mixture-of-Experts family: whether it renormalises its
    /// top-k routing weights.
    pub moe_routing: Option<MoeRouting>,
}

/// Whether a MoE family renormalises the top-k routing weights, as its
/// reference implementations decide it. Each one softmaxes the router
/// logits over all experts and keeps the k largest; they differ only here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeRouting {
    /// llama.cpp's `norm_w` argument to `build_moe_ffn` (llama-graph.cpp)
    /// in the architecture's graph (`src/models/{arch}.cpp`): fixed per
    /// architecture, not read from the file.
    pub gguf_normalize: bool,
    /// Hugging Face: `Some(default)` where the sparse-MoE block reads
    /// `config.norm_topk_prob` (the configuration class's default);
    /// `None` where it always renormalises, whatever the config says.
    pub hf_norm_topk_prob: Option<bool>,
}

impl MoeRouting {
    /// Always renormalised: Mixtral, Granite-MoE.
    const ALWAYS: MoeRouting = MoeRouting {
        gguf_normalize: true,
        hf_norm_topk_prob: None,
    };

    /// Renormalised in GGUF files when `gguf_normalize`; in Hugging Face
    /// ones when `norm_topk_prob` (default false) says so.
    const fn config(gguf_normalize: bool) -> MoeRouting {
        MoeRouting {
            gguf_normalize,
            hf_norm_topk_prob: Some(false),
        }
    }
}

impl Family {
    /// Gemma 3: local and global attention layers interleaved.
    pub fn is_gemma3(&self) -> bool {
        self.gguf == "gemma3"
    }
}

/// Gemma 3's layer pattern: five local (sliding-window) layers, then one
/// global layer (llama.cpp `hparams.set_swa_pattern(6)`; Hugging Face
/// `sliding_window_pattern = 6`, layer `i` local unless `(i + 1) % 6 == 0`).
pub const GEMMA3_PATTERN: usize = 6;
/// Gemma 3's RoPE base on local layers, unscaled: llama.cpp hard-codes
/// `rope_freq_base_train_swa = 10000` for gemma3 (Hugging Face
/// `rope_local_base_freq`, default 10000).
pub const GEMMA3_LOCAL_ROPE_THETA: f32 = 10000.0;

/// Every family, by both names.
pub const FAMILIES: &[Family] = &[
    Family {
        gguf: "llama",
        hf: "LlamaForCausalLM",
        gguf_rope_style: RopeStyle::Interleaved,
        qkv_bias: false,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        moe_routing: None,
    },
    Family {
        gguf: "mistral",
        hf: "MistralForCausalLM",
        gguf_rope_style: RopeStyle::Interleaved,
        qkv_bias: false,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        moe_routing: None,
    },
    Family {
        gguf: "qwen2",
        hf: "Qwen2ForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: true,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        moe_routing: None,
    },
    Family {
        gguf: "qwen3",
        hf: "Qwen3ForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: false,
        block: BlockSpec {
            qk_norm: true,
            ..BlockSpec::LLAMA
        },
        hf_norm_offset: false,
        moe_routing: None,
    },
    Family {
        gguf: "gemma3",
        hf: "Gemma3ForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: false,
        block: BlockSpec {
            qk_norm: true,
            qk_norm_whole: false,
            post_norms: true,
            activation: Activation::GeluTanh,
            scaled_embedding: true,
        },
        hf_norm_offset: true,
        moe_routing: None,
    },
    // Mixtral is a `llama` GGUF with experts. Always renormalised:
    // llama.cpp src/models/llama.cpp `graph` (`build_moe_ffn` with
    // norm_w = true); transformers modeling_mixtral.py
    // `MixtralSparseMoeBlock.forward` divides the top k by their sum
    // unconditionally.
    Family {
        gguf: "llama",
        hf: "MixtralForCausalLM",
        gguf_rope_style: RopeStyle::Interleaved,
        qkv_bias: false,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        moe_routing: Some(MoeRouting::ALWAYS),
    },
    Family {
        gguf: "qwen2moe",
        hf: "Qwen2MoeForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: true,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        // llama.cpp src/models/qwen2moe.cpp: norm_w = false; transformers
        // modeling_qwen2_moe.py `Qwen2MoeSparseMoeBlock.forward`: only
        // when `norm_topk_prob` (`Qwen2MoeConfig` default false).
        moe_routing: Some(MoeRouting::config(false)),
    },
    Family {
        gguf: "qwen3moe",
        hf: "Qwen3MoeForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: false,
        block: BlockSpec {
            qk_norm: true,
            ..BlockSpec::LLAMA
        },
        hf_norm_offset: false,
        // llama.cpp src/models/qwen3moe.cpp: norm_w = true; transformers
        // modeling_qwen3_moe.py `Qwen3MoeSparseMoeBlock.forward`: only when
        // `norm_topk_prob`, whose `Qwen3MoeConfig` default is false (the
        // published checkpoints set it true).
        moe_routing: Some(MoeRouting::config(true)),
    },
    Family {
        gguf: "olmoe",
        hf: "OlmoeForCausalLM",
        gguf_rope_style: RopeStyle::NeoX,
        qkv_bias: false,
        block: BlockSpec {
            qk_norm: true,
            qk_norm_whole: true,
            ..BlockSpec::LLAMA
        },
        hf_norm_offset: false,
        // llama.cpp src/models/olmoe.cpp: norm_w = false; transformers
        // modeling_olmoe.py `OlmoeSparseMoeBlock.forward`: only when
        // `norm_topk_prob` (`OlmoeConfig` default false).
        moe_routing: Some(MoeRouting::config(false)),
    },
    // llama.cpp converts Granite like Llama: Q/K rows permuted.
    Family {
        gguf: "granitemoe",
        hf: "GraniteMoeForCausalLM",
        gguf_rope_style: RopeStyle::Interleaved,
        qkv_bias: false,
        block: BlockSpec::LLAMA,
        hf_norm_offset: false,
        // llama.cpp src/models/granite.cpp `build_layer_ffn`: norm_w = true;
        // transformers modeling_granitemoe.py `GraniteMoeTopKGating.forward`
        // softmaxes the top-k logits alone, which equals renormalising the
        // top k of the full softmax.
        moe_routing: Some(MoeRouting::ALWAYS),
    },
];

/// The family of a GGUF `general.architecture` (the dense one where a name
/// has both, as `llama` has Mixtral).
pub fn by_gguf_name(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.gguf == name)
}

/// The family of a GGUF `general.architecture` with or without experts.
pub fn by_gguf_name_moe(name: &str, moe: bool) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .find(|f| f.gguf == name && f.moe_routing.is_some() == moe)
        .or_else(|| by_gguf_name(name))
}

/// The family of a Hugging Face `architectures[0]`.
pub fn by_hf_class(class: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.hf == class)
}

/// `a, b and c`: the names of every family, for error messages.
pub fn known_names(name: impl Fn(&Family) -> &'static str) -> String {
    let mut names: Vec<&str> = Vec::new();
    for n in FAMILIES.iter().map(name) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let (last, rest) = names.split_last().expect("FAMILIES is not empty");
    format!("{} and {last}", rest.join(", "))
}

/// Gemma 3's layers: local layers (window `window`, base 10000, no
/// scaling) and every [`GEMMA3_PATTERN`]th layer global (`global` RoPE),
/// unless `is_local` (Hugging Face `layer_types`) says which is which.
pub fn gemma3_layers(
    num_layers: usize,
    window: usize,
    global: &Rope,
    local_theta: f32,
    is_local: impl Fn(usize) -> bool,
) -> Vec<LayerSpec> {
    (0..num_layers)
        .map(|i| {
            if is_local(i) {
                LayerSpec {
                    sliding_window: Some(window),
                    rope: Rope {
                        theta: local_theta,
                        scaling: RopeScaling::None,
                    },
                }
            } else {
                LayerSpec {
                    sliding_window: None,
                    rope: global.clone(),
                }
            }
        })
        .collect()
}

/// Whether layer `i` of Gemma 3's fixed pattern is local.
pub fn gemma3_is_local(i: usize) -> bool {
    !(i + 1).is_multiple_of(GEMMA3_PATTERN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        for f in FAMILIES {
            let moe = f.moe_routing.is_some();
            assert_eq!(by_gguf_name_moe(f.gguf, moe).unwrap().hf, f.hf);
            assert_eq!(by_hf_class(f.hf).unwrap().gguf, f.gguf);
        }
        assert_eq!(by_gguf_name("llama").unwrap().hf, "LlamaForCausalLM");
        assert!(by_gguf_name("gemma").is_none());
        assert_eq!(
            known_names(|f| f.gguf),
            "llama, mistral, qwen2, qwen3, gemma3, qwen2moe, qwen3moe, olmoe and granitemoe"
        );
    }

    #[test]
    fn gemma3_pattern_has_every_sixth_layer_global() {
        let global = Rope {
            theta: 1e6,
            scaling: RopeScaling::Linear { factor: 8.0 },
        };
        let layers = gemma3_layers(13, 512, &global, 10000.0, gemma3_is_local);
        let globals: Vec<usize> = (0..13)
            .filter(|&i| layers[i].sliding_window.is_none())
            .collect();
        assert_eq!(globals, [5, 11]);
        assert_eq!(layers[5].rope, global);
        assert_eq!(layers[4].sliding_window, Some(512));
        assert_eq!(layers[4].rope.theta, 10000.0);
        assert_eq!(layers[4].rope.scaling, RopeScaling::None);
    }
}
