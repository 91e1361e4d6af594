//! Recorded steps as CUDA graphs (`Backend::begin_capture`).
//!
//! A small model's decode step is hundreds of short kernels (30 layers ×
//! ~10), and launching them one by one costs more than running them. A graph
//! records the step's launches once and replays them with one call; the
//! engine's decode recorder (`tandem_core::model::recorded`) decides what to
//! record and keeps the buffers a graph names alive.
//!
//! While capturing, allocation, upload and download return an error (they
//! would not be part of the graph), and the scratch buffers cannot grow:
//! the recorder runs each shape eagerly first, which sizes them. A scratch
//! buffer that grows after a graph was recorded is kept, not freed, because
//! the graph still writes to it (`CudaBackend::retire`).
//!
//! Kernels launched during a capture are counted into the graph, and each
//! replay adds them to `Backend::kernel_launches`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};
use tandem_core::backend::RecordedStep;
use tandem_core::Result;

use crate::backend_error;
use crate::CudaBackend;

/// A captured step, replayed on the stream that captured it.
pub struct DecodeGraph {
    graph: CudaGraph,
    /// Kernels the graph runs, added to the backend's count at each replay.
    kernels: u64,
    launches: Arc<AtomicU64>,
}

impl RecordedStep for DecodeGraph {
    fn replay(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| backend_error(format!("graph launch: {e}")))?;
        self.launches.fetch_add(self.kernels, Ordering::Relaxed);
        Ok(())
    }
}

impl CudaBackend {
    /// Starts recording: kernels launched from this thread until
    /// [`end_graph_capture`](Self::end_graph_capture) are recorded, not run.
    pub(crate) fn begin_graph_capture(&self) -> Result<()> {
        if self.capturing.swap(true, Ordering::AcqRel) {
            return Err(backend_error(
                "begin_capture: a capture is already in progress",
            ));
        }
        self.captured_launches.store(0, Ordering::Relaxed);
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .inspect_err(|_| self.capturing.store(false, Ordering::Release))
            .map_err(|e| backend_error(format!("begin_capture: {e}")))
    }

    /// Stops recording and instantiates the graph.
    pub(crate) fn end_graph_capture(&self) -> Result<DecodeGraph> {
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
        self.recorded.store(true, Ordering::Release);
        Ok(DecodeGraph {
            graph,
            kernels: self.captured_launches.swap(0, Ordering::Relaxed),
            launches: self.launches.clone(),
        })
    }
}
