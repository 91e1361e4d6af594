//! `ModelConfig`: the dimensions and options of a Llama-family model
//! (SmolLM, Llama 2/3, Mistral, Qwen2), whichever file format it came from.

use crate::backend::RopeStyle;
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
    /// `llama`, `mistral`, `qwen2`, ...
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
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    /// Longest context the model was trained for.
    pub max_context: usize,
    /// No `output.weight`: logits use the embedding table.
    pub tied_embeddings: bool,
    /// Q, K and V projections have biases (Qwen2).
    pub qkv_bias: bool,
    pub sliding_window: Option<usize>,
}

/// Upper bounds that no real model exceeds; a file claiming more is corrupt,
/// and refusing it early avoids huge allocations.
const MAX_DIM: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;
const MAX_VOCAB: usize = 1 << 24;

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
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
        let eps_ok = self.rms_eps > 0.0 && self.rms_eps < 1.0;
        let theta_ok = self.rope_theta > 0.0 && self.rope_theta.is_finite();
        if !eps_ok || !theta_ok {
            return bad(format!(
                "rms_eps {} or rope_theta {} out of range",
                self.rms_eps, self.rope_theta
            ));
        }
        Ok(())
    }

    /// RoPE inverse frequencies, `rotary_dim / 2` of them, with scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.rotary_dim / 2;
        (0..half)
            .map(|i| {
                let base =
                    1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / self.rotary_dim as f64);
                scale_frequency(base, i, &self.rope_scaling) as f32
            })
            .collect()
    }
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
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut c = smol();
        c.rope_theta = 500000.0;
        c.rotary_dim = 128;
        c.head_dim = 128;
        let plain = c.inv_freq();
        c.rope_scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        let scaled = c.inv_freq();
        assert_eq!(plain[0], scaled[0]);
        assert!((plain[63] / 8.0 - scaled[63]).abs() < 1e-12);
    }
}
