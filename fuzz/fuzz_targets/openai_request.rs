//! The OpenAI-compatible server's request parser (`tandem_server::api::parse`)
//! on fuzzed bodies for both endpoints: the first byte picks the endpoint,
//! the rest is the body.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tandem_core::tokenizer::Tokenizer;
use tandem_fuzz::tiny_tokenizer;
use tandem_server::api::{parse, Endpoint, Limits};
use tandem_server::token_floor::TokenFloor;

/// The model the requests name, and its context.
const MODEL_ID: &str = "tiny";
const MAX_CONTEXT: usize = 64;

/// The tokenizer and its token floor, built once per process.
fn tokenizer() -> &'static (Tokenizer, TokenFloor) {
    static TOKENIZER: OnceLock<(Tokenizer, TokenFloor)> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let tokenizer = tiny_tokenizer().expect("the synthetic tokenizer builds");
        let floor = TokenFloor::of(&tokenizer);
        (tokenizer, floor)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = if selector & 1 == 0 {
        Endpoint::Completions
    } else {
        Endpoint::ChatCompletions
    };
    let (tokenizer, token_floor) = tokenizer();
    let limits = Limits {
        model_id: MODEL_ID,
        max_context: MAX_CONTEXT,
        tokenizer,
        token_floor,
        default_seed: 0,
    };
    let _ = parse(endpoint, body, &limits);
});
