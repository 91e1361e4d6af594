//! A lower bound on a text's token count from its length in bytes, so that a
//! prompt which cannot fit the context is refused before it is tokenized
//! (tokenizing megabytes takes seconds).
//!
//! The bound is exact, not an estimate. A BPE token stands for at most `C`
//! bytes of the text its model splits, `C` being the longest vocabulary
//! entry: byte-level and SentencePiece vocabularies spell every byte with at
//! least one byte (`Ġ` for a space, `▁`, `<0x0A>`), and an unknown character
//! that becomes the unknown token is at most 4 bytes. That text is at least
//! `1/S` of the input's bytes, `S` being the most the normalizer can shrink
//! text. So a text of `n` bytes has at least `ceil(n / (C·S))` tokens.
//!
//! Tokenizers with no such bound get none (`min_tokens` is 0) and their
//! prompts are always tokenized: a pipeline that can drop text (whitespace
//! splitting, accent stripping, a replacement by a regex or by less text), a
//! vocabulary that does not spell every byte and has no unknown token, or
//! one that fuses any run of unknown text into a single token; and models
//! other than BPE.

use std::collections::HashSet;

use serde_json::Value;
use tandem_core::tokenizer::Tokenizer;

/// The most bytes of input one byte of canonically normalized (NFC, NFD) or
/// lowercased text stands for: a 3-byte sign becomes one ASCII letter (`K`
/// KELVIN SIGN to `K`; no 4-byte character has a canonical form under 2
/// bytes), and a composition turns at most 3 bytes into 1 (Hangul
/// jamo, 9 bytes, into a 3-byte syllable; `Ω` OHM SIGN and three marks, 9
/// bytes, into `ᾪ`).
const CANONICAL_SHRINK: usize = 3;

/// The same for compatibility forms (NFKC, NFKD): a 4-byte character can
/// become one ASCII letter (`𝐀` to `A`), and with two accents a 2-byte one
/// (`Ǟ`, 8 bytes into 2).
const COMPATIBILITY_SHRINK: usize = 4;

