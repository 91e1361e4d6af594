//! `tandem bench-serve`: serving throughput and latency measured as vLLM's
//! serving benchmark measures them, driving the engine directly (no HTTP).
//!
//! Requests arrive as a Poisson process at a sweep of rates (or all at
//! once), with long-tailed prompt and output lengths ([`workload`]); each
//! rate is served once with continuous batching and once with static,
//! request-level batching as HF `generate` does it ([`drivers`]); each run
//! is summarised in throughput and latency percentiles ([`report`]) and
//! the sweep is drawn as throughput against p99 latency ([`plot`]).

pub mod drivers;
pub mod plot;
pub mod report;
pub mod workload;

pub use drivers::{run, Clock, Mode, RunOutcome, Served, StaticBatch, StepClock, WallClock};
pub use report::{compare, json_document, percentile, table, Comparison, Summary};
pub use workload::{arrival_times, BenchRequest, LogNormal, Rate, WorkloadSpec};
