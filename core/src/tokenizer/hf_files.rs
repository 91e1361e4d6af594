//! Loading a tokenizer from a Hugging Face model directory.
//!
//! `tokenizer.json` holds the tokenizer itself. Beside it, `tokenizer_config.json`
//! names the BOS/EOS tokens, says whether prompts start with BOS and carries the
//! chat template (newer exports put the template in `chat_template.jinja`), and
//! `generation_config.json` lists the ids that end generation.

use std::path::Path;

use serde_json::Value;
use tokenizers::ModelWrapper;

use super::{SpecialTokens, Tokenizer};
use crate::{Error, Result};

pub(super) fn tokenizer_from_hf_dir(dir: &Path) -> Result<Tokenizer> {
    let json_path = dir.join("tokenizer.json");
    let json = std::fs::read(&json_path).map_err(|source| Error::Io {
        path: json_path.clone(),
        source,
    })?;
    let inner = tokenizers::Tokenizer::from_bytes(&json)
        .map_err(|e| Error::bad_file(&json_path, format!("not a tokenizer: {e}")))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation_config = read_json(&dir.join("generation_config.json"))?;
    let config = config.as_ref();

    let bos = config_token(&inner, config, "bos_token")?;
    let mut eos: Vec<u32> = config_token(&inner, config, "eos_token")?
        .into_iter()
        .collect();
    if let Some(ids) = generation_config
        .as_ref()
        .and_then(|c| c.get("eos_token_id"))
    {
        eos.extend(token_ids(ids));
    }
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
fn config_token(
    inner: &tokenizers::Tokenizer,
    config: Option<&Value>,
    key: &str,
) -> Result<Option<u32>> {
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

/// `eos_token_id` of `generation_config.json`: one id or a list of them.
fn token_ids(value: &Value) -> Vec<u32> {
    let as_id = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match value {
        Value::Array(ids) => ids.iter().filter_map(as_id).collect(),
        single => as_id(single).into_iter().collect(),
    }
}

/// Whether the tokenizer's own post-processor starts every text with `bos`, the
/// rule `tokenizer.json` carries when the config does not state one.
fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: u32) -> bool {
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

fn model_kind(model: &ModelWrapper) -> &'static str {
    match model {
        ModelWrapper::BPE(_) => "BPE",
        ModelWrapper::WordPiece(_) => "WordPiece",
        ModelWrapper::WordLevel(_) => "WordLevel",
        ModelWrapper::Unigram(_) => "Unigram",
    }
}
