//! `bench --tp T --pp P`: what the ranks' communication costs, read on rank
//! 0 from the job's metered communicator around each timed request.
//!
//! Per phase (prefill, decode), summed over the repetitions:
//!
//! - tensor parallelism (T > 1): the bytes all-reduced per token per layer
//!   beside the formula (two all-reduces of `hidden_size` f32 per token per
//!   layer: after O and after down). Rank 0's model holds only its stage's
//!   layers (`config.num_layers` is stage 0's count), and those are the
//!   layers it all-reduces in, so the per-layer figure divides by them.
//! - pipeline parallelism (P > 1): the bytes rank 0 sends down the pipe per
//!   token beside the formula. Rank 0 is stage 0, the first of P − 1 stage
//!   boundaries: it sends each row's residual stream (`hidden_size` f32)
//!   once, so exactly `4 × hidden_size` per token. It also receives the
//!   final hidden state of each row whose logits are wanted from the last
//!   stage (`4 × hidden_size` per logit row), and its time inside send and
//!   recv is mostly waiting for the later stages: the pipeline's bubble and
//!   their compute, as rank 0 sees it.
//! - the step time split into communication (wall time inside the
//!   communicator's calls, waits for the slower ranks included) and the
//!   rest (kernels, sampling, scheduling); the commands rank 0 broadcasts
//!   (counted apart from the activations).
//!
//! CUDA ranks all-reduce through NCCL, past the communicator: there the
//! all-reduce figures are absent (null).

use tandem_core::engine::Engine;
use tandem_core::model::ModelConfig;
use tandem_core::parallel::{CommStats, JobShape, Meter, Op};
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
    shape: JobShape,
    phases: [Totals; 2],
}

const F32: usize = std::mem::size_of::<f32>();

