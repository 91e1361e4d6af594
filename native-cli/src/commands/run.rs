//! `tandem run`: one prompt, one streamed completion (the prompt itself is not echoed).

use anyhow::{anyhow, Result};
use clap::Args;
use tandem_core::engine::Request;
use tandem_core::Backend;

use super::speculate::SpeculationArgs;
use super::{build_engine, context_length, stream_turn, KvEvictionArgs, ModelArgs, SamplingArgs};
use crate::backend_select::{dispatch, WithBackend};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv_eviction: KvEvictionArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculation: SpeculationArgs,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_tokens: usize,
    /// Apply the model's chat template to the prompt (as a user message).
    #[arg(long)]
    pub chat_template: bool,
    /// After the text, print the generated token ids on stderr (`token ids: 1 2 3`).
    #[arg(long)]
    pub token_ids: bool,
    /// After the text, print each generated token's log-probability and
    /// its N most likely alternatives on stderr, a line per token
    /// (`logprobs 3: 42 -0.11 | 42 -0.11 7 -2.4 ...`).
    #[arg(long, value_name = "N")]
    pub top_logprobs: Option<usize>,
    pub prompt: String,
}

pub fn run(args: RunArgs) -> Result<()> {
    dispatch(args.model.target(), args)
}

impl WithBackend for RunArgs {
    type Output = ();

    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let files = self.model.load_files()?;
        let ctx = context_length(&self.model, &files);
        let tokenizer = &files.tokenizer;
        let text = if self.chat_template {
            let msg = tandem_core::tokenizer::ChatMessage::new("user", self.prompt.clone());
            tokenizer.apply_chat_template(&[msg], true)?
        } else {
            self.prompt.clone()
        };
        let prompt = tokenizer.encode(&text, true)?;
        let mut engine = build_engine(backend, &self.model, &self.kv_eviction, &files, ctx, 1)?;
        self.speculation.attach(&mut engine, &files)?;
        let info = engine.backend().info();
        eprint_line!("backend: {} ({})", info.name, info.device);
        let request = Request {
            stop_tokens: tokenizer.eos_tokens().to_vec(),
            logprobs: self.top_logprobs,
            ..Request::new(prompt.clone(), self.sampling.params(), self.max_tokens)
        };
        let seq = engine.submit(request).map_err(|e| anyhow!("{e}"))?[0];
        let mut stdout = std::io::stdout().lock();
        let mut logprobs = Vec::new();
        let (generated, stats) = stream_turn(
            &mut engine,
            tokenizer,
            seq,
            prompt.len(),
            &mut stdout,
            |ev| {
                logprobs.extend(ev.logprobs.clone().map(|l| (ev.token, l)));
            },
        )?;
        println!();
        for (i, (token, l)) in logprobs.iter().enumerate() {
            let top: Vec<String> = l.top.iter().map(|(t, p)| format!("{t} {p}")).collect();
            eprint_line!("logprobs {i}: {token} {} | {}", l.logprob, top.join(" "));
        }
        if self.token_ids {
            let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
            eprint_line!("token ids: {}", ids.join(" "));
        }
        eprint_line!("{}", stats.report());
        if engine.speculation().is_some() {
            eprint_line!("{}", engine.stats().speculation.summary());
        }
        Ok(())
    }
}
