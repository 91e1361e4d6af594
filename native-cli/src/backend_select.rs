//! `--backend`: which device runs the model. Commands are written once as a
//! [`WithBackend`] visitor, generic over the backend type, and this module
//! instantiates them for the backend the user chose.

use anyhow::Result;
use clap::ValueEnum;
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The fastest backend present on this machine.
    Auto,
    /// The multi-threaded CPU backend.
    Cpu,
}

/// A command body that runs on any backend.
pub trait WithBackend {
    type Output;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Output>;
}

pub fn dispatch<W: WithBackend>(
    choice: BackendChoice,
    threads: usize,
    body: W,
) -> Result<W::Output> {
    match choice {
        BackendChoice::Auto | BackendChoice::Cpu => body.run(CpuBackend::new(threads)),
    }
}
