//! A plain f32 forward pass over a model's dequantized weights: every
//! position of a window computed at once with full causal attention, no KV
//! cache. Calibration runs it and watches the input of every linear layer;
//! sensitivity runs it with one layer replaced. Matrix products go to the CPU
//! backend's kernels; attention is computed here, one head per task.

use std::collections::HashMap;

use rayon::prelude::*;
use tandem_core::backend::RopeStyle;
use tandem_core::model::{ModelConfig, ModelFiles};

use crate::linalg::{Cpu, Matrix};
use crate::{invalid, Result};

/// Where a linear layer takes its input from; layers at one site share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Site {
    /// The attention RMSNorm's output: Q, K, V.
    AttnIn,
    /// The attention heads' output: O.
    AttnOut,
    /// The FFN RMSNorm's output: gate, up.
    FfnIn,
    /// `silu(gate) * up`: down.
    FfnAct,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::AttnIn, Site::AttnOut, Site::FfnIn, Site::FfnAct];

    /// The linear layers (tensor stems) reading this site.
    pub fn linears(self) -> &'static [&'static str] {
        match self {
            Site::AttnIn => &["attn_q", "attn_k", "attn_v"],
            Site::AttnOut => &["attn_output"],
            Site::FfnIn => &["ffn_gate", "ffn_up"],
            Site::FfnAct => &["ffn_down"],
        }
    }
}

/// The linear layers of one transformer block, in forward order.
pub const LINEARS: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

pub fn linear_name(layer: usize, stem: &str) -> String {
    format!("blk.{layer}.{stem}.weight")
}

/// One tensor in f32: `rows × cols` row-major (a vector is one row).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// The model's weights in f32, with its matrices ready for products.
pub struct DenseModel {
    pub config: ModelConfig,
    tensors: HashMap<String, Tensor>,
    matrices: HashMap<String, Matrix>,
    cpu: Cpu,
}

impl DenseModel {
    /// Dequantizes every tensor of `files`.
    pub fn from_files(files: &ModelFiles) -> Result<Self> {
        let tensors = files
            .tensors
            .tensors()
            .par_iter()
            .map(|info| {
                let view = files.tensors.view(&info.name).expect("listed tensor");
                let t = Tensor {
                    rows: view.rows,
                    cols: view.cols,
                    data: view.to_f32(),
                };
                (info.name.clone(), t)
            })
            .collect();
        Self::new(files.config.clone(), tensors)
    }

    /// A model from f32 tensors by canonical name.
    pub fn new(config: ModelConfig, tensors: HashMap<String, Tensor>) -> Result<Self> {
        let mut model = DenseModel {
            config,
            tensors,
            matrices: HashMap::new(),
            cpu: Cpu::default(),
        };
        let mut names: Vec<String> = (0..model.config.num_layers)
            .flat_map(|l| LINEARS.iter().map(move |s| linear_name(l, s)))
            .collect();
        names.push(model.output_name().to_string());
        for name in names {
            let t = model.tensor(&name)?;
            let m = model.cpu.matrix(&t.data, t.rows, t.cols)?;
            model.matrices.insert(name, m);
        }
        Ok(model)
    }

    pub fn cpu(&self) -> &Cpu {
        &self.cpu
    }

