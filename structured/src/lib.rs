//! Structured output: a request's `response_format` or grammar turned into a
//! token constraint for a Tandem tokenizer, with llguidance (the constraint
//! library of llama.cpp and mistral.rs) computing the masks.
//!
//! `format` reads what a request asks for (OpenAI's `response_format`,
//! vLLM's `guided_*` fields); [`StructuredOutput::compile`] compiles it
//! into a [`SharedConstraintFactory`] the engine runs (`tandem_core::sched::
//! constraint`); `vocab` gives llguidance the tokenizer's token bytes;
//! `constraint` adapts llguidance's matcher to the engine's trait.
//!
//! JSON output allows at most [`JSON_WHITESPACE`] whitespace between tokens
//! (as llama.cpp's JSON grammars bound it), so a model cannot loop on
//! whitespace; a schema's own `x-guidance` options take precedence.

mod constraint;
pub mod format;
mod vocab;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::InferenceCapabilities;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use tandem_core::sched::SharedConstraintFactory;
use tandem_core::tokenizer::Tokenizer;

pub use constraint::GrammarConstraint;
pub use format::{from_request, OutputFormat, RequestedFormat};

/// The whitespace allowed between JSON tokens.
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,20}";

#[derive(Debug, thiserror::Error)]
pub enum StructuredError {
    /// A request field is malformed.
    #[error("{message}")]
    Field { param: String, message: String },
    /// The schema or grammar does not compile.
    #[error("'{param}': {message}")]
    Grammar { param: String, message: String },
    /// This model's tokenizer cannot be read by llguidance.
    #[error("structured output is not available for this model: {0}")]
    Unavailable(String),
}

impl StructuredError {
    /// The request field the error is about, if any.
    pub fn param(&self) -> Option<&str> {
        match self {
            StructuredError::Field { param, .. } | StructuredError::Grammar { param, .. } => {
                Some(param)
            }
            StructuredError::Unavailable(_) => None,
        }
    }
}

/// Compiles output formats for one model's tokenizer. The token trie is
/// built on the first compile (it takes a moment for a large vocabulary),
/// then shared by every request.
pub struct StructuredOutput {
    tokenizer: Arc<Tokenizer>,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl StructuredOutput {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, StructuredError> {
        let built = self.factory.get_or_init(|| {
            let env = vocab::token_env(self.tokenizer.clone()).map_err(|e| match e {
                StructuredError::Unavailable(why) => why,
                other => other.to_string(),
            })?;
            let slices = llguidance::earley::SlicedBiasComputer::general_slices();
            let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices)
                .map_err(|e| e.to_string())?;
            factory.quiet();
            Ok(factory)
        });
        built
            .as_ref()
            .map_err(|why| StructuredError::Unavailable(why.clone()))
    }

    /// The constraint for `requested`; `None` for plain text.
    pub fn compile(
        &self,
        requested: &RequestedFormat,
    ) -> Result<Option<SharedConstraintFactory>, StructuredError> {
        let (grammar, what) = match &requested.format {
            OutputFormat::Text => return Ok(None),
            OutputFormat::JsonObject => (
                json_grammar(json!({"type": "object"})),
                "JSON object".to_string(),
            ),
            OutputFormat::JsonSchema(schema) => {
                (json_grammar(schema.clone()), "JSON schema".to_string())
            }
            OutputFormat::Regex(rx) => (TopLevelGrammar::from_regex(rx), "regex".to_string()),
            OutputFormat::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
                (
                    TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|"))),
                    format!("one of {} choices", choices.len()),
                )
            }
            OutputFormat::Lark(lark) => (
                TopLevelGrammar::from_lark(lark.clone()),
                "Lark grammar".to_string(),
            ),
        };
        let invalid = |message: String| StructuredError::Grammar {
            param: requested.param.clone(),
            message,
        };
        let parser = self
            .factory()?
            .create_parser(grammar)
            .map_err(|e| invalid(format!("the {what} does not compile: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(format!("the {what} does not compile: {e}")));
        }
        Ok(Some(Arc::new(GrammarConstraint::new(matcher, what))))
    }
}

/// A JSON schema grammar with bounded whitespace unless the schema says otherwise.
fn json_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// `text` as a regex matching exactly itself (the characters
/// `regex_syntax::escape` escapes).
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
