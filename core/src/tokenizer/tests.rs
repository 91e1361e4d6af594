//! Tokenizer tests on small vocabularies built in memory: no model files, no downloads.

use std::sync::Arc;

use super::{ChatMessage, StreamDecoder, Tokenizer};
use crate::model::gguf::{GgufArray, GgufFile, GgufValue};
use crate::model::Bytes;
use crate::Error;

// ---------------------------------------------------------------------------
// Fixtures

pub(super) const CONTROL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub(super) const BOS: u32 = 1;
pub(super) const EOS: u32 = 2;

/// Merges of the byte-level fixture, in rank order. "ð Ł" is the first half of
/// the bytes of 🙂, so the emoji spans three tokens.
const BYTE_LEVEL_MERGES: &[&str] = &[
    "H e", "l l", "He ll", "Hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "ð Ł",
];

/// GPT-2's mapping of bytes to printable characters, the alphabet byte-level vocabularies are written in.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut unprintable_seen = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                unprintable_seen += 1;
                char::from_u32(255 + unprintable_seen).unwrap()
            }
        })
        .collect()
}

fn strings(items: impl IntoIterator<Item = impl AsRef<str>>) -> GgufValue {
    GgufValue::Array(GgufArray::String(items.into_iter().collect()))
}

fn gguf(metadata: Vec<(&str, GgufValue)>) -> GgufFile {
    GgufFile {
        version: 3,
        metadata: metadata
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        tensors: Vec::new(),
        bytes: Arc::new(Bytes::Owned(Vec::new())),
    }
}

/// Sets `key` in `file`, replacing an existing value.
pub(super) fn set(mut file: GgufFile, key: &str, value: GgufValue) -> GgufFile {
    file.metadata.retain(|(k, _)| k != key);
    file.metadata.push((key.to_string(), value));
    file
}

fn unset(mut file: GgufFile, key: &str) -> GgufFile {
    file.metadata.retain(|(k, _)| k != key);
    file
}

/// A tiny byte-level BPE model: three control tokens, the 256 byte tokens, and
/// one token per merge.
pub(super) fn byte_level_gguf(pre: &str) -> GgufFile {
    let mut tokens: Vec<String> = CONTROL_TOKENS.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_chars().iter().map(char::to_string));
    tokens.extend(BYTE_LEVEL_MERGES.iter().map(|m| m.replace(' ', "")));
    let types = (0..tokens.len()).map(|id| if id < CONTROL_TOKENS.len() { 3 } else { 1 });
    gguf(vec![
        ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        (
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(types.collect())),
        ),
        (
            "tokenizer.ggml.merges",
            strings(BYTE_LEVEL_MERGES.iter().copied()),
        ),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(BOS)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(EOS)),
    ])
}

pub(super) fn smollm() -> Tokenizer {
    Tokenizer::from_gguf(&byte_level_gguf("smollm")).unwrap()
}

/// The id of the vocabulary entry `text`.
pub(super) fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.inner
        .token_to_id(text)
        .unwrap_or_else(|| panic!("{text:?} not in vocabulary"))
}

