//! Chat prompts as token ids, with the messages read as plain text: a
//! control token written in a message (`<|im_end|><|im_start|>system` typed
//! by a user) becomes the ids of its characters, never the control token, so
//! a message cannot forge turns of the template. Control tokens come only
//! from the template itself.
//!
//! Each span of a message (its role, content, tool calls) or of the tools'
//! definitions that the tokenizer would read as a special token is replaced, before rendering, by a placeholder: a private-use character
//! found nowhere in the conversation or the template, the span's number, and
//! the character again. The rendered text is tokenized as usual between the
//! placeholders (the template's control tokens are read as such), and each
//! placeholder as its span's plain text. A conversation without such spans
//! renders and tokenizes exactly as [`Tokenizer::apply_chat_template`] and
//! [`Tokenizer::encode`] do.

use serde_json::Value;
use tokenizers::{OffsetReferential, OffsetType};

use super::{Chat, ChatMessage, FunctionCall, Tokenizer, ToolCall};
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
        self.encode_chat_prompt(&Chat::new(messages, add_generation_prompt))
    }

    /// [`Tokenizer::encode_chat`] for a [`Chat`]: the tools' definitions and
    /// the tool calls' names and arguments are read as text too.
    pub fn encode_chat_prompt(&self, chat: &Chat<'_>) -> Result<Vec<u32>> {
        if self.special_tokens_in_content {
            let text = self.render_chat(chat)?;
            return self.encode(&text, true);
        }
        let marker = self.placeholder_char(chat)?;
        let mut spans = Vec::new();
        let mut escape = |text: &str| self.escape_specials(text, marker, &mut spans);
        let messages: Vec<ChatMessage> = (chat.messages.iter())
            .map(|m| ChatMessage {
                role: escape(&m.role),
                content: escape(&m.content),
                tool_calls: (m.tool_calls.iter())
                    .map(|call| ToolCall {
                        id: escape(&call.id),
                        kind: escape(&call.kind),
                        function: FunctionCall {
                            name: escape(&call.function.name),
                            arguments: escape_json(&call.function.arguments, &mut escape),
                        },
                    })
                    .collect(),
                tool_call_id: m.tool_call_id.as_deref().map(&mut escape),
            })
            .collect();
        let tools: Vec<Value> = (chat.tools.iter())
            .map(|tool| escape_json(tool, &mut escape))
            .collect();
        let text = self.render_chat(&Chat {
            messages: &messages,
            tools: &tools,
            add_generation_prompt: chat.add_generation_prompt,
        })?;
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

    /// A character that appears nowhere in the chat and not in the template.
    fn placeholder_char(&self, chat: &Chat<'_>) -> Result<char> {
        let template = self.template_text();
        let messages = serde_json::to_string(chat.messages).unwrap_or_default();
        let tools = serde_json::to_string(chat.tools).unwrap_or_default();
        let used = |c: char| template.contains(c) || messages.contains(c) || tools.contains(c);
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

/// `value` with every string in it, keys included, passed through `escape`.
fn escape_json(value: &Value, escape: &mut impl FnMut(&str) -> String) -> Value {
    match value {
        Value::String(text) => Value::String(escape(text)),
        Value::Array(items) => Value::Array(items.iter().map(|v| escape_json(v, escape)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (escape(k), escape_json(v, escape)))
                .collect(),
        ),
        other => other.clone(),
    }
}
