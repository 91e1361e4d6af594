//! [`Communicator`] over MPI: the ranks `mpirun` starts, and the transport
//! between CPU (and wgpu) ranks.
//!
//! MPI is initialised once per process with `MPI_THREAD_SERIALIZED`: the
//! engine may run on a thread other than `main` (the server's), and every
//! call, on any of the process's communicators, goes through one mutex, so
//! calls never overlap. MPI's default error
//! handler aborts the job, so a rank that dies takes the others down
//! (`mpirun` ends them) instead of leaving them blocked in a collective.

use std::sync::{Arc, Mutex, MutexGuard};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
// Its methods; the name `Communicator` is Tandem's trait here.
use mpi::traits::Communicator as _;
use tandem_core::parallel::Communicator;
use tandem_core::{Error, Result};

/// `MPI_COMM_WORLD` of this process, or a part of it (`split`).
pub struct MpiCommunicator {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    mpi: Arc<Mpi>,
}

/// What every communicator of the process shares.
struct Mpi {
    /// Held by every MPI call.
    lock: Mutex<()>,
    /// Finalises MPI when the last communicator is gone.
    _universe: Universe,
}

// SAFETY: MPI was initialised with MPI_THREAD_SERIALIZED (checked in
// `init`), which allows calls from any thread as long as no two overlap;
// every call holds the process's one `Mpi::lock`.
unsafe impl Send for MpiCommunicator {}
unsafe impl Sync for MpiCommunicator {}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MPI rank {} of {}", self.rank, self.size)
    }
}

impl MpiCommunicator {
    /// Initialises MPI; fails when it was already initialised or cannot
    /// give serialized threading.
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| Error::Communication("MPI was already initialised".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(Error::Communication(format!(
                "this MPI gives threading level {threading:?}, and Tandem needs Serialized"
            )));
        }
        let comm = universe.world();
        let mpi = Arc::new(Mpi {
            lock: Mutex::new(()),
            _universe: universe,
        });
        Ok(Self::of(comm, mpi))
    }

    fn of(comm: SimpleCommunicator, mpi: Arc<Mpi>) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            comm,
            rank,
            size,
            mpi,
        }
    }

    /// The communicator, with the process's MPI lock held.
    fn world(&self) -> Locked<'_> {
        // A panic while holding the lock leaves MPI itself in a usable state.
        let guard = self.mpi.lock.lock().unwrap_or_else(|e| e.into_inner());
        Locked {
            comm: &self.comm,
            _guard: guard,
        }
    }

    fn peer(&self, rank: usize) -> Result<i32> {
        match rank < self.size {
            true => Ok(rank as i32),
            false => Err(Error::Communication(format!(
                "rank {rank} does not exist: this job has {} ranks",
                self.size
            ))),
        }
    }
}

/// A communicator while the lock is held.
struct Locked<'a> {
    comm: &'a SimpleCommunicator,
    _guard: MutexGuard<'a, ()>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = SimpleCommunicator;

    fn deref(&self) -> &SimpleCommunicator {
        self.comm
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        let send = data.to_vec();
        self.world()
            .all_reduce_into(&send[..], data, SystemOperation::sum());
        Ok(())
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("all_gather", out.len(), local.len() * self.size)?;
        self.world().all_gather_into(local, out);
        Ok(())
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_len("all_to_all", recv.len(), send.len())?;
        if !send.len().is_multiple_of(self.size) {
            return Err(Error::Communication(format!(
                "all_to_all: {} elements do not split into {} equal chunks",
                send.len(),
                self.size
            )));
        }
        self.world().all_to_all_into(send, recv);
        Ok(())
    }

    fn send(&self, data: &[f32], to: usize) -> Result<()> {
        let to = self.peer(to)?;
        self.world().process_at_rank(to).send(data);
        Ok(())
    }

    fn recv(&self, data: &mut [f32], from: usize) -> Result<()> {
        let from = self.peer(from)?;
        self.world().process_at_rank(from).receive_into(data);
        Ok(())
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        let root = self.peer(root)?;
        let world = self.world();
        let process = world.process_at_rank(root);
        let mut len = data.len() as u64;
        process.broadcast_into(&mut len);
        data.resize(len as usize, 0);
        process.broadcast_into(&mut data[..]);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.world().barrier();
        Ok(())
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let color = i32::try_from(color)
            .map_err(|_| Error::Communication(format!("split: color {color} is too large")))?;
        let part = self
            .world()
            .split_by_color(Color::with_value(color))
            .ok_or_else(|| {
                Error::Communication("split: MPI gave this rank no communicator".into())
            })?;
        Ok(Arc::new(Self::of(part, Arc::clone(&self.mpi))))
    }

    fn abort_job(&self, reason: &str) -> ! {
        tandem_core::parallel::write_stderr_line(&format!("error: {reason}"));
        self.world().abort(1)
    }
}

/// This process's index among the ranks on its own machine, as the
/// launcher (OpenMPI's mpirun, MPICH's, Slurm's srun) tells it.
pub fn local_rank() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    match got == want {
        true => Ok(()),
        false => Err(Error::Communication(format!(
            "{what}: an output of {got} elements where {want} arrive"
        ))),
    }
}