/// Bytes of text one unknown token stands for when unknowns are not fused: one character.
const UNKNOWN_TOKEN_BYTES: usize = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenFloor {
    bound: Option<Bound>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Bound {
    /// Most input bytes per token (`C·S`).
    bytes_per_token: usize,
    /// Per byte value, whether BPE drops it (a byte-level vocabulary without its letter).
    dropped: [bool; 256],
}

impl TokenFloor {
    /// The bound of `tokenizer`, read from its pipeline and vocabulary.
    pub fn of(tokenizer: &Tokenizer) -> Self {
        let longest = (0..tokenizer.vocab_size() as u32)
            .filter_map(|id| tokenizer.token_text(id))
            .map(|t| t.len())
            .max()
            .unwrap_or(0);
        let bound = tokenizer
            .to_hf_json()
            .ok()
            .and_then(|json| serde_json::from_str::<Value>(&json).ok())
            .and_then(|pipeline| bound(&pipeline, longest));
        Self { bound }
    }

    /// Fewest tokens `text` can have (0 when unknown).
    pub fn min_tokens(&self, text: &str) -> usize {
        let Some(b) = &self.bound else {
            return 0;
        };
        let kept = if b.dropped.contains(&true) {
            text.bytes()
                .filter(|&byte| !b.dropped[byte as usize])
                .count()
        } else {
            text.len()
        };
        kept.div_ceil(b.bytes_per_token)
    }
}

/// The bound of a `tokenizer.json` pipeline whose longest vocabulary entry has `longest` bytes.
fn bound(pipeline: &Value, longest: usize) -> Option<Bound> {
    let shrink = normalizer_shrink(&pipeline["normalizer"])?;
    let pre_tokenizer = &pipeline["pre_tokenizer"];
    let model = &pipeline["model"];
    if !keeps_text(pre_tokenizer) || model["type"].as_str() != Some("BPE") || longest == 0 {
        return None;
    }
    let vocab: HashSet<&str> = model["vocab"]
        .as_object()?
        .keys()
        .map(String::as_str)
        .collect();
    let mut dropped = [false; 256];
    let coverage = if model["byte_fallback"].as_bool() == Some(true)
        && (0..=255u8).all(|b| vocab.contains(format!("<0x{b:02X}>").as_str()))
    {
        longest
    } else if uses_byte_level(pre_tokenizer) {
        // A byte without its letter is dropped, or becomes the unknown token
        // (runs of them perhaps one): either way, not counted.
        for (b, letter) in byte_level_alphabet().enumerate() {
            dropped[b] = !vocab.contains(letter.to_string().as_str());
        }
        // A normalizer could turn counted bytes into dropped ones.
        if dropped.contains(&true) && !pipeline["normalizer"].is_null() {
            return None;
        }
        longest
    } else if model["unk_token"].is_string() && model["fuse_unk"].as_bool() != Some(true) {
        longest.max(UNKNOWN_TOKEN_BYTES)
    } else {
        // Unknown text is dropped, or any run of it is one token.
        return None;
    };
    Some(Bound {
        bytes_per_token: coverage * shrink,
        dropped,
    })
}

/// How far a normalizer can shrink text; `None` when it can drop text or is unknown.
fn normalizer_shrink(n: &Value) -> Option<usize> {
    if n.is_null() {
        return Some(1);
    }
    match n["type"].as_str()? {
        "Sequence" => n["normalizers"]
            .as_array()?
            .iter()
            .try_fold(1, |s, n| Some(s * normalizer_shrink(n)?)),
        "Prepend" => Some(1),
        "Replace" => {
            let pattern = n["pattern"]["String"].as_str()?;
            let content = n["content"].as_str()?;
            match content.len() {
                0 => None,
                c => Some(pattern.len().div_ceil(c).max(1)),
            }
        }
        "NFC" | "NFD" | "Lowercase" => Some(CANONICAL_SHRINK),
        "NFKC" | "NFKD" => Some(COMPATIBILITY_SHRINK),
        _ => None,
    }
}

/// Whether a pre-tokenizer keeps every byte (splits and maps, never removes).
fn keeps_text(p: &Value) -> bool {
    if p.is_null() {
        return true;
    }
    match p["type"].as_str() {
        Some("Sequence") => p["pretokenizers"]
            .as_array()
            .is_some_and(|steps| steps.iter().all(keeps_text)),
        Some("ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts") => true,
        Some("Split" | "Punctuation") => p["behavior"].as_str() != Some("Removed"),
        _ => false,
    }
}

fn uses_byte_level(p: &Value) -> bool {
    match p["type"].as_str() {
        Some("Sequence") => p["pretokenizers"]
            .as_array()
            .is_some_and(|steps| steps.iter().any(uses_byte_level)),
        Some("ByteLevel") => true,
        _ => false,
    }
}

/// The 256 characters byte-level BPE spells bytes with (GPT-2's
/// `bytes_to_unicode`): printable Latin-1 as itself, the rest from U+0100 on.
fn byte_level_alphabet() -> impl Iterator<Item = char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8).map(move |b| {
        if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn per_token(pipeline: &Value, longest: usize) -> Option<usize> {
        bound(pipeline, longest).map(|b| b.bytes_per_token)
    }

    fn byte_level_vocab() -> Value {
        let mut vocab = serde_json::Map::new();
        for (i, c) in byte_level_alphabet().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        Value::Object(vocab)
    }

    fn pipeline(normalizer: Value, pre_tokenizer: Value, model: Value) -> Value {
        json!({"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "model": model})
    }

    fn byte_level(normalizer: Value) -> Value {
        pipeline(
            normalizer,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}),
            json!({"type": "BPE", "vocab": byte_level_vocab(), "unk_token": null}),
        )
    }

    #[test]
    fn byte_level_bpe_is_bounded_by_its_longest_token_and_normalizer() {
        assert_eq!(per_token(&byte_level(Value::Null), 12), Some(12));
        assert_eq!(per_token(&byte_level(json!({"type": "NFC"})), 12), Some(36));
        assert_eq!(
            per_token(&byte_level(json!({"type": "NFKC"})), 12),
            Some(48)
        );
        let floor = TokenFloor {
            bound: bound(&byte_level(Value::Null), 12),
        };
        assert_eq!(floor.min_tokens(""), 0);
        assert_eq!(floor.min_tokens(&"x".repeat(13)), 2);
    }

    #[test]
    fn bytes_a_byte_level_vocabulary_cannot_spell_are_not_counted() {
        let mut missing = byte_level(Value::Null);
        let vocab = missing["model"]["vocab"].as_object_mut().unwrap();
        vocab.remove("Ą"); // byte 4
        let floor = TokenFloor {
            bound: bound(&missing, 2),
        };
        assert_eq!(floor.min_tokens(&"\u{4}".repeat(100)), 0);
        assert_eq!(floor.min_tokens(&"\u{4}a".repeat(100)), 50);
        // A normalizer could make dropped bytes out of counted ones: no bound.
        missing["normalizer"] = json!({"type": "NFC"});
        assert_eq!(per_token(&missing, 2), None);
    }

    #[test]
    fn sentencepiece_with_byte_fallback_is_bounded() {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(format!("<0x{b:02X}>"), json!(b));
        }
        let spm = |byte_fallback: bool, fuse_unk: bool| {
            pipeline(
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
                Value::Null,
                json!({"type": "BPE", "vocab": vocab, "unk_token": "<unk>",
                       "byte_fallback": byte_fallback, "fuse_unk": fuse_unk}),
            )
        };
        assert_eq!(per_token(&spm(true, true), 16), Some(16));
        // Without byte tokens, one unknown token per character...
        assert_eq!(per_token(&spm(false, false), 3), Some(4));
        // ...or per run of unknown text, however long: no bound.
        assert_eq!(per_token(&spm(false, true), 16), None);
    }

    #[test]
    fn pipelines_that_can_drop_text_have_no_bound() {
        let dropping = [
            json!({"type": "StripAccents"}),
            json!({"type": "Replace", "pattern": {"String": " "}, "content": ""}),
            json!({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}),
            json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip"}]}),
        ];
        for n in dropping {
            assert_eq!(per_token(&byte_level(n.clone()), 12), None, "{n}");
        }
        let mut whitespace = byte_level(Value::Null);
        whitespace["pre_tokenizer"] = json!({"type": "WhitespaceSplit"});
        assert_eq!(per_token(&whitespace, 12), None);
        let mut wordpiece = byte_level(Value::Null);
        wordpiece["model"]["type"] = json!("WordPiece");
        assert_eq!(per_token(&wordpiece, 12), None);
    }

    #[test]
    fn the_floor_never_exceeds_the_real_count_of_the_tiny_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let files = tandem_tests::tiny_gguf(
            dir.path(),
            &tandem_tests::tiny(tandem_core::quant::WeightFormat::F32, 1),
        );
        let tok = &files.tokenizer;
        let floor = TokenFloor::of(tok);
        assert!(floor.bound.is_some(), "byte-level BPE has a bound");
        let texts = [
            "hello world".repeat(50),
            " ".repeat(300),
            "é ❤ 𝐀 Ω".repeat(40),
            "<|im_start|>".repeat(30),
            "\u{1}\u{7f}\n\t".repeat(60),
        ];
        for text in texts {
            let tokens = tok.encode(&text, false).unwrap().len();
            let min = floor.min_tokens(&text);
            assert!(
                min <= tokens,
                "{} bytes: floor {min} > {tokens} tokens",
                text.len()
            );
        }
    }
}
