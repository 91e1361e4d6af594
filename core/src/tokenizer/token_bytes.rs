//! The bytes a token stands for, which its text cannot always show: a
//! byte-level BPE token holding part of a multi-byte character, or a
//! SentencePiece byte token `<0xF0>`, decodes alone to U+FFFD. OpenAI's
//! logprobs give these bytes (`bytes`), so clients can join the pieces.
//!
//! The tokenizer's decoder says how tokens are written: byte-level BPE in
//! GPT-2's printable alphabet (each character one byte), SentencePiece with
//! `▁` for a space and `<0xNN>` for a raw byte, or plain text. Added tokens
//! (`<|im_end|>`, `<tool_call>`) are their text.

use tokenizers::DecoderWrapper;

use super::Tokenizer;

/// How the vocabulary writes a token's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's bytes-to-unicode alphabet.
    ByteLevel,
    /// `▁` for a space, `<0xNN>` byte tokens.
    SentencePiece,
    /// The token's text as it is.
    Text,
}

impl Tokenizer {
    /// The bytes of token `id`; `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let text = self.inner.id_to_token(id)?;
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        if added.contains_key(&id) {
            return Some(text.into_bytes());
        }
        Some(match spelling(self.inner.get_decoder()) {
            Spelling::ByteLevel => text.chars().map(byte_of_char).collect::<Option<_>>()?,
            Spelling::SentencePiece => match sentencepiece_byte(&text) {
                Some(byte) => vec![byte],
                None => text.replace('\u{2581}', " ").into_bytes(),
            },
            Spelling::Text => text.into_bytes(),
        })
    }
}

fn spelling(decoder: Option<&DecoderWrapper>) -> Spelling {
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => Spelling::ByteLevel,
        Some(DecoderWrapper::ByteFallback(_) | DecoderWrapper::Metaspace(_)) => {
            Spelling::SentencePiece
        }
        Some(DecoderWrapper::Sequence(seq)) => seq
            .get_decoders()
            .iter()
            .map(|d| spelling(Some(d)))
            .find(|s| *s != Spelling::Text)
            .unwrap_or(Spelling::Text),
        _ => Spelling::Text,
    }
}

/// `<0xNN>` read as its byte.
fn sentencepiece_byte(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The byte GPT-2's alphabet writes as `c`: printable bytes as themselves,
/// the others shifted to U+0100 and up, in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let code = c as u32;
    if printable(code) {
        return Some(code as u8);
    }
    let shifted = code.checked_sub(0x100)? as usize;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(shifted)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{sentencepiece_gguf, smollm};
    use super::*;

    #[test]
    fn token_bytes_join_into_the_text_even_inside_a_character() {
        let sentencepiece = Tokenizer::from_gguf(&sentencepiece_gguf()).unwrap();
        // SentencePiece writes a space before the text (its first token's `▁`).
        for (tok, prefix) in [(smollm(), ""), (sentencepiece, " ")] {
            for text in ["Hello world", "a🙂b é", " lead\nline", "x<|im_end|>y"] {
                let ids = tok.encode(text, false).unwrap();
                let bytes: Vec<u8> = (ids.iter())
                    .flat_map(|&id| tok.token_bytes(id).unwrap())
                    .collect();
                assert_eq!(
                    String::from_utf8(bytes).unwrap(),
                    format!("{prefix}{text}"),
                    "{ids:?}"
                );
            }
            // The emoji's pieces have bytes of their own, not U+FFFD's.
            let emoji = tok.encode("🙂", false).unwrap();
            let pieces: Vec<Vec<u8>> = emoji
                .iter()
                .map(|&id| tok.token_bytes(id).unwrap())
                .collect();
            assert!(
                pieces
                    .iter()
                    .any(|p| p.first() == Some(&0xF0) && std::str::from_utf8(p).is_err()),
                "{pieces:?}"
            );
            assert_eq!(tok.token_bytes(u32::MAX), None);
        }
    }
}
