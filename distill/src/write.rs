//! The student as an ordinary model directory that the Hugging Face loader
//! reads: `config.json` (the target's, with the student's layers),
//! `model.safetensors` (trained tensors in the chosen format, the target's
//! embedding and head copied as they are: the whole head, or with a reduced
//! output vocabulary the head rows of its tokens, in the target's format),
//! and the target's tokenizer files.

use std::path::Path;

use tandem_core::model::safetensors::{
    hf_config_json, hf_name, write_tokenizer_files, SafetensorsWriter,
};
use tandem_core::model::ModelFiles;
use tandem_core::quant::{quantize_row, WeightFormat};

use crate::student::Student;
use crate::{Error, Result};

/// `__metadata__` key naming the target layers the student started from.
pub const SOURCE_LAYERS_KEY: &str = "tandem.distill.source_layers";

/// Writes `student`, distilled from `target`, into `dir` (created if
/// needed); its matrices in `format`, norms and biases in f32.
pub fn write_student(
    target: &ModelFiles,
    student: &Student,
    format: WeightFormat,
    dir: &Path,
) -> Result<()> {
    let c = &student.config;
    let mut st = SafetensorsWriter::new();
    let layers: Vec<String> = student
        .source_layers()
        .iter()
        .map(usize::to_string)
        .collect();
    st.add_metadata(SOURCE_LAYERS_KEY, &layers.join(","));
    // Each frozen tensor, and the head rows it keeps of a reduced vocabulary.
    let mut frozen = vec![("token_embd.weight", None)];
    if !c.tied_embeddings {
        frozen.push(("output.weight", c.output_tokens.as_deref()));
    }
    // The target's head: its own matrix, or the embedding when tied.
    let head = match target.config.tied_embeddings {
        true => "token_embd.weight",
        false => "output.weight",
    };
    for (name, rows) in frozen {
        let source = if rows.is_some() { head } else { name };
        let info = target
            .tensors
            .info(source)
            .ok_or_else(|| Error::MissingTensor(source.into()))?;
        let bytes = target.tensors.bytes(info);
        let (shape, bytes) = match rows {
            None => ([info.rows(), info.cols()], bytes.to_vec()),
            Some(rows) => {
                let row_bytes = info.format.row_bytes(info.cols()).ok_or_else(|| {
                    Error::Unsupported(format!("{source} is not stored row by row"))
                })?;
                let picked = rows
                    .iter()
                    .flat_map(|&r| &bytes[r as usize * row_bytes..(r as usize + 1) * row_bytes])
                    .copied()
                    .collect();
                ([rows.len(), info.cols()], picked)
            }
        };
        st.add_tensor(&hf(name, student)?, info.format, &shape, bytes)?;
    }
    for t in student.trained_tensors()? {
        let (format, bytes) = match t.shape.as_slice() {
            [_, cols] => (format, encode_matrix(&t.name, format, *cols, &t.data)?),
            _ => (WeightFormat::F32, quantize_row(WeightFormat::F32, &t.data)),
        };
        st.add_tensor(&hf(&t.name, student)?, format, &t.shape, bytes)?;
    }
    let io = |path: &Path, r: std::io::Result<()>| {
        r.map_err(|source| {
            Error::Core(tandem_core::Error::Io {
                path: path.to_path_buf(),
                source,
            })
        })
    };
    io(dir, std::fs::create_dir_all(dir))?;
    st.write(&dir.join("model.safetensors"))?;
    let config = dir.join("config.json");
    io(
        &config,
        std::fs::write(&config, hf_config_json(c)?.to_string()),
    )?;
    write_tokenizer_files(target, dir)?;
    Ok(())
}

fn hf(name: &str, student: &Student) -> Result<String> {
    hf_name(name, student.config.block.post_norms)
        .ok_or_else(|| Error::Unsupported(format!("tensor '{name}' has no Hugging Face name")))
}

/// A matrix of rows of `cols` in `format`, row by row.
fn encode_matrix(name: &str, format: WeightFormat, cols: usize, data: &[f32]) -> Result<Vec<u8>> {
    if format.row_bytes(cols).is_none() {
        return Err(Error::InvalidInput(format!(
            "{} rows of {name} ({cols} values) do not split into its blocks of {}",
            format.name(),
            format.block_elems()
        )));
    }
    Ok(data
        .chunks_exact(cols)
        .flat_map(|row| quantize_row(format, row))
        .collect())
}
