//! Rank 0 drives the other ranks of a split model.
//!
//! Rank 0 owns the engine (scheduler, sampling, speculation); the others
//! only follow. Before it touches its shard of the model, rank 0 broadcasts
//! what it is about to do as a [`Command`]: allocate KV caches, run a
//! forward pass of this batch, copy these KV blocks, stop. Each follower
//! receives the command and does the same with its own shard, so every rank
//! runs the same kernels in the same order and meets the others in the same
//! all-reduces. The batch carries the block tables rank 0's allocator chose:
//! every rank's cache has the same blocks, each holding its own heads.
//!
//! A job loads a model once per engine rank 0 builds (`bench` builds
//! several): `Load` starts each, `Stop` ends it, `Exit` ends the job.
//!
//! A command is a list of little-endian u32 words: a tag, then the fields,
//! each vector preceded by its length.

use super::{Communicator, Job, PipelinePlan, TensorParallelPlan};
use crate::backend::KvDtype;
use crate::model::forward::ForwardBatch;
use crate::{Error, Result};

/// What rank 0 announces.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Load the model rank 0 read from `model` (its path, or the name of
    /// a random-weights shape), so a follower can tell which it is.
    Load {
        unfused: bool,
        model: String,
    },
    AllocKv {
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    },
    Forward(ForwardBatch),
    CopyBlocks(Vec<(u32, u32)>),
    /// The model rank 0 loaded last is dropped.
    Stop,
    /// Rank 0 is done: the followers return.
    Exit,
}

/// One rank's place in a split model: its job, its stage's layers, its
/// share of each layer.
pub struct Placement {
    pub job: Job,
    pub plan: TensorParallelPlan,
    pub pipeline: PipelinePlan,
}

impl Placement {
    pub fn is_leader(&self) -> bool {
        self.job.is_leader()
    }

    /// Rank 0 sends `command` to the others (nothing on a follower, which
    /// must not originate commands).
    pub fn announce(&self, command: &Command) -> Result<()> {
        match self.is_leader() {
            true => announce(&*self.job.world, command),
            false => Ok(()),
        }
    }

    /// The ranks whose partial sums each branch output is, when there are several.
    pub fn reduces_over(&self) -> Option<&dyn Communicator> {
        (self.job.stage.size() > 1).then_some(&*self.job.stage)
    }
}

/// Rank 0 sends `command` to every other rank.
pub fn announce(comm: &dyn Communicator, command: &Command) -> Result<()> {
    let mut bytes = encode(command);
    comm.broadcast_bytes(&mut bytes, 0)
}

/// A follower's next command from rank 0.
pub fn receive(comm: &dyn Communicator) -> Result<Command> {
    let mut bytes = Vec::new();
    comm.broadcast_bytes(&mut bytes, 0)?;
    decode(&bytes)
}

impl Drop for Placement {
    /// Rank 0's model going away releases the followers.
    fn drop(&mut self) {
        if self.is_leader() {
            let _ = self.announce(&Command::Stop);
        }
    }
}

const ALLOC_KV: u32 = 1;
const FORWARD: u32 = 2;
const COPY_BLOCKS: u32 = 3;
const STOP: u32 = 4;
const LOAD: u32 = 5;
const EXIT: u32 = 6;

