//! The llguidance adapter on the synthetic byte-level tokenizer: documents
//! that fit a format go through mask by mask and end the grammar, documents
//! that do not are refused where they go wrong, rollback restores the
//! earlier mask, and bad schemas and grammars are errors naming the field.

use std::sync::Arc;

use serde_json::json;
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::{SequenceConstraint, SharedConstraintFactory};
use tandem_core::tokenizer::Tokenizer;
use tandem_structured::{OutputFormat, RequestedFormat, StructuredError, StructuredOutput};

fn tokenizer() -> Arc<Tokenizer> {
    let model = SyntheticModel::preset("tiny", WeightFormat::F32, 1).unwrap();
    Arc::new(model.files().unwrap().tokenizer)
}

fn compile(out: &StructuredOutput, format: OutputFormat) -> SharedConstraintFactory {
    let requested = RequestedFormat {
        format,
        param: "response_format".into(),
    };
    out.compile(&requested).unwrap().expect("a constraint")
}

/// How many tokens of `text` the constraint takes before one is not
/// allowed, and whether it then ends (only EOS allowed).
fn walk(factory: &SharedConstraintFactory, tok: &Tokenizer, text: &str) -> (usize, bool) {
    let vocab = tok.vocab_size();
    let eos = tok.eos_tokens().to_vec();
    let mut c = SequenceConstraint::new(factory.start().unwrap());
    let tokens = tok.encode(text, false).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        if !c.allowed(vocab, &eos).unwrap().allows(t) {
            return (i, false);
        }
        c.advance(t).unwrap();
    }
    let mask = c.allowed(vocab, &eos).unwrap();
    (tokens.len(), mask.allows(eos[0]))
}

fn accepts(factory: &SharedConstraintFactory, tok: &Tokenizer, text: &str) -> bool {
    let n = tok.encode(text, false).unwrap().len();
    walk(factory, tok, text) == (n, true)
}

#[test]
fn json_schemas_accept_valid_documents_and_refuse_the_rest() {
    let tok = tokenizer();
    let out = StructuredOutput::new(tok.clone());
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "home": {"type": "object", "properties": {"x": {"type": "number"}},
                     "required": ["x"], "additionalProperties": false}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let f = compile(&out, OutputFormat::JsonSchema(schema));
    assert!(accepts(&f, &tok, r#"{"name":"Ann","age":31}"#));
    assert!(accepts(
        &f,
        &tok,
        r#"{"name": "Bo", "age": 7, "tags": ["b", "a"], "home": {"x": -1.5}}"#
    ));
    assert!(accepts(&f, &tok, "{\n  \"name\": \"\",\n  \"age\": 120\n}"));
    for bad in [
        r#"{"age":31}"#,                          // name is required first
        r#"{"name":"Ann","age":121}"#,            // above the maximum
        r#"{"name":"Ann","age":3,"tags":["c"]}"#, // not in the enum
        r#"{"name":"Ann","age":3,"extra":1}"#,    // no other properties
        r#"{"name":"123456789","age":3}"#,        // longer than maxLength
        r#"["name"]"#,                            // not an object
    ] {
        assert!(!accepts(&f, &tok, bad), "{bad}");
    }
    let f = compile(&out, OutputFormat::JsonObject);
    assert!(accepts(&f, &tok, r#"{"a":[1,{"b":null}],"c":"d"}"#));
    assert!(!accepts(&f, &tok, r#"[1]"#));
    assert!(!accepts(&f, &tok, r#"{"a":1"#));
}

#[test]
fn whitespace_between_json_tokens_is_bounded() {
    let tok = tokenizer();
    let out = StructuredOutput::new(tok.clone());
    let f = compile(&out, OutputFormat::JsonObject);
    let spaces = |n: usize| format!("{{\"a\":{}1}}", " ".repeat(n));
    assert!(accepts(&f, &tok, &spaces(20)));
    assert!(!accepts(&f, &tok, &spaces(21)));
}

#[test]
fn regexes_choices_and_lark_grammars_constrain() {
    let tok = tokenizer();
    let out = StructuredOutput::new(tok.clone());
    let f = compile(&out, OutputFormat::Regex(r"[0-9]{3}-[a-z]+".into()));
    assert!(accepts(&f, &tok, "123-abc"));
    assert_eq!(walk(&f, &tok, "12-"), (2, false));
    let f = compile(
        &out,
        OutputFormat::Choice(vec!["yes (1)".into(), "no.".into()]),
    );
    assert!(accepts(&f, &tok, "yes (1)"));
    assert!(accepts(&f, &tok, "no."));
    assert!(!accepts(&f, &tok, "no!"));
    let f = compile(
        &out,
        OutputFormat::Lark("start: item (\",\" item)*\nitem: /[a-c]/ | \"<\" item \">\"".into()),
    );
    assert!(accepts(&f, &tok, "a,<b>,<<c>>"));
    assert!(!accepts(&f, &tok, "a,<b"));
}

#[test]
fn rollback_restores_the_earlier_mask_and_finished_allows_only_stop_tokens() {
    let tok = tokenizer();
    let out = StructuredOutput::new(tok.clone());
    let f = compile(&out, OutputFormat::Regex("ab|abc".into()));
    let vocab = tok.vocab_size();
    let eos = tok.eos_tokens().to_vec();
    let mut c = SequenceConstraint::new(f.start().unwrap());
    let ids = tok.encode("abc", false).unwrap();
    assert_eq!(
        ids.len(),
        3,
        "one token per byte in the synthetic vocabulary"
    );
    c.advance(ids[0]).unwrap();
    let after_a = c.allowed(vocab, &eos).unwrap();
    c.advance_tentatively(ids[1]).unwrap();
    c.advance_tentatively(ids[2]).unwrap();
    assert!(c.is_finished(), "nothing may follow abc");
    let only_stop = c.allowed(vocab, &[eos[0]]).unwrap();
    assert_eq!(only_stop.tokens().collect::<Vec<_>>(), vec![eos[0]]);
    c.settle(0).unwrap();
    assert!(!c.is_finished());
    assert_eq!(c.allowed(vocab, &eos).unwrap(), after_a);
    // Samples start apart.
    let mut other = SequenceConstraint::new(f.start().unwrap());
    assert!(other.allowed(vocab, &eos).unwrap().allows(ids[0]));
    assert!(!other.allowed(vocab, &eos).unwrap().allows(ids[1]));
}

#[test]
fn bad_schemas_and_grammars_are_errors_naming_the_field() {
    let out = StructuredOutput::new(tokenizer());
    for (format, words) in [
        (
            OutputFormat::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "JSON schema does not compile",
        ),
        (
            OutputFormat::JsonSchema(
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            ),
            "missing",
        ),
        (OutputFormat::Regex("[a-".into()), "regex does not compile"),
        (
            OutputFormat::Lark("start: undefined_rule".into()),
            "Lark grammar does not compile",
        ),
    ] {
        let requested = RequestedFormat {
            format: format.clone(),
            param: "guided_x".into(),
        };
        match out.compile(&requested) {
            Err(e @ StructuredError::Grammar { .. }) => {
                assert_eq!(e.param(), Some("guided_x"));
                let text = e.to_string();
                assert!(text.contains(words), "{format:?}: {text}");
            }
            Err(e) => panic!("{format:?}: {e}"),
            Ok(_) => panic!("{format:?} compiled"),
        }
    }
    let text = RequestedFormat {
        format: OutputFormat::Text,
        param: "response_format".into(),
    };
    assert!(out.compile(&text).unwrap().is_none());
}
