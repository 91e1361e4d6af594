//! MoE models whose matrices are k-quants, mixed as llama.cpp's Q4_K_M
//! writes them, and the NumPy reference of a MoE forward pass
//! (`tests/reference/moe_reference.py`).
//!
//! The tiny presets are 64 wide, narrower than one 256-element k-quant
//! super-block, so these widen the hidden size to 256 and the experts to
//! 512 (Mixtral) or 320 with a 384-wide shared expert (Qwen2-MoE): rows
//! that are not whole super-blocks take Q4_K_M's fallbacks, as they do in
//! Qwen1.5-MoE's real Q4_K_M file (expert width 1408).

use std::path::Path;

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;

use crate::http_client::venv_python;

/// The MoE presets widened here: `tiny-mixtral` and `tiny-qwen2moe`.
pub const KQUANT_MOE_PRESETS: [&str; 2] = ["tiny-mixtral", "tiny-qwen2moe"];

/// `name` widened to whole k-quant super-blocks (see the module doc).
pub fn widened_moe(name: &str, seed: u64) -> SyntheticModel {
    let mut model = SyntheticModel::preset(name, WeightFormat::Q8_0, seed).unwrap();
    let c = &mut model.config;
    c.hidden_size = 256;
    let moe = c.moe.as_mut().expect("a MoE preset");
    match moe.shared_ffn {
        Some(_) => {
            c.intermediate_size = 320;
            moe.shared_ffn = Some(384);
        }
        None => c.intermediate_size = 512,
    }
    model
}

/// The format llama.cpp's Q4_K_M gives a matrix of `cols` columns
/// (`llama_tensor_get_type`, simplified): Q6_K for the output, V and the
/// first layer's down projections, Q4_K for the rest; Q8_0 and Q5_0 in
/// their place where a row is not whole super-blocks; routers stay F32.
pub fn q4_k_m_format(name: &str, shape: &[usize]) -> WeightFormat {
    let cols = shape[0];
    if name.contains("ffn_gate_inp") {
        return WeightFormat::F32;
    }
    let more_bits = name == "output.weight"
        || name.contains("attn_v")
        || (name.starts_with("blk.0.") && name.contains("ffn_down"));
    match (more_bits, cols.is_multiple_of(256)) {
        (true, true) => WeightFormat::Q6_K,
        (true, false) => WeightFormat::Q8_0,
        (false, true) => WeightFormat::Q4_K,
        (false, false) => WeightFormat::Q5_0,
    }
}

/// Writes `model` to `dir/model.gguf` in the Q4_K_M mix and loads it.
pub fn q4_k_m_gguf(dir: &Path, model: &SyntheticModel) -> ModelFiles {
    let path = dir.join("model.gguf");
    let bytes = model.to_gguf_with_formats(&q4_k_m_format).unwrap();
    std::fs::write(&path, bytes).unwrap();
    tandem_core::model::load(&path).unwrap()
}

/// The logits of every position of `tokens` from `moe_reference.py` on the
/// GGUF file at `path` (float64 arithmetic, `gguf`'s dequantizers).
pub fn moe_reference_logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/reference/moe_reference.py");
    let tokens: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = std::process::Command::new(venv_python())
        .arg(script)
        .arg(path)
        .arg(tokens.join(","))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect()
}
