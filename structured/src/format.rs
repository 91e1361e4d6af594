//! What a request asks its output to look like, read from the request body:
//! OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and
//! vLLM's extensions, as top-level `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar` (Lark) or the same keys without the
//! prefix inside `structured_outputs`. At most one of them; every mistake
//! names its field.

use serde_json::{Map, Value};

use crate::StructuredError;

/// The shape an output must have.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputFormat {
    /// Any text: no constraint.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax) as a whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Lark(String),
}

/// A format and the request field it came from (errors name it).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestedFormat {
    pub format: OutputFormat,
    pub param: String,
}

/// vLLM's constraint keys, as `guided_KEY` at the top level or `KEY` in `structured_outputs`.
const GUIDED_KEYS: [&str; 4] = ["json", "regex", "choice", "grammar"];

/// The output format `body` asks for, `None` when it asks for none.
pub fn from_request(body: &Map<String, Value>) -> Result<Option<RequestedFormat>, StructuredError> {
    let mut found: Vec<RequestedFormat> = Vec::new();
    if let Some(v) = present(body, "response_format") {
        let format = response_format(v)?;
        if format != OutputFormat::Text {
            found.push(RequestedFormat {
                format,
                param: "response_format".into(),
            });
        }
    }
    for key in GUIDED_KEYS {
        let param = format!("guided_{key}");
        if let Some(v) = present(body, &param) {
            found.push(guided(key, v, param)?);
        }
    }
    if let Some(v) = present(body, "structured_outputs") {
        let obj = v
            .as_object()
            .ok_or_else(|| field("structured_outputs", "must be an object"))?;
        for (key, v) in obj.iter().filter(|(_, v)| !v.is_null()) {
            let param = format!("structured_outputs.{key}");
            if !GUIDED_KEYS.contains(&key.as_str()) {
                return Err(field(
                    &param,
                    "is not supported (use json, regex, choice or grammar)",
                ));
            }
            found.push(guided(key, v, param)?);
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|f| f.param.as_str()).collect();
        return Err(field(
            &found[1].param,
            &format!("cannot be combined: give one of {}", names.join(", ")),
        ));
    }
    Ok(found.pop())
}

/// A field that is there and not `null`.
fn present<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn field(param: &str, what: &str) -> StructuredError {
    StructuredError::Field {
        param: param.to_string(),
        message: format!("'{param}' {what}"),
    }
}

/// OpenAI's `response_format` object.
fn response_format(v: &Value) -> Result<OutputFormat, StructuredError> {
    let obj = v.as_object().ok_or_else(|| {
        field(
            "response_format",
            "must be an object such as {\"type\": \"json_object\"}",
        )
    })?;
    let kind = present(obj, "type")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            field(
                "response_format.type",
                "must be \"text\", \"json_object\" or \"json_schema\"",
            )
        })?;
    match kind {
        "text" => Ok(OutputFormat::Text),
        "json_object" => Ok(OutputFormat::JsonObject),
        "json_schema" => json_schema(obj),
        other => Err(field(
            "response_format.type",
            &format!("is \"{other}\"; it must be \"text\", \"json_object\" or \"json_schema\""),
        )),
    }
}

/// `response_format.json_schema`: `name`, `schema`, optional `description`
/// and `strict` (every output is constrained, strict or not).
fn json_schema(obj: &Map<String, Value>) -> Result<OutputFormat, StructuredError> {
    let spec = present(obj, "json_schema")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            field(
                "response_format.json_schema",
                "must be an object with 'name' and 'schema'",
            )
        })?;
    let name = present(spec, "name").and_then(Value::as_str);
    let name_ok = name.is_some_and(|n| {
        (1..=64).contains(&n.len())
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    });
    if !name_ok {
        return Err(field(
            "response_format.json_schema.name",
            "must be 1 to 64 letters, digits, '_' or '-'",
        ));
    }
    if present(spec, "strict").is_some_and(|s| !s.is_boolean()) {
        return Err(field(
            "response_format.json_schema.strict",
            "must be true or false",
        ));
    }
    if present(spec, "description").is_some_and(|s| !s.is_string()) {
        return Err(field(
            "response_format.json_schema.description",
            "must be a string",
        ));
    }
    match present(spec, "schema") {
        Some(schema @ Value::Object(_)) => Ok(OutputFormat::JsonSchema(schema.clone())),
        Some(_) => Err(field(
            "response_format.json_schema.schema",
            "must be a JSON Schema object",
        )),
        None => Err(field("response_format.json_schema.schema", "is required")),
    }
}

