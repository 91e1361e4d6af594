//! Server metrics in the Prometheus text format: engine gauges and counters
//! (a snapshot the engine loop refreshes every iteration), request counts by
//! outcome, and latency histograms recorded by the HTTP tasks.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use tandem_core::engine::EngineStats;

/// Upper bounds (seconds) of the latency histogram buckets.
const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Clone, Debug, Default)]
struct Histogram {
    /// Cumulative counts per bucket of `LATENCY_BUCKETS`.
    buckets: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, n) in LATENCY_BUCKETS.iter().zip(&mut self.buckets) {
            if seconds <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, n) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct State {
    engine: EngineStats,
    kv_blocks_total: usize,
    /// Finished requests by outcome.
    requests_ok: u64,
    requests_cancelled: u64,
    requests_rejected: u64,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
}

/// Shared between the engine thread and the HTTP tasks.
#[derive(Debug, Default)]
pub struct Metrics {
    state: Mutex<State>,
}

/// How a request ended, for the request counters.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    Completed,
    /// The client went away (or stopped reading) before the end.
    Cancelled,
    /// Refused with a 4xx/5xx before generation.
    Rejected,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        // A panic elsewhere while holding the lock leaves plain numbers: still usable.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut state)
    }

    pub fn update_engine(&self, stats: EngineStats, kv_blocks_total: usize) {
        self.with(|s| {
            s.engine = stats;
            s.kv_blocks_total = kv_blocks_total;
        });
    }

    pub fn engine(&self) -> EngineStats {
        self.with(|s| s.engine.clone())
    }

    pub fn request_done(&self, outcome: Outcome) {
        self.with(|s| match outcome {
            Outcome::Completed => s.requests_ok += 1,
            Outcome::Cancelled => s.requests_cancelled += 1,
            Outcome::Rejected => s.requests_rejected += 1,
        });
    }

    pub fn time_to_first_token(&self, d: Duration) {
        self.with(|s| s.time_to_first_token.observe(d.as_secs_f64()));
    }

    pub fn inter_token_latency(&self, d: Duration) {
        self.with(|s| s.inter_token_latency.observe(d.as_secs_f64()));
    }

    /// The Prometheus exposition text.
    pub fn render(&self) -> String {
        let s = self.with(|s| {
            (
                s.engine.clone(),
                s.kv_blocks_total,
                [s.requests_ok, s.requests_cancelled, s.requests_rejected],
                s.time_to_first_token.clone(),
                s.inter_token_latency.clone(),
            )
        });
        let (e, total, requests, ttft, itl) = s;
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "tandem_requests_running",
            "gauge",
            "Sequences being generated.",
            e.running.to_string(),
        );
        metric(
            "tandem_requests_waiting",
            "gauge",
            "Sequences waiting for admission (preempted ones included).",
            e.waiting.to_string(),
        );
        metric(
            "tandem_kv_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            total.to_string(),
        );
        metric(
            "tandem_kv_blocks_used",
            "gauge",
            "KV cache blocks held by sequences.",
            e.kv_blocks_used.to_string(),
        );
        metric(
            "tandem_kv_blocks_free",
            "gauge",
            "KV cache blocks free (cached prefix blocks included).",
            e.kv_blocks_free.to_string(),
        );
        metric(
            "tandem_kv_blocks_cached",
            "gauge",
            "Free KV blocks keeping reusable prefix content.",
            e.kv_blocks_cached.to_string(),
        );
        let hit_rate = if e.prompt_tokens == 0 {
            0.0
        } else {
            e.prefix_hit_tokens as f64 / e.prompt_tokens as f64
        };
        metric(
            "tandem_prefix_cache_hit_rate",
            "gauge",
            "Share of prompt tokens found in the prefix cache.",
            hit_rate.to_string(),
        );
        metric(
            "tandem_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            e.prefix_hit_tokens.to_string(),
        );
        metric(
            "tandem_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            e.prompt_tokens.to_string(),
        );
        metric(
            "tandem_generation_tokens_total",
            "counter",
            "Tokens generated (rate() gives tokens/s).",
            e.generated_tokens.to_string(),
        );
        metric(
            "tandem_computed_tokens_total",
            "counter",
            "Tokens run through the model, recomputation included.",
            e.computed_tokens.to_string(),
        );
        metric(
            "tandem_engine_steps_total",
            "counter",
            "Engine iterations.",
            e.steps.to_string(),
        );
        metric(
            "tandem_preemptions_total",
            "counter",
            "Sequences preempted (by recompute) for KV blocks.",
            e.preemptions.to_string(),
        );
        let spec = &e.speculation;
        metric(
            "tandem_spec_draft_tokens_total",
            "counter",
            "Speculative draft tokens verified.",
            spec.proposed_tokens.to_string(),
        );
        metric(
            "tandem_spec_accepted_tokens_total",
            "counter",
            "Speculative draft tokens accepted.",
            spec.accepted_tokens.to_string(),
        );
        metric(
            "tandem_spec_acceptance_rate",
            "gauge",
            "Share of verified draft tokens accepted.",
            spec.acceptance_rate().to_string(),
        );
        metric(
            "tandem_spec_mean_accepted_length",
            "gauge",
            "Tokens a sequence gains per verification step.",
            spec.mean_accepted_length().to_string(),
        );
        metric(
            "tandem_spec_draft_time_share",
            "gauge",
            "Share of speculation time spent drafting (the rest verifies).",
            spec.draft_time_share().to_string(),
        );
        let _ = writeln!(out, "# HELP tandem_requests_total Finished HTTP generation requests by outcome.\n# TYPE tandem_requests_total counter");
        for (outcome, n) in ["completed", "cancelled", "rejected"].iter().zip(requests) {
            let _ = writeln!(out, "tandem_requests_total{{outcome=\"{outcome}\"}} {n}");
        }
        ttft.render(
            &mut out,
            "tandem_time_to_first_token_seconds",
            "Time from request to first token.",
        );
        itl.render(
            &mut out,
            "tandem_inter_token_latency_seconds",
            "Time between consecutive tokens of a choice.",
        );
        out
    }
}
