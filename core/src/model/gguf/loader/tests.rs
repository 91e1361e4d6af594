//! The GGUF loader's tests: tiny models written with one thing broken.

use std::collections::HashMap;
use std::sync::Arc;

use super::super::testing::test_values;
use super::super::GgufWriter;
use super::*;
use crate::backend::RopeStyle;
use crate::model::synthetic::{llama_tensor_shapes, SyntheticModel};
use crate::model::Bytes;
use crate::quant::quantize_row;

/// A tiny llama-family model described as metadata and tensor shapes, so
/// tests can break one thing before writing it.
struct TinyModel {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<usize>)>,
}

const HIDDEN: usize = 64;
const FFN: usize = 96;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = HIDDEN / HEADS;
const LAYERS: usize = 2;
const TOKENS: [&str; 8] = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "Ġa", "bc"];

/// Test values, positive for `rope_freqs.weight` (divisors of frequencies).
fn tensor_values(name: &str, n: usize) -> Vec<f32> {
    let values = test_values(n);
    match name {
        "rope_freqs.weight" => values.iter().map(|v| 1.0 + v.abs()).collect(),
        _ => values,
    }
}

impl TinyModel {
    fn new(arch: &str) -> Self {
        let strings = |items: &[&str]| GgufValue::Array(GgufArray::String(items.iter().collect()));
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let metadata = vec![
            (
                "general.architecture".into(),
                GgufValue::String(arch.into()),
            ),
            (key("context_length"), GgufValue::U32(256)),
            (key("embedding_length"), GgufValue::U32(HIDDEN as u32)),
            (key("feed_forward_length"), GgufValue::U32(FFN as u32)),
            (key("block_count"), GgufValue::U32(LAYERS as u32)),
            (key("attention.head_count"), GgufValue::U32(HEADS as u32)),
            (
                key("attention.head_count_kv"),
                GgufValue::U32(KV_HEADS as u32),
            ),
            (
                key("attention.layer_norm_rms_epsilon"),
                GgufValue::F32(1e-5),
            ),
            (key("rope.freq_base"), GgufValue::F32(100000.0)),
            (
                "tokenizer.ggml.model".into(),
                GgufValue::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".into(),
                GgufValue::String("gpt-2".into()),
            ),
            ("tokenizer.ggml.tokens".into(), strings(&TOKENS)),
            (
                "tokenizer.ggml.merges".into(),
                strings(&["a b", "Ġ a", "b c"]),
            ),
            ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(0)),
        ];
        let vocab = TOKENS.len();
        let tensors = llama_tensor_shapes(HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, vocab);
        TinyModel { metadata, tensors }
    }

    fn set(&mut self, key: &str, value: GgufValue) {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), value));
    }

    fn shape_of(&mut self, name: &str) -> &mut Vec<usize> {
        let (_, shape) = self.tensors.iter_mut().find(|(n, _)| n == name).unwrap();
        shape
    }

    /// Writes every tensor as F32 (Q8_0 for the matrices when `quantize`).
    fn to_bytes(&self, quantize: bool) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (key, value) in &self.metadata {
            w.add_metadata(key, value.clone()).unwrap();
        }
        for (name, shape) in &self.tensors {
            let format = if quantize && shape.len() == 2 {
                WeightFormat::Q8_0
            } else {
                WeightFormat::F32
            };
            let data = quantize_row(format, &tensor_values(name, shape.iter().product()));
            w.add_tensor(name, format, shape, data).unwrap();
        }
        w.to_bytes()
    }

    fn load(&self) -> Result<ModelFiles> {
        let bytes = Arc::new(Bytes::Owned(self.to_bytes(true)));
        let path = Path::new("tiny.gguf");
        model_from_gguf(GgufFile::parse(bytes, path)?, path)
    }

    fn load_error(&self) -> String {
        match self.load() {
            Ok(_) => panic!("loaded a bad model"),
            Err(e) => e.to_string(),
        }
    }
}

