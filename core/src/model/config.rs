//! `ModelConfig`: the dimensions of a model and its architecture as data
//! (`super::arch`), whichever file format it came from.

use super::arch::{BlockSpec, LayerSpec, MoeSpec, Multipliers, Rope};
use crate::backend::RopeStyle;
use crate::kv::KvShape;
use crate::{Error, Result};

/// How RoPE frequencies are stretched for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Per-frequency divisors, one per rotated pair (GGUF's `rope_freqs.weight`,
    /// which llama.cpp's converter writes for Llama 3.1 scaling).
    FreqFactors(Vec<f32>),
    /// Positions divided by `factor` (equivalently, frequencies).
    Linear {
        factor: f32,
    },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family's GGUF name: `llama`, `mistral`, `qwen2`, `qwen3`, `gemma3`
    /// (see [`arch::FAMILIES`](super::arch::FAMILIES)).
    pub arch: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rms_eps: f32,
    pub rope_style: RopeStyle,
    /// Longest context the model was trained for.
    pub max_context: usize,
    /// No `output.weight`: logits use the embedding table.
    pub tied_embeddings: bool,
    /// Q, K and V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// How every layer is wired beyond Llama's (norms, activation, embedding scale).
    pub block: BlockSpec,
    /// Factor on attention scores before the softmax (`1/sqrt(head_dim)`
    /// for most models).
    pub attention_scale: f32,
    /// One entry per layer: its attention window and RoPE frequencies.
    pub layers: Vec<LayerSpec>,
    /// `Some` for a Mixture-of-Experts model: every layer's FFN is routed
    /// experts of width `intermediate_size`.
    pub moe: Option<MoeSpec>,
    /// Granite's embedding, residual and logit factors.
    pub multipliers: Multipliers,
    /// `Some` for a draft with a reduced output vocabulary (FR-Spec): its
    /// output head has a row for each of these tokens only, in increasing
    /// order, and never predicts the others. Such a model drafts for a
    /// target; the engine does not sample from it alone.
    pub output_tokens: Option<Vec<u32>>,
    /// An EAGLE head: each row's input is its token's embedding plus
    /// `eagle_fc` times the target's final hidden state (before its output
    /// norm) at the row before, RMS-normalised by `eagle_norm`, so the
    /// model drafts from what the target already computed. It reads hidden states of its own width and
    /// drafts for a target; the engine does not run it alone.
    pub reads_hidden: bool,
}

