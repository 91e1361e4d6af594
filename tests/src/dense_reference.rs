//! A deliberately plain forward pass over f32 weights in Hugging Face layout:
//! every position recomputed from scratch with full causal attention,
//! half-split (NeoX) RoPE, no KV cache, no fused kernels. It shares no code
//! with the engine, so agreement checks the paged, fused, batched path.

use tandem_core::model::synthetic::NamedTensor;
use tandem_core::model::ModelConfig;

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
    let mut h: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    let inv_freq = cfg.inv_freq();
    for l in 0..cfg.num_layers {
        let w = |s: &str| weight(tensors, &format!("blk.{l}.{s}"));
        let x = rms_norm(&h, w("attn_norm.weight"), cfg.rms_eps);
        let mut q = linear(&x, w("attn_q.weight"));
        let mut k = linear(&x, w("attn_k.weight"));
        let v = linear(&x, w("attn_v.weight"));
        rope_neox(&mut q, cfg.num_heads, hd, &inv_freq);
        rope_neox(&mut k, cfg.num_kv_heads, hd, &inv_freq);
        let mut attn = vec![vec![0.0f32; cfg.q_dim()]; tokens.len()];
        for (i, out) in attn.iter_mut().enumerate() {
            for head in 0..cfg.num_heads {
                let kvh = head / group;
                let qh = &q[i][head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (0..=i)
                    .map(|j| {
                        qh.iter()
                            .zip(&k[j][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for c in 0..hd {
                        out[head * hd + c] += p / z * v[j][kvh * hd + c];
                    }
                }
            }
        }
        let o = linear(&attn, w("attn_output.weight"));
        for (hr, or) in h.iter_mut().zip(&o) {
            hr.iter_mut().zip(or).for_each(|(a, b)| *a += b);
        }
        let x = rms_norm(&h, w("ffn_norm.weight"), cfg.rms_eps);
        let gate = linear(&x, w("ffn_gate.weight"));
        let up = linear(&x, w("ffn_up.weight"));
        let act: Vec<Vec<f32>> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| {
                g.iter()
                    .zip(u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect()
            })
            .collect();
        let down = linear(&act, w("ffn_down.weight"));
        for (hr, dr) in h.iter_mut().zip(&down) {
            hr.iter_mut().zip(dr).for_each(|(a, b)| *a += b);
        }
    }
    let x = rms_norm(&h, weight(tensors, "output_norm.weight"), cfg.rms_eps);
    let out = if cfg.tied_embeddings {
        "token_embd.weight"
    } else {
        "output.weight"
    };
    linear(&x, weight(tensors, out))
}
