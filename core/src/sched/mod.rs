//! Requests and how they run: sampling (how the next token is chosen),
//! constraints (which tokens a grammar allows next) and the
//! continuous-batching scheduler (which sequences run in each step).

pub mod constraint;
pub mod sampling;
pub mod scheduler;

pub use constraint::{
    ConstraintFactory, SequenceConstraint, SharedConstraintFactory, TokenConstraint, TokenMask,
};
pub use sampling::{Rng, Sampler, SamplingParams};
pub use scheduler::{
    Priority, SchedSeq, Schedule, ScheduledChunk, Scheduler, SchedulerConfig, SchedulerStats,
    SeqStatus, SubmitError,
};