/// A tiny SentencePiece model: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, and
/// pieces whose scores make "Hello world" two tokens.
pub(super) fn sentencepiece_gguf() -> GgufFile {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for byte in 0..=255u8 {
        tokens.push(format!("<0x{byte:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        ("▁", -100.0),
        ("H", -100.0),
        ("e", -100.0),
        ("l", -100.0),
        ("o", -100.0),
        ("w", -100.0),
        ("r", -100.0),
        ("d", -100.0),
        ("▁H", -1.0),
        ("ll", -2.0),
        ("▁He", -3.0),
        ("llo", -4.0),
        ("▁Hello", -5.0),
        ("▁w", -6.0),
        ("or", -7.0),
        ("▁wor", -8.0),
        ("ld", -9.0),
        ("▁world", -10.0),
    ];
    for (piece, score) in pieces {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    gguf(vec![
        ("tokenizer.ggml.model", GgufValue::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        (
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(types)),
        ),
        (
            "tokenizer.ggml.scores",
            GgufValue::Array(GgufArray::F32(scores)),
        ),
    ])
}

pub(super) fn messages(turns: &[(&str, &str)]) -> Vec<ChatMessage> {
    turns
        .iter()
        .map(|(role, content)| ChatMessage::new(*role, *content))
        .collect()
}

// ---------------------------------------------------------------------------
// Byte-level BPE from GGUF

#[test]
fn byte_level_round_trips_awkward_text() {
    let tok = smollm();
    for text in [
        "Hello world",
        "  two leading spaces",
        "line one\nline two\n\n\ttab",
        "trailing space ",
        "naïve café — 日本語",
        "emoji 🙂🎉 end",
        "12345",
        "it's 3.14!",
        "",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "ids {ids:?}");
    }
}

#[test]
fn byte_level_applies_merges() {
    let tok = smollm();
    let ids = tok.encode("Hello world", false).unwrap();
    assert_eq!(ids, [id(&tok, "Hello"), id(&tok, "Ġworld")]);
}

#[test]
fn smollm_splits_digits_one_by_one() {
    let tok = smollm();
    let digits: Vec<u32> = ["1", "2", "3", "4", "5"]
        .iter()
        .map(|d| id(&tok, d))
        .collect();
    assert_eq!(tok.encode("12345", false).unwrap(), digits);

    // GPT-2's split keeps the number one word, so the "1 2" merge applies.
    let gpt2 = Tokenizer::from_gguf(&byte_level_gguf("gpt-2")).unwrap();
    let ids = gpt2.encode("12345", false).unwrap();
    assert_eq!(
        ids,
        [
            id(&gpt2, "12"),
            id(&gpt2, "3"),
            id(&gpt2, "4"),
            id(&gpt2, "5")
        ]
    );
}

#[test]
fn qwen2_puts_text_in_nfc_first() {
    let qwen2 = Tokenizer::from_gguf(&byte_level_gguf("qwen2")).unwrap();
    let composed = qwen2.encode("café", false).unwrap();
    assert_eq!(qwen2.encode("cafe\u{301}", false).unwrap(), composed);
    assert_eq!(qwen2.decode(&composed).unwrap(), "café");

    // Other families see the bytes as written.
    let smollm = smollm();
    assert_ne!(smollm.encode("cafe\u{301}", false).unwrap(), composed);
    assert_eq!(smollm.encode("café", false).unwrap(), composed);
}

#[test]
fn special_tokens_in_text_are_single_tokens() {
    let tok = smollm();
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&id(&tok, "<|im_start|>")));
    assert_eq!(ids.last(), Some(&id(&tok, "<|im_end|>")));
    assert_eq!(ids.len(), 2 + "user\nHi".len());
    assert_eq!(
        tok.decode(&ids).unwrap(),
        "user\nHi",
        "control tokens are not shown"
    );
    assert_eq!(tok.token_text(ids[0]).as_deref(), Some("<|im_start|>"));
}

#[test]
fn add_bos_follows_the_model() {
    // SmolLM's rule: no BOS.
    let tok = smollm();
    assert_eq!(
        tok.encode("Hi", true).unwrap(),
        tok.encode("Hi", false).unwrap()
    );

    let file = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.add_bos_token",
        GgufValue::Bool(true),
    );
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let plain = tok.encode("Hi", false).unwrap();
    assert_eq!(
        tok.encode("Hi", true).unwrap(),
        [&[BOS][..], &plain].concat()
    );
    // A text that already starts with BOS (a rendered template) gets no second one.
    let ids = tok.encode("<|im_start|>Hi", true).unwrap();
    assert_eq!(ids, [&[BOS][..], &plain].concat());

    // Llama 3's rule is BOS first, unless the file says otherwise.
    let llama3 = Tokenizer::from_gguf(&byte_level_gguf("llama-bpe")).unwrap();
    assert_eq!(llama3.encode("Hi", true).unwrap()[0], BOS);
}

#[test]
fn add_bos_without_a_bos_token_is_an_error() {
    let file = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.add_bos_token",
        GgufValue::Bool(true),
    );
    let file = unset(file, "tokenizer.ggml.bos_token_id");
    let err = Tokenizer::from_gguf(&file).err().unwrap();
    assert!(err.to_string().contains("BOS"), "{err}");
}

#[test]
fn end_of_generation_tokens() {
    let tok = smollm();
    assert_eq!(tok.eos_tokens()[0], EOS, "the EOS token comes first");
    assert!(tok.is_eos(EOS));
    assert!(tok.is_eos(0), "<|endoftext|> also ends generation");
    assert!(!tok.is_eos(BOS));

    let file = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.eot_token_id",
        GgufValue::U32(5),
    );
    assert!(Tokenizer::from_gguf(&file).unwrap().is_eos(5));
}

#[test]
fn stream_decoder_holds_split_characters() {
    let tok = smollm();
    let text = "a🙂b <|im_end|>🎉";
    let ids = tok.encode(text, false).unwrap();
    assert!(
        ids.contains(&id(&tok, "ðŁ")),
        "the emoji is split over tokens: {ids:?}"
    );

    let mut stream = StreamDecoder::new();
    let mut pieces = Vec::new();
    let mut held = 0;
    for &id in &ids {
        match stream.push(&tok, id).unwrap() {
            Some(piece) => pieces.push(piece),
            None => held += 1,
        }
    }
    pieces.extend(stream.finish(&tok).unwrap());
    assert!(held >= 2, "partial characters are held back");
    assert!(
        pieces
            .iter()
            .all(|p| !p.contains(char::REPLACEMENT_CHARACTER)),
        "{pieces:?}"
    );
    assert_eq!(pieces.concat(), tok.decode(&ids).unwrap());
    assert!(pieces.contains(&"🙂".to_string()), "{pieces:?}");
}