#[test]
fn tiny_llama_loads() {
    let model = TinyModel::new("llama").load().unwrap();
    let c = &model.config;
    assert_eq!(c.arch, "llama");
    assert_eq!(c.vocab_size, TOKENS.len());
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_layers),
        (HIDDEN, FFN, LAYERS)
    );
    assert_eq!(
        (c.num_heads, c.num_kv_heads, c.head_dim),
        (HEADS, KV_HEADS, HEAD_DIM)
    );
    assert_eq!(c.rotary_dim, HEAD_DIM);
    assert_eq!(
        (c.rms_eps, c.layers[1].rope.theta, c.max_context),
        (1e-5, 100000.0, 256)
    );
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert_eq!(c.layers[0].rope.scaling, RopeScaling::None);
    assert!(c.tied_embeddings && !c.qkv_bias);
    assert_eq!(c.sliding_window(), None);
    let q = model.tensors.view("blk.1.attn_q.weight").unwrap();
    assert_eq!(
        (q.format, q.rows, q.cols),
        (WeightFormat::Q8_0, HIDDEN, HIDDEN)
    );
    assert!(model.tokenizer.encode("ab", false).is_ok());
    let shown: HashMap<_, _> = model.metadata.into_iter().collect();
    assert_eq!(shown["llama.block_count"], "2");
    assert_eq!(
        shown["tokenizer.ggml.tokens"],
        "[<|endoftext|>, a, b, c, Ġ, ab, Ġa, bc]"
    );
}

#[test]
fn qwen2_has_biases_and_neox_rope() {
    let mut tiny = TinyModel::new("qwen2");
    for layer in 0..LAYERS {
        tiny.tensors.extend([
            (format!("blk.{layer}.attn_q.bias"), vec![HIDDEN]),
            (format!("blk.{layer}.attn_k.bias"), vec![HEAD_DIM]),
            (format!("blk.{layer}.attn_v.bias"), vec![HEAD_DIM]),
        ]);
    }
    tiny.tensors
        .push(("output.weight".into(), vec![HIDDEN, TOKENS.len()]));
    let model = tiny.load().unwrap();
    assert_eq!(model.config.rope_style, RopeStyle::NeoX);
    assert!(model.config.qkv_bias && !model.config.tied_embeddings);

    tiny.tensors.retain(|(n, _)| n != "blk.1.attn_v.bias");
    let message = tiny.load_error();
    assert!(
        message.contains("missing tensor 'blk.1.attn_v.bias'"),
        "{message}"
    );
}

#[test]
fn rope_options_are_read() {
    let mut tiny = TinyModel::new("mistral");
    tiny.set(
        "mistral.rope.scaling.type",
        GgufValue::String("linear".into()),
    );
    tiny.set("mistral.rope.scaling.factor", GgufValue::F32(4.0));
    tiny.set("mistral.attention.sliding_window", GgufValue::U32(128));
    tiny.set("mistral.rope.dimension_count", GgufValue::U32(16));
    let c = tiny.load().unwrap().config;
    assert_eq!(
        c.layers[0].rope.scaling,
        RopeScaling::Linear { factor: 4.0 }
    );
    assert_eq!((c.sliding_window(), c.rotary_dim), (Some(128), 16));

    tiny.set(
        "mistral.rope.scaling.type",
        GgufValue::String("none".into()),
    );
    tiny.tensors.push(("rope_freqs.weight".into(), vec![8]));
    let c = tiny.load().unwrap().config;
    assert_eq!(
        c.layers[1].rope.scaling,
        RopeScaling::FreqFactors(tensor_values("rope_freqs.weight", 8))
    );

    tiny.set(
        "mistral.rope.scaling.type",
        GgufValue::String("yarn".into()),
    );
    let message = tiny.load_error();
    assert!(message.contains("RoPE scaling 'yarn'"), "{message}");
}

#[test]
fn missing_tensor_is_named() {
    let mut tiny = TinyModel::new("llama");
    tiny.tensors.retain(|(n, _)| n != "blk.1.ffn_up.weight");
    let message = tiny.load_error();
    assert!(
        message.contains("missing tensor 'blk.1.ffn_up.weight' (expected shape [64, 96])"),
        "{message}"
    );
}

#[test]
fn wrong_tensor_shape_is_named() {
    let mut tiny = TinyModel::new("llama");
    *tiny.shape_of("blk.0.attn_k.weight") = vec![HIDDEN, HIDDEN];
    let message = tiny.load_error();
    assert!(
        message.contains("tensor 'blk.0.attn_k.weight' has shape [64, 64], expected [64, 32]"),
        "{message}"
    );
}

#[test]
fn absurd_config_is_named() {
    let mut tiny = TinyModel::new("llama");
    tiny.set("llama.attention.head_count", GgufValue::U32(0));
    let message = tiny.load_error();
    assert!(
        message.contains("num_heads = 0 is out of range"),
        "{message}"
    );

    let mut tiny = TinyModel::new("llama");
    tiny.set("llama.block_count", GgufValue::String("two".into()));
    let message = tiny.load_error();
    assert!(
        message
            .contains("'llama.block_count' is String(\"two\"), expected an integer from 1 to 1024"),
        "{message}"
    );

    let mut tiny = TinyModel::new("llama");
    tiny.metadata.retain(|(k, _)| k != "llama.embedding_length");
    let message = tiny.load_error();
    assert!(
        message.contains("missing metadata key 'llama.embedding_length'"),
        "{message}"
    );

    let tiny = TinyModel::new("gemma");
    let message = tiny.load_error();
    assert!(message.contains("architecture 'gemma'"), "{message}");
}

