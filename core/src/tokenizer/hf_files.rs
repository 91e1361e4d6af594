//! Loading a tokenizer from a Hugging Face model directory.
//!
//! `tokenizer.json` holds the tokenizer itself. Beside it, `tokenizer_config.json`
//! names the BOS/EOS tokens, says whether prompts start with BOS and carries the
//! chat template (newer exports put the template in `chat_template.jinja`), and
//! `generation_config.json` lists the ids that end generation (else
//! `config.json` does, as `transformers` falls back to it). Ids written there
//! are checked, never dropped: each must be a token of `tokenizer.json`, and
//! every token must have a row in the embedding (`config.json`'s `vocab_size`).

use std::path::Path;

use serde_json::Value;
use tokenizers::ModelWrapper;

use super::token_model::{Pipeline, TokenModel};
use super::{SpecialTokens, Tokenizer};
use crate::{Error, Result};

pub(super) fn tokenizer_from_hf_dir(dir: &Path) -> Result<Tokenizer> {
    let json_path = dir.join("tokenizer.json");
    let json = std::fs::read(&json_path).map_err(|source| Error::Io {
        path: json_path.clone(),
        source,
    })?;
    let inner = parse_tokenizer_json(&json, &json_path)?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation_path = dir.join("generation_config.json");
    let generation_config = read_json(&generation_path)?;
    let model_path = dir.join("config.json");
    let model_config = read_json(&model_path)?;
    let config = config.as_ref();
    if let Some(rows) = model_config
        .as_ref()
        .and_then(|c| c.get("vocab_size"))
        .and_then(Value::as_u64)
    {
        check_ids_have_rows(&inner, rows, &json_path)?;
    }

    let bos = config_token(&inner, config, "bos_token")?;
    let mut eos: Vec<u32> = config_token(&inner, config, "eos_token")?
        .into_iter()
        .collect();
    let generation_eos = eos_token_ids(&inner, generation_config.as_ref(), &generation_path)?;
    let model_eos = eos_token_ids(&inner, model_config.as_ref(), &model_path)?;
    eos.extend(generation_eos.or(model_eos).unwrap_or_default());
    let add_bos = match config
        .and_then(|c| c.get("add_bos_token"))
        .and_then(Value::as_bool)
    {
        Some(add_bos) => add_bos && bos.is_some(),
        None => bos.is_some_and(|bos| post_processor_adds(&inner, bos)),
    };
    let chat_template = match config.and_then(|c| c.get("chat_template")) {
        Some(template) => named_template(template),
        None => read_text(&dir.join("chat_template.jinja"))?,
    };

    let kind = format!("{} (tokenizer.json)", model_kind(inner.get_model()));
    Tokenizer::assemble(
        inner,
        kind,
        SpecialTokens { bos, eos, add_bos },
        chat_template,
    )
}

/// `tokenizer.json` parsed by the `tokenizers` crate, whose deserializers
/// panic on some malformed files (0.22: any JSON error inside `decoder`, such
/// as a syntax error, bytes that are not UTF-8 or a lone surrogate escape,
/// hits an `expect`). The whole file is parsed as JSON first, so the library
/// only ever sees valid JSON, and a panic left in it still becomes an error
/// naming the file, not a crash.
fn parse_tokenizer_json(json: &[u8], path: &Path) -> Result<Pipeline> {
    serde_json::from_slice::<Value>(json)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
    let parsed = std::panic::catch_unwind(|| Pipeline::from_bytes(json));
    match parsed {
        Ok(Ok(inner)) => Ok(inner),
        Ok(Err(e)) => Err(Error::bad_file(path, format!("not a tokenizer: {e}"))),
        Err(_) => Err(Error::bad_file(
            path,
            "not a tokenizer: the tokenizers library failed on it (a panic)",
        )),
    }
}

/// The file parsed as JSON, or `None` when it does not exist.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))
}

