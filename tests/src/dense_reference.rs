//! A deliberately plain forward pass over f32 weights in Hugging Face layout:
//! every position recomputed from scratch with causal attention (limited to
//! a layer's sliding window where it has one), half-split (NeoX) RoPE, no KV
//! cache, no fused kernels. It shares no code with the engine, so agreement
//! checks the paged, fused, batched path. What varies between architectures
//! (Q/K norms, post-norms, the FFN activation, the embedding scale, each
//! layer's window and RoPE) it reads from the configuration, like the engine.

use tandem_core::model::synthetic::NamedTensor;
use tandem_core::model::{Activation, ModelConfig};

fn weight<'a>(tensors: &'a [NamedTensor], name: &str) -> &'a [f32] {
    &tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .data
}

/// `x [n, cols] · w[rows, cols]ᵀ`.
fn linear(x: &[Vec<f32>], w: &[f32]) -> Vec<Vec<f32>> {
    let cols = x[0].len();
    x.iter()
        .map(|row| {
            w.chunks(cols)
                .map(|wr| wr.iter().zip(row).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect()
}

fn rms_norm(x: &[Vec<f32>], w: &[f32], eps: f32) -> Vec<Vec<f32>> {
    x.iter()
        .map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter().zip(w).map(|(v, g)| v * inv * g).collect()
        })
        .collect()
}

/// RMSNorm of each `dim`-wide piece of every row (a head when `dim` is `head_dim`).
fn rms_norm_pieces(x: &[Vec<f32>], w: &[f32], eps: f32) -> Vec<Vec<f32>> {
    x.iter()
        .map(|row| {
            let pieces: Vec<Vec<f32>> = row.chunks(w.len()).map(|p| p.to_vec()).collect();
            rms_norm(&pieces, w, eps).concat()
        })
        .collect()
}

fn add(h: &mut [Vec<f32>], x: &[Vec<f32>]) {
    for (hr, xr) in h.iter_mut().zip(x) {
        hr.iter_mut().zip(xr).for_each(|(a, b)| *a += b);
    }
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

fn gelu_tanh(g: f32) -> f32 {
    let u = (2.0 / std::f32::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
    0.5 * g * (1.0 + u.tanh())
}

fn rope_neox(x: &mut [Vec<f32>], heads: usize, head_dim: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for (pos, row) in x.iter_mut().enumerate() {
        for h in 0..heads {
            let v = &mut row[h * head_dim..(h + 1) * head_dim];
            for i in 0..half {
                let (s, c) = (pos as f32 * inv_freq[i]).sin_cos();
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = a * s + b * c;
            }
        }
    }
}

/// Logits `[tokens, vocab]` at every position.
pub fn dense_forward(cfg: &ModelConfig, tensors: &[NamedTensor], tokens: &[u32]) -> Vec<Vec<f32>> {
    let d = cfg.hidden_size;
    let hd = cfg.head_dim;
    let group = cfg.num_heads / cfg.num_kv_heads;
    let emb = weight(tensors, "token_embd.weight");
    let embed_scale = if cfg.block.scaled_embedding {
        (d as f32).sqrt()
    } else {
        1.0
    };
    let mut h: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            let row = &emb[t as usize * d..(t as usize + 1) * d];
            row.iter().map(|v| v * embed_scale).collect()
        })
        .collect();
    let eps = cfg.rms_eps;
    for (l, layer) in cfg.layers.iter().enumerate() {
        let w = |s: &str| weight(tensors, &format!("blk.{l}.{s}"));
        let with_bias = |x: Vec<Vec<f32>>, name: &str| -> Vec<Vec<f32>> {
            if !cfg.qkv_bias {
                return x;
            }
            let b = w(name);
            x.into_iter()
                .map(|row| row.iter().zip(b).map(|(v, b)| v + b).collect())
                .collect()
        };
        let x = rms_norm(&h, w("attn_norm.weight"), eps);
        let mut q = with_bias(linear(&x, w("attn_q.weight")), "attn_q.bias");
        let mut k = with_bias(linear(&x, w("attn_k.weight")), "attn_k.bias");
        let v = with_bias(linear(&x, w("attn_v.weight")), "attn_v.bias");
        if cfg.block.qk_norm {
            q = rms_norm_pieces(&q, w("attn_q_norm.weight"), eps);
            k = rms_norm_pieces(&k, w("attn_k_norm.weight"), eps);
        }
        let inv_freq = layer.rope.inv_freq(cfg.rotary_dim);
        rope_neox(&mut q, cfg.num_heads, hd, &inv_freq);
        rope_neox(&mut k, cfg.num_kv_heads, hd, &inv_freq);
        let mut attn = vec![vec![0.0f32; cfg.q_dim()]; tokens.len()];
        for (i, out) in attn.iter_mut().enumerate() {
            let first = layer
                .sliding_window
                .map_or(0, |w| (i + 1).saturating_sub(w));
            for head in 0..cfg.num_heads {
                let kvh = head / group;
                let qh = &q[i][head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (first..=i)
                    .map(|j| {
                        qh.iter()
                            .zip(&k[j][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * cfg.attention_scale
                    })
                    .collect();
                let max = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f32 = e.iter().sum();
                for (p, j) in e.iter().zip(first..=i) {
                    for c in 0..hd {
                        out[head * hd + c] += p / z * v[j][kvh * hd + c];
                    }
                }
            }
        }
        let mut o = linear(&attn, w("attn_output.weight"));
        if cfg.block.post_norms {
            o = rms_norm(&o, w("post_attention_norm.weight"), eps);
        }
        add(&mut h, &o);
        let x = rms_norm(&h, w("ffn_norm.weight"), eps);
        let gate = linear(&x, w("ffn_gate.weight"));
        let up = linear(&x, w("ffn_up.weight"));
        let act_fn = match cfg.block.activation {
            Activation::Silu => silu,
            Activation::GeluTanh => gelu_tanh,
        };
        let act: Vec<Vec<f32>> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| act_fn(*g) * u).collect())
            .collect();
        let mut down = linear(&act, w("ffn_down.weight"));
        if cfg.block.post_norms {
            down = rms_norm(&down, w("post_ffw_norm.weight"), eps);
        }
        add(&mut h, &down);
    }
    let x = rms_norm(&h, weight(tensors, "output_norm.weight"), eps);
    let out = if cfg.tied_embeddings {
        "token_embd.weight"
    } else {
        "output.weight"
    };
    linear(&x, weight(tensors, out))
}
