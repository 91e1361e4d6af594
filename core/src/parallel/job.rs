//! A job's ranks and the shape they split a model into.
//!
//! `tp × pp` ranks: `pp` pipeline stages of `tp` ranks each. World rank
//! `stage × tp + t` is rank `t` of its stage, so the ranks of a stage are
//! consecutive: with one machine per stage, a stage's all-reduces stay on
//! its machine (NVLink) and only the activations between stages cross
//! machines, as Megatron and vLLM place them.
//!
//! Expert parallelism runs on the ranks of a stage, as vLLM's does: the
//! attention stays tensor parallel over them, and each MoE layer's experts
//! are placed over `ep` groups of `tp / ep` ranks (`--ep` alone sets `tp`
//! to the same count).

use std::sync::Arc;

use super::{Communicator, PipelinePlan, TensorParallelPlan};
use crate::model::ModelFiles;
use crate::{Error, Result};

/// How many ranks split a model, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobShape {
    /// Ranks per pipeline stage (tensor parallelism).
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Groups each MoE layer's experts are placed over, within a stage.
    pub ep: usize,
    /// A pipelined step's rows go through the stages in this many parts.
    pub micro_batches: usize,
}

impl Default for JobShape {
    fn default() -> Self {
        Self::new(1, 1, 1)
    }
}

impl JobShape {
    /// `tp` ranks per stage (the `ep` count when `tp` is 1), `pp` stages,
    /// and as many micro-batches as stages.
    pub fn new(tp: usize, pp: usize, ep: usize) -> Self {
        let tp = if tp <= 1 { ep.max(1) } else { tp };
        Self {
            tp,
            pp: pp.max(1),
            ep: ep.max(1),
            micro_batches: pp.max(1),
        }
    }

    pub fn ranks(&self) -> usize {
        self.tp * self.pp
    }

    /// The flags as a user writes them (`--tp 2 --pp 2`).
    pub fn flags(&self) -> String {
        let mut flags = vec![format!("--tp {}", self.tp)];
        if self.pp > 1 {
            flags.push(format!("--pp {}", self.pp));
        }
        if self.ep > 1 {
            flags.push(format!("--ep {}", self.ep));
        }
        flags.join(" ")
    }

    /// Refuses a shape that no model could run.
    pub fn check(&self) -> Result<()> {
        if !self.tp.is_multiple_of(self.ep) {
            return Err(Error::InvalidRequest(format!(
                "--ep {}: expert groups must divide the {} ranks of a stage (--tp {})",
                self.ep, self.tp, self.tp
            )));
        }
        if self.micro_batches == 0 {
            return Err(Error::InvalidRequest(
                "--micro-batches must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// One line per rank: what `inspect --tp/--pp/--ep` shows.
    pub fn describe(&self, files: &ModelFiles) -> Result<Vec<String>> {
        self.check()?;
        (0..self.ranks())
            .map(|rank| {
                let (stage, t) = (rank / self.tp, rank % self.tp);
                let pipeline = PipelinePlan::for_model(files, stage, self.pp)?;
                let plan = TensorParallelPlan::for_model(files, t, self.tp, self.ep)?;
                Ok(format!(
                    "rank {rank}: stage {stage} layers {:?}, {}",
                    pipeline.layers,
                    plan.describe()
                ))
            })
            .collect()
    }
}

/// This rank's part in a job: the communicators it runs collectives on.
#[derive(Clone, Debug)]
pub struct Job {
    /// Every rank: commands from rank 0, activations between stages.
    pub world: Arc<dyn Communicator>,
    /// The ranks of this rank's stage: tensor and expert parallel all-reduces.
    pub stage: Arc<dyn Communicator>,
    pub shape: JobShape,
}

impl Job {
    /// Arranges the ranks of `world` as `shape` says. Collective: every
    /// rank calls it, in the same order as its other collectives.
    pub fn new(world: Arc<dyn Communicator>, shape: JobShape) -> Result<Self> {
        shape.check()?;
        if world.size() != shape.ranks() {
            return Err(Error::InvalidRequest(format!(
                "{} needs {} ranks: start it as `mpirun -np {} tandem ...` (this job has {})",
                shape.flags(),
                shape.ranks(),
                shape.ranks(),
                world.size()
            )));
        }
        let stage = world.split(world.rank() / shape.tp)?;
        Ok(Self {
            world,
            stage,
            shape,
        })
    }

    /// This rank's pipeline stage.
    pub fn stage_index(&self) -> usize {
        self.world.rank() / self.shape.tp
    }

    pub fn is_leader(&self) -> bool {
        self.world.rank() == 0
    }

    /// World rank of rank `t` of stage `stage`.
    pub fn world_rank(&self, stage: usize, t: usize) -> usize {
        stage * self.shape.tp + t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::SingleRank;

    #[test]
    fn ep_alone_sets_the_stage_width_and_must_divide_it() {
        let shape = JobShape::new(1, 2, 2);
        assert_eq!((shape.tp, shape.ranks(), shape.micro_batches), (2, 4, 2));
        assert!(JobShape::new(4, 1, 2).check().is_ok());
        let err = JobShape::new(3, 1, 2).check().unwrap_err().to_string();
        assert!(
            err.contains("--ep 2: expert groups must divide the 3 ranks"),
            "{err}"
        );
    }

    #[test]
    fn a_job_needs_its_rank_count() {
        let world: Arc<dyn Communicator> = Arc::new(SingleRank);
        let err = Job::new(world.clone(), JobShape::new(2, 2, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--tp 2 --pp 2 needs 4 ranks"), "{err}");
        let job = Job::new(world, JobShape::default()).unwrap();
        assert_eq!((job.stage_index(), job.stage.size()), (0, 1));
    }
}