fn encode(command: &Command) -> Vec<u8> {
    let mut w = Vec::<u32>::new();
    let list = |w: &mut Vec<u32>, v: &[u32]| {
        w.push(v.len() as u32);
        w.extend_from_slice(v);
    };
    match command {
        Command::Load { unfused, model } => {
            w.extend([LOAD, *unfused as u32]);
            let bytes: Vec<u32> = model.bytes().map(u32::from).collect();
            list(&mut w, &bytes);
        }
        Command::AllocKv {
            num_blocks,
            block_size,
            dtype,
        } => {
            let code = KvDtype::ALL.iter().position(|d| d == dtype).unwrap_or(0);
            w.extend([
                ALLOC_KV,
                *num_blocks as u32,
                *block_size as u32,
                code as u32,
            ]);
        }
        Command::Forward(b) => {
            w.extend([FORWARD, b.max_blocks_per_seq as u32, b.block_size as u32]);
            for v in [
                &b.tokens,
                &b.positions,
                &b.row_seq,
                &b.slots,
                &b.block_tables,
                &b.logit_rows,
            ] {
                list(&mut w, v);
            }
        }
        Command::CopyBlocks(pairs) => {
            let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
            w.push(COPY_BLOCKS);
            list(&mut w, &flat);
        }
        Command::Stop => w.push(STOP),
        Command::Exit => w.push(EXIT),
    }
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode(bytes: &[u8]) -> Result<Command> {
    let bad = || {
        Error::Communication(format!(
            "a malformed command of {} bytes from rank 0",
            bytes.len()
        ))
    };
    if !bytes.len().is_multiple_of(4) {
        return Err(bad());
    }
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut at = 0;
    let mut word = || -> Result<u32> {
        at += 1;
        words.get(at - 1).copied().ok_or_else(bad)
    };
    let command = match word()? {
        ALLOC_KV => {
            let (num_blocks, block_size) = (word()? as usize, word()? as usize);
            let dtype = *KvDtype::ALL.get(word()? as usize).ok_or_else(bad)?;
            Command::AllocKv {
                num_blocks,
                block_size,
                dtype,
            }
        }
        FORWARD => {
            let max_blocks_per_seq = word()? as usize;
            let mut b = ForwardBatch::new(word()? as usize, max_blocks_per_seq);
            let mut lists = Vec::with_capacity(6);
            for _ in 0..6 {
                let len = word()? as usize;
                let list = (0..len).map(|_| word()).collect::<Result<Vec<_>>>()?;
                lists.push(list);
            }
            let mut lists = lists.into_iter();
            let mut next = || lists.next().unwrap_or_default();
            (b.tokens, b.positions, b.row_seq) = (next(), next(), next());
            (b.slots, b.block_tables, b.logit_rows) = (next(), next(), next());
            Command::Forward(b)
        }
        COPY_BLOCKS => {
            let len = word()? as usize;
            let flat = (0..len).map(|_| word()).collect::<Result<Vec<_>>>()?;
            Command::CopyBlocks(flat.chunks_exact(2).map(|p| (p[0], p[1])).collect())
        }
        STOP => Command::Stop,
        EXIT => Command::Exit,
        LOAD => {
            let unfused = word()? != 0;
            let len = word()? as usize;
            let bytes = (0..len)
                .map(|_| word().and_then(|b| u8::try_from(b).map_err(|_| bad())))
                .collect::<Result<Vec<u8>>>()?;
            let model = String::from_utf8(bytes).map_err(|_| bad())?;
            Command::Load { unfused, model }
        }
        _ => return Err(bad()),
    };
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_survive_the_wire() {
        let mut batch = ForwardBatch::new(16, 3);
        batch.push_sequence(&[5, 6, 7], 2, &[34, 35, 36], &[2, 0, 9]);
        batch.push_sequence(&[1], 40, &[17], &[1, 4]);
        batch.logit_rows = vec![2, 3];
        let commands = [
            Command::Load {
                unfused: true,
                model: "/models/smollm2 ü.gguf".into(),
            },
            Command::Exit,
            Command::AllocKv {
                num_blocks: 300,
                block_size: 16,
                dtype: KvDtype::ALL[KvDtype::ALL.len() - 1],
            },
            Command::Forward(batch),
            Command::CopyBlocks(vec![(3, 4), (9, 1)]),
            Command::CopyBlocks(Vec::new()),
            Command::Stop,
        ];
        for c in commands {
            assert_eq!(decode(&encode(&c)).unwrap(), c);
        }
    }

    #[test]
    fn a_truncated_or_unknown_command_is_an_error() {
        let mut batch = ForwardBatch::new(16, 1);
        batch.push_sequence(&[5, 6], 0, &[0, 1], &[0]);
        let bytes = encode(&Command::Forward(batch));
        for cut in [1, 4, 12, bytes.len() - 4] {
            let err = decode(&bytes[..cut]).unwrap_err().to_string();
            assert!(err.contains("malformed command"), "{err}");
        }
        assert!(decode(&99u32.to_le_bytes()).is_err());
    }
}
