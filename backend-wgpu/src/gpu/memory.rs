//! Device memory: storage buffers, pooled by size class or dedicated, and
//! the queue writes that fill them. Its one tie to command recording is the
//! pool's `recording` flag, which holds released buffers back until the
//! submit (the ordering rule in the parent module).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tandem_core::Result;

use super::{backend_error, lock, Gpu};

/// A device buffer with a process-unique id (the key of cached bind groups).
/// Pooled buffers go back to their pool when dropped, keeping their id.
pub(crate) struct GpuBuffer {
    pub id: u64,
    pub buffer: wgpu::Buffer,
    pub(super) pool: Option<(Weak<Mutex<Pool>>, u64)>,
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if let Some((pool, class)) = &self.pool {
            if let Some(pool) = pool.upgrade() {
                lock(&pool).release(*class, self.id, self.buffer.clone());
            }
        }
    }
}

/// Free storage buffers by size class.
#[derive(Default)]
pub(crate) struct Pool {
    free: HashMap<u64, Vec<(u64, wgpu::Buffer)>>,
    /// Released while commands were pending; free once they are submitted.
    held: Vec<(u64, u64, wgpu::Buffer)>,
    /// Commands are recorded and not yet submitted.
    pub(super) recording: bool,
}

impl Pool {
    fn release(&mut self, class: u64, id: u64, buffer: wgpu::Buffer) {
        if self.recording {
            self.held.push((class, id, buffer));
        } else {
            self.free.entry(class).or_default().push((id, buffer));
        }
    }

    pub(super) fn submitted(&mut self) {
        self.recording = false;
        for (class, id, buffer) in self.held.drain(..) {
            self.free.entry(class).or_default().push((id, buffer));
        }
    }
}

/// Sizes round up to a quarter of their power of two, so that a reused buffer
/// wastes at most a fifth of itself.
fn size_class(bytes: u64) -> u64 {
    let bytes = bytes.max(16);
    let quarter = (bytes.next_power_of_two() / 4).max(16);
    bytes.div_ceil(quarter) * quarter
}

impl Gpu {
    pub(super) fn create_buffer(
        &self,
        bytes: u64,
        usage: wgpu::BufferUsages,
        label: &str,
    ) -> Result<wgpu::Buffer> {
        if bytes > self.limits.max_buffer_size {
            return Err(backend_error(format!(
                "{label}: {bytes} bytes exceed the adapter's largest buffer ({} bytes)",
                self.limits.max_buffer_size
            )));
        }
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(4).next_multiple_of(4),
            usage,
            mapped_at_creation: false,
        });
        self.check(label)?;
        Ok(buffer)
    }

    /// A storage buffer of at least `bytes` from the pool; its content is
    /// whatever its last user left.
    pub fn pooled(&self, bytes: u64) -> Result<GpuBuffer> {
        if bytes > self.limits.max_storage_buffer_binding_size {
            return Err(backend_error(format!(
                "a tensor of {bytes} bytes exceeds the adapter's storage binding limit ({} bytes)",
                self.limits.max_storage_buffer_binding_size
            )));
        }
        let class = size_class(bytes).min(self.limits.max_storage_buffer_binding_size);
        let reused = lock(&self.pool).free.get_mut(&class).and_then(Vec::pop);
        let (id, buffer) = match reused {
            Some(found) => found,
            None => {
                let usage = wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST;
                (self.fresh_id(), self.create_buffer(class, usage, "tensor")?)
            }
        };
        Ok(GpuBuffer {
            id,
            buffer,
            pool: Some((Arc::downgrade(&self.pool), class)),
        })
    }

    /// A buffer of its own (weights, KV caches), zero-filled by wgpu.
    pub fn dedicated(&self, bytes: u64, label: &str) -> Result<GpuBuffer> {
        if bytes > self.limits.max_storage_buffer_binding_size {
            return Err(backend_error(format!(
                "{label}: {bytes} bytes exceed the adapter's storage binding limit ({} bytes)",
                self.limits.max_storage_buffer_binding_size
            )));
        }
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST;
        Ok(GpuBuffer {
            id: self.fresh_id(),
            buffer: self.create_buffer(bytes, usage, label)?,
            pool: None,
        })
    }

    /// Queues `bytes` to be written at the start of `buffer` (padded to 4 bytes).
    pub fn write(&self, buffer: &GpuBuffer, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if bytes.len().is_multiple_of(4) {
            self.queue.write_buffer(&buffer.buffer, 0, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4), 0);
            self.queue.write_buffer(&buffer.buffer, 0, &padded);
        }
    }
}
