//! A fuzzed chat template rendered with fuzzed messages through the
//! tokenizer's public API. The input is a flags byte (bit 0: add the
//! generation prompt), then the template and each message's role and content,
//! joined by NUL bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_core::tokenizer::ChatMessage;
use tandem_fuzz::{split_parts, template_tokenizer};

/// Messages beyond this many are ignored, so an input's size buys text, not turns.
const MAX_MESSAGES: usize = 8;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let parts = split_parts(rest, 2 + 2 * MAX_MESSAGES);
    let text = |part: &[u8]| String::from_utf8_lossy(part).into_owned();
    let template = text(parts[0]);
    let messages: Vec<ChatMessage> = parts[1..]
        .chunks_exact(2)
        .take_while(|turn| !turn[0].is_empty())
        .map(|turn| ChatMessage::new(text(turn[0]), text(turn[1])))
        .collect();
    let Ok(tokenizer) = template_tokenizer(&template) else {
        return;
    };
    let _ = tokenizer.apply_chat_template(&messages, flags & 1 == 1);
});
