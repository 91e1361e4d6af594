//! Text to token ids and back, and chat prompts.
//!
//! A [`Tokenizer`] wraps the `tokenizers` crate's pipeline, built either from a
//! GGUF file's `tokenizer.ggml.*` metadata (read the way llama.cpp reads it, see
//! `gguf_vocab`) or from a Hugging Face directory's `tokenizer.json` (see
//! `hf_files`). Its model is one of that crate's, or for a GGUF SentencePiece
//! vocabulary Tandem's own `sentencepiece` (`token_model`), which needs a
//! tenth of the memory. Around it sits what the runtime needs and `tokenizers` does not
//! model: the ids that end generation, whether a prompt starts with BOS, and the
//! model's chat template, rendered by a real Jinja engine (`chat_template`).
//! [`StreamDecoder`] turns generated ids into text as they arrive.
//!
//! Encoding never runs the `tokenizers` post-processor: BOS is prepended by this
//! module from one rule per model ([`Tokenizer::encode`]), so GGUF and Hugging
//! Face models behave alike. Special tokens written in the text (`<|im_start|>`)
//! are read as single special tokens, because chat templates produce them; in a
//! chat, only the template's are: the messages' content is read as plain text
//! ([`Tokenizer::encode_chat`], `chat_prompt`), so a message cannot forge turns.

mod chat_prompt;
mod chat_template;
mod gguf_vocab;
pub(crate) mod hf_files;
mod sentencepiece;
mod stream;
mod token_bytes;
mod token_model;

#[cfg(test)]
mod chat_tests;
#[cfg(test)]
mod hf_dir_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tools_tests;

use std::path::Path;
use std::sync::OnceLock;

pub use chat_template::{ChatMessage, FunctionCall, ToolCall};
pub use stream::StreamDecoder;
use token_model::Pipeline;
use tokenizers::Model;

use crate::model::gguf::GgufFile;
use crate::{Error, Result};

/// A model's tokenizer: encoding, decoding, end-of-generation ids and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Pipeline,
    /// What kind of tokenizer this is and where it came from, for [`Tokenizer::describe`].
    kind: String,
    bos: Option<u32>,
    /// Every id that ends generation; the model's EOS token first.
    eos: Vec<u32>,
    /// Distinct token texts, the vocabulary's and the added tokens': counted
    /// once, since `tokenizers` counts them by building the whole map.
    vocab_size: usize,
    /// Whether `encode(text, true)` prepends BOS. Only true when `bos` is set.
    add_bos: bool,
    chat_template: Option<String>,
    /// The template used when `chat_template` is `None`.
    fallback_template: &'static chat_template::FallbackTemplate,
    /// Chat content may write control tokens (the behaviour before content
    /// was read as text), for clients that build turns themselves.
    special_tokens_in_content: bool,
    /// `inner` reading special tokens as text, made when first needed.
    plain: OnceLock<Pipeline>,
    /// Whether the chat template reads `tools`, found when first asked.
    reads_tools: OnceLock<bool>,
}

/// What a chat template renders: the conversation, the tools the model may
/// call (OpenAI function definitions, `{"type": "function", "function":
/// {...}}`), and whether to open the assistant's turn.
#[derive(Clone, Copy, Debug)]
pub struct Chat<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: &'a [serde_json::Value],
    pub add_generation_prompt: bool,
}

impl<'a> Chat<'a> {
    /// A conversation without tools.
    pub fn new(messages: &'a [ChatMessage], add_generation_prompt: bool) -> Self {
        Chat {
            messages,
            tools: &[],
            add_generation_prompt,
        }
    }
}

