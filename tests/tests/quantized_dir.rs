//! Quantized model directories: `write_model_dir` with a different weight
//! format per tensor, loaded back by `tandem_core::model::load`, give the
//! logits of the same model with every matrix replaced by its dequantized
//! values.

use tandem_core::model::safetensors::{write_model_dir, OutputTensor};
use tandem_core::model::ModelFiles;
use tandem_core::quant::{quantize_matrix, WeightFormat};
use tandem_tests::{cpu_engine, max_abs_diff, tiny, tiny_gguf};

/// The formats the matrices take in turn (INT4 with groups of 128 only
/// where the columns allow it).
const FORMATS: [WeightFormat; 5] = [
    WeightFormat::Int8PerChannel,
    WeightFormat::W8A8,
    WeightFormat::Int4 {
        group: tandem_core::quant::Int4Group::G64,
    },
    WeightFormat::Q8_0,
    WeightFormat::Q4_1,
];

/// Every matrix of `source` quantized (round to nearest) into a format
/// picked from [`FORMATS`] (or by `pick`), and the same matrices
/// dequantized to F32.
fn quantized_and_dequantized(
    source: &ModelFiles,
    pick: impl Fn(usize, usize) -> WeightFormat,
) -> (Vec<OutputTensor>, Vec<OutputTensor>) {
    let mut quantized = Vec::new();
    let mut dense = Vec::new();
    for (i, info) in source.tensors.tensors().iter().enumerate() {
        if info.shape.len() != 2 {
            continue;
        }
        let view = source.tensors.view(&info.name).unwrap();
        let format = pick(i, view.cols);
        let data = quantize_matrix(format, view.cols, &view.to_f32());
        let back = tandem_core::quant::WeightView {
            format,
            rows: view.rows,
            cols: view.cols,
            data: &data,
        }
        .to_f32();
        dense.push(OutputTensor {
            name: info.name.clone(),
            format: WeightFormat::F32,
            rows: view.rows,
            cols: view.cols,
            data: back.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
        quantized.push(OutputTensor {
            name: info.name.clone(),
            format,
            rows: view.rows,
            cols: view.cols,
            data,
        });
    }
    (quantized, dense)
}

fn logits(files: &ModelFiles, ids: &[u32]) -> Vec<f32> {
    cpu_engine(files, 64, 512).score(ids, 0).unwrap()
}

#[test]
fn a_copied_gguf_model_gives_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny(WeightFormat::F32, 31);
    model.config.qkv_bias = true;
    let source = tiny_gguf(dir.path(), &model);
    let out = dir.path().join("copy");
    write_model_dir(&source, Vec::new(), &[], &out).unwrap();
    let copy = tandem_core::model::load(&out).unwrap();
    assert!(copy.config.qkv_bias);
    let ids = source.tokenizer.encode("a tin can, heated", true).unwrap();
    assert_eq!(
        copy.tokenizer.encode("a tin can, heated", true).unwrap(),
        ids
    );
    let diff = max_abs_diff(&logits(&source, &ids), &logits(&copy, &ids));
    assert!(diff < 1e-4, "max |diff| {diff}");
}

#[test]
fn mixed_formats_load_and_match_their_dequantized_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny(WeightFormat::F32, 32);
    let c = &mut model.config;
    (c.hidden_size, c.intermediate_size, c.head_dim, c.rotary_dim) = (128, 256, 32, 32);
    let source = tiny_gguf(dir.path(), &model);
    let pick = |i: usize, cols: usize| {
        if i.is_multiple_of(3) && cols.is_multiple_of(128) {
            WeightFormat::int4(128).unwrap()
        } else {
            FORMATS[i % FORMATS.len()]
        }
    };
    let (quantized, dense) = quantized_and_dequantized(&source, pick);
    let formats: Vec<(String, WeightFormat)> = quantized
        .iter()
        .map(|t| (t.name.clone(), t.format))
        .collect();
    let used: std::collections::HashSet<WeightFormat> = formats.iter().map(|f| f.1).collect();
    assert_eq!(used.len(), FORMATS.len() + 1, "every format is exercised");

    let quantized_dir = dir.path().join("quantized");
    let metadata = [("tandem.quantization".to_string(), "rtn (test)".to_string())];
    write_model_dir(&source, quantized, &metadata, &quantized_dir).unwrap();
    let dense_dir = dir.path().join("dense");
    write_model_dir(&source, dense, &[], &dense_dir).unwrap();

    let loaded = tandem_core::model::load(&quantized_dir).unwrap();
    for (name, format) in &formats {
        assert_eq!(loaded.tensors.info(name).unwrap().format, *format, "{name}");
    }
    assert!(loaded
        .metadata
        .iter()
        .any(|(k, v)| k.ends_with("tandem.quantization") && v == "rtn (test)"));
    let dense = tandem_core::model::load(&dense_dir).unwrap();
    let ids = source
        .tokenizer
        .encode("the inner heat of a tin can", true)
        .unwrap();
    let (got, want) = (logits(&loaded, &ids), logits(&dense, &ids));
    // W8A8 layers quantize their activations to 8 bits: that is the only
    // difference from the dequantized model.
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = max_abs_diff(&got, &want);
    assert!(
        diff < 0.02 * scale,
        "max |diff| {diff}, largest logit {scale}"
    );
}
