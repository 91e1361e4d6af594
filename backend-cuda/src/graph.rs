//! Decode steps as CUDA graphs.
//!
//! A small model's decode step is hundreds of short kernels (30 layers ×
//! ~10), and launching them one by one costs more than running them. A graph
//! records the step's launches once and replays them with one call.
//!
//! A graph replays the exact launches it recorded: the same kernels, grid
//! sizes, scalar arguments and buffer addresses. So the caller (the engine):
//!
//! 1. runs the step once eagerly with the shapes it will capture (this
//!    compiles the kernels and sizes the scratch buffers);
//! 2. calls [`CudaBackend::begin_capture`], runs the step's kernels (no
//!    allocation, upload or download: those return an error while
//!    capturing), and [`CudaBackend::end_capture`];
//! 3. per step, writes the new inputs into the same buffers
//!    ([`CudaBackend::write_indices`]: token ids, positions, slots, block
//!    tables), calls [`CudaBackend::replay`], and downloads the sampled ids.
//!
//! A graph is valid for one batch size and one `max_blocks_per_seq` (both
//! are launch parameters); the engine keeps one per padded batch size.

use std::sync::atomic::Ordering;

use cudarc::driver::{sys, CudaGraph};
use tandem_core::Result;

use crate::backend_error;
use crate::CudaBackend;

/// A captured decode step, ready to replay on the backend that captured it.
pub struct DecodeGraph {
    graph: CudaGraph,
}

impl CudaBackend {
    /// Starts recording: kernels launched from this thread until
    /// [`end_capture`](Self::end_capture) are recorded, not run.
    pub fn begin_capture(&self) -> Result<()> {
        if self.capturing.swap(true, Ordering::AcqRel) {
            return Err(backend_error(
                "begin_capture: a capture is already in progress",
            ));
        }
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .inspect_err(|_| self.capturing.store(false, Ordering::Release))
            .map_err(|e| backend_error(format!("begin_capture: {e}")))
    }

    /// Stops recording and instantiates the graph.
    pub fn end_capture(&self) -> Result<DecodeGraph> {
        if !self.capturing.load(Ordering::Acquire) {
            return Err(backend_error("end_capture without begin_capture"));
        }
        let ended = self.stream().end_capture(sys::CUgraphInstantiate_flags(0));
        self.capturing.store(false, Ordering::Release);
        let graph = ended
            .map_err(|e| backend_error(format!("end_capture: {e}")))?
            .ok_or_else(|| backend_error("end_capture: nothing was captured"))?;
        graph
            .upload()
            .map_err(|e| backend_error(format!("uploading the graph: {e}")))?;
        Ok(DecodeGraph { graph })
    }

    /// Queues one replay of `graph` on the backend's stream.
    pub fn replay(&self, graph: &DecodeGraph) -> Result<()> {
        graph
            .graph
            .launch()
            .map_err(|e| backend_error(format!("graph launch: {e}")))
    }
}
