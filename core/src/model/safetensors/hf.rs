//! The Hugging Face directory loader: `config.json` (through
//! [`hf_config`](super::hf_config)), the weights of one or several
//! safetensors files under canonical names, and `tokenizer.json`.

// The directory loader needs a file system, which the browser lacks.
#![cfg_attr(target_arch = "wasm32", allow(dead_code, unused_imports))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::hf_config::HfConfig;
use super::names::canonical_name;
use super::{
    SafetensorsFile, CONFIG_FILE, FORMAT_METADATA_PREFIX, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILE,
};
use crate::model::experts::ExpertMatrix;
use crate::model::{check_tensors, Bytes, ModelFiles, TensorInfo, TensorStore};
use crate::quant::WeightFormat;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// Loads a Hugging Face model directory.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_hf_dir(dir: &Path) -> Result<ModelFiles> {
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.is_file() {
        return Err(Error::bad_file(
            dir,
            format!("no {CONFIG_FILE} in the model directory"),
        ));
    }
    let config_text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
        path: config_path.clone(),
        source,
    })?;
    let hf_config = HfConfig::from_json(&config_text, &config_path)?;
    let family = hf_config.family(&config_path)?;

    let mut tensors = TensorStore::default();
    let mut file_metadata = Vec::new();
    for shard in weight_files(dir)? {
        let path = dir.join(&shard);
        let file = SafetensorsFile::open(&path)?;
        let index = tensors.add_file(file.bytes.clone());
        for info in file.tensors {
            let Some(name) = canonical_name(&info.name, family.block.post_norms) else {
                continue;
            };
            if tensors.info(&name).is_some() {
                return Err(Error::bad_file(
                    &path,
                    format!("tensor '{}' appears in more than one file", info.name),
                ));
            }
            tensors.insert(TensorInfo {
                name,
                file: index,
                ..info
            });
        }
        // Per-tensor formats show in the tensors themselves, not as metadata.
        file_metadata.extend(
            file.metadata
                .into_iter()
                .filter(|(k, _)| !k.starts_with(FORMAT_METADATA_PREFIX))
                .map(|(k, v)| (format!("{shard}: {k}"), v)),
        );
    }

    if family.hf_norm_offset {
        add_one_to_norms(&mut tensors);
    }
    split_gate_up_experts(&mut tensors, dir)?;
    let config = hf_config.to_model_config(&tensors, &config_path)?;
    config.validate().map_err(|e| match e {
        Error::Unsupported(reason) => {
            Error::bad_file(&config_path, format!("bad model configuration: {reason}"))
        }
        other => other,
    })?;
    check_tensors(&config, &tensors, dir)?;
    if !dir.join(TOKENIZER_FILE).is_file() {
        return Err(Error::bad_file(
            dir,
            format!("no {TOKENIZER_FILE} in the model directory"),
        ));
    }
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let mut metadata = config_metadata(&config_text);
    metadata.extend(file_metadata);
    Ok(ModelFiles {
        path: dir.to_path_buf(),
        config,
        tensors,
        tokenizer,
        metadata,
    })
}

/// Granite-MoE's stacked `input_linear` (`[experts, 2·ffn, hidden]`) as
/// each expert's own gate and up tensors: byte ranges of the same file
/// (`super::moe_names`).
fn split_gate_up_experts(tensors: &mut TensorStore, dir: &Path) -> Result<()> {
    let suffix = format!(".{}.weight", super::moe_names::GATE_UP_EXPS);
    let stacked: Vec<TensorInfo> = tensors
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with(&suffix))
        .cloned()
        .collect();
    for info in stacked {
        let layer = info
            .name
            .trim_end_matches(&suffix)
            .trim_start_matches("blk.");
        let layer: usize = layer
            .parse()
            .map_err(|_| Error::bad_file(dir, format!("tensor '{}' names no layer", info.name)))?;
        let [hidden, rows, experts] = info.shape[..] else {
            return Err(Error::bad_file(
                dir,
                format!(
                    "tensor '{}' has shape {:?}, expected [hidden, 2·ffn, experts] (innermost first)",
                    info.name, info.shape
                ),
            ));
        };
        let ffn = rows / 2;
        let half = info
            .format
            .bytes_for(ffn as u64, hidden as u64)
            .filter(|_| rows % 2 == 0 && !info.format.is_quantized())
            .ok_or_else(|| {
                Error::bad_file(
                    dir,
                    format!(
                        "tensor '{}' ({}) does not split into gate and up halves",
                        info.name, info.format
                    ),
                )
            })? as usize;
        for e in 0..experts {
            for (i, m) in [ExpertMatrix::Gate, ExpertMatrix::Up]
                .into_iter()
                .enumerate()
            {
                tensors.insert(TensorInfo {
                    name: m.per_expert_name(layer, e),
                    shape: vec![hidden, ffn],
                    offset: info.offset + (2 * e + i) * half,
                    len: half,
                    ..info.clone()
                });
            }
        }
    }
    Ok(())
}

