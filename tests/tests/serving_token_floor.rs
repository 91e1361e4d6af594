//! The server's token floor (`tandem_server::token_floor`) on the real
//! checkpoints' tokenizers: each has one, so an oversize prompt is refused
//! without tokenizing it, and it never exceeds the real token count, on
//! text that normalization shrinks (NFC, Qwen), that needs byte tokens, or
//! whose bytes the vocabulary cannot spell.

use tandem_core::model::gguf::GgufFile;
use tandem_core::tokenizer::Tokenizer;
use tandem_server::token_floor::TokenFloor;
use tandem_tests::model_path;

/// Texts whose bytes per token are as high as we could make them.
fn awkward_texts() -> Vec<String> {
    vec![
        "the quick brown fox jumps over the lazy dog ".repeat(40),
        " ".repeat(2000),
        "\n".repeat(1000),
        "a".repeat(3000),
        "0123456789".repeat(100),
        "abcdefghijklmnopqrstuvwxyz".repeat(60),
        // NFC makes each of these 3-byte signs one ASCII letter or a 2-byte letter.
        "\u{212A}\u{212B}\u{2126}".repeat(400),
        // Hangul jamo that NFC composes into syllables (9 bytes into 3).
        "\u{1100}\u{1161}\u{11A8}".repeat(300),
        // A letter and combining marks that compose.
        "e\u{0301}a\u{0308}\u{0304}".repeat(300),
        "𝐀𝐁𝐂 ❤ 日本語 ".repeat(200),
        "<|im_start|><|im_end|><|endoftext|>".repeat(100),
        "\u{0}\u{1}\u{7f}\u{ff}".repeat(200),
        // Bytes SmolLM2's vocabulary has no letter for: dropped, not counted.
        "a\u{4}\u{6}\u{13}\u{14}\u{16}\u{1d}".repeat(300),
        "\u{40000}\u{80000}".repeat(200),
    ]
}

#[test]
fn the_real_tokenizers_have_a_floor_that_never_exceeds_their_count() {
    for name in ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m"] {
        let file = GgufFile::open(&model_path(name)).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let floor = TokenFloor::of(&tok);
        assert!(floor.min_tokens(&"x".repeat(1000)) > 0, "{name}: no floor");
        for text in awkward_texts() {
            let tokens = tok.encode(&text, false).unwrap().len();
            let min = floor.min_tokens(&text);
            assert!(
                min <= tokens,
                "{name}: {} bytes of {:?}...: floor {min} > {tokens} tokens",
                text.len(),
                text.chars().take(8).collect::<String>()
            );
        }
        println!(
            "{name}: a 3.9 MB prompt has at least {} tokens",
            floor.min_tokens(&"x".repeat(3_900_000))
        );
    }
}
