//! The target's tensors as the student starts from them: dequantized to f32,
//! Q/K rows in Hugging Face order (GGUF Llama files permute them for
//! interleaved RoPE; the student, like the directory it is written to, uses
//! NeoX RoPE), and the shape checks that refuse what the student cannot be.

use tandem_core::backend::RopeStyle;
use tandem_core::model::safetensors::rows_from_interleaved;
use tandem_core::model::{BlockSpec, ModelFiles};
use tandem_core::quant::WeightView;

use crate::{Error, Result};

/// One tensor in f32: `rows × cols` row-major (a vector is one row).
pub struct F32Tensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// Refuses a target the student's forward pass does not reproduce: only the
/// plain Llama block (Llama, Mistral without windows, Qwen2, SmolLM2) with
/// full-width RoPE, no sliding windows and no experts.
pub fn check_supported(files: &ModelFiles) -> Result<()> {
    let c = &files.config;
    let unsupported = |why: String| Err(Error::Unsupported(format!("{}: {why}", c.arch)));
    if c.block != BlockSpec::LLAMA {
        return unsupported(format!(
            "the student reproduces the plain Llama block only, not {:?}",
            c.block
        ));
    }
    if c.rotary_dim != c.head_dim {
        return unsupported(format!(
            "RoPE on {} of {} head dimensions",
            c.rotary_dim, c.head_dim
        ));
    }
    if c.layers.iter().any(|l| l.sliding_window.is_some()) {
        return unsupported("sliding-window attention layers".into());
    }
    if files.tensors.info("blk.0.ffn_gate_inp.weight").is_some() {
        return unsupported("Mixture-of-Experts layers".into());
    }
    if c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
        return unsupported(format!(
            "{} query heads over {} KV heads",
            c.num_heads, c.num_kv_heads
        ));
    }
    Ok(())
}

/// The tensor `name` of `files` in f32, Hugging Face row order.
pub fn load(files: &ModelFiles, name: &str) -> Result<F32Tensor> {
    let info = files
        .tensors
        .info(name)
        .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
    let (rows, cols) = (info.rows(), info.cols());
    let view = WeightView {
        format: info.format,
        rows,
        cols,
        data: files.tensors.bytes(info),
    };
    let data = view.to_f32();
    let c = &files.config;
    let heads = match name.rsplit_once('.').map(|(stem, _)| stem) {
        Some(s) if s.ends_with(".attn_q") => c.num_heads,
        Some(s) if s.ends_with(".attn_k") => c.num_kv_heads,
        _ => 0,
    };
    let data = if c.rope_style == RopeStyle::Interleaved && heads > 0 {
        // A bias is a vector: its elements move like a matrix's rows.
        let row_len = if rows == 1 { 1 } else { cols };
        rows_from_interleaved(&data, row_len, heads)
    } else {
        data
    };
    Ok(F32Tensor { rows, cols, data })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::model::synthetic::permute_for_interleaved_rope;

    #[test]
    fn interleaved_rows_go_back_to_hugging_face_order() {
        let (heads, head_dim, cols) = (2, 4, 3);
        let hf: Vec<f32> = (0..heads * head_dim * cols).map(|i| i as f32).collect();
        let permuted = permute_for_interleaved_rope(&hf, heads, cols);
        assert_ne!(permuted, hf);
        assert_eq!(rows_from_interleaved(&permuted, cols, heads), hf);
    }
}