/// Replaces every norm weight `w` by `1 + w` in F32, the GGUF convention
/// (Gemma's RMSNorm computes `x * (1 + w)` in f32, `modeling_gemma3.py`).
fn add_one_to_norms(tensors: &mut TensorStore) {
    let norms: Vec<TensorInfo> = tensors
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("norm.weight"))
        .cloned()
        .collect();
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(norms.len());
    for info in &norms {
        let view = tensors
            .view(&info.name)
            .expect("the tensor was just listed");
        offsets.push(bytes.len());
        bytes.extend(view.to_f32().iter().flat_map(|w| (1.0 + w).to_le_bytes()));
    }
    let file = tensors.add_file(std::sync::Arc::new(Bytes::Owned(bytes)));
    for (info, offset) in norms.into_iter().zip(offsets) {
        let len = 4 * info.elems();
        tensors.replace(TensorInfo {
            format: WeightFormat::F32,
            file,
            offset,
            len,
            ..info
        });
    }
}

/// The safetensors files of a directory: the shards its index lists, or `model.safetensors`.
#[cfg(not(target_arch = "wasm32"))]
fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index_path = dir.join(INDEX_FILE);
    if !index_path.is_file() {
        if dir.join(SINGLE_FILE).is_file() {
            return Ok(vec![SINGLE_FILE.to_string()]);
        }
        return Err(Error::bad_file(
            dir,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in the model directory"),
        ));
    }
    let text = std::fs::read_to_string(&index_path).map_err(|source| Error::Io {
        path: index_path.clone(),
        source,
    })?;
    let index: ShardIndex =
        serde_json::from_str(&text).map_err(|e| Error::bad_file(&index_path, e.to_string()))?;
    let shards: BTreeSet<String> = index.weight_map.into_values().collect();
    // A shard name is a file beside the index, never a path out of the directory.
    if let Some(bad) = shards
        .iter()
        .find(|s| s.is_empty() || s.contains(['/', '\\']) || s.as_str() == "..")
    {
        return Err(Error::bad_file(
            &index_path,
            format!("shard name '{bad}' is not a file name in the model directory"),
        ));
    }
    Ok(shards.into_iter().collect())
}

