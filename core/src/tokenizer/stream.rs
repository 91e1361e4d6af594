//! Incremental detokenization for streaming output.
//!
//! Decoding each token on its own goes wrong in two ways: a token may carry only
//! part of a UTF-8 character (byte-level BPE splits an emoji over several
//! tokens), and a token's text may depend on the tokens before it (SentencePiece
//! drops the space that starts the first token). So, as Hugging Face's
//! text-generation-inference does, the decoder decodes a short window of recent
//! ids with and without the newest ones and emits the difference, once that
//! difference ends in a complete character.

use super::Tokenizer;
use crate::Result;

/// Turns generated ids into text pieces; the pieces joined equal the decode of all the ids.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    /// Ids still needed: `window[..emitted]` were already emitted and remain as
    /// context for decoding the ids after them, which are not emitted yet.
    window: Vec<u32>,
    emitted: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the generated `id` and returns the text it completes, or `None` while
    /// the text so far ends inside a character (or the id adds no text, as a
    /// control token does).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.window.push(id);
        let Some(text) = self.pending_text(tok)? else {
            return Ok(None);
        };
        // The replacement character at the end means the last bytes are the start
        // of a character whose remaining bytes come with the next tokens.
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        self.window.drain(..self.emitted);
        self.emitted = self.window.len();
        Ok(Some(text))
    }

    /// Returns the text still held back (an unfinished character comes out as
    /// U+FFFD) and empties the decoder for a new stream.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let text = self.pending_text(tok)?;
        self.window.clear();
        self.emitted = 0;
        Ok(text)
    }

    /// The text the not-yet-emitted ids add after the emitted context.
    fn pending_text(&self, tok: &Tokenizer) -> Result<Option<String>> {
        let context = tok.decode(&self.window[..self.emitted])?;
        let text = tok.decode(&self.window)?;
        Ok(text
            .get(context.len()..)
            .filter(|new| !new.is_empty())
            .map(str::to_string))
    }
}
