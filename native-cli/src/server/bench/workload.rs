//! The benchmark's requests: prompt and output lengths drawn from
//! log-normal distributions, random prompt tokens, and Poisson arrival
//! times, all from one seed so reruns see the same workload.
//!
//! Log-normal, because real chat traces are long-tailed: in ShareGPT (the
//! conversations vLLM's serving benchmark replays) most answers are short
//! and a few are many times longer. That tail is what static batching pays
//! for, and a benchmark with narrow, uniform lengths hides it.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Result};
use tandem_core::sched::Rng;

/// A log-normal distribution given by its median (`exp(mu)`) and the
/// standard deviation `sigma` of its logarithm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogNormal {
    pub median: f64,
    pub sigma: f64,
}

impl LogNormal {
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        self.median * (self.sigma * standard_normal(rng)).exp()
    }

    /// `median * exp(sigma^2 / 2)`.
    pub fn mean(&self) -> f64 {
        self.median * (self.sigma * self.sigma / 2.0).exp()
    }
}

/// Box–Muller: one standard normal draw from two uniform ones.
fn standard_normal(rng: &mut Rng) -> f64 {
    let u1 = 1.0 - rng.next_f64(); // (0, 1]: the logarithm stays finite
    let u2 = rng.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Requests per second of a Poisson arrival process, or every request at
/// once (`inf`, written so on the command line and in the JSON).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    PerSecond(f64),
    Infinite,
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("inf") {
            return Ok(Rate::Infinite);
        }
        match t.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Rate::PerSecond(r)),
            _ => Err(format!(
                "'{text}' is not a request rate (a positive number of requests per second, or inf)"
            )),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rate::PerSecond(r) => write!(f, "{r}"),
            Rate::Infinite => f.write_str("inf"),
        }
    }
}

/// Arrival times in seconds of `n` requests at `rate`: the first at 0, then
/// exponentially distributed gaps of mean `1 / rate` (a Poisson process),
/// as vLLM's benchmark sends them. Every rate scales the same unit-rate
/// pattern drawn from `seed`, so a sweep differs only in the rate.
pub fn arrival_times(n: usize, rate: Rate, seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed ^ ARRIVAL_STREAM);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -(1.0 - rng.next_f64()).ln();
            }
            match rate {
                Rate::PerSecond(r) => t / r,
                Rate::Infinite => 0.0,
            }
        })
        .collect()
}

/// Seeds of the independent random streams drawn from the one workload seed.
const ARRIVAL_STREAM: u64 = 0x5eed_0001;
const LENGTH_STREAM: u64 = 0x5eed_0002;
const TOKEN_STREAM: u64 = 0x5eed_0003;

/// One benchmark request: prompt tokens and exactly how many tokens to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRequest {
    pub prompt: Vec<u32>,
    pub output_tokens: usize,
}

/// What [`WorkloadSpec::requests`] draws.
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    pub requests: usize,
    /// Tokens of each request's own prompt (after the shared system prompt).
    pub prompt_tokens: LogNormal,
    pub output_tokens: LogNormal,
    /// A system prompt every request starts with (0: none), for the prefix cache.
    pub system_tokens: usize,
    /// Most tokens (prompt and output) one request may reach: the context,
    /// or the KV pool if smaller.
    pub max_len: usize,
    pub vocab: usize,
    pub seed: u64,
}

/// Shortest own prompt and output: vLLM drops ShareGPT requests shorter
/// than 4 tokens; an output of 2 has a time per output token.
pub const MIN_PROMPT_TOKENS: usize = 4;
pub const MIN_OUTPUT_TOKENS: usize = 2;

impl WorkloadSpec {
    /// Lengths are rounded and clipped: a prompt (system prompt included) to
    /// at most half of `max_len`, its output to the rest.
    pub fn requests(&self) -> Result<Vec<BenchRequest>> {
        let prompt_room = (self.max_len / 2).saturating_sub(self.system_tokens);
        if prompt_room < MIN_PROMPT_TOKENS {
            bail!(
                "requests of at most {} tokens leave no room for a prompt after a {}-token system prompt",
                self.max_len,
                self.system_tokens
            );
        }
        if self.vocab < 2 {
            bail!("a vocabulary of {} tokens is too small", self.vocab);
        }
        // Skip the low ids, often special or byte tokens.
        let first_id = (self.vocab / 4).min(256);
        let mut lengths = Rng::new(self.seed ^ LENGTH_STREAM);
        let mut tokens = Rng::new(self.seed ^ TOKEN_STREAM);
        let mut token =
            || (first_id + (tokens.next_u64() % (self.vocab - first_id) as u64) as usize) as u32;
        let system: Vec<u32> = (0..self.system_tokens).map(|_| token()).collect();
        let clip = |x: f64, lo: usize, hi: usize| (x.round().max(0.0) as usize).clamp(lo, hi);
        let requests = (0..self.requests)
            .map(|_| {
                let own = clip(
                    self.prompt_tokens.sample(&mut lengths),
                    MIN_PROMPT_TOKENS,
                    prompt_room,
                );
                let mut prompt = system.clone();
                prompt.extend((0..own).map(|_| token()));
                let output_tokens = clip(
                    self.output_tokens.sample(&mut lengths),
                    MIN_OUTPUT_TOKENS,
                    self.max_len - prompt.len(),
                );
                BenchRequest {
                    prompt,
                    output_tokens,
                }
            })
            .collect();
        Ok(requests)
    }
}
