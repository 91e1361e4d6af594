//! A run's serving metrics, as vLLM's serving benchmark defines them, and
//! how they are shown: a Markdown table, a JSON document, and the
//! continuous-against-static comparison per rate.
//!
//! - throughput: output tokens (and requests) over the run's duration, from
//!   the first arrival to the last request's end;
//! - TTFT: from a request's arrival to its first token;
//! - TPOT: `(end-to-end latency - TTFT) / (output tokens - 1)`, per request;
//! - end-to-end latency: from arrival to the request's end.
//!
//! Percentiles interpolate linearly between the two nearest ranks (NumPy's
//! default, which vLLM uses).

use std::fmt::Write;

use serde_json::{json, Value};

use super::drivers::{Mode, RunOutcome};
use super::workload::Rate;

/// The `p`-th percentile (0..=100) of `values`; NaN when there are none.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// One mode at one rate.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub mode: Mode,
    pub rate: Rate,
    pub requests: usize,
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub tpot_p50_s: f64,
    pub tpot_p99_s: f64,
    pub e2e_latency_p50_s: f64,
    pub e2e_latency_p99_s: f64,
    pub kv_blocks_peak: usize,
    pub kv_blocks_mean: f64,
    pub kv_pool_blocks: usize,
    /// See [`super::drivers::KvUse::useful_fraction`].
    pub kv_slots_useful_fraction: f64,
    pub preemptions: u64,
    pub steps: u64,
    /// Tokens the engine generated, a static batch's padding included.
    pub generated_tokens: u64,
    pub prefix_hit_rate: f64,
}

impl Summary {
    pub fn new(run: &RunOutcome, rate: Rate) -> Self {
        let served = &run.served;
        let ttft: Vec<f64> = served.iter().map(|s| s.first_token - s.arrival).collect();
        let e2e: Vec<f64> = served.iter().map(|s| s.done - s.arrival).collect();
        let tpot: Vec<f64> = served
            .iter()
            .filter(|s| s.output_tokens > 1)
            .map(|s| (s.done - s.first_token) / (s.output_tokens - 1) as f64)
            .collect();
        let output_tokens: usize = served.iter().map(|s| s.output_tokens).sum();
        let per_s = |n: f64| n / run.duration.max(1e-12);
        Self {
            mode: run.mode,
            rate,
            requests: served.len(),
            duration_s: run.duration,
            input_tokens: served.iter().map(|s| s.prompt_tokens).sum(),
            output_tokens,
            requests_per_s: per_s(served.len() as f64),
            output_tokens_per_s: per_s(output_tokens as f64),
            ttft_p50_s: percentile(&ttft, 50.0),
            ttft_p99_s: percentile(&ttft, 99.0),
            tpot_p50_s: percentile(&tpot, 50.0),
            tpot_p99_s: percentile(&tpot, 99.0),
            e2e_latency_p50_s: percentile(&e2e, 50.0),
            e2e_latency_p99_s: percentile(&e2e, 99.0),
            kv_blocks_peak: run.kv.peak_blocks,
            kv_blocks_mean: run.kv.mean_blocks(run.duration),
            kv_pool_blocks: run.kv.pool_blocks,
            kv_slots_useful_fraction: run.kv.useful_fraction(),
            preemptions: run.preemptions,
            steps: run.steps,
            generated_tokens: run.generated_tokens,
            prefix_hit_rate: run.prefix_hit_tokens as f64 / run.prompt_tokens.max(1) as f64,
        }
    }

    /// One flat object; times in seconds; `rate` is a number or `"inf"`.
    pub fn to_json(&self) -> Value {
        json!({
            "mode": self.mode.name(),
            "rate": rate_json(self.rate),
            "requests": self.requests,
            "duration_s": self.duration_s,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "tpot_p50_s": self.tpot_p50_s,
            "tpot_p99_s": self.tpot_p99_s,
            "e2e_latency_p50_s": self.e2e_latency_p50_s,
            "e2e_latency_p99_s": self.e2e_latency_p99_s,
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_blocks_mean": self.kv_blocks_mean,
            "kv_pool_blocks": self.kv_pool_blocks,
            "kv_slots_useful_fraction": self.kv_slots_useful_fraction,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "prefix_hit_rate": self.prefix_hit_rate,
        })
    }
}

