//! `bench --tp N`: what the ranks' collectives cost, read on rank 0 from the
//! job's metered communicator around each timed request.
//!
//! Per phase (prefill, decode), summed over the repetitions: the bytes
//! all-reduced per token per layer beside the formula (two all-reduces of
//! `hidden_size` f32 per token per layer: after O and after down), and the
//! step time split into communication (wall time inside collectives, waits
//! for the slower rank included) and the rest (kernels, sampling, scheduling).
//! CUDA ranks all-reduce through NCCL, past the communicator: there only the
//! commands are counted, and the all-reduce figures are absent (null).

use tandem_core::engine::Engine;
use tandem_core::model::ModelConfig;
use tandem_core::parallel::{CommStats, Meter, Op};
use tandem_core::Backend;

#[derive(Clone, Copy, Debug)]
pub enum Phase {
    Prefill,
    Decode,
}

/// The counters at the start of a request.
pub struct Mark {
    comm: CommStats,
    steps: u64,
    tokens: u64,
}

/// One phase's totals.
#[derive(Default)]
struct Totals {
    comm: CommStats,
    seconds: f64,
    steps: u64,
    tokens: u64,
}

/// The communication figures of a split model; inert when it is not split.
#[derive(Default)]
pub struct Collectives {
    meter: Option<Meter>,
    ranks: usize,
    phases: [Totals; 2],
}

impl Collectives {
    /// The figures of this job, when this process is one rank of several.
    pub fn of_job() -> Self {
        match (crate::parallel::meter(), crate::parallel::job()) {
            (Some(meter), Some(job)) if job.world.size() > 1 => Self {
                meter: Some(meter),
                ranks: job.world.size(),
                ..Self::default()
            },
            _ => Self::default(),
        }
    }

    pub fn mark<B: Backend>(&self, engine: &Engine<B>) -> Mark {
        let stats = engine.stats();
        Mark {
            comm: self.meter.as_ref().map(Meter::read).unwrap_or_default(),
            steps: stats.steps,
            tokens: stats.computed_tokens,
        }
    }

    /// Adds what happened since `mark`, a request that took `seconds`.
    pub fn add<B: Backend>(&mut self, phase: Phase, mark: Mark, engine: &Engine<B>, seconds: f64) {
        let Some(meter) = &self.meter else { return };
        let stats = engine.stats();
        let t = &mut self.phases[phase as usize];
        t.comm = t.comm.plus(&meter.read().since(&mark.comm));
        t.seconds += seconds;
        t.steps += stats.steps - mark.steps;
        t.tokens += stats.computed_tokens - mark.tokens;
    }

    /// The `tensor_parallel` object of `bench --json`, when the model is split.
    pub fn json(&self, cfg: &ModelConfig) -> Option<serde_json::Value> {
        self.meter.as_ref()?;
        let phase = |t: &Totals| {
            let f = Figures::of(t, cfg);
            let metered = |x: f64| f.metered_reduces.then_some(x);
            serde_json::json!({
                "steps": t.steps,
                "tokens": t.tokens,
                "all_reduces_per_step_per_layer": metered(f.reduces_per_step_layer),
                "all_reduce_bytes_per_token_per_layer": metered(f.bytes_per_token_layer),
                "expected_all_reduce_bytes_per_token_per_layer": f.expected_bytes,
                "all_reduce_us_per_call": metered(f.us_per_reduce),
                "command_bytes_per_step": f.command_bytes_per_step,
                "step_ms": f.step_ms,
                "comm_ms_per_step": f.comm_ms,
                "all_reduce_ms_per_step": metered(f.reduce_ms),
                "compute_ms_per_step": f.step_ms - f.comm_ms,
                "comm_share": f.comm_ms / f.step_ms.max(1e-12),
            })
        };
        Some(serde_json::json!({
            "ranks": self.ranks,
            "prefill": phase(&self.phases[Phase::Prefill as usize]),
            "decode": phase(&self.phases[Phase::Decode as usize]),
        }))
    }

    /// The human-readable lines, when the model is split.
    pub fn print(&self, cfg: &ModelConfig) {
        if self.meter.is_none() {
            return;
        }
        for (name, t) in [("prefill", &self.phases[0]), ("decode", &self.phases[1])] {
            if t.steps == 0 {
                continue;
            }
            let f = Figures::of(t, cfg);
            if f.metered_reduces {
                println!(
                    "tp{} {name:<7} all-reduce {:.0} B per token per layer (formula 2 × 4 × {} = {}), {:.1} per step per layer, {:.0} µs each; commands {:.0} B per step",
                    self.ranks,
                    f.bytes_per_token_layer,
                    cfg.hidden_size,
                    f.expected_bytes,
                    f.reduces_per_step_layer,
                    f.us_per_reduce,
                    f.command_bytes_per_step,
                );
            } else {
                println!(
                    "tp{} {name:<7} all-reduces on the device, not metered (formula 2 × 4 × {} = {} B per token per layer); commands {:.0} B per step",
                    self.ranks, cfg.hidden_size, f.expected_bytes, f.command_bytes_per_step,
                );
            }
            let reduces = match f.metered_reduces {
                true => format!("all-reduce {:.2} ms", f.reduce_ms),
                false => "all-reduces inside compute".into(),
            };
            println!(
                "tp{} {name:<7} step {:.2} ms = compute {:.2} ms + communication {:.2} ms ({:.1}%; {reduces})",
                self.ranks,
                f.step_ms,
                f.step_ms - f.comm_ms,
                f.comm_ms,
                100.0 * f.comm_ms / f.step_ms.max(1e-12),
            );
        }
    }
}

/// One phase's ratios.
struct Figures {
    /// Whether the all-reduces went through the communicator.
    metered_reduces: bool,
    reduces_per_step_layer: f64,
    bytes_per_token_layer: f64,
    expected_bytes: usize,
    us_per_reduce: f64,
    command_bytes_per_step: f64,
    step_ms: f64,
    comm_ms: f64,
    reduce_ms: f64,
}

impl Figures {
    fn of(t: &Totals, cfg: &ModelConfig) -> Self {
        let reduce = t.comm.op(Op::AllReduce);
        let layers = cfg.num_layers.max(1) as f64;
        let steps = t.steps.max(1) as f64;
        Self {
            metered_reduces: reduce.calls > 0,
            reduces_per_step_layer: reduce.calls as f64 / steps / layers,
            bytes_per_token_layer: reduce.bytes as f64 / t.tokens.max(1) as f64 / layers,
            expected_bytes: 2 * std::mem::size_of::<f32>() * cfg.hidden_size,
            us_per_reduce: 1e6 * reduce.seconds / reduce.calls.max(1) as f64,
            command_bytes_per_step: t.comm.op(Op::Broadcast).bytes as f64 / steps,
            step_ms: 1e3 * t.seconds / steps,
            comm_ms: 1e3 * t.comm.seconds() / steps,
            reduce_ms: 1e3 * reduce.seconds / steps,
        }
    }
}
