//! Tool calling, the request side: `tools`, `tool_choice` and
//! `parallel_tool_calls` checked against what the model's chat template can
//! do.
//!
//! The tools reach the model through its own chat template (as
//! `transformers`' `apply_chat_template(tools=...)`), and its calls are read
//! back in the Hermes format Qwen2.5 is trained on (`<tool_call>{"name":
//! ..., "arguments": ...}</tool_call>`, or the bare object at the start of
//! the output, see [`crate::tool_parser`]). A model
//! whose template does not show tools to the model (SmolLM2, Gemma 3), or
//! writes calls in another format, gets a 400: a prompt the model was not
//! trained on would give calls nobody can rely on.
//!
//! `tool_choice`:
//! - `"auto"` (the default with tools): the model decides;
//! - `"none"`: the tools are left out of the prompt and the output is text;
//! - `"required"`: the output is constrained (llguidance, through
//!   `tandem-structured`) to calls, `<tool_call>\n{"name": ..., "arguments":
//!   ...}\n</tool_call>`, each naming one of the functions with arguments
//!   valid under its `parameters` schema;
//! - `{"type": "function", "function": {"name": N}}`: the same, one call of
//!   `N` (as vLLM).
//!
//! `parallel_tool_calls: false` ends the output after its first call.

use serde_json::{json, Value};
use tandem_core::sched::SharedConstraintFactory;
use tandem_core::tokenizer::Tokenizer;
use tandem_structured::{OutputFormat, RequestedFormat, StructuredOutput, JSON_WHITESPACE};

use crate::api::ApiError;
use crate::fields::Fields;

/// What the Hermes format opens a call with.
pub const CALL_OPEN: &str = "<tool_call>";
/// What the Hermes format closes a call with.
pub const CALL_CLOSE: &str = "</tool_call>";

/// Longest function name OpenAI accepts.
const MAX_NAME_LEN: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tools of a chat request and how they may be used.
#[derive(Clone, Debug)]
pub struct ToolUse {
    /// The function definitions as the client sent them.
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    /// Whether several calls may follow each other.
    pub parallel: bool,
}

impl ToolUse {
    /// The tools the template shows the model.
    pub fn shown(&self) -> &[Value] {
        match self.choice {
            ToolChoice::None => &[],
            _ => &self.tools,
        }
    }

    /// The names of the functions.
    pub fn function_names(&self) -> Vec<String> {
        (self.tools.iter())
            .filter_map(|t| t["function"]["name"].as_str())
            .map(str::to_string)
            .collect()
    }

    /// Whether calls are read from the output.
    pub fn reads_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The constraint that forces calls (`required`, a named function);
    /// `None` when the model may answer in text.
    pub fn constraint(
        &self,
        structured: &StructuredOutput,
    ) -> Result<Option<SharedConstraintFactory>, ApiError> {
        let allowed: Vec<&Value> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return Ok(None),
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => (self.tools.iter())
                .filter(|t| t["function"]["name"] == name.as_str())
                .collect(),
        };
        let rules: Vec<String> = (allowed.iter().enumerate())
            .map(|(i, tool)| format!("f{i}: %json {}", call_schema(tool)))
            .collect();
        let bodies: Vec<String> = (0..allowed.len()).map(|i| format!("f{i}")).collect();
        // A named function is called once, as vLLM does; `required` may
        // make several calls unless `parallel_tool_calls` is false.
        let several = self.parallel && self.choice == ToolChoice::Required;
        let calls = if several {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        let grammar = format!(
            "start: {calls}\ncall: {open} body {close}\nbody: {}\n{}\n",
            bodies.join(" | "),
            rules.join("\n"),
            open = Value::from(format!("{CALL_OPEN}\n")),
            close = Value::from(format!("\n{CALL_CLOSE}")),
        );
        let requested = RequestedFormat {
            format: OutputFormat::Lark(grammar),
            param: "tools".into(),
        };
        structured
            .compile(&requested)
            .map_err(|e| ApiError::bad_request(e.to_string(), e.param()))
    }
}

/// The JSON schema of a call of `tool`: its name, then arguments valid
/// under its `parameters`, in the order Hermes writes them.
fn call_schema(tool: &Value) -> Value {
    let function = &tool["function"];
    let parameters = match function.get("parameters") {
        Some(p) if p.is_object() => p.clone(),
        _ => json!({"type": "object"}),
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
    })
}

/// The tools of a chat request, `None` when it has none.
pub fn parse(f: &Fields<'_>, tokenizer: &Tokenizer) -> Result<Option<ToolUse>, ApiError> {
    let tools = match f.get("tools") {
        None => Vec::new(),
        Some(Value::Array(tools)) => tools.clone(),
        Some(_) => return Err(Fields::wrong("tools", "a list of function definitions")),
    };
    let names = tools
        .iter()
        .enumerate()
        .map(|(i, tool)| function_name(i, tool))
        .collect::<Result<Vec<_>, _>>()?;
    let choice = tool_choice(f.get("tool_choice"))?;
    let parallel = f.boolean("parallel_tool_calls")?.unwrap_or(true);
    if tools.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::bad_request(
                "'tool_choice' requires a function: 'tools' is empty",
                Some("tool_choice"),
            )),
        };
    }
    if let ToolChoice::Named(name) = &choice {
        if !names.contains(&name.as_str()) {
            return Err(ApiError::bad_request(
                format!("'tool_choice' names '{name}', which is not in 'tools'"),
                Some("tool_choice"),
            ));
        }
    }
    if choice != ToolChoice::None {
        check_template(tokenizer)?;
    }
    Ok(Some(ToolUse {
        tools,
        choice,
        parallel,
    }))
}

/// The name of `tools[i]`, an OpenAI function definition.
fn function_name(i: usize, tool: &Value) -> Result<&str, ApiError> {
    let field = format!("tools[{i}]");
    let wrong = |what: &str| ApiError::bad_request(format!("'{field}' {what}"), Some(&field));
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(wrong(
            "must be {\"type\": \"function\", \"function\": {\"name\": ...}} (only functions are supported)",
        ));
    }
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| wrong("needs a 'function' object"))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| wrong("needs 'function.name', a string"))?;
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > MAX_NAME_LEN || !name.chars().all(valid) {
        return Err(wrong(&format!(
            "has the name '{name}': names are 1 to {MAX_NAME_LEN} of a-z, A-Z, 0-9, _ and -"
        )));
    }
    if function.get("parameters").is_some_and(|p| !p.is_object()) {
        return Err(wrong(
            "has 'function.parameters' that is not a JSON schema object",
        ));
    }
    Ok(name)
}

fn tool_choice(value: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let wrong = || {
        Fields::wrong(
            "tool_choice",
            "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    Ok(match value {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(wrong()),
        },
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(wrong)?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(wrong()),
    })
}

/// Refuses a model whose chat template cannot show tools, or writes calls
/// in a format other than Hermes's.
fn check_template(tokenizer: &Tokenizer) -> Result<(), ApiError> {
    if !tokenizer.chat_template_reads_tools() {
        return Err(Fields::unsupported(
            "tools",
            "this model's chat template does not support tools",
        ));
    }
    if !tokenizer
        .chat_template()
        .is_some_and(|t| t.contains(CALL_OPEN))
    {
        return Err(Fields::unsupported(
            "tools",
            "this model's chat template writes tool calls in a format this server does not read (it reads Hermes/Qwen2.5's <tool_call>)",
        ));
    }
    Ok(())
}
