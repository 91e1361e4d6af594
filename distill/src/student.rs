//! The student: the target's forward pass (plain Llama block) written in
//! candle over a subset of the target's layers, so it can be trained. Its
//! embedding and output head are the target's, frozen; every layer's weights
//! and the final norm are trained. With a reduced output vocabulary
//! ([`Student::with_output_tokens`]) its head is the target's rows of those
//! tokens only, and it learns the target's distribution among them. It
//! computes what Tandem's forward pass computes for the same weights (NeoX
//! RoPE, grouped-query attention, SwiGLU), so the directory it is written
//! to drafts exactly what it was trained as.

use candle_core::{Device, Tensor, Var, D};
use tandem_core::backend::RopeStyle;
use tandem_core::model::{ModelConfig, ModelFiles};

use crate::target_weights::{self, F32Tensor};
use crate::{Error, Result};

/// The student's trainable tensors of one layer, canonical stems as keys.
struct Layer {
    /// The target layer it started from.
    source: usize,
    weights: Vec<(&'static str, Var)>,
}

/// Matrices and norms of a layer; biases are added where the model has them.
const LAYER_TENSORS: [&str; 9] = [
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];
const QKV_BIASES: [&str; 3] = ["attn_q.bias", "attn_k.bias", "attn_v.bias"];

/// A trained tensor: canonical name, shape (outermost first), f32 values.
pub struct TrainedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub struct Student {
    /// The student's own configuration: the target's with `layers` only and
    /// NeoX RoPE (the order its Q/K rows are kept in).
    pub config: ModelConfig,
    device: Device,
    embedding: Tensor,
    /// `None` when the model ties its output head to the embedding.
    head: Option<Tensor>,
    /// The reduced vocabulary's ids, to pick the target's logits of its tokens.
    output_ids: Option<Tensor>,
    layers: Vec<Layer>,
    final_norm: Var,
    /// An EAGLE head's norm and projection of the target's hidden states
    /// (`eagle_norm.weight`, `eagle_fc.weight`: `[hidden, hidden]`), added
    /// to each row's token embedding.
    eagle: Option<(Var, Var)>,
}

impl Student {
    /// A student made of the target's `layers` (in this order), on `device`.
    pub fn from_target(target: &ModelFiles, layers: &[usize], device: &Device) -> Result<Self> {
        target_weights::check_supported(target)?;
        let c = &target.config;
        if layers.is_empty() {
            return Err(Error::InvalidInput(
                "the student needs at least one layer".into(),
            ));
        }
        if let Some(&bad) = layers.iter().find(|&&l| l >= c.num_layers) {
            return Err(Error::InvalidInput(format!(
                "layer {bad} is past the target's {} layers",
                c.num_layers
            )));
        }
        let tensor = |name: &str| -> Result<Tensor> {
            let t = target_weights::load(target, name)?;
            to_tensor(t, device)
        };
        let embedding = tensor("token_embd.weight")?;
        let head = match c.tied_embeddings {
            true => None,
            false => Some(tensor("output.weight")?),
        };
        let mut student_layers = Vec::with_capacity(layers.len());
        for &source in layers {
            let mut names: Vec<&'static str> = LAYER_TENSORS.to_vec();
            if c.qkv_bias {
                names.extend(QKV_BIASES);
            }
            let mut weights = Vec::with_capacity(names.len());
            for stem in names {
                let t = tensor(&format!("blk.{source}.{stem}"))?;
                weights.push((stem, Var::from_tensor(&t)?));
            }
            student_layers.push(Layer { source, weights });
        }
        let final_norm = Var::from_tensor(&tensor("output_norm.weight")?)?;
        let config = ModelConfig {
            num_layers: layers.len(),
            layers: layers.iter().map(|&l| c.layers[l].clone()).collect(),
            rope_style: RopeStyle::NeoX,
            ..c.clone()
        };
        Ok(Self {
            config,
            device: device.clone(),
            embedding,
            head,
            output_ids: None,
            layers: student_layers,
            final_norm,
            eagle: None,
        })
    }

