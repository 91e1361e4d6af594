//! `tandem`: run, chat with, benchmark, score and inspect models.

/// `eprintln!` in one write, so the lines of a job's ranks stay whole
/// (see `write_stderr_line`).
macro_rules! eprint_line {
    ($($arg:tt)*) => {
        tandem_core::parallel::write_stderr_line(&format!($($arg)*))
    };
}

mod backend_select;
mod commands;
mod model_path;
mod parallel;
mod progress;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Portable LLM inference: CPU, WebGPU and CUDA backends"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for a prompt, streamed to stdout.
    Run(commands::run::RunArgs),
    /// Talk with the model interactively, using its chat template.
    Chat(commands::chat::ChatArgs),
    /// Perplexity of a text file, computed the way llama.cpp does.
    Perplexity(commands::perplexity::PerplexityArgs),
    /// Quantize a model's weights (RTN, INT8, SmoothQuant W8A8, GPTQ, AWQ, mixed precision).
    Quantize(commands::quantize::QuantizeArgs),
    /// Train a draft model for `--speculate draft:DIR` from the model itself.
    #[cfg(feature = "distill")]
    Distill(commands::distill::DistillArgs),
    /// Show a model's architecture, tensors, tokenizer and chat template.
    Inspect(commands::inspect::InspectArgs),
    /// Measure prefill and decode speed (like llama-bench's pp512 / tg128).
    Bench(commands::bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(commands::serve::ServeArgs),
    /// Serving benchmark: continuous vs static batching under Poisson arrivals at a sweep of rates.
    BenchServe(commands::bench_serve::BenchServeArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command.model_args().map(|m| (m, parallel::start(m))) {
        Some((_, Err(e))) => Err(e),
        Some((args, Ok(parallel::Role::Follower))) => cli
            .command
            .model_files()
            .and_then(|files| parallel::follow(args, files)),
        _ => run(cli.command),
    };
    if let Err(e) = result {
        eprint_line!("error: {}", one_line(&e));
        // Without finalising MPI: a rank of a job exiting with an error
        // makes mpirun end the others, which may be waiting in a collective.
        std::process::exit(1);
    }
    parallel::finish();
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Run(a) => commands::run::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Perplexity(a) => commands::perplexity::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        #[cfg(feature = "distill")]
        Command::Distill(a) => commands::distill::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::BenchServe(a) => commands::bench_serve::run(a),
    }
}

impl Command {
    /// The model files a command that runs a model reads (a random-weights
    /// shape for `bench --random-weights`).
    fn model_files(&self) -> Result<tandem_core::model::ModelFiles> {
        match self {
            Command::Bench(a) => a.model_files(),
            other => other
                .model_args()
                .context("this command runs no model")?
                .load_files(),
        }
    }

    /// The model options of a command that runs a model.
    fn model_args(&self) -> Option<&commands::ModelArgs> {
        match self {
            Command::Run(a) => Some(&a.model),
            Command::Chat(a) => Some(&a.model),
            Command::Perplexity(a) => Some(&a.model),
            Command::Bench(a) => Some(&a.model),
            Command::Serve(a) => Some(&a.model),
            Command::BenchServe(a) => Some(&a.model),
            _ => None,
        }
    }
}

/// The error and its causes on one line, leaving out a cause whose text the
/// message before it already includes (library errors often embed their source).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}
