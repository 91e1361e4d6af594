//! The loader on the tensor names and shapes of published MoE checkpoints
//! (`olmoe-1b-7b`, `qwen1.5-moe-a2.7b`, `mixtral-8x7b`: their config.json
//! sizes, expert counts, expert widths and shared expert) with random
//! weights, cut to one layer and a 1024-token vocabulary so that they fit a
//! test: GGUF files in llama.cpp's layout (Q4_0) and Hugging Face
//! directories (BF16, one tensor per expert) load and give finite logits.
//! Mixtral's one layer of experts is 1.4 G parameters (2.8 GB in BF16): the
//! directory writer draws and writes one expert's matrix at a time.

use std::path::Path;

use tandem_core::model::gguf::GgufWriter;
use tandem_core::model::synthetic::{gguf_metadata, SyntheticModel};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_tests::cpu_engine;

const VOCAB: usize = 1024;
const PROMPT: [u32; 9] = [1, 500, 77, 1000, 3, 64, 900, 12, 345];

fn cut(name: &str, format: WeightFormat) -> SyntheticModel {
    let mut model = SyntheticModel::preset(name, format, 3)
        .unwrap()
        .with_layers(1)
        .unwrap();
    model.config.vocab_size = VOCAB;
    model
}

/// Writes `model` as a GGUF file with its quantized blocks drawn directly
/// (no f32 copy of the weights).
fn write_gguf(model: &SyntheticModel, path: &Path) {
    let files = model.files().unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in gguf_metadata(&model.config) {
        w.add_metadata(&key, value).unwrap();
    }
    for t in files.tensors.tensors() {
        let data = files.tensors.bytes(t).to_vec();
        w.add_tensor(&t.name, t.format, &t.shape, data).unwrap();
    }
    w.write(path).unwrap();
}

/// The loaded model has the preset's experts and gives finite logits.
fn check(files: &ModelFiles, model: &SyntheticModel, what: &str) {
    let (want, got) = (model.config.moe.unwrap(), files.config.moe.unwrap());
    assert_eq!(got, want, "{what}");
    assert_eq!(
        files.config.intermediate_size, model.config.intermediate_size,
        "{what}: expert width"
    );
    let logits = cpu_engine(files, 64, 64).score(&PROMPT, 0).unwrap();
    assert_eq!(logits.len(), PROMPT.len() * VOCAB, "{what}");
    assert!(logits.iter().all(|v| v.is_finite()), "{what}: logits");
}

#[test]
fn published_moe_shapes_load_from_gguf() {
    for name in ["olmoe-1b-7b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"] {
        let dir = tempfile::tempdir().unwrap();
        let model = cut(name, WeightFormat::Q4_0);
        let path = dir.path().join("model.gguf");
        write_gguf(&model, &path);
        let files = tandem_core::model::load(&path).unwrap();
        check(&files, &model, name);
    }
}

#[test]
fn published_moe_shapes_load_from_hugging_face_directories() {
    for name in ["olmoe-1b-7b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"] {
        let dir = tempfile::tempdir().unwrap();
        let model = cut(name, WeightFormat::BF16);
        model.write_hf_dir(dir.path()).unwrap();
        let files = tandem_core::model::load(dir.path()).unwrap();
        check(&files, &model, name);
    }
}