#[test]
fn degenerate_values_are_refused_naming_the_key() {
    let cases = [
        (
            // Found by the gguf_reader fuzzer: the layers were described one
            // by one (4 billion of them) before the count was checked.
            "llama.block_count",
            GgufValue::U32(u32::MAX),
            "'llama.block_count' is U32(4294967295), expected an integer from 1 to 1024",
        ),
        (
            "llama.attention.sliding_window",
            GgufValue::U32(0),
            "'llama.attention.sliding_window' is U32(0), expected an integer of at least 1",
        ),
        (
            "llama.rope.freq_base",
            GgufValue::F32(f32::INFINITY),
            "'llama.rope.freq_base' is F32(inf), expected a finite number above 0",
        ),
        (
            "llama.rope.freq_base",
            GgufValue::F64(-1e4),
            "'llama.rope.freq_base' is F64(-10000.0), expected a finite number above 0",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(f32::NAN),
            "'llama.attention.layer_norm_rms_epsilon' is F32(NaN), expected a number between 0 and 1",
        ),
        (
            "llama.attention.head_count",
            GgufValue::U32(3),
            "'llama.embedding_length' 64 is not a multiple of 'llama.attention.head_count' 3, \
             and no 'llama.attention.key_length' gives the head size",
        ),
    ];
    for (key, value, expected) in cases {
        let mut tiny = TinyModel::new("llama");
        tiny.set(key, value);
        let message = tiny.load_error();
        assert!(message.contains(expected), "{message}");
    }
    for factor in [f32::INFINITY, f32::NAN, 0.0, -2.0] {
        let mut tiny = TinyModel::new("llama");
        tiny.set(
            "llama.rope.scaling.type",
            GgufValue::String("linear".into()),
        );
        tiny.set("llama.rope.scaling.factor", GgufValue::F32(factor));
        let message = tiny.load_error();
        let expected = format!(
            "'llama.rope.scaling.factor' is F32({factor:?}), expected a finite number above 0"
        );
        assert!(message.contains(&expected), "{message}");
    }
    let zero = Some(GgufValue::U32(0));
    let message = edited_error("tiny-gemma3", "", "gemma3.attention.sliding_window", zero);
    assert!(
        message.contains("'gemma3.attention.sliding_window' is U32(0), expected an integer"),
        "{message}"
    );
}

#[test]
fn rope_frequency_factors_must_be_positive_and_finite() {
    let mut tiny = TinyModel::new("llama");
    tiny.tensors
        .push(("rope_freqs.weight".into(), vec![HEAD_DIM / 2]));
    let bytes = tiny.to_bytes(true);
    let path = Path::new("tiny.gguf");
    let offset = GgufFile::parse(Arc::new(Bytes::Owned(bytes.clone())), path)
        .unwrap()
        .tensor("rope_freqs.weight")
        .unwrap()
        .offset;
    for (pair, bad) in [(0, 0.0f32), (3, f32::NAN), (15, f32::INFINITY), (7, -1.0)] {
        let mut bytes = bytes.clone();
        let at = offset + 4 * pair;
        bytes[at..at + 4].copy_from_slice(&bad.to_le_bytes());
        let file = GgufFile::parse(Arc::new(Bytes::Owned(bytes)), path).unwrap();
        let message = model_from_gguf(file, path).err().unwrap().to_string();
        let expected = format!("tensor 'rope_freqs.weight' holds {bad} for pair {pair}");
        assert!(message.contains(&expected), "{message}");
    }
}

#[test]
fn vocabulary_must_match_the_embedding_rows() {
    let tokens = |n: usize| {
        let padding = (TOKENS.len()..n).map(|i| format!("<pad{i}>"));
        let tokens = TOKENS.iter().map(|t| t.to_string()).chain(padding).take(n);
        GgufValue::Array(GgufArray::String(tokens.collect()))
    };
    let mut tiny = TinyModel::new("llama");
    tiny.set("tokenizer.ggml.tokens", tokens(TOKENS.len() + 1));
    let message = tiny.load_error();
    assert!(
        message.contains("'tokenizer.ggml.tokens' has 9 tokens but 'token_embd.weight' has 8 rows"),
        "{message}"
    );
    tiny.set("tokenizer.ggml.tokens", tokens(TOKENS.len() - 1));
    let message = tiny.load_error();
    assert!(
        message.contains("'tokenizer.ggml.tokens' has 7 tokens but 'token_embd.weight' has 8 rows"),
        "{message}"
    );
}

