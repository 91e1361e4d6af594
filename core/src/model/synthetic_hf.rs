//! A random model as a Hugging Face directory (`SyntheticModel::write_hf_dir`),
//! MoE tensors under their Hugging Face names (`safetensors::moe_names`):
//! one tensor per expert, or Granite's stacked `input_linear`/`output_linear`.
//! The weights are drawn and written one piece at a time (an expert's matrix
//! at most), so shapes of real MoE models fit in memory.

use std::collections::HashSet;
use std::path::Path;

use super::arch;
use super::experts::ExpertMatrix;
use super::safetensors::moe_names::{hf_expert_name, hf_moe_module_name};
use super::safetensors::{hf_name, SafetensorsWriter};
use super::synthetic::{random_run, synthetic_tokenizer, SyntheticModel, SPECIAL_TOKENS};
use crate::quant::{quantize_row, WeightFormat};
use crate::sched::Rng;
use crate::{Error, Result};

impl SyntheticModel {
    /// Writes the model as a Hugging Face directory: `config.json`,
    /// `model.safetensors` (matrices in F32, or F16/BF16 when that is the
    /// model's format), `tokenizer.json` and `tokenizer_config.json`. The
    /// weights are drawn and written one piece at a time (an expert's
    /// matrix at most), so shapes of real MoE models fit in memory.
    pub fn write_hf_dir(&self, dir: &Path) -> Result<()> {
        let c = &self.config;
        let format = match self.format {
            WeightFormat::F16 | WeightFormat::BF16 => self.format,
            _ => WeightFormat::F32,
        };
        let format_of = |shape: &[usize]| match shape.len() {
            1 => WeightFormat::F32,
            _ => format,
        };
        let family = arch::by_gguf_name_moe(&c.arch, c.moe.is_some())
            .expect("presets are of known families");
        let pieces_of = |name: &str, shape: &[usize]| {
            hf_moe_pieces(family.hf, name, shape).unwrap_or_else(|| {
                let name = hf_name(name, c.block.post_norms)
                    .expect("synthetic tensors have Hugging Face names");
                let shape = shape.to_vec();
                vec![HfPiece {
                    name,
                    shape,
                    offset: 0,
                }]
            })
        };
        let shapes = self.tensor_shapes();
        let mut st = SafetensorsWriter::new();
        st.add_metadata("format", "pt");
        let mut declared = HashSet::new();
        for (name, shape) in &shapes {
            for piece in pieces_of(name, shape) {
                if declared.insert(piece.name.clone()) {
                    let outer_first: Vec<usize> = piece.shape.iter().rev().copied().collect();
                    st.declare_tensor(&piece.name, format_of(&piece.shape), &outer_first)?;
                }
            }
        }
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut file = st.create(&dir.join("model.safetensors"))?;
        let mut rng = Rng::new(self.seed);
        for (name, shape) in &shapes {
            let pieces = pieces_of(name, shape);
            let run = shape.iter().product::<usize>() / pieces.len();
            let tensor_format = format_of(shape);
            for piece in pieces {
                let mut values = random_run(&mut rng, name, shape, run);
                if family.hf_norm_offset && name.ends_with("norm.weight") {
                    values.iter_mut().for_each(|w| *w -= 1.0);
                }
                let offset = piece.offset * tensor_format.row_bytes(1).unwrap_or(0);
                file.write_at(&piece.name, offset, &quantize_row(tensor_format, &values))?;
            }
        }
        let io = |path: std::path::PathBuf, r: std::io::Result<()>| {
            r.map_err(|source| Error::Io { path, source })
        };
        let config = super::safetensors::hf_config_json(c)?;
        let path = dir.join("config.json");
        io(path.clone(), std::fs::write(&path, config.to_string()))?;
        let tokenizer = synthetic_tokenizer(c.vocab_size)?;
        let path = dir.join("tokenizer.json");
        io(path.clone(), std::fs::write(&path, tokenizer.to_hf_json()?))?;
        let tokenizer_config = serde_json::json!({
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[0],
            "add_bos_token": false,
        });
        let path = dir.join("tokenizer_config.json");
        io(
            path.clone(),
            std::fs::write(&path, tokenizer_config.to_string()),
        )
    }
}

/// Where one piece of a canonical tensor's values goes in a Hugging Face
/// file: into tensor `name` (of `shape`, innermost first) from element
/// `offset` on.
struct HfPiece {
    name: String,
    shape: Vec<usize>,
    offset: usize,
}

/// The pieces of canonical MoE tensor `name` (of `shape`) for the family
/// `hf_class`, one per equal consecutive run of its values: per expert for
/// stacked experts, which land in one tensor each, or interleaved in
/// Granite's `input_linear` (per expert its gate rows, then its up rows);
/// one piece for a router or shared expert. `None` for a tensor that is not
/// a MoE tensor.
fn hf_moe_pieces(hf_class: &str, name: &str, shape: &[usize]) -> Option<Vec<HfPiece>> {
    let (layer, module) = layer_module(name)?;
    let stacked = ExpertMatrix::ALL
        .into_iter()
        .find(|m| m.stacked_name(layer) == name);
    let whole = |name: String, shape: Vec<usize>| {
        vec![HfPiece {
            name,
            shape,
            offset: 0,
        }]
    };
    let Some(matrix) = stacked else {
        return Some(whole(
            hf_moe_module_name(hf_class, layer, module)?,
            shape.to_vec(),
        ));
    };
    let (cols, rows, experts) = (shape[0], shape[1], shape[2]);
    let per = cols * rows;
    let granite =
        |module: &str| hf_moe_module_name("GraniteMoeForCausalLM", layer, module).expect("granite");
    Some(match (hf_class == "GraniteMoeForCausalLM", matrix) {
        (true, ExpertMatrix::Down) => whole(granite("ffn_down_exps"), shape.to_vec()),
        (true, gate_or_up) => {
            let after_gate = usize::from(gate_or_up == ExpertMatrix::Up) * per;
            (0..experts)
                .map(|e| HfPiece {
                    name: granite("ffn_gate_up_exps"),
                    shape: vec![cols, 2 * rows, experts],
                    offset: 2 * per * e + after_gate,
                })
                .collect()
        }
        (false, m) => (0..experts)
            .map(|e| HfPiece {
                name: hf_expert_name(hf_class, layer, m, e),
                shape: vec![cols, rows],
                offset: 0,
            })
            .collect(),
    })
}

/// `(N, module)` of a canonical `blk.N.module.weight`.
fn layer_module(name: &str) -> Option<(usize, &str)> {
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((layer.parse().ok()?, rest.strip_suffix(".weight")?))
}
