//! Chat templates: a model's Jinja template rendered with minijinja, set up the
//! way Hugging Face `transformers` renders them (`trim_blocks`, `lstrip_blocks`,
//! Python string methods, `raise_exception`, and `tojson` as Python's
//! `json.dumps` writes it), so the templates shipped in real model files
//! produce the prompts the models were trained on. Tools and tool calls reach
//! the template as `apply_chat_template(messages, tools=...)` passes them: a
//! `tools` list of OpenAI function definitions, and per assistant turn its
//! `tool_calls` with `arguments` as a JSON object.
//!
//! A model's template is checked when the model loads ([`check`]): it must
//! compile and render a basic conversation, so a broken template is one
//! error at load instead of a failure of every chat request.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One turn of a conversation: `role` is `system`, `user`, `assistant` or
/// `tool` (or whatever else the model's template knows).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The functions an assistant turn called; absent from the template's
    /// view when there are none, as in `transformers`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A function call made by an assistant turn, in OpenAI's shape
/// (`{id, type: "function", function: {name, arguments}}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object (templates write it with `tojson`); OpenAI's JSON
    /// string is parsed into one by the caller.
    pub arguments: serde_json::Value,
}

impl ToolCall {
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: serde_json::Value,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }
}

/// A template for models whose file brings none, chosen by the turn markers
/// their vocabulary has (a base model's file often has no template).
pub(super) struct FallbackTemplate {
    pub name: &'static str,
    pub text: &'static str,
    /// Control tokens the vocabulary must have for this template to apply.
    markers: &'static [&'static str],
}

/// ChatML, which most small chat models speak; the fallback when no other fits.
const CHATML: FallbackTemplate = FallbackTemplate {
    name: "ChatML",
    text: concat!(
        r"{% for message in messages %}",
        r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
        r"{% endfor %}",
        r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    ),
    markers: &[],
};

/// Gemma's turns: the system message opens the first user turn, the assistant is
/// "model", and user and assistant alternate, as Gemma's instruction-tuned
/// models were trained.
const GEMMA: FallbackTemplate = FallbackTemplate {
    name: "Gemma turns",
    text: concat!(
        "{{ bos_token }}",
        "{% if messages and messages[0]['role'] == 'system' %}",
        "{% set prefix = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}",
        "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}",
        "{% for message in turns %}",
        "{% if message['role'] != ['user', 'assistant'][loop.index0 % 2] %}",
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
        "{% endif %}",
        "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\n' }}",
        "{% if loop.first %}{{ prefix }}{% endif %}",
        "{{ message['content'] | trim }}<end_of_turn>\n",
        "{% endfor %}",
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
    markers: &["<start_of_turn>", "<end_of_turn>"],
};

/// The first fallback whose markers the vocabulary has (`has_token`), else ChatML.
pub(super) fn fallback(has_token: impl Fn(&str) -> bool) -> &'static FallbackTemplate {
    [&GEMMA]
        .into_iter()
        .find(|template| template.markers.iter().all(|marker| has_token(marker)))
        .unwrap_or(&CHATML)
}

/// The variables a template sees.
#[derive(Serialize)]
pub(super) struct TemplateInputs<'a> {
    pub messages: &'a [ChatMessage],
    /// OpenAI function definitions; left undefined when there are none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a [serde_json::Value]>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
}

/// Renders `template` with `inputs`; a template that does not parse, or that calls
/// `raise_exception`, is an [`Error::ChatTemplate`] carrying minijinja's message.
pub(super) fn render(template: &str, inputs: &TemplateInputs<'_>) -> Result<String> {
    environment()
        .render_str(template, inputs)
        .map_err(|e| Error::ChatTemplate(e.to_string()))
}

/// A conversation every template must render at load.
struct Probe {
    turns: &'static [(&'static str, &'static str)],
    add_generation_prompt: bool,
    /// The template may refuse it by `raise_exception` (models trained
    /// without system turns refuse them).
    may_refuse: bool,
}

const PROBES: [Probe; 2] = [
    Probe {
        turns: &[
            ("user", "Hello."),
            ("assistant", "Hi!"),
            ("user", "How are you?"),
        ],
        add_generation_prompt: true,
        may_refuse: false,
    },
    Probe {
        turns: &[
            ("system", "Be brief."),
            ("user", "Hello."),
            ("assistant", "Hi!"),
        ],
        add_generation_prompt: false,
        may_refuse: true,
    },
];

