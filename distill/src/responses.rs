//! Training text in the target's own words. A draft trained on raw prose
//! meets chat-formatted prompts, and the way the target answers them, only
//! when it drafts; there it agreed with the target on a few percent of
//! tokens. So the target answers a list of instructions itself (greedy, as
//! the speculative decoding it will serve is judged), and each
//! conversation, rendered with the model's chat template, becomes training
//! text. The target's logits on that text are then what the student learns,
//! as for any other text.

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::ChatMessage;
use tandem_cpu::CpuBackend;

use crate::{Error, Result};

/// Conversations answered at once.
const CONCURRENT: usize = 16;

/// Each instruction of `instructions` as a user turn, the target's greedy
/// answer of at most `max_tokens` tokens after it (its end-of-turn token
/// included when it ends within them): one token list per instruction.
/// `progress(done, generated tokens)` is called as answers complete.
pub fn answer(
    target: &ModelFiles,
    instructions: &[String],
    max_tokens: usize,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Vec<u32>>> {
    if max_tokens == 0 {
        return Err(Error::InvalidInput(
            "answers of 0 tokens teach nothing".into(),
        ));
    }
    let tokenizer = &target.tokenizer;
    let prompts = instructions
        .iter()
        .map(|text| {
            let turn = [ChatMessage::new("user", text.as_str())];
            let rendered = tokenizer.apply_chat_template(&turn, true)?;
            Ok(tokenizer.encode(&rendered, true)?)
        })
        .collect::<Result<Vec<Vec<u32>>>>()?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_tokens;
    if longest > target.config.max_context {
        return Err(Error::InvalidInput(format!(
            "an instruction and its answer take up to {longest} tokens, past the target's context of {}",
            target.config.max_context
        )));
    }
    let config = EngineConfig {
        max_context: Some(longest),
        max_running: CONCURRENT,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(CONCURRENT * longest);
    let mut engine = Engine::new(CpuBackend::new(threads), target, config, &mut |_, _| {})?;
    let stop = tokenizer.eos_tokens().to_vec();
    let mut conversations = Vec::with_capacity(prompts.len());
    let mut generated = 0;
    for wave in prompts.chunks(CONCURRENT) {
        let ids = wave
            .iter()
            .map(|p| {
                engine.add_request(
                    p.clone(),
                    SamplingParams::default(),
                    max_tokens,
                    stop.clone(),
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        while engine.has_work() {
            generated += engine.step().map_err(tandem_core::Error::from)?.len();
        }
        for id in ids {
            conversations.push(engine.tokens(id).map(<[u32]>::to_vec).unwrap_or_default());
            engine.remove(id);
        }
        progress(conversations.len(), generated);
    }
    Ok(conversations)
}
