//! Tool calls read from generated text as it arrives, in the Hermes format
//! Qwen2.5 writes:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! A call's name is handed out as soon as `{"name": "...", "arguments": `
//! has been read, then its arguments as they come: the text after that
//! opening up to the object's closing brace, as the model wrote it. Text
//! outside the calls is content; whitespace around calls is dropped. A call
//! whose opening is written otherwise (the keys in another order) is read
//! whole at `</tool_call>` as JSON, and a block that is not a call stays
//! content. Output that ends inside a call ends the call there.
//!
//! Small models (Qwen2.5-Coder-0.5B) often leave the tags out and answer
//! with the bare object. An output that starts with `{"name": "F",
//! "arguments": ` for one of the request's functions `F` is read as calls
//! too, each ending at the brace that closes its object.
//!
//! With `parallel_tool_calls: false` the output ends after its first call:
//! the parser takes nothing more and says so ([`ToolCallParser::is_ended`]).
//!
//! Streaming and whole responses run the same parser over the same text,
//! so streamed deltas reassemble into exactly the whole response.

mod scan;

use serde_json::Value;

use crate::tools::{ToolUse, CALL_CLOSE, CALL_OPEN};
use scan::{arguments_text, partial_suffix, scan_head, Head, ObjectEnd};

/// What the parser hands out, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// A call begins: its index among the choice's calls, its id, the function's name.
    Call {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (a JSON text).
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug)]
enum State {
    /// Nothing but whitespace and bare calls so far.
    Start,
    /// Outside calls.
    Text,
    /// Inside `<tool_call>`, before `{"name": ..., "arguments": ` is read.
    Head,
    /// The arguments of the last call; `sent` bytes of them handed out.
    Arguments { sent: usize },
    /// A call whose opening is written otherwise: kept until its end.
    Whole,
    /// The arguments of a call without tags; `sent` bytes handed out.
    Bare { sent: usize, object: ObjectEnd },
}

/// Reads one choice's calls.
#[derive(Debug)]
pub struct ToolCallParser {
    /// Call ids are this and the call's index.
    id_prefix: String,
    /// The request's functions, which a call without tags must name.
    functions: Vec<String>,
    /// Text not handed out yet (in `Arguments`, the arguments so far).
    buffer: String,
    state: State,
    /// Whitespace at the end of the content so far: handed out before more
    /// content (or at the end when there was no call), dropped before a call.
    held_space: String,
    calls: usize,
    /// Calls after which the output ends (`parallel_tool_calls: false`: one).
    max_calls: Option<usize>,
    /// The last call ended and the output has had no content since:
    /// whitespace here is dropped.
    after_call: bool,
    /// The output has had its last call; the rest is ignored.
    ended: bool,
}

impl ToolCallParser {
    /// A parser for calls of `tools`.
    pub fn new(id_prefix: String, tools: &ToolUse) -> Self {
        Self {
            id_prefix,
            functions: tools.function_names(),
            buffer: String::new(),
            state: State::Start,
            held_space: String::new(),
            calls: 0,
            max_calls: (!tools.parallel).then_some(1),
            after_call: false,
            ended: false,
        }
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The output had the last call it may have: the rest is ignored.
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// Takes the next piece of text; returns what can be handed out now.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        self.buffer.push_str(text);
        loop {
            match &mut self.state {
                State::Start => {
                    let text = self.buffer.trim_start();
                    if text.is_empty() {
                        return out;
                    }
                    match scan_head(text) {
                        Head::Found { name, len } if self.functions.contains(&name) => {
                            let spaces = self.buffer.len() - text.len();
                            self.buffer.drain(..spaces + len);
                            self.held_space.clear();
                            out.push(self.begin_call(name));
                            self.state = State::Bare {
                                sent: 0,
                                object: ObjectEnd::default(),
                            };
                        }
                        Head::NeedMore if !text.starts_with(CALL_OPEN) => return out,
                        _ => self.state = State::Text,
                    }
                }
                State::Bare { sent, object } => {
                    let sent = *sent;
                    match object.find(&self.buffer) {
                        Some(at) => {
                            let arguments = self.buffer[..at].trim_end().to_string();
                            self.buffer.drain(..at + 1);
                            self.arguments(&arguments, sent, &mut out);
                            self.state = State::Start;
                            if self.call_ended() {
                                return out;
                            }
                        }
                        None => {
                            let safe = self.buffer.trim_end().len();
                            let text = self.buffer[..safe].to_string();
                            self.arguments(&text, sent, &mut out);
                            if let State::Bare { sent, .. } = &mut self.state {
                                *sent = (*sent).max(safe);
                            }
                            return out;
                        }
                    }
                }
                State::Text => match self.buffer.find(CALL_OPEN) {
                    Some(at) => {
                        let before: String = self.buffer.drain(..at + CALL_OPEN.len()).collect();
                        self.content(&before[..at], &mut out);
                        self.held_space.clear();
                        self.state = State::Head;
                    }
                    None => {
                        let keep = partial_suffix(&self.buffer, CALL_OPEN);
                        let text: String = self.buffer.drain(..self.buffer.len() - keep).collect();
                        self.content(&text, &mut out);
                        return out;
                    }
                },
                State::Head => match scan_head(&self.buffer) {
                    Head::Found { name, len } => {
                        self.buffer.drain(..len);
                        out.push(self.begin_call(name));
                        self.state = State::Arguments { sent: 0 };
                    }
                    Head::NeedMore => return out,
                    Head::Other => self.state = State::Whole,
                },
                &mut State::Arguments { sent } => match self.buffer.find(CALL_CLOSE) {
                    Some(at) => {
                        let block: String = self.buffer.drain(..at + CALL_CLOSE.len()).collect();
                        self.arguments(arguments_text(&block[..at]), sent, &mut out);
                        self.state = State::Text;
                        if self.call_ended() {
                            return out;
                        }
                    }
                    None => {
                        let keep = partial_suffix(&self.buffer, CALL_CLOSE);
                        let safe = arguments_text(&self.buffer[..self.buffer.len() - keep]).len();
                        let text = self.buffer[..safe].to_string();
                        self.arguments(&text, sent, &mut out);
                        self.state = State::Arguments {
                            sent: sent.max(safe),
                        };
                        return out;
                    }
                },
                State::Whole => match self.buffer.find(CALL_CLOSE) {
                    Some(at) => {
                        let block: String = self.buffer.drain(..at + CALL_CLOSE.len()).collect();
                        self.state = State::Text;
                        if self.whole(&block[..at], true, &mut out) && self.call_ended() {
                            return out;
                        }
                    }
                    None => return out,
                },
            }
        }
    }

