//! Readback, the only place the runtime waits. The map is awaited as a
//! future so that one path serves both targets: natively the buffer is
//! mapped once the device is polled, in the browser the event loop maps it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tandem_core::Result;

use super::{backend_error, lock, Gpu, GpuBuffer};

impl Gpu {
    /// Submits pending work, then reads the first `bytes` (a multiple of 4) of `src`.
    pub async fn read(&self, src: &GpuBuffer, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let reused = lock(&self.readback).take();
        let staging = match reused {
            Some(buffer) if buffer.size() >= bytes => buffer,
            _ => self.create_buffer(
                bytes
                    .next_power_of_two()
                    .min(self.limits.max_buffer_size.max(bytes)),
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                "readback",
            )?,
        };
        {
            let mut state = lock(&self.state);
            self.record(&mut state, |e| {
                e.copy_buffer_to_buffer(&src.buffer, 0, &staging, 0, bytes)
            });
            self.submit_locked(&mut state)?;
        }
        let mapped = Oneshot::default();
        let done = mapped.clone();
        staging.map_async(wgpu::MapMode::Read, 0..bytes, move |r| done.set(r));
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| backend_error(format!("waiting for the device: {e}")))?;
        mapped
            .await
            .map_err(|e| backend_error(format!("mapping a readback buffer: {e}")))?;
        self.check("reading back")?;
        let data = staging
            .get_mapped_range(0..bytes)
            .map_err(|e| backend_error(format!("reading a mapped buffer: {e}")))?
            .to_vec();
        staging.unmap();
        *lock(&self.readback) = Some(staging);
        Ok(data)
    }
}

/// A value set once by a callback and awaited by one reader (the map_async
/// callback; natively it is already set when awaited, in the browser it
/// arrives from the event loop).
struct Oneshot<T> {
    slot: Arc<Mutex<(Option<T>, Option<Waker>)>>,
}

impl<T> Default for Oneshot<T> {
    fn default() -> Self {
        Oneshot {
            slot: Arc::new(Mutex::new((None, None))),
        }
    }
}

impl<T> Clone for Oneshot<T> {
    fn clone(&self) -> Self {
        Oneshot {
            slot: self.slot.clone(),
        }
    }
}

impl<T> Oneshot<T> {
    fn set(&self, value: T) {
        let waker = {
            let mut slot = lock(&self.slot);
            slot.0 = Some(value);
            slot.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Future for Oneshot<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut slot = lock(&self.slot);
        match slot.0.take() {
            Some(v) => Poll::Ready(v),
            None => {
                slot.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}