    /// An EAGLE head: the target's `layers` (in this order) reading, beside
    /// each token's embedding, the target's final hidden state at the
    /// position before, normalised (by a copy of the target's output norm,
    /// as its head reads it) and projected (by a matrix that starts at
    /// zero, so training starts from the plain student of those layers),
    /// with the target's final norm and head.
    pub fn eagle_from_target(
        target: &ModelFiles,
        layers: &[usize],
        device: &Device,
    ) -> Result<Self> {
        let mut student = Self::from_target(target, layers, device)?;
        let dim = student.config.hidden_size;
        let norm = Var::from_tensor(student.final_norm.as_tensor())?;
        let fc = Var::zeros((dim, dim), candle_core::DType::F32, device)?;
        student.eagle = Some((norm, fc));
        student.config.reads_hidden = true;
        Ok(student)
    }

    /// Whether it is an EAGLE head, trained on the target's hidden states.
    pub fn reads_hidden(&self) -> bool {
        self.eagle.is_some()
    }

    /// The student with an output head for `tokens` only (increasing ids
    /// of the target's vocabulary): the target's head rows of those tokens.
    pub fn with_output_tokens(mut self, tokens: Vec<u32>) -> Result<Self> {
        if self.output_ids.is_some() {
            // Its head rows are no longer the target's token ids.
            return Err(Error::InvalidInput(
                "the student already has a reduced output vocabulary".into(),
            ));
        }
        let config = ModelConfig {
            tied_embeddings: false,
            output_tokens: Some(tokens.clone()),
            ..self.config.clone()
        };
        config
            .validate()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let ids = Tensor::from_vec(tokens, config.logit_width(), &self.device)?;
        let full = self.head.as_ref().unwrap_or(&self.embedding);
        self.head = Some(full.index_select(&ids, 0)?);
        self.output_ids = Some(ids);
        self.config = config;
        Ok(self)
    }

    /// The reduced output vocabulary, if the student has one.
    pub fn output_tokens(&self) -> Option<&[u32]> {
        self.config.output_tokens.as_deref()
    }

    /// The target's logits `[rows, vocab]` cut to the student's output
    /// vocabulary (`[rows, its tokens]`), unchanged with the whole one.
    pub fn restrict(&self, target_logits: &Tensor) -> Result<Tensor> {
        Ok(match &self.output_ids {
            Some(ids) => target_logits.index_select(ids, 1)?,
            None => target_logits.clone(),
        })
    }

    /// The target layers the student's layers started from.
    pub fn source_layers(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.source).collect()
    }

    /// Everything the optimizer updates.
    pub fn trainable(&self) -> Vec<Var> {
        let mut vars: Vec<Var> = self
            .layers
            .iter()
            .flat_map(|l| l.weights.iter().map(|(_, v)| v.clone()))
            .collect();
        vars.push(self.final_norm.clone());
        if let Some((norm, fc)) = &self.eagle {
            vars.extend([norm.clone(), fc.clone()]);
        }
        vars
    }