    /// The output ended: hands out what was held.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        let rest = std::mem::take(&mut self.buffer);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Start | State::Text => self.content(&rest, &mut out),
            State::Arguments { sent } => self.arguments(arguments_text(&rest), sent, &mut out),
            State::Bare { sent, .. } => self.arguments(rest.trim_end(), sent, &mut out),
            State::Head | State::Whole => {
                self.whole(&rest, false, &mut out);
            }
        }
        if self.calls == 0 && !self.held_space.is_empty() {
            out.push(ToolEvent::Content(std::mem::take(&mut self.held_space)));
        }
        out
    }

    /// A call just ended; whether the output ends with it.
    fn call_ended(&mut self) -> bool {
        self.after_call = true;
        if self.max_calls == Some(self.calls) {
            self.ended = true;
            self.buffer.clear();
        }
        self.ended
    }

    /// Hands out `text` as content, but for its trailing whitespace, held
    /// (and whitespace right after a call, dropped).
    fn content(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let text = if self.after_call {
            text.trim_start()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.after_call = false;
        let body = text.trim_end();
        if body.is_empty() {
            self.held_space.push_str(text);
            return;
        }
        let mut content = std::mem::take(&mut self.held_space);
        content.push_str(body);
        out.push(ToolEvent::Content(content));
        self.held_space = text[body.len()..].to_string();
    }

    fn begin_call(&mut self, name: String) -> ToolEvent {
        let index = self.calls;
        self.calls += 1;
        ToolEvent::Call {
            index,
            id: format!("{}{index}", self.id_prefix),
            name,
        }
    }

    /// Hands out `arguments` past the `sent` bytes already handed out.
    fn arguments(&mut self, arguments: &str, sent: usize, out: &mut Vec<ToolEvent>) {
        if let Some(text) = arguments.get(sent..).filter(|t| !t.is_empty()) {
            out.push(ToolEvent::Arguments {
                index: self.calls - 1,
                text: text.to_string(),
            });
        }
    }

    /// A call block read whole: a call if it is `{"name": ..., "arguments": ...}`
    /// (then true), else content.
    fn whole(&mut self, block: &str, closed: bool, out: &mut Vec<ToolEvent>) -> bool {
        let call = serde_json::from_str::<Value>(block.trim())
            .ok()
            .and_then(|v| {
                let name = v.get("name")?.as_str()?.to_string();
                let arguments = match v.get("arguments").or_else(|| v.get("parameters"))? {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                Some((name, arguments))
            });
        match call {
            Some((name, arguments)) => {
                self.held_space.clear();
                let call = self.begin_call(name);
                out.push(call);
                self.arguments(&arguments, 0, out);
                true
            }
            None => {
                let close = if closed { CALL_CLOSE } else { "" };
                self.content(&format!("{CALL_OPEN}{block}{close}"), out);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tools::ToolChoice;

    /// Content, and each call's (id, name, arguments), from `events`.
    fn assemble(events: &[ToolEvent]) -> (String, Vec<(String, String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => content.push_str(t),
                ToolEvent::Call { index, id, name } => {
                    assert_eq!(*index, calls.len());
                    calls.push((id.clone(), name.clone(), String::new()));
                }
                ToolEvent::Arguments { index, text } => calls[*index].2.push_str(text),
            }
        }
        (content, calls)
    }

    /// The functions `f`, `g` and `get_weather`, `choice` and `parallel` as given.
    fn tools(choice: ToolChoice, parallel: bool) -> ToolUse {
        let tools = ["f", "g", "get_weather"]
            .map(|name| json!({"type": "function", "function": {"name": name}}));
        ToolUse {
            tools: tools.to_vec(),
            choice,
            parallel,
        }
    }

    /// Parses `text` whole and one character at a time; both must agree.
    fn parse_with(tools: &ToolUse, text: &str) -> (String, Vec<(String, String, String)>) {
        let mut whole = ToolCallParser::new("call_".into(), tools);
        let mut events = whole.push(text);
        events.extend(whole.finish());
        let mut piecewise = ToolCallParser::new("call_".into(), tools);
        let mut streamed = Vec::new();
        for c in text.chars() {
            streamed.extend(piecewise.push(&c.to_string()));
        }
        streamed.extend(piecewise.finish());
        let result = assemble(&events);
        assert_eq!(assemble(&streamed), result, "{text:?}");
        result
    }

    fn parse(text: &str) -> (String, Vec<(String, String, String)>) {
        parse_with(&tools(ToolChoice::Auto, true), text)
    }

    fn call(i: usize, name: &str, arguments: &str) -> (String, String, String) {
        (format!("call_{i}"), name.into(), arguments.into())
    }

    #[test]
    fn calls_are_read_in_pieces_and_whole_alike() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": {}}}\n</tool_call>";
        assert_eq!(
            parse(text),
            (
                String::new(),
                vec![call(0, "get_weather", "{\"city\": \"Paris\", \"n\": {}}")]
            )
        );
        let two = format!("I will look.\n{text}\n{}", text.replace("Paris", "Oslo"));
        let (content, calls) = parse(&two);
        assert_eq!(content, "I will look.");
        assert_eq!(
            calls[1],
            call(1, "get_weather", "{\"city\": \"Oslo\", \"n\": {}}")
        );
    }

    #[test]
    fn text_without_calls_is_content_unchanged() {
        for text in [
            "Hello <tool world",
            "  spaced  \n",
            "a < b </tool_call> c",
            "",
        ] {
            assert_eq!(parse(text), (text.to_string(), vec![]));
        }
    }

    #[test]
    fn other_layouts_are_read_whole_and_non_calls_stay_content() {
        let reordered = "<tool_call>{\"arguments\": {\"x\": 1}, \"name\": \"f\"}</tool_call>";
        assert_eq!(
            parse(reordered),
            (String::new(), vec![call(0, "f", "{\"x\":1}")])
        );
        let not_a_call = "<tool_call>not json</tool_call> after";
        assert_eq!(parse(not_a_call), (not_a_call.to_string(), vec![]));
    }

    #[test]
    fn an_unfinished_call_ends_where_the_output_does() {
        // Cut short (max_tokens, a stop string).
        assert_eq!(
            parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1,"),
            (String::new(), vec![call(0, "f", "{\"a\": [1,")])
        );
    }

    #[test]
    fn calls_without_tags_at_the_start_of_the_output() {
        let bare = "{\"name\": \"f\", \"arguments\": {\"s\": \"a } \\\" ]\", \"l\": [1, {}]}}";
        assert_eq!(
            parse(bare),
            (
                String::new(),
                vec![call(0, "f", "{\"s\": \"a } \\\" ]\", \"l\": [1, {}]}")]
            )
        );
        let two = format!("  {bare}\n{}", bare.replace("\"f\"", "\"g\""));
        assert_eq!(parse(&two).1.len(), 2);
        // Not one of the request's functions, or not at the start: content.
        let other = bare.replace("\"f\"", "\"h\"");
        assert_eq!(parse(&other), (other.clone(), vec![]));
        let later = format!("Sure: {bare}");
        assert_eq!(parse(&later), (later.clone(), vec![]));
        // Cut short inside the arguments.
        assert_eq!(
            parse("{\"name\": \"g\", \"arguments\": {\"x\": "),
            (String::new(), vec![call(0, "g", "{\"x\":")])
        );
    }

    #[test]
    fn whitespace_after_a_call_is_dropped_and_one_call_ends_the_output() {
        let tagged = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let bare = "{\"name\": \"g\", \"arguments\": {}}";
        for first in [tagged, bare] {
            let text = format!("{first}\n\n  Done.\n{tagged}");
            let (content, calls) = parse(&text);
            assert_eq!((content.as_str(), calls.len()), ("Done.", 2), "{text}");
            let single = tools(ToolChoice::Auto, false);
            let (content, calls) = parse_with(&single, &text);
            assert_eq!((content.as_str(), calls.len()), ("", 1), "{text}");
            let mut parser = ToolCallParser::new("call_".into(), &single);
            parser.push(&text);
            assert!(parser.is_ended());
        }
    }
}