/// Refuses a `template` that does not compile, or that fails on a basic
/// conversation other than by refusing it on purpose.
pub(super) fn check(template: &str, bos_token: &str, eos_token: &str) -> Result<()> {
    let env = environment();
    let compiled = env
        .template_from_str(template)
        .map_err(|e| Error::ChatTemplate(format!("the model's template does not compile: {e}")))?;
    for probe in PROBES {
        let messages: Vec<ChatMessage> = (probe.turns.iter())
            .map(|&(role, content)| ChatMessage::new(role, content))
            .collect();
        let inputs = TemplateInputs {
            messages: &messages,
            tools: None,
            add_generation_prompt: probe.add_generation_prompt,
            bos_token,
            eos_token,
        };
        match compiled.render(&inputs) {
            Ok(_) => {}
            Err(e) if probe.may_refuse && is_refusal(&e) => {}
            Err(e) => {
                let roles: Vec<&str> = probe.turns.iter().map(|t| t.0).collect();
                return Err(Error::ChatTemplate(format!(
                    "the model's template fails on a {} conversation: {e}",
                    roles.join("/")
                )));
            }
        }
    }
    Ok(())
}

/// An environment set up as `transformers` renders chat templates.
pub(super) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // transformers compiles chat templates with both options on; templates are
    // written for them (a `{% if %}` line leaves no newline behind).
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    env
}

/// Whether `template` reads the variable `name` (a template that never
/// reads `tools` cannot show them to the model).
pub(super) fn reads_variable(template: &str, name: &str) -> bool {
    let env = environment();
    env.template_from_str(template)
        .is_ok_and(|t| t.undeclared_variables(false).contains(name))
}

/// Marks the errors of `raise_exception`: a template refusing a conversation.
#[derive(Debug, thiserror::Error)]
#[error("refused by the template")]
struct Refusal;

/// What templates call to refuse a conversation (`raise_exception('roles must alternate')`).
fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message).with_source(Refusal))
}

fn is_refusal(e: &minijinja::Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<Refusal>())
}

/// `transformers`' `tojson`: Python's `json.dumps(value, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, the same keyword
/// arguments taken. minijinja's own filter escapes `<`, `>`, `&` and `'` for
/// HTML, which would change the prompt.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(text) => Some(text.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item, key)",
            ))
        }
        // Python's defaults: no space before a newline when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json = PythonJson {
        indent,
        item,
        key,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    json.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// How `json.dumps` lays out a value.
struct PythonJson {
    indent: Option<String>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PythonJson {
    fn write(
        &self,
        value: &Value,
        depth: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match value.as_i64() {
                Some(n) if value.is_integer() => out.push_str(&n.to_string()),
                _ => {
                    let x = f64::try_from(value.clone())?;
                    out.push_str(&python_float(x));
                }
            },
            ValueKind::String => self.write_str(value.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let items = keys
                    .into_iter()
                    .map(|k| value.get_item(&k).map(|v| (k, v)))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                self.write_items(('{', '}'), items.len(), depth, out, |i, out| {
                    let (k, v) = &items[i];
                    match k.as_str() {
                        Some(text) => self.write_str(text, out),
                        // Python writes other keys as strings.
                        None => self.write_str(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.write(v, depth + 1, out)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_items(('[', ']'), items.len(), depth, out, |i, out| {
                    self.write(&items[i], depth + 1, out)
                })?;
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// `len` items between `brackets`, each written by `item`.
    fn write_items(
        &self,
        (open, close): (char, char),
        len: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth));
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            item(i, out)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn write_str(&self, text: &str, out: &mut String) {
        let quoted = serde_json::to_string(text).expect("a string serializes");
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

/// `repr` of a Python float: integral values keep `.0`, exponents are
/// signed and two digits at least (`1e+16`, `1e-05`), and what JSON cannot hold is `NaN`/`Infinity` as Python writes it.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let text = serde_json::to_string(&x).expect("a finite float serializes");
    match text.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(digits) => ('-', digits),
                None => ('+', exp.trim_start_matches('+')),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => text,
    }
}