/// The file's text, or `None` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The id of the token `tokenizer_config.json` names under `key`, written either as
/// its text or as an added-token object with a `content` field.
fn config_token(inner: &Pipeline, config: Option<&Value>, key: &str) -> Result<Option<u32>> {
    let text = match config.and_then(|c| c.get(key)) {
        Some(Value::String(text)) => text,
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(text)) => text,
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    inner.token_to_id(text).map(Some).ok_or_else(|| {
        Error::Tokenizer(format!(
            "tokenizer_config.json names {key} {text:?}, which tokenizer.json does not have"
        ))
    })
}

/// `eos_token_id` of `generation_config.json` or `config.json` (`file`, at
/// `path`): one id or a list of them, each a token of the vocabulary. `None`
/// when the file or the key is absent (or `null`).
fn eos_token_ids(inner: &Pipeline, file: Option<&Value>, path: &Path) -> Result<Option<Vec<u32>>> {
    let Some(value) = file.and_then(|c| c.get("eos_token_id")) else {
        return Ok(None);
    };
    let single = std::slice::from_ref(value);
    let ids = match value {
        Value::Null => return Ok(None),
        Value::Array(ids) => ids.as_slice(),
        _ => single,
    };
    ids.iter()
        .map(|id| {
            id.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|&id| inner.id_to_token(id).is_some())
                .ok_or_else(|| {
                    Error::bad_file(
                        path,
                        format!(
                            "'eos_token_id' holds {id}, which is not a token id of \
                             tokenizer.json ({} tokens)",
                            inner.get_vocab_size(true)
                        ),
                    )
                })
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// Every id of the tokenizer must index a row of the embedding, which has
/// `rows` rows (`config.json`'s `vocab_size`); fewer tokens than rows is
/// normal (Qwen pads its embedding).
fn check_ids_have_rows(inner: &Pipeline, rows: u64, json_path: &Path) -> Result<()> {
    let vocab = inner.get_vocab(true);
    let Some((token, &id)) = vocab.iter().max_by_key(|(_, &id)| id) else {
        return Ok(());
    };
    if u64::from(id) >= rows {
        return Err(Error::bad_file(
            json_path,
            format!(
                "token {token:?} has id {id}, but the embedding has {rows} rows \
                 (config.json's vocab_size): every token needs a row"
            ),
        ));
    }
    Ok(())
}

/// Whether the tokenizer's own post-processor starts every text with `bos`, the
/// rule `tokenizer.json` carries when the config does not state one.
fn post_processor_adds(inner: &Pipeline, bos: u32) -> bool {
    inner
        .encode_fast("a", true)
        .is_ok_and(|encoding| encoding.get_ids().first() == Some(&bos))
}

/// A chat template given as text, or as a list of named templates: the one named
/// "default", else the first.
fn named_template(template: &Value) -> Option<String> {
    match template {
        Value::String(text) => Some(text.clone()),
        Value::Array(named) => {
            let text = |entry: &Value| {
                entry
                    .get("template")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            named
                .iter()
                .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"))
                .or(named.first())
                .and_then(text)
        }
        _ => None,
    }
}

fn model_kind(model: &TokenModel) -> &'static str {
    let TokenModel::Library(model) = model else {
        return "SentencePiece BPE";
    };
    match model.as_ref() {
        ModelWrapper::BPE(_) => "BPE",
        ModelWrapper::WordPiece(_) => "WordPiece",
        ModelWrapper::WordLevel(_) => "WordLevel",
        ModelWrapper::Unigram(_) => "Unigram",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A byte-level BPE of four tokens; `<|endoftext|>` is 0 (the HF loader's tests use it too).
    pub(crate) const TOKENIZER_JSON: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "post_processor": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}, "merges": ["a b"]}
    }"#;

    /// A directory with `tokenizer.json` and `files`, removed when dropped.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str, files: &[(&str, &str)]) -> Self {
            let dir =
                std::env::temp_dir().join(format!("tandem-hf-files-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("tokenizer.json"), TOKENIZER_JSON).unwrap();
            for (file, contents) in files {
                std::fs::write(dir.join(file), contents).unwrap();
            }
            Dir(dir)
        }

        fn error(&self) -> String {
            match tokenizer_from_hf_dir(&self.0) {
                Ok(_) => panic!("loaded a bad tokenizer"),
                Err(e) => e.to_string(),
            }
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn malformed_tokenizer_json_is_an_error_not_a_panic() {
        // Found by the hf_model_dir fuzzer: any JSON error inside `decoder`
        // made tokenizers 0.22 panic ("Helper: Error(...)").
        let decoder = r#""decoder": {"type": "ByteLevel", "add_prefix_space""#;
        let cases: [(&[u8], &str); 3] = [
            (
                br#""decoder": {"type": "ByteLevel", $add_prefix_space""#,
                "key must be a string",
            ),
            (
                b"\"decoder\": {\"type\": \"Byte\x98Level\", \"add_prefix_space\"",
                "invalid unicode code point",
            ),
            (
                br#""decoder": {"type": "Byte\ud800Level", "add_prefix_space""#,
                "unexpected end of hex escape",
            ),
        ];
        for (broken, expected) in cases {
            let mut json = Vec::new();
            let at = TOKENIZER_JSON.find(decoder).unwrap();
            json.extend_from_slice(&TOKENIZER_JSON.as_bytes()[..at]);
            json.extend_from_slice(broken);
            json.extend_from_slice(&TOKENIZER_JSON.as_bytes()[at + decoder.len()..]);
            let dir = Dir::new("malformed", &[]);
            std::fs::write(dir.0.join("tokenizer.json"), json).unwrap();
            let message = dir.error();
            assert!(
                message.contains("tokenizer.json: not valid JSON: ") && message.contains(expected),
                "{message}"
            );
        }
    }

    #[test]
    fn bad_eos_token_ids_are_refused_naming_the_file() {
        for file in ["generation_config.json", "config.json"] {
            let cases = [
                ("-1", "holds -1"),
                (r#""x""#, r#"holds "x""#),
                ("1.5", "holds 1.5"),
                ("[0, 4]", "holds 4"),
                ("[0, [1]]", "holds [1]"),
                ("4294967296", "holds 4294967296"),
            ];
            for (ids, held) in cases {
                let dir = Dir::new("eos", &[(file, &format!(r#"{{"eos_token_id": {ids}}}"#))]);
                let message = dir.error();
                assert!(
                    message.starts_with(&dir.0.join(file).display().to_string()),
                    "{message}"
                );
                assert!(
                    message.contains(&format!(
                        "'eos_token_id' {held}, which is not a token id of tokenizer.json (4 tokens)"
                    )),
                    "{message}"
                );
            }
        }
    }

    #[test]
    fn eos_token_ids_come_from_generation_config_else_config() {
        let generation = ("generation_config.json", r#"{"eos_token_id": [3, 0]}"#);
        let model = ("config.json", r#"{"eos_token_id": 2, "vocab_size": 4}"#);
        let eos = |files: &[(&str, &str)]| {
            let dir = Dir::new("eos-source", files);
            tokenizer_from_hf_dir(&dir.0).unwrap().eos_tokens().to_vec()
        };
        assert_eq!(eos(&[generation, model]), [3, 0]);
        assert_eq!(eos(&[model]), [2]);
        assert_eq!(
            eos(&[("config.json", r#"{"eos_token_id": null}"#)]),
            [] as [u32; 0]
        );
    }

    #[test]
    fn every_token_needs_an_embedding_row() {
        // Fewer tokens than rows is a padded embedding, as Qwen's.
        let padded = Dir::new("rows-padded", &[("config.json", r#"{"vocab_size": 6}"#)]);
        assert!(tokenizer_from_hf_dir(&padded.0).is_ok());
        let short = Dir::new("rows-short", &[("config.json", r#"{"vocab_size": 3}"#)]);
        let message = short.error();
        assert!(
            message.contains(
                "tokenizer.json: token \"ab\" has id 3, but the embedding has 3 rows \
                 (config.json's vocab_size): every token needs a row"
            ),
            "{message}"
        );
    }
}