    fn output_name(&self) -> &'static str {
        if self.config.tied_embeddings {
            "token_embd.weight"
        } else {
            "output.weight"
        }
    }

    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        match self.tensors.get(name) {
            Some(t) => Ok(t),
            None => invalid(format!("the model has no tensor '{name}'")),
        }
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Replaces a tensor's values (same shape).
    pub fn set(&mut self, name: &str, data: Vec<f32>) -> Result<()> {
        let t = match self.tensors.get_mut(name) {
            Some(t) if t.data.len() == data.len() => t,
            Some(t) => {
                return invalid(format!(
                    "{name} has {} values, not {}",
                    t.data.len(),
                    data.len()
                ))
            }
            None => return invalid(format!("the model has no tensor '{name}'")),
        };
        t.data = data;
        if self.matrices.contains_key(name) {
            let m = self.cpu.matrix(&t.data, t.rows, t.cols)?;
            self.matrices.insert(name.to_string(), m);
        }
        Ok(())
    }

    /// The embeddings of `tokens`: the residual stream entering layer 0.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let emb = self.tensor("token_embd.weight")?;
        let mut h = Vec::with_capacity(tokens.len() * emb.cols);
        for &t in tokens {
            let t = t as usize;
            if t >= emb.rows {
                return invalid(format!(
                    "token id {t} is outside the vocabulary of {}",
                    emb.rows
                ));
            }
            h.extend_from_slice(&emb.data[t * emb.cols..(t + 1) * emb.cols]);
        }
        Ok(h)
    }

    fn linear(&self, layer: usize, stem: &str, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let name = linear_name(layer, stem);
        let mut y = self.cpu.xwt(x, n, &self.matrices[&name])?;
        if let Some(bias) = self.tensors.get(&format!("blk.{layer}.{stem}.bias")) {
            for row in y.chunks_exact_mut(bias.data.len()) {
                row.iter_mut().zip(&bias.data).for_each(|(v, b)| *v += b);
            }
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &[f32], name: &str) -> Result<Vec<f32>> {
        let w = &self.tensor(name)?.data;
        let eps = self.config.rms_eps;
        let mut out = vec![0.0; x.len()];
        for (o, row) in out.chunks_exact_mut(w.len()).zip(x.chunks_exact(w.len())) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            o.iter_mut()
                .zip(row.iter().zip(w))
                .for_each(|(o, (v, g))| *o = v * inv * g);
        }
        Ok(out)
    }

    fn rope(&self, x: &mut [f32], n: usize, heads: usize, layer: usize) {
        let c = &self.config;
        let (hd, half) = (c.head_dim, c.rotary_dim / 2);
        let inv_freq = c.inv_freq(layer);
        let width = heads * hd;
        for pos in 0..n {
            let row = &mut x[pos * width..(pos + 1) * width];
            for head in row.chunks_exact_mut(hd) {
                for (i, f) in inv_freq.iter().enumerate() {
                    let (s, co) = (pos as f32 * f).sin_cos();
                    let (a, b) = match c.rope_style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::NeoX => (i, i + half),
                    };
                    let (xa, xb) = (head[a], head[b]);
                    head[a] = xa * co - xb * s;
                    head[b] = xa * s + xb * co;
                }
            }
        }
    }

    /// Causal attention over a window; `[n, q_dim]`.
    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], n: usize) -> Vec<f32> {
        let c = &self.config;
        let (hd, qd, kd) = (c.head_dim, c.q_dim(), c.kv_dim());
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let heads: Vec<Vec<f32>> = (0..c.num_heads)
            .into_par_iter()
            .map(|head| {
                let kvh = head / group;
                let mut out = vec![0.0f32; n * hd];
                let mut scores = vec![0.0f32; n];
                for i in 0..n {
                    let qi = &q[i * qd + head * hd..][..hd];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in scores[..=i].iter_mut().enumerate() {
                        let kj = &k[j * kd + kvh * hd..][..hd];
                        *s = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                        max = max.max(*s);
                    }
                    let mut z = 0.0;
                    for s in &mut scores[..=i] {
                        *s = (*s - max).exp();
                        z += *s;
                    }
                    let oi = &mut out[i * hd..(i + 1) * hd];
                    for (j, p) in scores[..=i].iter().enumerate() {
                        let vj = &v[j * kd + kvh * hd..][..hd];
                        let p = p / z;
                        oi.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
                    }
                }
                out
            })
            .collect();
        let mut out = vec![0.0; n * qd];
        for (head, ho) in heads.iter().enumerate() {
            for i in 0..n {
                out[i * qd + head * hd..][..hd].copy_from_slice(&ho[i * hd..(i + 1) * hd]);
            }
        }
        out
    }

    /// Runs layer `layer` on the residual stream `h` (`n` positions from 0),
    /// showing `observe` the input of each site.
    pub fn layer(
        &self,
        layer: usize,
        h: &mut [f32],
        n: usize,
        observe: &mut dyn FnMut(Site, &[f32]),
    ) -> Result<()> {
        let c = &self.config;
        let name = |s: &str| format!("blk.{layer}.{s}");
        let x = self.rms_norm(h, &name("attn_norm.weight"))?;
        observe(Site::AttnIn, &x);
        let mut q = self.linear(layer, "attn_q", &x, n)?;
        let mut k = self.linear(layer, "attn_k", &x, n)?;
        let v = self.linear(layer, "attn_v", &x, n)?;
        self.rope(&mut q, n, c.num_heads, layer);
        self.rope(&mut k, n, c.num_kv_heads, layer);
        let a = self.attention(&q, &k, &v, n);
        observe(Site::AttnOut, &a);
        let o = self.linear(layer, "attn_output", &a, n)?;
        h.iter_mut().zip(&o).for_each(|(h, o)| *h += o);
        let x = self.rms_norm(h, &name("ffn_norm.weight"))?;
        observe(Site::FfnIn, &x);
        let gate = self.linear(layer, "ffn_gate", &x, n)?;
        let up = self.linear(layer, "ffn_up", &x, n)?;
        let act: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        observe(Site::FfnAct, &act);
        let down = self.linear(layer, "ffn_down", &act, n)?;
        h.iter_mut().zip(&down).for_each(|(h, d)| *h += d);
        Ok(())
    }

    /// Logits `[n, vocab]` from the residual stream after the last layer.
    pub fn logits(&self, h: &[f32], n: usize) -> Result<Vec<f32>> {
        let x = self.rms_norm(h, "output_norm.weight")?;
        self.cpu.xwt(&x, n, &self.matrices[self.output_name()])
    }

    /// Logits of a whole window.
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let n = tokens.len();
        let mut h = self.embed(tokens)?;
        for l in 0..self.config.num_layers {
            self.layer(l, &mut h, n, &mut |_, _| {})?;
        }
        self.logits(&h, n)
    }
}
