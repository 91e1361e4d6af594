//! Reading the Hermes text itself, apart from the parser's states: where a
//! call's opening ends, where its object closes while the text is still
//! arriving, and how much of a marker may be cut across two pieces.
//! [`super::ToolCallParser`] decides what to hand out; this only finds
//! offsets.

/// The arguments in `text`, the rest of a call after its opening: up to
/// the call object's closing brace, without the whitespace around it.
pub(super) fn arguments_text(text: &str) -> &str {
    let text = text.trim_end();
    text.strip_suffix('}').unwrap_or(text).trim_end()
}

/// Length of the longest tail of `text` that `marker` starts with (and is shorter than it).
pub(super) fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Where a JSON object ends, read as its text arrives: the object's
/// opening brace is already behind, the text starts inside it.
#[derive(Debug, Default)]
pub(super) struct ObjectEnd {
    /// Bytes read so far.
    read: usize,
    /// Brackets and braces open inside the object.
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl ObjectEnd {
    /// The byte offset in `text` of the brace that closes the object, once it has come.
    pub(super) fn find(&mut self, text: &str) -> Option<usize> {
        for (i, c) in text[self.read..].char_indices() {
            let at = self.read + i;
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' if self.depth == 0 => {
                    self.read = at + 1;
                    return Some(at);
                }
                '}' | ']' => self.depth -= 1,
                _ => {}
            }
        }
        self.read = text.len();
        None
    }
}

/// How far a call's opening has been read.
pub(super) enum Head {
    /// `{"name": "NAME", "arguments": ` read, `len` bytes, with more after it.
    Found {
        name: String,
        len: usize,
    },
    NeedMore,
    /// Not written this way.
    Other,
}

/// Reads `{"name": "NAME", "arguments": ` at the start of `text`.
pub(super) fn scan_head(text: &str) -> Head {
    let mut c = Cursor { text, at: 0 };
    let mut read = || -> Result<String, Head> {
        c.space();
        c.literal("{")?;
        c.space();
        c.literal("\"name\"")?;
        c.space();
        c.literal(":")?;
        c.space();
        let name = c.name()?;
        c.space();
        c.literal(",")?;
        c.space();
        c.literal("\"arguments\"")?;
        c.space();
        c.literal(":")?;
        c.space();
        // The arguments start with what follows the spaces.
        if c.at == c.text.len() {
            return Err(Head::NeedMore);
        }
        Ok(name)
    };
    match read() {
        Ok(name) => Head::Found { name, len: c.at },
        Err(stop) => stop,
    }
}

struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.text[self.at..]
    }

    fn space(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    fn literal(&mut self, literal: &str) -> Result<(), Head> {
        let rest = self.rest();
        if rest.starts_with(literal) {
            self.at += literal.len();
            Ok(())
        } else if literal.starts_with(rest) {
            Err(Head::NeedMore)
        } else {
            Err(Head::Other)
        }
    }

    /// A JSON string without escapes.
    fn name(&mut self) -> Result<String, Head> {
        self.literal("\"")?;
        let rest = self.rest();
        match rest.find(['"', '\\']) {
            Some(end) if rest.as_bytes()[end] == b'"' && end > 0 => {
                self.at += end + 1;
                Ok(rest[..end].to_string())
            }
            Some(_) => Err(Head::Other),
            None => Err(Head::NeedMore),
        }
    }
}
