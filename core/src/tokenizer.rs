//! Tokenizer. (Being written: see the helper's task.)
use crate::Result;

pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct Tokenizer {}

impl Tokenizer {
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let _ = (text, add_special);
        todo!()
    }
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let _ = ids;
        todo!()
    }
    pub fn is_eos(&self, id: u32) -> bool {
        let _ = id;
        todo!()
    }
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let _ = (messages, add_generation_prompt);
        todo!()
    }
}
