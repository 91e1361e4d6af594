//! Tokenizers read from Hugging Face files: these tests write real
//! `tokenizer.json` and config files to temporary directories, unlike the
//! in-memory GGUF fixtures of `tests` they reuse.

use std::path::{Path, PathBuf};

use super::tests::{messages, sentencepiece_gguf, smollm, BOS, EOS};
use super::token_model::Pipeline;
use super::Tokenizer;
use crate::Error;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-tokenizer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

#[test]
fn sentencepiece_writes_a_tokenizer_json_that_tokenizes_alike() {
    let gguf_tok = Tokenizer::from_gguf(&sentencepiece_gguf()).unwrap();
    let dir = temp_dir("sentencepiece-json");
    write(&dir, "tokenizer.json", &gguf_tok.to_hf_json().unwrap());
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert!(tok.describe().starts_with("BPE (tokenizer.json)"));
    assert_eq!(tok.vocab_size(), gguf_tok.vocab_size());
    for text in [
        "Hello world",
        "é and 🙂",
        "Hello\nworld",
        " lead",
        "<s>Hello</s>",
    ] {
        let ids = gguf_tok.encode(text, false).unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids, "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), gguf_tok.decode(&ids).unwrap());
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes the byte-level fixture as `tokenizer.json` into a fresh directory.
fn hf_dir(name: &str, tokenizer: &Pipeline) -> PathBuf {
    let dir = temp_dir(name);
    write(&dir, "tokenizer.json", &tokenizer.to_string(false).unwrap());
    dir
}

#[test]
fn hf_dir_reads_config_and_generation_config() {
    let gguf_tok = smollm();
    let dir = hf_dir("config", &gguf_tok.inner);
    write(
        &dir,
        "tokenizer_config.json",
        r#"{
            "bos_token": {"content": "<|im_start|>", "special": true},
            "eos_token": "<|im_end|>",
            "add_bos_token": true,
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ messages[0]['content'] }}"}
            ]
        }"#,
    );
    write(
        &dir,
        "generation_config.json",
        r#"{"eos_token_id": [2, 0]}"#,
    );

    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.bos_token(), Some(BOS));
    assert_eq!(tok.eos_tokens(), [EOS, 0]);
    let text = "Hello world 12345 <|im_end|>";
    let plain = gguf_tok.encode(text, false).unwrap();
    assert_eq!(tok.encode(text, false).unwrap(), plain);
    assert_eq!(
        tok.encode(text, true).unwrap(),
        [&[BOS][..], &plain].concat()
    );
    assert_eq!(
        tok.apply_chat_template(&messages(&[("user", "Hi")]), true)
            .unwrap(),
        "Hi"
    );
    assert!(
        tok.describe().starts_with("BPE (tokenizer.json)"),
        "{}",
        tok.describe()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn hf_dir_add_bos_follows_the_post_processor() {
    use tokenizers::processors::template::TemplateProcessing;

    let mut with_bos = smollm().inner;
    let processor = TemplateProcessing::builder()
        .try_single("<|im_start|> $A")
        .unwrap()
        .special_tokens(vec![("<|im_start|>", BOS)])
        .build()
        .unwrap();
    with_bos.with_post_processor(Some(processor));
    for (name, inner, adds_bos) in [
        ("post-bos", with_bos, true),
        ("post-none", smollm().inner, false),
    ] {
        let dir = hf_dir(name, &inner);
        write(
            &dir,
            "tokenizer_config.json",
            r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}"#,
        );
        write(
            &dir,
            "chat_template.jinja",
            "{{ bos_token }}{{ messages[0]['content'] }}",
        );
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(
            tok.encode("Hi", true).unwrap()[0] == BOS,
            adds_bos,
            "{name}"
        );
        assert_eq!(
            tok.apply_chat_template(&messages(&[("user", "Hi")]), true)
                .unwrap(),
            "<|im_start|>Hi"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn hf_dir_errors_name_the_file() {
    let dir = temp_dir("missing");
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    assert!(
        matches!(&err, Error::Io { path, .. } if path.ends_with("tokenizer.json")),
        "{err}"
    );

    write(&dir, "tokenizer.json", "{ not json");
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    assert!(
        matches!(&err, Error::BadModelFile { path, .. } if path.ends_with("tokenizer.json")),
        "{err}"
    );

    write(
        &dir,
        "tokenizer.json",
        &smollm().inner.to_string(false).unwrap(),
    );
    write(&dir, "tokenizer_config.json", "{ not json");
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    assert!(
        matches!(&err, Error::BadModelFile { path, .. } if path.ends_with("tokenizer_config.json")),
        "{err}"
    );

    write(&dir, "tokenizer_config.json", r#"{"eos_token": "</s>"}"#);
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    assert!(err.to_string().contains("\"</s>\""), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
