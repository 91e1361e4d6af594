//! What the fuzz targets share: one input split into several files, a tiny
//! tokenizer, and the weights of a tiny Llama.

use std::sync::Arc;

use tandem_core::model::gguf::{GgufArray, GgufFile, GgufValue};
use tandem_core::model::safetensors::{hf_name, SafetensorsWriter};
use tandem_core::model::synthetic::{tokenizer_metadata, SyntheticModel};
use tandem_core::model::{expected_tensors, Bytes, LayerSpec};
use tandem_core::quant::WeightFormat;
use tandem_core::tokenizer::Tokenizer;

/// Splits `data` at NUL bytes into `n` parts (the last keeps any further
/// NULs); parts past the end of the input are empty. NUL never occurs in the
/// JSON and template texts the targets feed, so a seed is its files joined by NULs.
pub fn split_parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut parts: Vec<&[u8]> = data.splitn(n, |&b| b == 0).collect();
    parts.resize(n, &[]);
    parts
}

/// The synthetic byte-level BPE tokenizer (256 byte tokens, 3 control
/// tokens, 4 merges).
pub fn tiny_tokenizer() -> tandem_core::Result<Tokenizer> {
    let file = GgufFile {
        version: 3,
        metadata: tokenizer_metadata(0),
        tensors: Vec::new(),
        bytes: Arc::new(Bytes::Owned(Vec::new())),
    };
    Tokenizer::from_gguf(&file)
}

/// A SentencePiece tokenizer (`<unk>`, `<s>`, `</s>`, the 256 byte tokens and
/// `▁`) with `chat_template`: cheap to build, as it compiles no regex, so a
/// target can build one per input.
pub fn template_tokenizer(chat_template: &str) -> tandem_core::Result<Tokenizer> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|byte| format!("<0x{byte:02X}>")));
    types.extend([6; 256]);
    tokens.push("▁".into());
    types.push(1);
    let scores = vec![0.0; tokens.len()];
    let metadata = vec![
        (
            "tokenizer.ggml.model".into(),
            GgufValue::String("llama".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::String(tokens.iter().collect())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(types)),
        ),
        (
            "tokenizer.ggml.scores".into(),
            GgufValue::Array(GgufArray::F32(scores)),
        ),
        (
            "tokenizer.chat_template".into(),
            GgufValue::String(chat_template.into()),
        ),
    ];
    let file = GgufFile {
        version: 3,
        metadata,
        tensors: Vec::new(),
        bytes: Arc::new(Bytes::Owned(Vec::new())),
    };
    Tokenizer::from_gguf(&file)
}

/// `model.safetensors` of a Llama with 8 tokens, hidden size 32, FFN 32, two
/// heads of 16 (one KV head) and one layer: the shapes the `hf_model_dir`
/// seeds' `config.json` describes.
pub fn tiny_llama_safetensors() -> Vec<u8> {
    let mut model = SyntheticModel::preset("tiny", WeightFormat::F32, 0).expect("a preset");
    let c = &mut model.config;
    (c.vocab_size, c.hidden_size, c.intermediate_size) = (8, 32, 32);
    (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) = (1, 2, 1, 16);
    c.rotary_dim = 16;
    c.layers = LayerSpec::uniform(1, None, c.layers[0].rope.clone());
    let mut writer = SafetensorsWriter::new();
    for (name, shape) in expected_tensors(c) {
        let hf = hf_name(&name, false).expect("Llama tensors have Hugging Face names");
        let outermost_first: Vec<usize> = shape.iter().rev().copied().collect();
        let data = vec![0u8; 4 * shape.iter().product::<usize>()];
        writer
            .add_tensor(&hf, WeightFormat::F32, &outermost_first, data)
            .expect("shapes and sizes agree");
    }
    writer.to_bytes()
}