fn rate_json(rate: Rate) -> Value {
    match rate {
        Rate::PerSecond(r) => json!(r),
        Rate::Infinite => json!("inf"),
    }
}

/// Continuous against static batching at one rate.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub rate: Rate,
    /// Continuous over static output tokens/s.
    pub throughput_ratio: f64,
    /// Continuous over static p99 end-to-end latency.
    pub p99_latency_ratio: f64,
}

impl Comparison {
    /// The goal: at least twice the throughput at no worse p99 latency.
    pub fn goal_met(&self) -> bool {
        self.throughput_ratio >= 2.0 && self.p99_latency_ratio <= 1.0
    }
}

/// One comparison per rate that both modes ran.
pub fn compare(summaries: &[Summary]) -> Vec<Comparison> {
    let of = |mode: Mode, rate: Rate| summaries.iter().find(|s| s.mode == mode && s.rate == rate);
    summaries
        .iter()
        .filter(|s| s.mode == Mode::Continuous)
        .filter_map(|c| {
            let s = of(Mode::Static, c.rate)?;
            Some(Comparison {
                rate: c.rate,
                throughput_ratio: c.output_tokens_per_s / s.output_tokens_per_s,
                p99_latency_ratio: c.e2e_latency_p99_s / s.e2e_latency_p99_s,
            })
        })
        .collect()
}

/// `{"setup": setup, "continuous": [per rate], "static": [per rate],
/// "comparison": [per rate]}`: e.g. `.continuous[0].output_tokens_per_s`.
pub fn json_document(setup: Value, summaries: &[Summary]) -> Value {
    let runs = |mode: Mode| -> Vec<Value> {
        summaries
            .iter()
            .filter(|s| s.mode == mode)
            .map(Summary::to_json)
            .collect()
    };
    let comparison: Vec<Value> = compare(summaries)
        .iter()
        .map(|c| {
            json!({
                "rate": rate_json(c.rate),
                "output_tokens_per_s_ratio": c.throughput_ratio,
                "e2e_latency_p99_ratio": c.p99_latency_ratio,
                "goal_met": c.goal_met(),
            })
        })
        .collect();
    json!({
        "setup": setup,
        "continuous": runs(Mode::Continuous),
        "static": runs(Mode::Static),
        "comparison": comparison,
    })
}

/// The summaries as a Markdown table, then one comparison line per rate.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::from(
        "| mode | rate (req/s) | req/s | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | end-to-end p50 / p99 (s) | KV blocks peak / mean / pool | KV slots useful | preemptions |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in summaries {
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {:.1} | {:.2} / {:.2} | {:.0} / {:.0} | {:.2} / {:.2} | {} / {:.1} / {} | {:.0}% | {} |",
            s.mode.name(),
            s.rate,
            s.requests_per_s,
            s.output_tokens_per_s,
            s.ttft_p50_s,
            s.ttft_p99_s,
            1e3 * s.tpot_p50_s,
            1e3 * s.tpot_p99_s,
            s.e2e_latency_p50_s,
            s.e2e_latency_p99_s,
            s.kv_blocks_peak,
            s.kv_blocks_mean,
            s.kv_pool_blocks,
            100.0 * s.kv_slots_useful_fraction,
            s.preemptions,
        );
    }
    let comparisons = compare(summaries);
    if !comparisons.is_empty() {
        out.push('\n');
    }
    for c in comparisons {
        let _ = writeln!(
            out,
            "rate {}: continuous has {:.2}x static's output tokens/s at {:.2}x its p99 latency ({})",
            c.rate,
            c.throughput_ratio,
            c.p99_latency_ratio,
            if c.goal_met() {
                "goal met: >= 2x at no worse p99"
            } else {
                "goal NOT met: >= 2x at no worse p99"
            }
        );
    }
    out
}
