//! The tensors of Mixture-of-Experts layers, in both layouts llama.cpp
//! reads: stacked (`blk.N.ffn_gate_exps.weight` of shape
//! `[cols, rows, experts]`, innermost first, expert `e`'s matrix the `e`-th
//! contiguous slice) and one tensor per expert (`blk.N.ffn_gate.E.weight`,
//! older GGUF files and every Hugging Face directory, whose
//! `experts.E.gate_proj` names map there). The router is
//! `ffn_gate_inp.weight` (`[hidden, experts]`); Qwen2-MoE's shared expert is
//! `ffn_{gate,up,down}_shexp.weight` with its gate `ffn_gate_inp_shexp.weight`
//! (`[hidden]`).

use super::{ModelConfig, TensorStore};
use crate::quant::WeightView;

/// The three matrices of an expert's SwiGLU FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

impl ExpertMatrix {
    pub const ALL: [ExpertMatrix; 3] = [ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down];

    fn stem(self) -> &'static str {
        match self {
            ExpertMatrix::Gate => "ffn_gate",
            ExpertMatrix::Up => "ffn_up",
            ExpertMatrix::Down => "ffn_down",
        }
    }

    /// The stacked tensor of layer `layer`.
    pub fn stacked_name(self, layer: usize) -> String {
        format!("blk.{layer}.{}_exps.weight", self.stem())
    }

    /// Expert `expert`'s own tensor of layer `layer`.
    pub fn per_expert_name(self, layer: usize, expert: usize) -> String {
        format!("blk.{layer}.{}.{expert}.weight", self.stem())
    }

    /// The shared expert's tensor of layer `layer`.
    pub fn shared_name(self, layer: usize) -> String {
        format!("blk.{layer}.{}_shexp.weight", self.stem())
    }

    /// `[cols, rows]` of one expert of `width` (innermost first).
    pub fn shape(self, hidden: usize, width: usize) -> Vec<usize> {
        match self {
            ExpertMatrix::Gate | ExpertMatrix::Up => vec![hidden, width],
            ExpertMatrix::Down => vec![width, hidden],
        }
    }
}

/// The router of layer `layer`.
pub fn router_name(layer: usize) -> String {
    format!("blk.{layer}.ffn_gate_inp.weight")
}

/// The shared expert's gate of layer `layer`.
pub fn shared_gate_name(layer: usize) -> String {
    format!("blk.{layer}.ffn_gate_inp_shexp.weight")
}

/// The FFN tensors of one MoE layer in llama.cpp's stacked layout (names
/// and shapes, innermost first), what `expected_tensors` lists.
pub fn expected_moe_tensors(config: &ModelConfig, layer: usize) -> Vec<(String, Vec<usize>)> {
    let Some(moe) = &config.moe else {
        return Vec::new();
    };
    let (hidden, ffn) = (config.hidden_size, config.intermediate_size);
    let mut expected = vec![(router_name(layer), vec![hidden, moe.experts])];
    for m in ExpertMatrix::ALL {
        let mut shape = m.shape(hidden, ffn);
        shape.push(moe.experts);
        expected.push((m.stacked_name(layer), shape));
    }
    if let Some(width) = moe.shared_ffn {
        expected.push((shared_gate_name(layer), vec![hidden]));
        for m in ExpertMatrix::ALL {
            expected.push((m.shared_name(layer), m.shape(hidden, width)));
        }
    }
    expected
}

/// If `name` is a stacked expert tensor, its layer and matrix.
pub fn parse_stacked(name: &str) -> Option<(usize, ExpertMatrix)> {
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer = layer.parse().ok()?;
    ExpertMatrix::ALL
        .into_iter()
        .find(|m| rest == format!("{}_exps.weight", m.stem()))
        .map(|m| (layer, m))
}

/// Expert `expert`'s matrix `m` of layer `layer` as a `rows × cols` view,
/// from the stacked tensor or the expert's own (`None` if neither exists or
/// the stacked tensor is too small, which `check_tensors` has ruled out).
pub fn expert_view(
    tensors: &TensorStore,
    layer: usize,
    m: ExpertMatrix,
    expert: usize,
) -> Option<WeightView<'_>> {
    if let Some(own) = tensors.view(&m.per_expert_name(layer, expert)) {
        return Some(own);
    }
    let info = tensors.info(&m.stacked_name(layer))?;
    let (cols, rows) = (info.cols(), *info.shape.get(1)?);
    let len = info.format.bytes_for(rows as u64, cols as u64)? as usize;
    let data = tensors.bytes(info).get(expert * len..(expert + 1) * len)?;
    Some(WeightView {
        format: info.format,
        rows,
        cols,
        data,
    })
}