/// One of vLLM's constraint keys (`json`, `regex`, `choice`, `grammar`).
fn guided(key: &str, v: &Value, param: String) -> Result<RequestedFormat, StructuredError> {
    let format = match key {
        "json" => match v {
            Value::Object(_) => OutputFormat::JsonSchema(v.clone()),
            // vLLM takes the schema as JSON text too.
            Value::String(text) => match serde_json::from_str::<Value>(text) {
                Ok(schema @ Value::Object(_)) => OutputFormat::JsonSchema(schema),
                _ => return Err(field(&param, "must be a JSON Schema object")),
            },
            _ => return Err(field(&param, "must be a JSON Schema object")),
        },
        "regex" => OutputFormat::Regex(non_empty_string(v, &param)?),
        "grammar" => OutputFormat::Lark(non_empty_string(v, &param)?),
        _ => {
            let wrong = || field(&param, "must be a non-empty list of strings");
            let items = v.as_array().filter(|a| !a.is_empty()).ok_or_else(wrong)?;
            let choices = items
                .iter()
                .map(|c| c.as_str().map(str::to_string).ok_or_else(wrong))
                .collect::<Result<Vec<_>, _>>()?;
            OutputFormat::Choice(choices)
        }
    };
    Ok(RequestedFormat { format, param })
}

fn non_empty_string(v: &Value, param: &str) -> Result<String, StructuredError> {
    match v.as_str() {
        Some(s) if !s.trim().is_empty() => Ok(s.to_string()),
        _ => Err(field(param, "must be a non-empty string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<Option<RequestedFormat>, StructuredError> {
        from_request(body.as_object().unwrap())
    }

    fn format(body: Value) -> Option<OutputFormat> {
        parse(body).unwrap().map(|f| f.format)
    }

    fn param_of_error(body: Value) -> String {
        match parse(body).unwrap_err() {
            StructuredError::Field { param, .. } => param,
            other => panic!("{other}"),
        }
    }

    #[test]
    fn reads_openai_and_vllm_fields() {
        assert_eq!(format(json!({"model": "m"})), None);
        assert_eq!(format(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            format(json!({"response_format": {"type": "json_object"}})),
            Some(OutputFormat::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            format(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "a_1", "schema": schema, "strict": true}}})),
            Some(OutputFormat::JsonSchema(schema.clone()))
        );
        assert_eq!(
            format(json!({"guided_json": schema.to_string()})),
            Some(OutputFormat::JsonSchema(schema))
        );
        assert_eq!(
            format(json!({"guided_regex": "[a-z]+"})),
            Some(OutputFormat::Regex("[a-z]+".into()))
        );
        assert_eq!(
            format(json!({"structured_outputs": {"choice": ["yes", "no"]}})),
            Some(OutputFormat::Choice(vec!["yes".into(), "no".into()]))
        );
        assert_eq!(
            format(json!({"guided_grammar": "start: \"x\""})),
            Some(OutputFormat::Lark("start: \"x\"".into()))
        );
    }

    #[test]
    fn mistakes_name_their_field() {
        for (body, param) in [
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "n", "schema": {}, "strict": "yes"}}}),
                "response_format.json_schema.strict",
            ),
            (json!({"guided_regex": ""}), "guided_regex"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_json": "not json"}), "guided_json"),
            (
                json!({"structured_outputs": {"xml": "x"}}),
                "structured_outputs.xml",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            assert_eq!(param_of_error(body.clone()), param, "{body}");
        }
    }
}
