//! A [`Communicator`] that measures another: per kind of operation, the
//! calls, the bytes and the wall time spent inside them.
//!
//! The bytes of an operation are its payload on this rank: the buffer an
//! all-reduce sums (`len × 4`), the slice `all_gather`, `all_to_all` or
//! `send` hands over, the slice `recv` fills, the message a broadcast
//! delivers (counted on every rank, root or not). They are what the model
//! asks to move, not what the transport puts on the wire (a ring
//! all-reduce of n ranks sends `2 (n - 1) / n` times its buffer per rank).
//! The time is the wall time between entering and leaving the call, so it
//! includes waiting for the slowest rank to arrive. A backend with device
//! collectives (NCCL on CUDA ranks) all-reduces without the communicator:
//! only what goes through it is counted.
//!
//! [`Metered::meter`] hands out a [`Meter`], a cheap handle on the same
//! counters, to read or reset them while the communicator itself is shared
//! as an `Arc<dyn Communicator>`.

use std::sync::{Arc, Mutex};

use super::Communicator;
use crate::spec::Stopwatch;
use crate::Result;

/// The kinds of operation a [`Communicator`] offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    AllReduce,
    AllGather,
    AllToAll,
    Send,
    Recv,
    Broadcast,
    Barrier,
}

impl Op {
    pub const ALL: [Op; 7] = [
        Op::AllReduce,
        Op::AllGather,
        Op::AllToAll,
        Op::Send,
        Op::Recv,
        Op::Broadcast,
        Op::Barrier,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::AllToAll => "all_to_all",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }
}

/// Counters of one kind of operation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpStats {
    /// Calls, failed ones included.
    pub calls: u64,
    /// Payload bytes of the calls that succeeded.
    pub bytes: u64,
    /// Wall time inside the calls.
    pub seconds: f64,
}

/// Counters of every kind of operation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    ops: [OpStats; Op::ALL.len()],
}

impl CommStats {
    pub fn op(&self, op: Op) -> OpStats {
        self.ops[op as usize]
    }

    /// Wall time inside every operation.
    pub fn seconds(&self) -> f64 {
        self.ops.iter().map(|o| o.seconds).sum()
    }

    /// Payload bytes of every operation.
    pub fn bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.bytes).sum()
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(&earlier.ops) {
            o.calls -= e.calls;
            o.bytes -= e.bytes;
            o.seconds -= e.seconds;
        }
        out
    }

    /// Both counts together.
    pub fn plus(&self, other: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(&other.ops) {
            o.calls += e.calls;
            o.bytes += e.bytes;
            o.seconds += e.seconds;
        }
        out
    }
}

/// A handle on a [`Metered`] communicator's counters.
#[derive(Clone, Debug, Default)]
pub struct Meter(Arc<Mutex<CommStats>>);

impl Meter {
    /// The counters now.
    pub fn read(&self) -> CommStats {
        *self.lock()
    }

    /// Zeroes the counters.
    pub fn reset(&self) {
        *self.lock() = CommStats::default();
    }

    /// The counters now, zeroing them.
    pub fn take(&self) -> CommStats {
        std::mem::take(&mut *self.lock())
    }

