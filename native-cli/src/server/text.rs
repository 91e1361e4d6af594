//! Generated tokens to text, one choice at a time, with stop strings.
//!
//! Text is handed out as soon as it cannot be part of a stop string: a tail
//! that could still grow into one is held back until the next tokens decide.
//! A stop string ends the choice and is not included. A choice the server
//! cuts short ([`ChoiceText::end`]) hands out what it held back and ends
//! with the server's reason.

use tandem_core::engine::FinishReason;
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};
use tandem_core::Result;

#[derive(Debug)]
pub struct ChoiceText {
    decoder: StreamDecoder,
    /// Decoded text not handed out yet.
    pending: String,
    stops: Vec<String>,
    /// Tokens consumed (the one that completed a stop string included).
    pub completion_tokens: usize,
    /// Set when the choice ended: `"stop"`, `"length"`, or the reason the
    /// server ended it (`"timeout"`, `"abort"`).
    pub finish_reason: Option<&'static str>,
}

impl ChoiceText {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            decoder: StreamDecoder::new(),
            pending: String::new(),
            stops,
            completion_tokens: 0,
            finish_reason: None,
        }
    }

    pub fn is_done(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Takes the next token of this choice; returns the text now safe to send.
    pub fn push(
        &mut self,
        tok: &Tokenizer,
        token: u32,
        finished: Option<FinishReason>,
    ) -> Result<String> {
        if self.is_done() {
            return Ok(String::new());
        }
        self.completion_tokens += 1;
        // The end-of-sequence token has no text of its own.
        if !(finished == Some(FinishReason::Stop) && tok.is_eos(token)) {
            if let Some(piece) = self.decoder.push(tok, token)? {
                self.pending.push_str(&piece);
            }
        }
        if finished.is_some() {
            if let Some(rest) = self.decoder.finish(tok)? {
                self.pending.push_str(&rest);
            }
        }
        if self.cut_at_stop() {
            return Ok(std::mem::take(&mut self.pending));
        }
        match finished {
            Some(reason) => {
                self.finish_reason = Some(match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                });
                Ok(std::mem::take(&mut self.pending))
            }
            None => {
                let keep = self.undecided_tail();
                let rest = self.pending.split_off(self.pending.len() - keep);
                Ok(std::mem::replace(&mut self.pending, rest))
            }
        }
    }

    /// Ends the choice early for `reason`; returns the text still held.
    pub fn end(&mut self, tok: &Tokenizer, reason: &'static str) -> Result<String> {
        if self.is_done() {
            return Ok(String::new());
        }
        if let Some(rest) = self.decoder.finish(tok)? {
            self.pending.push_str(&rest);
        }
        if !self.cut_at_stop() {
            self.finish_reason = Some(reason);
        }
        Ok(std::mem::take(&mut self.pending))
    }

    /// Ends the choice at the first stop string in `pending`, if there is one.
    fn cut_at_stop(&mut self) -> bool {
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.pending.truncate(at);
            self.finish_reason = Some("stop");
        }
        first.is_some()
    }

    /// Length of the longest tail of `pending` that starts some stop string.
    fn undecided_tail(&self) -> usize {
        let text = &self.pending;
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        (1..=text.len().min(longest))
            .rev()
            .filter(|&n| text.is_char_boundary(text.len() - n))
            .find(|&n| {
                let tail = &text[text.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}
