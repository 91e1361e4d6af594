//! `--tp T --pp P [--ep E]`: one model over T × P ranks started by
//! `mpirun -np N tandem ...`.
//!
//! Every rank parses the same command line. Rank 0 runs the command as it
//! would alone (it alone reads stdin, writes the completion, serves HTTP);
//! its engines load the model split (`EngineConfig::parallel`).
//! The other ranks never run the command: they load their shard of each
//! model rank 0 loads and run what it announces (`Model::follow`), until
//! rank 0 says the job is over.
//!
//! The job's communicator is [`Metered`](tandem_core::parallel::Metered):
//! `bench --tp` reads the bytes and time of its collectives on rank 0
//! through [`meter`].

use std::sync::{Arc, Mutex};

#[cfg(not(feature = "mpi"))]
use anyhow::bail;
use anyhow::{Context, Result};
use tandem_core::kv::KvPlan;
use tandem_core::model::forward::{LoadOptions, Model};
use tandem_core::model::ModelFiles;
#[cfg(feature = "mpi")]
use tandem_core::parallel::Metered;
use tandem_core::parallel::{announce, receive, Command, Job, JobShape, Meter};
use tandem_core::Backend;

use crate::backend_select::{dispatch, WithBackend};
use crate::commands::ModelArgs;

/// The job, from `start` until `finish`.
static JOB: Mutex<Option<Job>> = Mutex::new(None);

/// The counters of the job's communicator.
static METER: Mutex<Option<Meter>> = Mutex::new(None);

/// What this process does in the job. A build without MPI is always `Single`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub enum Role {
    /// Alone: no `--tp`, `--pp` or `--ep`.
    Single,
    /// Rank 0 of a job: runs the command.
    Leader,
    /// Another rank: follows rank 0.
    Follower,
}

/// The job, when this process is one rank of several.
pub fn job() -> Option<Job> {
    JOB.lock().ok()?.clone()
}

/// The bytes and time of this rank's collectives, when it is one rank of several.
pub fn meter() -> Option<Meter> {
    METER.lock().ok()?.clone()
}

/// This rank's index on its machine (0 alone): its default CUDA device.
pub fn local_rank() -> usize {
    #[cfg(feature = "mpi")]
    if let Some(local) = tandem_mpi::local_rank() {
        return local;
    }
    job().map_or(0, |job| job.world.rank())
}

/// Every rank `mpirun` started, when it started this process (a command
/// that runs no model: `inspect --devices`); `None` otherwise.
pub fn launched_world() -> Result<Option<Arc<dyn tandem_core::parallel::Communicator>>> {
    #[cfg(feature = "mpi")]
    if tandem_mpi::local_rank().is_some() {
        let world = tandem_mpi::MpiCommunicator::init()?;
        return Ok(Some(Arc::new(world)));
    }
    Ok(None)
}

/// Joins the job that `--tp`, `--pp` and `--ep` ask for.
pub fn start(args: &ModelArgs) -> Result<Role> {
    let mut shape = JobShape::new(args.tp, args.pp, args.ep);
    if let Some(parts) = args.micro_batches {
        shape.micro_batches = parts;
    }
    shape.check()?;
    if shape.ranks() <= 1 {
        return Ok(Role::Single);
    }
    join(shape)
}

#[cfg(feature = "mpi")]
fn join(shape: JobShape) -> Result<Role> {
    let comm = Metered::new(tandem_mpi::MpiCommunicator::init()?);
    let meter = comm.meter();
    let job = Job::new(Arc::new(comm), shape)?;
    let role = match job.world.rank() {
        0 => Role::Leader,
        _ => Role::Follower,
    };
    *METER.lock().unwrap_or_else(|e| e.into_inner()) = Some(meter);
    *JOB.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
    Ok(role)
}

#[cfg(not(feature = "mpi"))]
fn join(shape: JobShape) -> Result<Role> {
    bail!(
        "{}: this tandem was built without MPI (cargo feature `mpi`)",
        shape.flags()
    )
}

/// Ends this process's part in the job: rank 0 releases the followers,
/// and MPI is finalised once the last engine holding it is gone.
pub fn finish() {
    let Some(job) = JOB.lock().ok().and_then(|mut job| job.take()) else {
        return;
    };
    if job.is_leader() {
        let _ = announce(&*job.world, &Command::Exit);
    }
}

/// One rank's share and its memory, a line on stderr per rank and model:
/// `rank R of N: layers .., query heads .., KV heads .., FFN features ..;
/// weights B bytes, KV B bytes per token, RSS B bytes` (RSS where /proc
/// has it).
pub fn describe_rank<B: Backend>(model: &Model<B>, kv: usize) -> String {
    let Some(place) = model.placement() else {
        return String::new();
    };
    let plan = &place.plan;
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(format!(", RSS {} bytes", kib * 1024))
        })
        .unwrap_or_default();
    format!(
        "rank {} of {}: layers {:?}, query heads {:?}, KV heads {:?}, FFN features {:?}; weights {} bytes, KV {kv} bytes per token{rss}",
        place.job.world.rank(),
        place.job.world.size(),
        place.pipeline.layers,
        plan.heads,
        plan.kv_heads,
        plan.ffn,
        model.loaded_bytes
    )
}

/// A follower rank's life, on the backend `args` choose; `files` is the
/// model the command names (a draft model rank 0 loads besides it is read
/// from the path rank 0 announces).
pub fn follow(args: &ModelArgs, files: ModelFiles) -> Result<()> {
    let job = job().context("no job to follow")?;
    dispatch(args.target(), Follow { args, job, files })
}

struct Follow<'a> {
    args: &'a ModelArgs,
    job: Job,
    files: ModelFiles,
}

impl WithBackend for Follow<'_> {
    type Output = ();

    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let rank = self.job.world.rank();
        let own = self.files;
        loop {
            match receive(&*self.job.world)? {
                Command::Load { unfused, model } => {
                    let other;
                    let files = match own.path.to_string_lossy() == model {
                        true => &own,
                        false => {
                            other = tandem_core::model::load(std::path::Path::new(&model))
                                .with_context(|| {
                                    format!("rank {rank}: reading {model}, which rank 0 loaded")
                                })?;
                            &other
                        }
                    };
                    let options = LoadOptions {
                        layers: None,
                        unfused,
                        parallel: Some(&self.job),
                    };
                    let model = Model::load_with(&backend, files, options, &mut |_, _| {})
                        .with_context(|| {
                            format!("rank {rank}: loading {}", files.path.display())
                        })?;
                    // A split model's caches are uniform (a plan is refused).
                    let dtype = self.args.kv_dtype.uniform().unwrap_or_default();
                    let kv = KvPlan::uniform(dtype, model.config.num_layers)
                        .bytes_per_token(model.kv_shape(self.args.kv_block_size));
                    eprint_line!("{}", describe_rank(&model, kv));
                    model
                        .follow(&backend)
                        .with_context(|| format!("rank {rank}"))?;
                }
                Command::Exit => return Ok(()),
                other => anyhow::bail!("rank {rank}: rank 0 sent {other:?} before loading a model"),
            }
        }
    }
}
