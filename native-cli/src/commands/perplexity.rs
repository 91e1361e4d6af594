//! `tandem perplexity`: llama.cpp's method, so figures compare directly.
//! The text is cut into non-overlapping windows of `ctx` tokens (the tail
//! that does not fill a window is dropped); each window is evaluated from an
//! empty cache and only its second half is scored, so every scored token has
//! at least `ctx / 2` tokens of context.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_core::engine::EngineConfig;
use tandem_core::Backend;

use super::{build_engine_with, KvEvictionArgs, ModelArgs};
use crate::backend_select::{dispatch, WithBackend};

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Percentages of the budget are of the window (`--ctx`); SnapKV
    /// selects once the window's first half is computed.
    #[command(flatten)]
    pub kv_eviction: KvEvictionArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Score at most this many windows (0: all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    /// Tokens per forward pass (the engine's batch budget); small values
    /// fill the KV cache as decoding does, a few tokens per step.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    dispatch(args.model.target(), args)
}

/// Running sums of negative log-likelihoods.
#[derive(Default, Debug, Clone, Copy)]
pub struct NllSums {
    sum: f64,
    sum_sq: f64,
    count: usize,
}

impl NllSums {
    pub fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    pub fn ppl(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }

    /// llama.cpp's estimate: the standard error of the mean NLL, scaled by PPL.
    pub fn ppl_error(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum_sq / n - mean * mean;
        if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt() * self.ppl()
        } else {
            0.0
        }
    }
}

/// `-log softmax(logits)[target]`, computed stably in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln() - logits[target as usize] as f64
}

impl WithBackend for PerplexityArgs {
    type Output = ();

    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let text = std::fs::read_to_string(&self.file)
            .with_context(|| format!("reading {}", self.file.display()))?;
        let files = self.model.load_files()?;
        let tokens = files.tokenizer.encode(&text, true)?;
        // `--ctx` is the window length here, 512 unless given (llama.cpp's default).
        let n = self.model.ctx.unwrap_or(512);
        if n < 4 {
            bail!("--ctx must be at least 4");
        }
        let mut windows = tokens.len() / n;
        if windows == 0 {
            bail!(
                "{} has {} tokens, fewer than one window of {n}",
                self.file.display(),
                tokens.len()
            );
        }
        if self.chunks > 0 {
            windows = windows.min(self.chunks);
        }
        let config = EngineConfig {
            max_context: Some(n + 1),
            kv_precision: self.model.kv_precision(&files)?,
            max_recorded_batch: self.model.graph_batch,
            unfused: self.model.unfused,
            max_batch_tokens: self.batch as usize,
            kv_eviction: self.kv_eviction.config()?,
            block_size: self.model.kv_block_size,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(n + 1);
        let mut engine = build_engine_with(backend, &files, config)?;
        let vocab = files.config.vocab_size;
        let bos = files
            .tokenizer
            .bos_token()
            .filter(|_| tokens.first() == files.tokenizer.bos_token().as_ref());
        eprint_line!(
            "perplexity: {} tokens, {windows} windows of {n}, KV {}, KV eviction {}",
            tokens.len(),
            super::describe_kv_plan(&engine),
            self.kv_eviction.describe()
        );
        let first = n / 2;
        let mut sums = NllSums::default();
        for w in 0..windows {
            let mut window = tokens[w * n..(w + 1) * n].to_vec();
            // As llama.cpp: every window starts with BOS when the model uses one.
            if let Some(b) = bos {
                window[0] = b;
            }
            let logits = engine.score(&window, first)?;
            for (j, row) in (first..n - 1).zip(logits.chunks_exact(vocab)) {
                sums.add(nll(row, window[j + 1]));
            }
            eprint!("[{}]{:.4},", w + 1, sums.ppl());
            let _ = std::io::stderr().flush();
        }
        eprintln!();
        println!("PPL = {:.4} +/- {:.5}", sums.ppl(), sums.ppl_error());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_vocab_size_perplexity() {
        let mut s = NllSums::default();
        for t in 0..10 {
            s.add(nll(&[0.0; 8], t % 8));
        }
        assert!((s.ppl() - 8.0).abs() < 1e-9);
        assert!(s.ppl_error() < 1e-6, "{}", s.ppl_error());
    }
}