/// What a loader found besides the `tokenizers` tokenizer itself.
struct SpecialTokens {
    bos: Option<u32>,
    eos: Vec<u32>,
    add_bos: bool,
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        gguf_vocab::tokenizer_from_gguf(file)
    }

    /// Loads `tokenizer.json` from a Hugging Face model directory, with the BOS/EOS
    /// tokens and chat template of `tokenizer_config.json` and the EOS ids of
    /// `generation_config.json` when those files exist.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        hf_files::tokenizer_from_hf_dir(dir)
    }

    /// Checks that the special ids exist and puts the parts together.
    fn assemble(
        inner: Pipeline,
        kind: String,
        specials: SpecialTokens,
        chat_template: Option<String>,
    ) -> Result<Tokenizer> {
        let model = inner.get_model();
        let added_apart = inner
            .get_added_vocabulary()
            .get_vocab()
            .keys()
            .filter(|text| model.token_to_id(text).is_none())
            .count();
        let vocab_size = model.get_vocab_size() + added_apart;
        let out_of_range = specials
            .bos
            .iter()
            .chain(&specials.eos)
            .find(|&&id| id as usize >= vocab_size);
        if let Some(id) = out_of_range {
            return Err(Error::Tokenizer(format!(
                "special token id {id} is outside the vocabulary ({vocab_size} tokens)"
            )));
        }
        if specials.add_bos && specials.bos.is_none() {
            return Err(Error::Tokenizer(
                "the model asks for a BOS token at the start of prompts but names none".into(),
            ));
        }
        let mut eos: Vec<u32> = Vec::with_capacity(specials.eos.len());
        for id in specials.eos {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let fallback_template =
            chat_template::fallback(|text| inner.get_added_vocabulary().is_special_token(text));
        let tokenizer = Tokenizer {
            inner,
            kind,
            bos: specials.bos,
            eos,
            vocab_size,
            add_bos: specials.add_bos,
            chat_template,
            fallback_template,
            special_tokens_in_content: false,
            plain: OnceLock::new(),
            reads_tools: OnceLock::new(),
        };
        if let Some(template) = tokenizer.chat_template() {
            let (bos, eos) = tokenizer.template_specials();
            chat_template::check(template, &bos, &eos)?;
        }
        Ok(tokenizer)
    }

    /// Lets control tokens written in chat messages through as control tokens
    /// (off by default: [`Tokenizer::encode_chat`] reads content as text).
    pub fn set_special_tokens_in_content(&mut self, allow: bool) {
        self.special_tokens_in_content = allow;
    }

    /// The tokenizer in Hugging Face's `tokenizer.json` form, so a model
    /// converted from GGUF can be written as a Hugging Face directory.
    pub fn to_hf_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| Error::Tokenizer(format!("cannot serialize the tokenizer: {e}")))
    }

    /// Token ids of `text`. Special tokens written in the text are read as such.
    ///
    /// With `add_special`, BOS is prepended when the model's rule says so (and the
    /// text does not already start with it, as text rendered by a chat template
    /// that writes `bos_token` does).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let ids = encode_with(&self.inner, text)?;
        Ok(if add_special { self.with_bos(ids) } else { ids })
    }

    /// Token ids of `text` with special tokens read as the text they are
    /// made of; never BOS.
    fn encode_as_text(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        encode_with(plain, text)
    }

    /// `ids` with BOS in front when the model's rule asks for it and they
    /// do not start with it already.
    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some(bos) = self.bos.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// The text of `ids` as a user reads it: control tokens (BOS, EOS, `<|im_start|>`)
    /// are left out, and so are ids the vocabulary does not have (models pad their
    /// embedding past the tokenizer's vocabulary).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("decoding failed: {e}")))
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// Every id that ends generation (EOS, end-of-turn, end-of-message).
    pub fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    /// Whether prompts start with the BOS token.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    pub fn bos_token(&self) -> Option<u32> {
        self.bos
    }

    /// Number of ids the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The vocabulary entry of `id` as stored (byte-level BPE tokens show `Ġ` for a space).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The model's own chat template, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders a conversation into the prompt text the model was trained on, with the
    /// model's chat template, or when it has none the fallback its turn markers
    /// pick (Gemma's turns, else ChatML).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat(&Chat::new(messages, add_generation_prompt))
    }

    /// [`Tokenizer::apply_chat_template`] for a [`Chat`], tools included.
    pub fn render_chat(&self, chat: &Chat<'_>) -> Result<String> {
        let (bos, eos) = self.template_specials();
        chat_template::render(
            self.template_text(),
            &chat_template::TemplateInputs {
                messages: chat.messages,
                tools: (!chat.tools.is_empty()).then_some(chat.tools),
                add_generation_prompt: chat.add_generation_prompt,
                bos_token: &bos,
                eos_token: &eos,
            },
        )
    }

    /// Whether the chat template shows `tools` to the model (Qwen2.5's does;
    /// SmolLM2's and the fallbacks do not).
    pub fn chat_template_reads_tools(&self) -> bool {
        *self
            .reads_tools
            .get_or_init(|| chat_template::reads_variable(self.template_text(), "tools"))
    }

    /// The template chats are rendered with.
    fn template_text(&self) -> &str {
        self.chat_template().unwrap_or(self.fallback_template.text)
    }

    /// The texts of BOS and EOS, as templates see them (`bos_token`, `eos_token`).
    fn template_specials(&self) -> (String, String) {
        let text = |id: Option<u32>| id.and_then(|id| self.token_text(id)).unwrap_or_default();
        (text(self.bos), text(self.eos.first().copied()))
    }

    /// One line for `inspect`: kind, vocabulary size, special tokens, BOS rule, chat template.
    pub fn describe(&self) -> String {
        let name = |id: u32| match self.token_text(id) {
            Some(text) => format!("{text:?} ({id})"),
            None => id.to_string(),
        };
        let bos = self.bos.map_or_else(|| "none".to_string(), name);
        let eos = if self.eos.is_empty() {
            "none".to_string()
        } else {
            self.eos
                .iter()
                .map(|&id| name(id))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let template = match self.chat_template {
            Some(_) => "the model's".to_string(),
            None => format!("none ({} fallback)", self.fallback_template.name),
        };
        format!(
            "{}, vocab {}, bos {bos}, eos {eos}, add_bos {}, chat template {template}",
            self.kind,
            self.vocab_size(),
            self.add_bos,
        )
    }
}

/// The ids `tokenizer` gives `text`, without its post-processor.
fn encode_with(tokenizer: &Pipeline, text: &str) -> Result<Vec<u32>> {
    let encoding = tokenizer
        .encode_fast(text, false)
        .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
    Ok(encoding.get_ids().to_vec())
}