    /// The trained tensors under their canonical names (`blk.I.*` numbered
    /// from 0 in the student, `output_norm.weight`), f32 row-major.
    pub fn trained_tensors(&self) -> Result<Vec<TrainedTensor>> {
        let tensor = |name: String, var: &Var| -> Result<TrainedTensor> {
            let t = var.as_tensor();
            Ok(TrainedTensor {
                name,
                shape: t.dims().to_vec(),
                data: t.flatten_all()?.to_vec1()?,
            })
        };
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (stem, var) in &layer.weights {
                out.push(tensor(format!("blk.{i}.{stem}"), var)?);
            }
        }
        out.push(tensor("output_norm.weight".into(), &self.final_norm)?);
        if let Some((norm, fc)) = &self.eagle {
            out.push(tensor("eagle_norm.weight".into(), norm)?);
            out.push(tensor("eagle_fc.weight".into(), fc)?);
        }
        Ok(out)
    }

    /// Logits `[batch × len, output tokens]` for `tokens`: `batch` windows
    /// of `len` tokens each, every window starting at position 0. A plain
    /// student gives one tensor. An EAGLE head reads `hidden`, the target's
    /// final hidden states of the same rows (`[batch × len, hidden]`), and
    /// gives two: its drafts after the target's hidden states, and the
    /// next draft's, each row reading the head's own hidden state of the
    /// row before instead and attending to the first pass's keys before it
    /// (drafting's second step, trained as EAGLE-3 does).
    pub fn forward(
        &self,
        tokens: &[u32],
        batch: usize,
        len: usize,
        hidden: Option<&[f32]>,
    ) -> Result<Vec<Tensor>> {
        if batch * len != tokens.len() || len == 0 {
            return Err(Error::InvalidInput(format!(
                "{} tokens are not {batch} windows of {len}",
                tokens.len()
            )));
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
        let embedded = self.embedding.index_select(&ids, 0)?;
        let shape = Windows { batch, len };
        let Some((norm, fc)) = &self.eagle else {
            let (x, _) = self.layers_forward(embedded, shape, None)?;
            return Ok(vec![self.logits(&x)?]);
        };
        let dim = self.config.hidden_size;
        let hidden = match hidden {
            Some(h) if h.len() == tokens.len() * dim => h,
            _ => {
                return Err(Error::InvalidInput(
                    "an EAGLE head needs the target's hidden state of every row".into(),
                ))
            }
        };
        let target = Tensor::from_slice(hidden, (tokens.len(), dim), &self.device)?;
        let eps = self.config.rms_eps;
        let input = |h: &Tensor| -> Result<Tensor> {
            let normed = rms_norm(&shape.previous_rows(h)?, norm.as_tensor(), eps)?;
            Ok((&embedded + linear(&normed, fc.as_tensor(), None)?)?)
        };
        let (first, keys) = self.layers_forward(input(&target)?, shape, None)?;
        let (second, _) = self.layers_forward(input(&first)?, shape, Some(&keys))?;
        Ok(vec![self.logits(&first)?, self.logits(&second)?])
    }

    /// The final norm and the output head.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let x = rms_norm(x, self.final_norm.as_tensor(), self.config.rms_eps)?;
        let head = self.head.as_ref().unwrap_or(&self.embedding);
        Ok(x.matmul(&head.t()?)?)
    }

    /// The layers over `x` (`[rows, hidden]`). Returns the final residual
    /// stream and each layer's keys and values (RoPE applied, one per query
    /// head). With `prior` (an earlier pass's keys and values), each row
    /// attends to the prior's rows before it and to itself.
    fn layers_forward(
        &self,
        mut x: Tensor,
        shape: Windows,
        prior: Option<&[(Tensor, Tensor)]>,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let c = &self.config;
        let Windows { batch, len } = shape;
        let mask = causal_mask(len, prior.is_some(), &self.device)?;
        let mut keys = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let w = |stem: &str| -> &Tensor {
                let (_, v) = layer
                    .weights
                    .iter()
                    .find(|(s, _)| *s == stem)
                    .expect("every layer holds every tensor");
                v.as_tensor()
            };
            let bias = |stem: &str| c.qkv_bias.then(|| w(stem));
            let (cos, sin) = rope_tables(&c.inv_freq(i), len, &self.device)?;
            let h = rms_norm(&x, w("attn_norm.weight"), c.rms_eps)?;
            let heads = |t: Tensor, n: usize| -> Result<Tensor> {
                Ok(t.reshape((batch, len, n, c.head_dim))?.transpose(1, 2)?)
            };
            let q = heads(
                linear(&h, w("attn_q.weight"), bias("attn_q.bias"))?,
                c.num_heads,
            )?;
            let k = heads(
                linear(&h, w("attn_k.weight"), bias("attn_k.bias"))?,
                c.num_kv_heads,
            )?;
            let v = heads(
                linear(&h, w("attn_v.weight"), bias("attn_v.bias"))?,
                c.num_kv_heads,
            )?;
            let q = rope(&q, &cos, &sin)?;
            let k = repeat_kv(&rope(&k, &cos, &sin)?, c.num_heads / c.num_kv_heads)?;
            let v = repeat_kv(&v, c.num_heads / c.num_kv_heads)?;
            let scale = c.attention_scale as f64;
            let attended = match prior.map(|p| &p[i]) {
                None => {
                    let scores =
                        (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
                    softmax(&scores)?.matmul(&v)?
                }
                Some((prior_k, prior_v)) => {
                    let scores =
                        (q.matmul(&prior_k.t()?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
                    let own = ((&q * &k)?.sum_keepdim(D::Minus1)? * scale)?;
                    let p = softmax(&Tensor::cat(&[scores, own], D::Minus1)?)?;
                    let from_prior = p.narrow(D::Minus1, 0, len)?.matmul(prior_v)?;
                    (from_prior + p.narrow(D::Minus1, len, 1)?.broadcast_mul(&v)?)?
                }
            };
            keys.push((k, v));
            let attended = attended
                .transpose(1, 2)?
                .reshape((batch * len, c.num_heads * c.head_dim))?;
            x = (x + linear(&attended, w("attn_output.weight"), None)?)?;
            let h = rms_norm(&x, w("ffn_norm.weight"), c.rms_eps)?;
            let gate = linear(&h, w("ffn_gate.weight"), None)?.silu()?;
            let up = linear(&h, w("ffn_up.weight"), None)?;
            x = (x + linear(&(gate * up)?, w("ffn_down.weight"), None)?)?;
        }
        Ok((x, keys))
    }
}

/// `batch` windows of `len` rows each, one after the other.
#[derive(Clone, Copy)]
struct Windows {
    batch: usize,
    len: usize,
}

impl Windows {
    /// Each row replaced by the row before it in its window, zeros first:
    /// what an EAGLE head's row reads of `x` (`[batch × len, width]`).
    fn previous_rows(self, x: &Tensor) -> Result<Tensor> {
        let width = x.dim(D::Minus1)?;
        let x = x.reshape((self.batch, self.len, width))?;
        let zeros = Tensor::zeros((self.batch, 1, width), x.dtype(), x.device())?;
        let shifted = Tensor::cat(&[zeros, x.narrow(1, 0, self.len - 1)?], 1)?;
        Ok(shifted.reshape((self.batch * self.len, width))?)
    }
}

fn to_tensor(t: F32Tensor, device: &Device) -> Result<Tensor> {
    let shape = if t.rows == 1 {
        vec![t.cols]
    } else {
        vec![t.rows, t.cols]
    };
    Ok(Tensor::from_vec(t.data, shape, device)?)
}

/// `x · wᵀ (+ b)` for `x` of `[rows, in]` and `w` of `[out, in]`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// `x / sqrt(mean(x²) + eps) · w` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x.broadcast_div(&(ms + eps as f64)?.sqrt()?)?;
    Ok(normed.broadcast_mul(w)?)
}

/// Softmax over the last dimension. The maximum is taken out of the graph:
/// the result does not depend on it, so neither does the gradient.
pub(crate) fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// `0` where row `i` sees column `j` (`j <= i`, or `j < i` when
/// `strict`), `-inf` elsewhere.
fn causal_mask(len: usize, strict: bool, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..len * len)
        .map(|i| {
            let (row, col) = (i / len, i % len);
            if col > row || (strict && col == row) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(mask, (len, len), device)?)
}

/// Cosines and sines `[len, head_dim / 2]` of position × inverse frequency.
fn rope_tables(inv_freq: &[f32], len: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let angles: Vec<f32> = (0..len)
        .flat_map(|p| inv_freq.iter().map(move |f| p as f32 * f))
        .collect();
    let angles = Tensor::from_vec(angles, (len, inv_freq.len()), device)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// NeoX RoPE on `[batch, heads, len, head_dim]`: the first half of each head
/// pairs with the second.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let r1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let r2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Ok(Tensor::cat(&[r1, r2], D::Minus1)?.contiguous()?)
}

/// Each KV head repeated for the `n` query heads that share it.
fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.contiguous()?);
    }
    let (b, kv, len, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, kv, n, len, d))?
        .reshape((b, kv * n, len, d))?)
}
