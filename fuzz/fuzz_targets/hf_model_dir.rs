//! A Hugging Face model directory from fuzzed files: the input is
//! `config.json`, `tokenizer.json`, `generation_config.json` and
//! `tokenizer_config.json` joined by NUL bytes (an empty part is an absent
//! file), written beside the fixed weights of a tiny Llama; then the
//! directory loader and the tokenizer loader run on it.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tandem_core::model::safetensors::load_hf_dir;
use tandem_core::tokenizer::Tokenizer;
use tandem_fuzz::{split_parts, tiny_llama_safetensors};

const FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "generation_config.json",
    "tokenizer_config.json",
];

/// This process's model directory, holding the weights.
fn model_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tandem-fuzz-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        std::fs::write(dir.join("model.safetensors"), tiny_llama_safetensors())
            .expect("the weights are written");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = model_dir();
    for (name, contents) in FILES.iter().zip(split_parts(data, FILES.len())) {
        let path = dir.join(name);
        if contents.is_empty() {
            let _ = std::fs::remove_file(&path);
        } else {
            std::fs::write(&path, contents).expect("the file is written");
        }
    }
    let _ = load_hf_dir(dir);
    if let Ok(tokenizer) = Tokenizer::from_hf_dir(dir) {
        let _ = tokenizer.encode("Hello, world", true);
    }
});
