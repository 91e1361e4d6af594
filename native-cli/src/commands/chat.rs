//! `tandem chat`: an interactive conversation. The whole conversation is
//! re-rendered with the chat template each turn, but only the tokens that
//! differ from what the KV cache already holds are run through the model.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;
use tandem_core::tokenizer::ChatMessage;
use tandem_core::Backend;

use super::speculate::SpeculationArgs;
use super::{build_engine, context_length, stream_turn, KvEvictionArgs, ModelArgs, SamplingArgs};
use crate::backend_select::{dispatch, WithBackend};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv_eviction: KvEvictionArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculation: SpeculationArgs,
    /// Most tokens per reply.
    #[arg(long, short = 'n', default_value_t = 512)]
    pub max_tokens: usize,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Read control tokens typed in messages (`<|im_start|>`) as control
    /// tokens; by default they are plain text, like the rest of a message.
    #[arg(long)]
    pub allow_special_tokens_in_content: bool,
}

pub fn run(args: ChatArgs) -> Result<()> {
    dispatch(args.model.target(), args)
}

impl WithBackend for ChatArgs {
    type Output = ();

    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let mut files = self.model.load_files()?;
        let allow = self.allow_special_tokens_in_content;
        files.tokenizer.set_special_tokens_in_content(allow);
        let ctx = context_length(&self.model, &files);
        let tokenizer = &files.tokenizer;
        let mut engine = build_engine(backend, &self.model, &self.kv_eviction, &files, ctx, 1)?;
        self.speculation.attach(&mut engine, &files)?;
        let mut messages: Vec<ChatMessage> = self
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.clone()))
            .collect();
        let mut seq = None;
        let stdin = std::io::stdin();
        let mut stdout = std::io::stdout();
        eprint_line!(
            "chatting with {} (empty line or Ctrl-D to quit)",
            files.path.display()
        );
        loop {
            write!(stdout, "> ")?;
            stdout.flush()?;
            let mut line = String::new();
            if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            messages.push(ChatMessage::new("user", line.trim_end()));
            let all = tokenizer.encode_chat(&messages, true)?;
            // Only the tokens after the longest prefix the sequence already holds are new.
            let continued = match seq {
                Some(id) => {
                    let cached = engine.tokens(id).unwrap_or_default();
                    let common = cached.iter().zip(&all).take_while(|(a, b)| a == b).count();
                    // Refused when the cut lies in evicted KV (--kv-budget).
                    let rewound = engine.rewind(id, common).is_ok();
                    if rewound {
                        engine.extend(id, &all[common..], self.max_tokens)?;
                    } else {
                        engine.remove(id);
                    }
                    rewound.then_some((id, all.len() - common))
                }
                None => None,
            };
            let (id, new_tokens) = match continued {
                Some(c) => c,
                None => {
                    let params = self.sampling.params();
                    let stop = tokenizer.eos_tokens().to_vec();
                    (
                        engine.add_request(all.clone(), params, self.max_tokens, stop)?,
                        all.len(),
                    )
                }
            };
            seq = Some(id);
            let (reply, stats) =
                stream_turn(&mut engine, tokenizer, id, new_tokens, &mut stdout, |_| {})?;
            writeln!(stdout)?;
            eprint_line!("[{}]", stats.report());
            if engine.speculation().is_some() {
                eprint_line!("[{}]", engine.stats().speculation.summary());
            }
            let content = tokenizer.decode(
                &reply
                    .iter()
                    .copied()
                    .filter(|&t| !tokenizer.is_eos(t))
                    .collect::<Vec<_>>(),
            )?;
            messages.push(ChatMessage::new("assistant", content));
        }
        Ok(())
    }
}