/// Upper bounds that no real model exceeds; a file claiming more is corrupt,
/// and refusing it early avoids huge allocations.
const MAX_DIM: usize = 1 << 20;
/// The loaders check the layer count against it before building per-layer
/// descriptions, so a corrupt count cannot allocate first.
pub const MAX_LAYERS: usize = 1024;
const MAX_VOCAB: usize = 1 << 24;

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The shape every layer's KV cache shares, in blocks of `block_size` tokens.
    pub fn kv_shape(&self, block_size: usize) -> KvShape {
        KvShape {
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size,
        }
    }

    /// Bytes of one KV block's key bounds over every layer, when the cache
    /// keeps them for sparse drafting ([`KvShape::key_bounds_block_bytes`]
    /// per layer).
    pub fn key_bounds_block_bytes(&self, block_size: usize) -> usize {
        self.num_layers * self.kv_shape(block_size).key_bounds_block_bytes()
    }

    /// Logits per row: the output head's rows.
    pub fn logit_width(&self) -> usize {
        self.output_tokens
            .as_ref()
            .map_or(self.vocab_size, Vec::len)
    }

    /// Checks the dimensions are positive, mutually consistent and not absurd.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Unsupported(m));
        let dims = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("intermediate_size", self.intermediate_size, MAX_DIM),
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_heads", self.num_heads, MAX_DIM),
            ("num_kv_heads", self.num_kv_heads, MAX_DIM),
            ("head_dim", self.head_dim, 4096),
            ("max_context", self.max_context, 1 << 24),
        ];
        for (name, v, max) in dims {
            if v == 0 || v > max {
                return bad(format!("{name} = {v} is out of range (1..={max})"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rotary_dim == 0
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return bad(format!(
                "rotary_dim {} must be even and at most head_dim {}",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.layers.len() != self.num_layers {
            return bad(format!(
                "{} layer descriptions for {} layers",
                self.layers.len(),
                self.num_layers
            ));
        }
        if !(self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return bad(format!("rms_eps {} out of range", self.rms_eps));
        }
        if !(self.attention_scale > 0.0 && self.attention_scale.is_finite()) {
            return bad(format!(
                "attention scale {} must be positive",
                self.attention_scale
            ));
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
        }
        let factors = [
            ("embedding multiplier", self.multipliers.embedding),
            ("residual multiplier", self.multipliers.residual),
            ("logits scaling", self.multipliers.logits),
        ];
        for (name, factor) in factors {
            if let Some(f) = factor.filter(|f| !(f.is_finite() && *f > 0.0)) {
                return bad(format!("{name} {f} must be finite and above 0"));
            }
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let theta = layer.rope.theta;
            if !(theta > 0.0 && theta.is_finite()) {
                return bad(format!("layer {i}: rope_theta {theta} out of range"));
            }
            if layer.sliding_window == Some(0) {
                return bad(format!("layer {i}: sliding window 0"));
            }
        }
        if let Some(tokens) = &self.output_tokens {
            self.validate_output_tokens(tokens)?;
        }
        Ok(())
    }

    fn validate_output_tokens(&self, tokens: &[u32]) -> Result<()> {
        let bad = |m: String| Err(Error::Unsupported(format!("output vocabulary: {m}")));
        if tokens.is_empty() {
            return bad("no tokens".into());
        }
        if self.tied_embeddings {
            return bad("a reduced output head needs its own matrix, not the embedding".into());
        }
        if let Some(w) = tokens.windows(2).find(|w| w[0] >= w[1]) {
            return bad(format!(
                "token {} follows {}: the ids must increase",
                w[1], w[0]
            ));
        }
        match tokens.last() {
            Some(&last) if last as usize >= self.vocab_size => bad(format!(
                "token {last} is outside the vocabulary of {}",
                self.vocab_size
            )),
            _ => Ok(()),
        }
    }

    /// RoPE inverse frequencies of layer `layer`, `rotary_dim / 2` of them, scaling applied.
    pub fn inv_freq(&self, layer: usize) -> Vec<f32> {
        self.layers[layer].rope.inv_freq(self.rotary_dim)
    }

    /// The factor on embedding rows, if the architecture has one.
    pub fn embedding_scale(&self) -> Option<f32> {
        self.block
            .scaled_embedding
            .then(|| (self.hidden_size as f32).sqrt())
            .or(self.multipliers.embedding)
    }

    /// Parameters of the model (embedding included once when tied), and
    /// those one token uses: the routed experts it goes through rather than
    /// all of them (`(total, active)`, equal for a dense model).
    pub fn parameter_counts(&self) -> (usize, usize) {
        let (dim, ffn) = (self.hidden_size, self.intermediate_size);
        let attention = dim * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * dim;
        let expert = 3 * dim * ffn;
        let (ffn_total, ffn_active) = match &self.moe {
            None => (expert, expert),
            Some(moe) => {
                let router = dim * moe.router_width();
                let shared = moe.shared_ffn.map_or(0, |w| 3 * dim * w);
                (
                    router + shared + moe.experts * expert,
                    router + shared + moe.experts_per_token * expert,
                )
            }
        };
        let head = if self.tied_embeddings {
            0
        } else {
            self.logit_width()
        };
        let hidden_input = if self.reads_hidden {
            dim * dim + dim
        } else {
            0
        };
        let embeddings = (self.vocab_size + head) * dim + hidden_input;
        let layers = self.num_layers;
        (
            embeddings + layers * (attention + ffn_total),
            embeddings + layers * (attention + ffn_active),
        )
    }

    /// The sliding window of the model's local layers, if it has any.
    pub fn sliding_window(&self) -> Option<usize> {
        self.layers.iter().find_map(|l| l.sliding_window)
    }

    /// The RoPE of the global (full-attention) layers, or of the first layer
    /// when every layer is local.
    pub fn global_rope(&self) -> Option<&Rope> {
        let global = self.layers.iter().find(|l| l.sliding_window.is_none());
        global.or(self.layers.first()).map(|l| &l.rope)
    }

    /// Runs of consecutive layers with the same attention and RoPE, as
    /// `(first, last, spec)`: how `inspect` shows the layers.
    pub fn layer_runs(&self) -> Vec<(usize, usize, &LayerSpec)> {
        let mut runs: Vec<(usize, usize, &LayerSpec)> = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            match runs.last_mut() {
                Some((_, last, spec)) if *spec == layer => *last = i,
                _ => runs.push((i, i, layer)),
            }
        }
        runs
    }
}

/// `rotary_dim / 2` RoPE inverse frequencies of base `theta`, with `scaling` applied.
pub(super) fn inv_freq(theta: f32, scaling: &RopeScaling, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| {
            let base = 1.0 / (theta as f64).powf(2.0 * i as f64 / rotary_dim as f64);
            scale_frequency(base, i, scaling) as f32
        })
        .collect()
}

fn scale_frequency(freq: f64, pair: usize, scaling: &RopeScaling) -> f64 {
    match *scaling {
        RopeScaling::None => freq,
        RopeScaling::FreqFactors(ref f) => freq / f.get(pair).copied().unwrap_or(1.0) as f64,
        RopeScaling::Linear { factor } => freq / factor as f64,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let (factor, lo, hi) = (
                factor as f64,
                low_freq_factor as f64,
                high_freq_factor as f64,
            );
            let old = original_max_position as f64;
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let low_freq_wavelen = old / lo;
            let high_freq_wavelen = old / hi;
            if wavelen < high_freq_wavelen {
                freq
            } else if wavelen > low_freq_wavelen {
                freq / factor
            } else {
                let smooth = (old / wavelen - lo) / (hi - lo);
                (1.0 - smooth) * freq / factor + smooth * freq
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> ModelConfig {
        crate::model::synthetic::SyntheticModel::preset(
            "smollm2-135m",
            crate::quant::WeightFormat::Q4_1,
            0,
        )
        .unwrap()
        .config
    }

    #[test]
    fn validate_rejects_bad_head_grouping() {
        let mut c = smol();
        assert!(c.validate().is_ok());
        c.num_kv_heads = 4;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("num_kv_heads"));
    }

    #[test]
    fn a_reduced_output_vocabulary_is_checked() {
        let mut c = smol();
        c.tied_embeddings = false;
        c.output_tokens = Some(vec![0, 5, 49151]);
        assert!(c.validate().is_ok());
        assert_eq!(c.logit_width(), 3);
        let (total, _) = c.parameter_counts();
        c.output_tokens = None;
        assert_eq!(c.parameter_counts().0 - total, (49152 - 3) * c.hidden_size);
        for (tokens, tied, why) in [
            (vec![], false, "no tokens"),
            (vec![3, 3], false, "must increase"),
            (vec![7, 2], false, "must increase"),
            (vec![1, 49152], false, "outside the vocabulary"),
            (vec![1, 2], true, "its own matrix"),
        ] {
            c.output_tokens = Some(tokens);
            c.tied_embeddings = tied;
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut rope = Rope {
            theta: 500000.0,
            scaling: RopeScaling::None,
        };
        let plain = rope.inv_freq(128);
        rope.scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        let scaled = rope.inv_freq(128);
        assert_eq!(plain[0], scaled[0]);
        assert!((plain[63] / 8.0 - scaled[63]).abs() < 1e-12);
    }
}