    fn record(&self, op: Op, bytes: Option<usize>, seconds: f64) {
        let mut stats = self.lock();
        let o = &mut stats.ops[op as usize];
        o.calls += 1;
        o.bytes += bytes.unwrap_or(0) as u64;
        o.seconds += seconds;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CommStats> {
        // Counters are plain numbers: a panic elsewhere leaves them valid.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `inner`, with every operation counted and timed.
#[derive(Debug)]
pub struct Metered<C> {
    inner: C,
    meter: Meter,
}

impl<C: Communicator> Metered<C> {
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            meter: Meter::default(),
        }
    }

    /// A handle on the counters, valid as long as anyone holds it.
    pub fn meter(&self) -> Meter {
        self.meter.clone()
    }

    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Runs `f` as one `op`, of `bytes` payload bytes when it succeeds.
    fn timed<T>(
        &self,
        op: Op,
        f: impl FnOnce() -> Result<T>,
        bytes: impl FnOnce() -> usize,
    ) -> Result<T> {
        let clock = Stopwatch::start();
        let result = f();
        let seconds = clock.seconds();
        self.meter.record(op, result.is_ok().then(bytes), seconds);
        result
    }
}

const F32: usize = std::mem::size_of::<f32>();

impl<C: Communicator> Communicator for Metered<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        let bytes = data.len() * F32;
        self.timed(Op::AllReduce, || self.inner.all_reduce_sum(data), || bytes)
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        let f = || self.inner.all_gather(local, out);
        self.timed(Op::AllGather, f, || local.len() * F32)
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let f = || self.inner.all_to_all(send, recv);
        self.timed(Op::AllToAll, f, || send.len() * F32)
    }

    fn send(&self, data: &[f32], to: usize) -> Result<()> {
        self.timed(Op::Send, || self.inner.send(data, to), || data.len() * F32)
    }

    fn recv(&self, data: &mut [f32], from: usize) -> Result<()> {
        let bytes = data.len() * F32;
        self.timed(Op::Recv, || self.inner.recv(data, from), || bytes)
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        let clock = Stopwatch::start();
        let result = self.inner.broadcast_bytes(data, root);
        let seconds = clock.seconds();
        let bytes = result.is_ok().then_some(data.len());
        self.meter.record(Op::Broadcast, bytes, seconds);
        result
    }

    fn barrier(&self) -> Result<()> {
        self.timed(Op::Barrier, || self.inner.barrier(), || 0)
    }

    /// The part is metered too, into the same counters.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let inner = self.inner.split(color)?;
        Ok(Arc::new(Metered {
            inner,
            meter: self.meter.clone(),
        }))
    }

    fn abort_job(&self, reason: &str) -> ! {
        self.inner.abort_job(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::SingleRank;
    use std::time::Duration;

    #[test]
    fn single_rank_counts_are_exact() {
        let comm = Metered::new(SingleRank);
        let meter = comm.meter();
        let mut x = vec![1.0f32; 576];
        for _ in 0..3 {
            comm.all_reduce_sum(&mut x).unwrap();
        }
        let mut out = vec![0.0; 10];
        comm.all_gather(&[2.0; 10], &mut out).unwrap();
        comm.all_to_all(&[3.0; 6], &mut [0.0; 6]).unwrap();
        let mut message = b"forward".to_vec();
        comm.broadcast_bytes(&mut message, 0).unwrap();
        comm.barrier().unwrap();
        // A single rank has no peer: the calls fail, count, and move nothing.
        assert!(comm.send(&[1.0; 4], 1).is_err());
        assert!(comm.recv(&mut [0.0; 4], 1).is_err());

        let stats = meter.read();
        let counts = |op| (stats.op(op).calls, stats.op(op).bytes);
        assert_eq!(counts(Op::AllReduce), (3, 3 * 576 * 4));
        assert_eq!(counts(Op::AllGather), (1, 40));
        assert_eq!(counts(Op::AllToAll), (1, 24));
        assert_eq!(counts(Op::Broadcast), (1, 7));
        assert_eq!(counts(Op::Barrier), (1, 0));
        assert_eq!(counts(Op::Send), (1, 0));
        assert_eq!(counts(Op::Recv), (1, 0));
        assert_eq!(stats.bytes(), 3 * 576 * 4 + 40 + 24 + 7);
        // The wrapper changes nothing it passes through.
        assert_eq!(
            (x[0], out, message),
            (1.0, vec![2.0; 10], b"forward".to_vec())
        );
        assert_eq!((comm.rank(), comm.size()), (0, 1));
    }

    #[test]
    fn counters_are_read_reset_and_differenced() {
        let comm = Metered::new(SingleRank);
        let meter = comm.meter();
        comm.all_reduce_sum(&mut [0.0; 8]).unwrap();
        let before = meter.read();
        comm.all_reduce_sum(&mut [0.0; 2]).unwrap();
        let delta = meter.read().since(&before);
        assert_eq!(delta.op(Op::AllReduce).calls, 1);
        assert_eq!(delta.op(Op::AllReduce).bytes, 8);
        let sum = before.plus(&delta).op(Op::AllReduce);
        assert_eq!((sum.calls, sum.bytes), (2, 40));
        let taken = meter.take();
        assert_eq!(taken.op(Op::AllReduce).bytes, 40);
        assert_eq!(meter.read(), CommStats::default());
        comm.barrier().unwrap();
        meter.reset();
        assert_eq!(meter.read(), CommStats::default());
        // A clone of the meter reads the same counters.
        let other = meter.clone();
        comm.all_reduce_sum(&mut [0.0; 1]).unwrap();
        assert_eq!(other.read().op(Op::AllReduce).bytes, 4);
    }

    /// A rank whose all-reduce takes a known time.
    #[derive(Debug)]
    struct Slow(Duration);

    impl Communicator for Slow {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn all_reduce_sum(&self, _data: &mut [f32]) -> Result<()> {
            std::thread::sleep(self.0);
            Ok(())
        }
        fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
            SingleRank.all_gather(local, out)
        }
        fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
            SingleRank.all_to_all(send, recv)
        }
        fn send(&self, _data: &[f32], _to: usize) -> Result<()> {
            Ok(())
        }
        fn recv(&self, _data: &mut [f32], _from: usize) -> Result<()> {
            Ok(())
        }
        fn split(&self, _color: usize) -> Result<Arc<dyn Communicator>> {
            Ok(Arc::new(SingleRank))
        }
        fn broadcast_bytes(&self, _data: &mut Vec<u8>, _root: usize) -> Result<()> {
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn time_inside_collectives_is_measured_per_kind() {
        let comm = Metered::new(Slow(Duration::from_millis(20)));
        let meter = comm.meter();
        comm.all_reduce_sum(&mut [0.0; 4]).unwrap();
        comm.all_reduce_sum(&mut [0.0; 4]).unwrap();
        comm.barrier().unwrap();
        let stats = meter.read();
        let reduce = stats.op(Op::AllReduce).seconds;
        assert!(reduce >= 0.040, "{reduce}");
        assert!(stats.op(Op::Barrier).seconds < reduce);
        assert_eq!(stats.seconds(), reduce + stats.op(Op::Barrier).seconds);
        assert_eq!(comm.size(), 2);
    }
}
