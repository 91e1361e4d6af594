//! Chat prompts as token ids, with the messages read as plain text: a
//! control token written in a message (`<|im_end|><|im_start|>system` typed
//! by a user) becomes the ids of its characters, never the control token, so
//! a message cannot forge turns of the template. Control tokens come only
//! from the template itself.
//!
//! Each span of a message that the tokenizer would read as a special token
//! is replaced, before rendering, by a placeholder: a private-use character
//! found nowhere in the conversation or the template, the span's number, and
//! the character again. The rendered text is tokenized as usual between the
//! placeholders (the template's control tokens are read as such), and each
//! placeholder as its span's plain text. A conversation without such spans
//! renders and tokenizes exactly as [`Tokenizer::apply_chat_template`] and
//! [`Tokenizer::encode`] do.

use tokenizers::{OffsetReferential, OffsetType};

use super::{ChatMessage, Tokenizer};
use crate::{Error, Result};

/// Where placeholder characters are drawn from: Unicode's Supplementary
/// Private Use Area-A, which no tokenizer gives a meaning.
const PLACEHOLDER_CHARS: std::ops::RangeInclusive<u32> = 0xF0000..=0xFFFFD;

impl Tokenizer {
    /// Renders `messages` with the chat template and tokenizes the prompt,
    /// BOS included where the model wants it, reading the messages' roles
    /// and content as plain text (see the module documentation). With
    /// [`Tokenizer::set_special_tokens_in_content`] on, control tokens in
    /// content are read as control tokens instead.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        if self.special_tokens_in_content {
            let text = self.apply_chat_template(messages, add_generation_prompt)?;
            return self.encode(&text, true);
        }
        let marker = self.placeholder_char(messages)?;
        let mut spans = Vec::new();
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                role: self.escape_specials(&m.role, marker, &mut spans),
                content: self.escape_specials(&m.content, marker, &mut spans),
            })
            .collect();
        let text = self.apply_chat_template(&escaped, add_generation_prompt)?;
        if spans.is_empty() {
            return self.encode(&text, true);
        }
        let mut pieces = text.split(marker);
        let mut ids = self.encode(pieces.next().unwrap_or_default(), false)?;
        while let Some(number) = pieces.next() {
            let (Some(span), Some(after)) = (
                number.parse::<usize>().ok().and_then(|i| spans.get(i)),
                pieces.next(),
            ) else {
                return Err(Error::ChatTemplate(
                    "the template cut through a message that writes control tokens; \
                     they cannot be read as text"
                        .into(),
                ));
            };
            ids.extend(self.encode_as_text(span)?);
            ids.extend(self.encode(after, false)?);
        }
        Ok(self.with_bos(ids))
    }

    /// A character that appears in no message and not in the template.
    fn placeholder_char(&self, messages: &[ChatMessage]) -> Result<char> {
        let template = self.chat_template().unwrap_or(self.fallback_template.text);
        let used = |c: char| {
            template.contains(c)
                || (messages.iter()).any(|m| m.role.contains(c) || m.content.contains(c))
        };
        PLACEHOLDER_CHARS
            .filter_map(char::from_u32)
            .find(|&c| !used(c))
            .ok_or_else(|| {
                Error::Tokenizer("the conversation uses every private-use character".into())
            })
    }

    /// `text` with each span read as a special token replaced by a
    /// placeholder numbered by its place in `spans`, where it is kept.
    fn escape_specials(&self, text: &str, marker: char, spans: &mut Vec<String>) -> String {
        let added = self.inner.get_added_vocabulary();
        let found = added.extract_and_normalize(self.inner.get_normalizer(), text);
        let mut out = String::with_capacity(text.len());
        let mut copied = 0;
        for (_, (start, end), tokens) in
            found.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            let special = (tokens.iter().flatten()).any(|t| self.is_special_id(t.id));
            if !special || start < copied {
                continue;
            }
            out.push_str(&text[copied..start]);
            out.push(marker);
            out.push_str(&spans.len().to_string());
            out.push(marker);
            spans.push(text[start..end].to_string());
            copied = end;
        }
        out.push_str(&text[copied..]);
        out
    }

    fn is_special_id(&self, id: u32) -> bool {
        (self.inner.get_added_vocabulary().get_added_tokens_decoder())
            .get(&id)
            .is_some_and(|t| t.special)
    }
}
