//! `bench --batch 1,2,4,...`: several sequences at once, measured like
//! llama-batched-bench. For each count N, N requests of `-p` random prompt
//! tokens each generate `-n` tokens together:
//!
//! - prompt tokens/s: N × p over the time until every sequence has its
//!   first token (llama-batched-bench's S_PP). Sequences admitted early may
//!   already decode meanwhile: the engine batches iteration by iteration.
//! - decode tokens/s: the tokens generated after that, all sequences
//!   decoding together, over the time they took (its S_TG).

use std::time::Instant;

use anyhow::Result;
use tandem_core::engine::Engine;
use tandem_core::sched::{Rng, SamplingParams};
use tandem_core::Backend;

use super::{awaits_first_token, random_tokens, summary, BenchArgs};

/// The rates of one batch size over the repetitions.
struct BatchRates {
    sequences: usize,
    prompt: Vec<f64>,
    decode: Vec<f64>,
}

/// Runs every batch size of `args.batch`, `args.repetitions` times each,
/// and prints a row per size (or one JSON object).
pub fn bench<B: Backend>(engine: &mut Engine<B>, args: &BenchArgs, rng: &mut Rng) -> Result<()> {
    let vocab = engine.model().config.vocab_size;
    let mut rows = Vec::new();
    for &n in &args.batch {
        let mut rates = BatchRates {
            sequences: n as usize,
            prompt: Vec::new(),
            decode: Vec::new(),
        };
        for _ in 0..args.repetitions.max(1) {
            let prompts = (0..n)
                .map(|_| random_tokens(rng, args.prompt_tokens.max(1), vocab))
                .collect();
            let (prompt, decode) = time_batch(engine, prompts, args.gen_tokens)?;
            rates.prompt.push(prompt);
            rates.decode.push(decode);
        }
        rows.push(rates);
    }
    let info = engine.backend().info();
    if args.json {
        let batches: Vec<_> = rows
            .iter()
            .map(|r| {
                let (pp, pp_sd) = summary(&r.prompt);
                let (tg, tg_sd) = summary(&r.decode);
                serde_json::json!({
                    "sequences": r.sequences,
                    "prompt_tokens_per_s": pp,
                    "prompt_tokens_per_s_sd": pp_sd,
                    "decode_tokens_per_s": tg,
                    "decode_tokens_per_s_sd": tg_sd,
                })
            })
            .collect();
        let obj = serde_json::json!({
            "backend": info.name,
            "device": info.device,
            "prompt_tokens": args.prompt_tokens.max(1),
            "gen_tokens": args.gen_tokens,
            "repetitions": args.repetitions,
            "kv_dtype": args.model.kv_dtype.to_string(),
            "batches": batches,
        });
        println!("{obj}");
    } else {
        println!("backend: {} ({})", info.name, info.device);
        println!(
            "{} prompt tokens and {} generated per sequence, KV {}",
            args.prompt_tokens.max(1),
            args.gen_tokens,
            args.model.kv_dtype
        );
        println!("sequences     prompt tokens/s          decode tokens/s   per sequence");
        for r in &rows {
            let (pp, pp_sd) = summary(&r.prompt);
            let (tg, tg_sd) = summary(&r.decode);
            println!(
                "{:9} {:12.1} ± {:<8.1} {:12.1} ± {:<8.1} {:8.1}",
                r.sequences,
                pp,
                pp_sd,
                tg,
                tg_sd,
                tg / r.sequences as f64
            );
        }
    }
    Ok(())
}

/// Prompt and decode tokens/s of `prompts` run together, each generating
/// `n` tokens.
fn time_batch<B: Backend>(
    engine: &mut Engine<B>,
    prompts: Vec<Vec<u32>>,
    n: usize,
) -> Result<(f64, f64)> {
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let start = Instant::now();
    let seqs = prompts
        .into_iter()
        .map(|p| {
            let len = p.len();
            engine
                .add_request(p, SamplingParams::default(), n.max(1), Vec::new())
                .map(|seq| (seq, len))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let generated = |engine: &Engine<B>| -> usize {
        let tokens = |&(seq, len)| engine.tokens(seq).map_or(0, |t| t.len() - len);
        seqs.iter().map(tokens).sum()
    };
    while seqs
        .iter()
        .any(|&(seq, len)| awaits_first_token(engine, seq, len))
    {
        engine.step()?;
    }
    let prompt_secs = start.elapsed().as_secs_f64();
    let first = generated(engine);
    let start = Instant::now();
    while seqs.iter().any(|&(seq, _)| !engine.is_finished(seq)) {
        engine.step()?;
    }
    let decode_secs = start.elapsed().as_secs_f64();
    let decoded = generated(engine) - first;
    for &(seq, _) in &seqs {
        engine.remove(seq);
    }
    Ok((
        prompt_tokens as f64 / prompt_secs,
        decoded as f64 / decode_secs.max(1e-9),
    ))
}