impl Collectives {
    /// The figures of this job, when this process is one rank of several.
    pub fn of_job() -> Self {
        match (crate::parallel::meter(), crate::parallel::job()) {
            (Some(meter), Some(job)) if job.world.size() > 1 => Self {
                meter: Some(meter),
                shape: job.shape,
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

    /// `tp2 pp1`: the prefix of the printed lines.
    fn label(&self) -> String {
        format!("tp{} pp{}", self.shape.tp, self.shape.pp)
    }

    /// The `parallel` object of `bench --json`, when the model is split.
    /// `cfg` is rank 0's model: its stage's layers, its share of each.
    pub fn json(&self, cfg: &ModelConfig) -> Option<serde_json::Value> {
        self.meter.as_ref()?;
        let tp = self.shape.tp > 1;
        let phase = |t: &Totals| {
            let f = Figures::of(t, cfg, &self.shape);
            let metered = |x: f64| f.metered_reduces.then_some(x);
            serde_json::json!({
                "steps": t.steps,
                "tokens": t.tokens,
                "all_reduces_per_step_per_layer": metered(f.reduces_per_step_layer),
                "all_reduce_bytes_per_token_per_layer": metered(f.bytes_per_token_layer),
                "expected_all_reduce_bytes_per_token_per_layer": tp.then_some(f.expected_bytes),
                "all_reduce_us_per_call": metered(f.us_per_reduce),
                "send_bytes_per_token": f.send_bytes_per_token,
                "expected_send_bytes_per_token": f.expected_send_bytes,
                "sends_per_step": f.sends_per_step,
                "recv_bytes_per_step": f.recv_bytes_per_step,
                "send_recv_ms_per_step": f.send_recv_ms,
                "command_bytes_per_step": f.command_bytes_per_step,
                "step_ms": f.step_ms,
                "comm_ms_per_step": f.comm_ms,
                "all_reduce_ms_per_step": metered(f.reduce_ms),
                "compute_ms_per_step": f.step_ms - f.comm_ms,
                "comm_share": f.comm_ms / f.step_ms.max(1e-12),
            })
        };
        Some(serde_json::json!({
            "ranks": self.shape.ranks(),
            "tp": self.shape.tp,
            "pp": self.shape.pp,
            "micro_batches": self.shape.micro_batches,
            "stage_layers": cfg.num_layers,
            "prefill": phase(&self.phases[Phase::Prefill as usize]),
            "decode": phase(&self.phases[Phase::Decode as usize]),
        }))
    }

    /// The human-readable lines, when the model is split.
    pub fn print(&self, cfg: &ModelConfig) {
        if self.meter.is_none() {
            return;
        }
        let label = self.label();
        let (tp, pp) = (self.shape.tp > 1, self.shape.pp > 1);
        for (name, t) in [("prefill", &self.phases[0]), ("decode", &self.phases[1])] {
            if t.steps == 0 {
                continue;
            }
            let f = Figures::of(t, cfg, &self.shape);
            if tp && f.metered_reduces {
                println!(
                    "{label} {name:<7} all-reduce {:.0} B per token per layer (formula 2 × 4 × {} = {}; {} layers on this stage), {:.1} per step per layer, {:.0} µs each; commands {:.0} B per step",
                    f.bytes_per_token_layer,
                    cfg.hidden_size,
                    f.expected_bytes,
                    cfg.num_layers,
                    f.reduces_per_step_layer,
                    f.us_per_reduce,
                    f.command_bytes_per_step,
                );
            } else if tp {
                println!(
                    "{label} {name:<7} all-reduces on the device, not metered (formula 2 × 4 × {} = {} B per token per layer); commands {:.0} B per step",
                    cfg.hidden_size, f.expected_bytes, f.command_bytes_per_step,
                );
            }
            if pp {
                println!(
                    "{label} {name:<7} send {:.0} B per token to stage 1 (formula 4 × {} = {} per stage boundary), {:.1} sends per step ({} micro-batches asked); receive {:.0} B per step (final rows); commands {:.0} B per step",
                    f.send_bytes_per_token,
                    cfg.hidden_size,
                    f.expected_send_bytes,
                    f.sends_per_step,
                    self.shape.micro_batches,
                    f.recv_bytes_per_step,
                    f.command_bytes_per_step,
                );
            }
            let mut parts = Vec::new();
            if tp {
                parts.push(match f.metered_reduces {
                    true => format!("all-reduce {:.2} ms", f.reduce_ms),
                    false => "all-reduces inside compute".into(),
                });
            }
            if pp {
                parts.push(format!("send/recv {:.2} ms", f.send_recv_ms));
            }
            println!(
                "{label} {name:<7} step {:.2} ms = compute {:.2} ms + communication {:.2} ms ({:.1}%; {})",
                f.step_ms,
                f.step_ms - f.comm_ms,
                f.comm_ms,
                100.0 * f.comm_ms / f.step_ms.max(1e-12),
                parts.join(", "),
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
    send_bytes_per_token: f64,
    expected_send_bytes: usize,
    sends_per_step: f64,
    recv_bytes_per_step: f64,
    send_recv_ms: f64,
    command_bytes_per_step: f64,
    step_ms: f64,
    comm_ms: f64,
    reduce_ms: f64,
}

impl Figures {
    /// `cfg` is rank 0's model, whose `num_layers` are its stage's layers.
    fn of(t: &Totals, cfg: &ModelConfig, shape: &JobShape) -> Self {
        let reduce = t.comm.op(Op::AllReduce);
        let (send, recv) = (t.comm.op(Op::Send), t.comm.op(Op::Recv));
        let layers = cfg.num_layers.max(1) as f64;
        let steps = t.steps.max(1) as f64;
        let tokens = t.tokens.max(1) as f64;
        Self {
            metered_reduces: reduce.calls > 0,
            reduces_per_step_layer: reduce.calls as f64 / steps / layers,
            bytes_per_token_layer: reduce.bytes as f64 / tokens / layers,
            expected_bytes: 2 * F32 * cfg.hidden_size,
            us_per_reduce: 1e6 * reduce.seconds / reduce.calls.max(1) as f64,
            send_bytes_per_token: send.bytes as f64 / tokens,
            // Rank 0 is stage 0: it sends every row on to stage 1 once.
            expected_send_bytes: if shape.pp > 1 {
                F32 * cfg.hidden_size
            } else {
                0
            },
            sends_per_step: send.calls as f64 / steps,
            recv_bytes_per_step: recv.bytes as f64 / steps,
            send_recv_ms: 1e3 * (send.seconds + recv.seconds) / steps,
            command_bytes_per_step: t.comm.op(Op::Broadcast).bytes as f64 / steps,
            step_ms: 1e3 * t.seconds / steps,
            comm_ms: 1e3 * t.comm.seconds() / steps,
            reduce_ms: 1e3 * reduce.seconds / steps,
        }
    }
}
