//! Scratch buffers reused across launches (attention split partials,
//! the cuBLAS path's halves, the one-kernel MLP's sums), grown on demand;
//! an outgrown buffer is kept while a recorded graph may still write it.

use super::*;

#[derive(Default)]
pub(super) struct Scratch {
    /// Attention split partials; the up half of a GLU on the cuBLAS path;
    /// the one-kernel MLP's partial sums.
    pub(super) partials: Option<CudaSlice<f32>>,
    /// The one-kernel MLP's count of blocks done, zero between launches
    /// (`mlp_residual.cu` resets it).
    pub(super) mlp_counter: Option<CudaSlice<u32>>,
    pub(super) halves: Option<CudaSlice<u16>>,
    /// Outgrown buffers a recorded graph may still write to.
    pub(super) retired_partials: Vec<CudaSlice<f32>>,
    pub(super) retired_halves: Vec<CudaSlice<u16>>,
}

impl CudaBackend {
    /// A scratch buffer of at least `len` f32 for `what`'s partial sums
    /// (attention splits, the one-kernel MLP).
    pub(super) fn partials(&self, len: usize, what: &str) -> Result<ScratchSlice<'_, f32>> {
        let mut guard = self.lock_scratch()?;
        let scratch = &mut *guard;
        self.grow(
            &mut scratch.partials,
            &mut scratch.retired_partials,
            len,
            what,
        )?;
        Ok(ScratchSlice {
            guard,
            pick: |s| s.partials.as_mut(),
        })
    }

    /// The scratch of a cuBLAS matmul: at least `halves` u16 for half copies
    /// of activations and, when `floats` is not 0, that many f32 (the
    /// attention partials' buffer: the two are never in use at once).
    pub(super) fn gemm_scratch(
        &self,
        halves: usize,
        floats: usize,
    ) -> Result<MutexGuard<'_, Scratch>> {
        let mut guard = self.lock_scratch()?;
        let scratch = &mut *guard;
        self.grow(
            &mut scratch.halves,
            &mut scratch.retired_halves,
            halves,
            "GEMM",
        )?;
        if floats > 0 {
            self.grow(
                &mut scratch.partials,
                &mut scratch.retired_partials,
                floats,
                "GEMM",
            )?;
        }
        Ok(guard)
    }

    /// The one-kernel MLP's scratch: at least `len` f32 of partials, and
    /// its counter.
    pub(super) fn mlp_scratch(&self, len: usize) -> Result<MutexGuard<'_, Scratch>> {
        let ScratchSlice { mut guard, .. } = self.partials(len, "MLP")?;
        if guard.mlp_counter.is_none() {
            self.refuse_while_capturing(
                "allocating the MLP counter (run the step once before capturing)",
            )?;
            guard.mlp_counter = Some(self.alloc_raw::<u32>(1)?);
        }
        Ok(guard)
    }

    /// Grows a scratch buffer to at least `len` elements (by powers of two).
    pub(super) fn grow<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &mut Option<CudaSlice<T>>,
        retired: &mut Vec<CudaSlice<T>>,
        len: usize,
        what: &str,
    ) -> Result<()> {
        if buf.as_ref().is_none_or(|b| b.len() < len) {
            self.refuse_while_capturing(&format!(
                "growing the {what} scratch buffer (run the step once before capturing)"
            ))?;
            let grown = self.alloc_raw::<T>(len.next_power_of_two())?;
            if let Some(old) = buf.replace(grown) {
                self.retire(retired, old);
            }
        }
        Ok(())
    }

    /// Keeps an outgrown scratch buffer alive if a recorded graph may name
    /// it (sizes grow by powers of two, so at most as much again is kept).
    pub(super) fn retire<T>(&self, retired: &mut Vec<CudaSlice<T>>, old: CudaSlice<T>) {
        if self.recorded.load(Ordering::Acquire) {
            retired.push(old);
        }
    }

    pub(super) fn lock_scratch(&self) -> Result<MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| backend_error("scratch buffer lock poisoned"))
    }

    pub(super) fn alloc_raw<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        // Zero-length allocations are not allowed by the driver.
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| backend_error(format!("allocating {len} elements: {e}")))
    }
}

/// A locked scratch buffer.
pub(super) struct ScratchSlice<'a, T> {
    pub(super) guard: MutexGuard<'a, Scratch>,
    pub(super) pick: fn(&mut Scratch) -> Option<&mut CudaSlice<T>>,
}

impl<T> ScratchSlice<'_, T> {
    pub(super) fn slice(&mut self) -> Result<&mut CudaSlice<T>> {
        (self.pick)(&mut self.guard).ok_or_else(|| backend_error("scratch buffer missing"))
    }
}

impl Scratch {
    /// The partials and the counter that `CudaBackend::mlp_scratch` made.
    pub(super) fn partials_and_counter(
        &mut self,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<u32>)> {
        match (self.partials.as_mut(), self.mlp_counter.as_mut()) {
            (Some(partials), Some(counter)) => Ok((partials, counter)),
            _ => Err(backend_error("scratch buffer missing")),
        }
    }

    /// The half and f32 buffers that `CudaBackend::gemm_scratch` grew.
    pub(super) fn halves_and_floats(
        &mut self,
    ) -> Result<(&mut CudaSlice<u16>, Option<&mut CudaSlice<f32>>)> {
        let halves = self
            .halves
            .as_mut()
            .ok_or_else(|| backend_error("scratch buffer missing"))?;
        Ok((halves, self.partials.as_mut()))
    }
}