/// `config.json`'s scalar fields, for `inspect`.
fn config_metadata(config_text: &str) -> Vec<(String, String)> {
    let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(config_text) else {
        return Vec::new();
    };
    fields
        .into_iter()
        .filter_map(|(key, value)| match value {
            Value::String(s) => Some((key, s)),
            Value::Number(_) | Value::Bool(_) => Some((key, value.to_string())),
            Value::Array(items) if items.iter().all(Value::is_string) => {
                let names: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
                Some((key, names.join(", ")))
            }
            Value::Object(_) if key == "rope_scaling" => Some((key, value.to_string())),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::hf_name;
    use super::super::testing::test_values;
    use super::super::SafetensorsWriter;
    use super::*;
    use crate::backend::RopeStyle;
    use crate::model::config::RopeScaling;
    use crate::model::synthetic::llama_tensor_shapes;
    use crate::quant::{quantize_row, WeightFormat};
    use crate::tokenizer::hf_files::tests::TOKENIZER_JSON;

    /// A directory removed when the test ends.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn write(&self, file: &str, contents: impl AsRef<[u8]>) {
            std::fs::write(self.0.join(file), contents).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const HIDDEN: usize = 64;
    const FFN: usize = 96;
    const KV_DIM: usize = 32;
    const VOCAB: usize = 4;
    const LAYERS: usize = 2;

    fn config_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": {VOCAB}, "hidden_size": {HIDDEN},
                "intermediate_size": {FFN}, "num_hidden_layers": {LAYERS}, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000,
                "max_position_embeddings": 256, "tie_word_embeddings": true{extra}}}"#
        )
    }

    /// The tensors of a tiny Llama under Hugging Face names, shapes outermost first.
    fn hf_tensors() -> Vec<(String, Vec<usize>)> {
        let heads = HIDDEN / KV_DIM;
        llama_tensor_shapes(HIDDEN, FFN, heads, 1, LAYERS, VOCAB)
            .into_iter()
            .map(|(name, shape)| {
                let hf = hf_name(&name, false).unwrap();
                (hf, shape.into_iter().rev().collect())
            })
            .collect()
    }

    fn safetensors_bytes(tensors: &[(String, Vec<usize>)]) -> Vec<u8> {
        let mut w = SafetensorsWriter::new();
        for (name, shape) in tensors {
            let data = quantize_row(WeightFormat::BF16, &test_values(shape.iter().product()));
            w.add_tensor(name, WeightFormat::BF16, shape, data).unwrap();
        }
        w.to_bytes()
    }

    #[test]
    fn hugging_face_directory_loads() {
        let dir = TempDir::new("hf-single");
        let scaling = r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        dir.write(CONFIG_FILE, config_json(scaling));
        dir.write(SINGLE_FILE, safetensors_bytes(&hf_tensors()));
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(
            message.contains("no tokenizer.json in the model directory"),
            "{message}"
        );

        dir.write(TOKENIZER_FILE, TOKENIZER_JSON);
        let model = load_hf_dir(&dir.0).unwrap();
        let c = &model.config;
        assert_eq!(c.arch, "llama");
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (2, 1, 32));
        let rope = &c.layers[1].rope;
        assert_eq!((rope.theta, c.rope_style), (500000.0, RopeStyle::NeoX));
        assert_eq!(
            rope.scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }
        );
        assert!(c.tied_embeddings && !c.qkv_bias);
        let k = model.tensors.view("blk.1.attn_k.weight").unwrap();
        assert_eq!(
            (k.format, k.rows, k.cols),
            (WeightFormat::BF16, KV_DIM, HIDDEN)
        );
        assert!(model
            .metadata
            .contains(&("architectures".to_string(), "LlamaForCausalLM".to_string())));
    }

    /// `bytes` (a safetensors file) with the data offsets of `tensor` moved by `shift` bytes.
    fn shifted(bytes: &[u8], tensor: &str, shift: i64) -> Vec<u8> {
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        for offset in header[tensor]["data_offsets"].as_array_mut().unwrap() {
            *offset = (offset.as_i64().unwrap() + shift).into();
        }
        let mut json = header.to_string().into_bytes();
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend(json);
        out.extend_from_slice(&bytes[8 + header_len..]);
        out
    }

    #[test]
    fn inconsistent_directories_are_refused_at_load() {
        let dir = TempDir::new("hf-refused");
        dir.write(TOKENIZER_FILE, TOKENIZER_JSON);
        let weights = safetensors_bytes(&hf_tensors());
        let error = |dir: &TempDir| load_hf_dir(&dir.0).err().unwrap().to_string();

        dir.write(CONFIG_FILE, config_json(r#", "sliding_window": 0"#));
        dir.write(SINGLE_FILE, &weights);
        let message = error(&dir);
        assert!(
            message.contains(
                "config.json: 'sliding_window' is 0; a window must hold at least 1 token"
            ),
            "{message}"
        );

        dir.write(CONFIG_FILE, config_json(""));
        let last = &hf_tensors().last().unwrap().0.clone();
        dir.write(SINGLE_FILE, shifted(&weights, last, 2));
        let message = error(&dir);
        assert!(
            message.contains(&format!("model.safetensors: tensor '{last}' data_offsets"))
                && message.contains("past the end of the data"),
            "{message}"
        );
        let first = &hf_tensors()[0].0.clone();
        dir.write(SINGLE_FILE, shifted(&weights, first, 2));
        let message = error(&dir);
        assert!(
            message.contains(&format!("tensor '{first}' data_offsets [2, "))
                && message.contains("leave bytes 0..2 of the data to no tensor"),
            "{message}"
        );
        let second = &hf_tensors()[1].0.clone();
        dir.write(SINGLE_FILE, shifted(&weights, second, -2));
        let message = error(&dir);
        assert!(
            message.contains(&format!("tensor '{second}' data_offsets"))
                && message.contains(&format!("overlap tensor '{first}'")),
            "{message}"
        );

        dir.write(SINGLE_FILE, &weights);
        dir.write("generation_config.json", r#"{"eos_token_id": -1}"#);
        let message = error(&dir);
        assert!(
            message.contains(
                "generation_config.json: 'eos_token_id' holds -1, which is not a token id"
            ),
            "{message}"
        );
        dir.write("generation_config.json", r#"{"eos_token_id": 0}"#);
        assert!(load_hf_dir(&dir.0).is_ok());
    }

    #[test]
    fn sharded_directory_loads_and_checks_tensors() {
        let dir = TempDir::new("hf-sharded");
        let untied = config_json("").replace(
            r#""tie_word_embeddings": true"#,
            r#""tie_word_embeddings": false"#,
        );
        dir.write(CONFIG_FILE, untied);
        dir.write(TOKENIZER_FILE, TOKENIZER_JSON);
        let mut tensors = hf_tensors();
        tensors.push(("lm_head.weight".into(), vec![VOCAB, HIDDEN]));
        let (first, second) = tensors.split_at(tensors.len() / 2);
        dir.write("model-00001-of-00002.safetensors", safetensors_bytes(first));
        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(second),
        );
        let weight_map: serde_json::Map<String, Value> = tensors
            .iter()
            .enumerate()
            .map(|(i, (name, _))| {
                let shard = if i < first.len() { 1 } else { 2 };
                (
                    name.clone(),
                    format!("model-0000{shard}-of-00002.safetensors").into(),
                )
            })
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        dir.write(INDEX_FILE, index.to_string());
        let model = load_hf_dir(&dir.0).unwrap();
        assert!(!model.config.tied_embeddings);
        assert!(model.tensors.info("output.weight").is_some());

        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(&second[1..]),
        );
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(message.contains("missing tensor 'blk."), "{message}");

        let mut broken = second.to_vec();
        let matrix = broken
            .iter_mut()
            .find(|(_, s)| s.len() == 2 && s[0] != s[1])
            .unwrap();
        matrix.1.reverse();
        dir.write(
            "model-00002-of-00002.safetensors",
            safetensors_bytes(&broken),
        );
        let message = load_hf_dir(&dir.0).err().unwrap().to_string();
        assert!(message.contains("has shape"), "{message}");
    }
}