/// A synthetic model's GGUF file, rewritten without the tensor `drop`
/// and with `key` set to `value` (or removed when `value` is `None`).
fn edited_preset(
    preset: &str,
    drop: &str,
    key: &str,
    value: Option<GgufValue>,
) -> Result<ModelFiles> {
    let model = SyntheticModel::preset(preset, WeightFormat::F32, 4).unwrap();
    let path = Path::new("edited.gguf");
    let bytes = Arc::new(Bytes::Owned(model.to_gguf().unwrap()));
    let file = GgufFile::parse(bytes, path).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &file.metadata {
        if k != key {
            w.add_metadata(k, v.clone()).unwrap();
        }
    }
    if let Some(value) = value {
        w.add_metadata(key, value).unwrap();
    }
    for info in file.tensors.iter().filter(|t| t.name != drop) {
        let data = file.tensor_data(info).unwrap().to_vec();
        w.add_tensor(&info.name, info.format, &info.shape, data)
            .unwrap();
    }
    let bytes = Arc::new(Bytes::Owned(w.to_bytes()));
    model_from_gguf(GgufFile::parse(bytes, path)?, path)
}

fn edited_error(preset: &str, drop: &str, key: &str, value: Option<GgufValue>) -> String {
    match edited_preset(preset, drop, key, value) {
        Ok(_) => panic!("loaded a bad {preset}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_preset_architecture_reads_back_its_configuration() {
    for name in ["tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"] {
        let model = SyntheticModel::preset(name, WeightFormat::F32, 4).unwrap();
        let loaded = edited_preset(name, "", "", None).unwrap();
        assert_eq!(loaded.config, model.config, "{name}");
    }
    let gemma = edited_preset("tiny-gemma3", "", "", None).unwrap().config;
    let globals: Vec<usize> = (0..gemma.num_layers)
        .filter(|&i| gemma.layers[i].sliding_window.is_none())
        .collect();
    assert_eq!(globals, [5]);
    assert_eq!(gemma.layers[0].rope.theta, arch::GEMMA3_LOCAL_ROPE_THETA);
    assert_eq!(gemma.layers[0].rope.scaling, RopeScaling::None);
    assert_eq!(
        gemma.layers[5].rope.scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
    assert_eq!(gemma.rope_style, RopeStyle::NeoX);
    assert!(gemma.block.post_norms && gemma.block.qk_norm);
    assert_eq!(gemma.q_dim(), 96, "key_length, not hidden / heads");
}

#[test]
fn missing_architecture_tensors_and_keys_are_named() {
    let message = edited_error("tiny-gemma3", "blk.3.post_ffw_norm.weight", "", None);
    assert!(
        message.contains("missing tensor 'blk.3.post_ffw_norm.weight' (expected shape [64])"),
        "{message}"
    );
    let message = edited_error("tiny-qwen3", "blk.2.attn_k_norm.weight", "", None);
    assert!(
        message.contains("missing tensor 'blk.2.attn_k_norm.weight' (expected shape [24])"),
        "{message}"
    );
    let message = edited_error("tiny-qwen2", "blk.0.attn_q.bias", "", None);
    assert!(
        message.contains("missing tensor 'blk.0.attn_q.bias'"),
        "{message}"
    );
    let window = "gemma3.attention.sliding_window";
    let message = edited_error("tiny-gemma3", "", window, None);
    assert!(
        message.contains("missing metadata key 'gemma3.attention.sliding_window'"),
        "{message}"
    );
    let text = Some(GgufValue::String("512".into()));
    let message = edited_error("tiny-gemma3", "", window, text);
    assert!(
        message.contains("'gemma3.attention.sliding_window' is String(\"512\"), expected an integer of at least 1"),
        "{message}"
    );
    let float = Some(GgufValue::U32(7));
    let message = edited_error("tiny-qwen3", "", "qwen3.rope.freq_base", float);
    assert!(
        message.contains("'qwen3.rope.freq_base' is U32(7), expected a finite number above 0"),
        "{message}"
    );
}

#[test]
fn gemma3_27b_scales_attention_by_its_query_pre_attn_scalar() {
    let gemma = arch::by_gguf_name("gemma3").unwrap();
    let llama = arch::by_gguf_name("llama").unwrap();
    assert_eq!(gguf_attention_scale(gemma, 26, 1152, 4, 256), 1.0 / 16.0);
    assert_eq!(
        gguf_attention_scale(gemma, 62, 5376, 32, 128),
        1.0 / 168f32.sqrt()
    );
    assert_eq!(
        gguf_attention_scale(llama, 62, 5376, 32, 128),
        1.0 / 128f32.sqrt()
    );
}
