//! Requests and how they run: sampling (how the next token is chosen) and
//! the continuous-batching scheduler (which sequences run in each step).

pub mod sampling;
pub mod scheduler;

pub use sampling::{Rng, Sampler, SamplingParams};
pub use scheduler::{
    Priority, SchedSeq, Schedule, ScheduledChunk, Scheduler, SchedulerConfig, SchedulerStats,
    SeqStatus, SubmitError,
};