#[test]
fn stream_decoder_finish_flushes_an_unfinished_character() {
    let tok = smollm();
    let mut stream = StreamDecoder::new();
    assert_eq!(
        stream.push(&tok, id(&tok, "a")).unwrap().as_deref(),
        Some("a")
    );
    assert_eq!(stream.push(&tok, id(&tok, "ðŁ")).unwrap(), None);
    assert_eq!(stream.finish(&tok).unwrap().as_deref(), Some("\u{FFFD}"));
    assert_eq!(stream.finish(&tok).unwrap(), None);
}

#[test]
fn unknown_pre_tokenizer_falls_back_to_gpt2() {
    let tok = Tokenizer::from_gguf(&byte_level_gguf("mystery")).unwrap();
    assert!(
        tok.describe().contains("unknown pre-tokenizer 'mystery'"),
        "{}",
        tok.describe()
    );
    let ids = tok.encode("Hello world 12345", false).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "Hello world 12345");
}

#[test]
fn describe_names_kind_specials_and_template() {
    let description = smollm().describe();
    for part in [
        "byte-level BPE (GGUF, pre-tokenizer smollm)",
        &format!("vocab {}", 3 + 256 + BYTE_LEVEL_MERGES.len()),
        "bos \"<|im_start|>\" (1)",
        "eos \"<|im_end|>\" (2), \"<|endoftext|>\" (0)",
        "add_bos false",
        "chat template none (ChatML fallback)",
    ] {
        assert!(
            description.contains(part),
            "{part:?} not in {description:?}"
        );
    }
}

#[test]
fn gguf_errors_name_the_problem() {
    let no_tokens = unset(byte_level_gguf("smollm"), "tokenizer.ggml.tokens");
    let err = Tokenizer::from_gguf(&no_tokens).err().unwrap();
    assert_eq!(
        err.to_string(),
        "tokenizer: model file has no tokenizer (tokenizer.ggml.tokens missing)"
    );

    let bert = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.model",
        GgufValue::String("bert".into()),
    );
    assert!(
        matches!(Tokenizer::from_gguf(&bert), Err(Error::Unsupported(m)) if m.contains("'bert'"))
    );

    let no_merges = unset(byte_level_gguf("smollm"), "tokenizer.ggml.merges");
    let err = Tokenizer::from_gguf(&no_merges).err().unwrap();
    assert!(
        err.to_string().contains("tokenizer.ggml.merges missing"),
        "{err}"
    );

    let bad_type = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.pre",
        GgufValue::U32(7),
    );
    let err = Tokenizer::from_gguf(&bad_type).err().unwrap();
    assert!(
        err.to_string()
            .contains("tokenizer.ggml.pre is not a string"),
        "{err}"
    );

    let bad_bos = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.bos_token_id",
        GgufValue::U32(100_000),
    );
    let err = Tokenizer::from_gguf(&bad_bos).err().unwrap();
    assert!(
        err.to_string().contains("tokenizer.ggml.bos_token_id"),
        "{err}"
    );

    let bad_merge = set(
        byte_level_gguf("smollm"),
        "tokenizer.ggml.merges",
        strings(["Hx"]),
    );
    let err = Tokenizer::from_gguf(&bad_merge).err().unwrap();
    assert!(
        err.to_string().contains("tokenizer.ggml.merges[0]"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------
// SentencePiece from GGUF

#[test]
fn sentencepiece_merges_by_score_and_falls_back_to_bytes() {
    let tok = Tokenizer::from_gguf(&sentencepiece_gguf()).unwrap();
    assert_eq!(
        tok.encode("Hello world", false).unwrap(),
        [id(&tok, "▁Hello"), id(&tok, "▁world")]
    );
    assert_eq!(
        tok.encode("Hello", true).unwrap(),
        [1, id(&tok, "▁Hello")],
        "BOS by default"
    );
    assert_eq!(
        tok.encode("<s>Hello", false).unwrap(),
        [1, id(&tok, "▁Hello")]
    );
    assert_eq!(
        tok.encode("é", false).unwrap(),
        [id(&tok, "▁"), id(&tok, "<0xC3>"), id(&tok, "<0xA9>")]
    );
    assert!(tok.is_eos(2));
    for text in ["Hello world", "é and 🙂", "Hello\nworld", " lead"] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "ids {ids:?}");
    }
}

#[test]
fn sentencepiece_stream_keeps_spaces() {
    let tok = Tokenizer::from_gguf(&sentencepiece_gguf()).unwrap();
    let ids = tok.encode("Hello world é", true).unwrap();
    let mut stream = StreamDecoder::new();
    let mut text = String::new();
    for &id in &ids {
        text.extend(stream.push(&tok, id).unwrap());
    }
    text.extend(stream.finish(&tok).unwrap());
    assert_eq!(text, "Hello world é");
}
