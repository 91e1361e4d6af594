//! The OpenAI-compatible server's request parser (`tandem_server::api::parse`)
//! on fuzzed bodies for both endpoints: the first byte picks the endpoint,
//! the rest is the body.

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use tandem_core::kv::DEFAULT_BLOCK_SIZE;
use tandem_core::tokenizer::Tokenizer;
use tandem_fuzz::tiny_tokenizer;
use tandem_server::api::{parse, Endpoint, Limits};
use tandem_server::token_floor::TokenFloor;
use tandem_structured::StructuredOutput;

/// The model the requests name, and its context.
const MODEL_ID: &str = "tiny";
const MAX_CONTEXT: usize = 64;

/// The tokenizer, its token floor and the output-format compiler, built once per process.
fn tokenizer() -> &'static (Arc<Tokenizer>, TokenFloor, StructuredOutput) {
    static TOKENIZER: OnceLock<(Arc<Tokenizer>, TokenFloor, StructuredOutput)> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let tokenizer = Arc::new(tiny_tokenizer().expect("the synthetic tokenizer builds"));
        let floor = TokenFloor::of(&tokenizer);
        let structured = StructuredOutput::new(tokenizer.clone());
        (tokenizer, floor, structured)
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
    let (tokenizer, token_floor, structured) = tokenizer();
    let limits = Limits {
        model_id: MODEL_ID,
        max_context: MAX_CONTEXT,
        kv_block_size: DEFAULT_BLOCK_SIZE,
        tokenizer,
        token_floor,
        default_seed: 0,
        structured,
    };
    let _ = parse(endpoint, body, &limits);
});
