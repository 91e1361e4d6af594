//! Chat templates: a model's Jinja template rendered with minijinja, set up the
//! way Hugging Face `transformers` renders them (`trim_blocks`, `lstrip_blocks`,
//! Python string methods, `raise_exception`), so the templates shipped in real
//! model files produce the prompts the models were trained on.
//!
//! A model's template is checked when the model loads ([`check`]): it must
//! compile and render a basic conversation, so a broken template is one
//! error at load instead of a failure of every chat request.

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One turn of a conversation: `role` is `system`, `user` or `assistant` (or
/// whatever else the model's template knows).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
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
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // transformers compiles chat templates with both options on; templates are
    // written for them (a `{% if %}` line leaves no newline behind).
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env
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
