//! The device runtime under the kernels: buffers (pooled by size class),
//! compiled pipelines (cached by variant), bind groups (cached by the
//! buffers they bind), one pending command encoder that every kernel of a
//! step is recorded into, and readback, the only place that waits.
//!
//! Ordering. Kernel parameters and uploads go through `queue.write_buffer`,
//! which takes effect before the pending encoder's commands when it is
//! submitted. Two rules keep that correct: every dispatch gets its own slot
//! of the parameter buffer until the next submit, and a pooled buffer
//! released while commands are pending is only reused after they are
//! submitted (so no upload can overwrite data an earlier command still reads).

mod memory;
mod readback;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tandem_core::{Error, Result};

use crate::shader::{self, ShaderTarget, ShaderVariant};

pub(crate) use memory::GpuBuffer;
use memory::Pool;

pub(crate) fn backend_error(message: impl Into<String>) -> Error {
    Error::backend("wgpu", message)
}

/// Locks, recovering the data of a mutex poisoned by a panic elsewhere:
/// every critical section leaves the state consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a kernel uses a storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Access {
    Read,
    ReadWrite,
}

/// Bytes of one parameter slot: the largest dynamic-offset alignment WebGPU
/// allows, and more than any kernel's parameter struct.
const PARAM_SLOT: u64 = 256;
/// Dispatches recorded between two submits before an early submit.
const PARAM_SLOTS: u64 = 1024;

/// A compiled kernel entry point.
struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout_id: u64,
    bind_layout: wgpu::BindGroupLayout,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PipelineKey {
    variant: ShaderVariant,
    entry: &'static str,
}

/// One dispatch of a kernel.
pub(crate) struct Dispatch<'a> {
    pub variant: ShaderVariant,
    pub entry: &'static str,
    /// Storage bindings 1.. of the kernel, in order; binding 0 is the parameters.
    pub access: &'static [Access],
    pub buffers: &'a [&'a GpuBuffer],
    /// The kernel's parameter struct, as 32-bit words.
    pub params: &'a [u32],
    pub workgroups: u32,
}

struct State {
    encoder: Option<wgpu::CommandEncoder>,
    /// Parameters of the dispatches recorded in `encoder`, one slot each.
    params: Vec<u8>,
    pipelines: HashMap<PipelineKey, Arc<Pipeline>>,
    layouts: HashMap<Vec<Access>, (u64, wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    bind_groups: HashMap<(u64, Vec<u64>), wgpu::BindGroup>,
}

/// Bind groups kept before the cache is emptied (it holds their buffers alive).
const MAX_BIND_GROUPS: usize = 4096;

/// Errors the device reported outside any call's result (validation, out of
/// memory, device lost).
#[derive(Default)]
struct ErrorLog {
    pending: Vec<String>,
    lost: Option<String>,
}

pub(crate) struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub target: ShaderTarget,
    params_buffer: GpuBuffer,
    pool: Arc<Mutex<Pool>>,
    state: Mutex<State>,
    errors: Arc<Mutex<ErrorLog>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Dispatches recorded since the device was opened.
    launches: std::sync::atomic::AtomicU64,
    /// The mappable buffer of the last readback, reused by the next.
    readback: Mutex<Option<wgpu::Buffer>>,
}

impl Gpu {
    pub fn new(device: wgpu::Device, queue: wgpu::Queue, target: ShaderTarget) -> Self {
        let errors = Arc::new(Mutex::new(ErrorLog::default()));
        let log = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            lock(&log).pending.push(describe(&e));
        }));
        let log = errors.clone();
        device.set_device_lost_callback(move |reason, message| {
            lock(&log).lost = Some(format!("device lost ({reason:?}): {message}"));
        });
        let params_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kernel parameters"),
            size: PARAM_SLOT * PARAM_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Gpu {
            limits: device.limits(),
            device,
            queue,
            target,
            params_buffer: GpuBuffer {
                id: 0,
                buffer: params_buffer,
                pool: None,
            },
            pool: Arc::default(),
            state: Mutex::new(State {
                encoder: None,
                params: Vec::new(),
                pipelines: HashMap::new(),
                layouts: HashMap::new(),
                bind_groups: HashMap::new(),
            }),
            errors,
            next_id: 1.into(),
            launches: 0.into(),
            readback: Mutex::new(None),
        }
    }

    /// Dispatches recorded so far (`Backend::kernel_launches`).
    pub fn launches(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn fresh_id(&self) -> u64 {
        self.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// The errors the device reported since the last check, as one error.
    pub fn check(&self, during: &str) -> Result<()> {
        let mut log = lock(&self.errors);
        if let Some(lost) = &log.lost {
            return Err(backend_error(format!("{during}: {lost}")));
        }
        if log.pending.is_empty() {
            return Ok(());
        }
        let all = log.pending.drain(..).collect::<Vec<_>>().join("; ");
        Err(backend_error(format!("{during}: {all}")))
    }

    /// Runs `record` on the pending encoder (created when there is none).
    fn record<T>(
        &self,
        state: &mut State,
        record: impl FnOnce(&mut wgpu::CommandEncoder) -> T,
    ) -> T {
        let encoder = state.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                })
        });
        lock(&self.pool).recording = true;
        record(encoder)
    }

    /// Records zero-filling the first `bytes` of `buffer`.
    pub fn clear(&self, buffer: &GpuBuffer, bytes: u64) {
        let bytes = bytes.next_multiple_of(4);
        if bytes == 0 {
            return;
        }
        let mut state = lock(&self.state);
        self.record(&mut state, |e| {
            e.clear_buffer(&buffer.buffer, 0, Some(bytes))
        });
    }

    /// Records a buffer-to-buffer copy (byte offsets and size multiples of 4).
    pub fn copy(
        &self,
        src: &GpuBuffer,
        src_offset: u64,
        dst: &GpuBuffer,
        dst_offset: u64,
        bytes: u64,
    ) {
        let mut state = lock(&self.state);
        self.record(&mut state, |e| {
            e.copy_buffer_to_buffer(&src.buffer, src_offset, &dst.buffer, dst_offset, bytes)
        });
    }

    /// Records one dispatch; nothing runs until the next submit.
    pub fn dispatch(&self, d: Dispatch<'_>) -> Result<()> {
        if d.workgroups == 0 {
            return Ok(());
        }
        if 4 * d.params.len() as u64 > PARAM_SLOT {
            return Err(backend_error(format!(
                "{}: {} parameter words exceed a slot",
                d.variant.kernel,
                d.params.len()
            )));
        }
        let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
        let x = d.workgroups.min(max_dim);
        let y = d.workgroups.div_ceil(x);
        if y > max_dim {
            return Err(backend_error(format!(
                "{}: {} workgroups exceed the adapter's dispatch limit",
                d.variant.kernel, d.workgroups
            )));
        }
        let mut state = lock(&self.state);
        let pipeline = self.pipeline(&mut state, &d)?;
        if state.params.len() as u64 >= PARAM_SLOT * PARAM_SLOTS {
            self.submit_locked(&mut state)?;
        }
        let offset = state.params.len();
        state
            .params
            .extend(d.params.iter().flat_map(|w| w.to_le_bytes()));
        state.params.resize(offset + PARAM_SLOT as usize, 0);

        let key = (
            pipeline.layout_id,
            d.buffers.iter().map(|b| b.id).collect::<Vec<_>>(),
        );
        if !state.bind_groups.contains_key(&key) {
            if state.bind_groups.len() >= MAX_BIND_GROUPS {
                state.bind_groups.clear();
            }
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.params_buffer.buffer,
                    offset: 0,
                    size: wgpu::BufferSize::new(PARAM_SLOT),
                }),
            }];
            for (i, b) in d.buffers.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.buffer.as_entire_binding(),
                });
            }
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.variant.kernel),
                layout: &pipeline.bind_layout,
                entries: &entries,
            });
            state.bind_groups.insert(key.clone(), group);
        }
        let State {
            encoder,
            bind_groups,
            ..
        } = &mut *state;
        let group = &bind_groups[&key];
        let encoder = encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                })
        });
        lock(&self.pool).recording = true;
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(d.variant.kernel),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, group, &[offset as u32]);
        pass.dispatch_workgroups(x, y, 1);
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn pipeline(&self, state: &mut State, d: &Dispatch<'_>) -> Result<Arc<Pipeline>> {
        let key = PipelineKey {
            variant: d.variant,
            entry: d.entry,
        };
        if let Some(p) = state.pipelines.get(&key) {
            return Ok(p.clone());
        }
        let (layout_id, bind_layout, layout) = match state.layouts.get(d.access) {
            Some(found) => found.clone(),
            None => {
                let created = self.layout(d.access);
                state.layouts.insert(d.access.to_vec(), created.clone());
                created
            }
        };
        let label = format!("{}/{}", d.variant.kernel, d.entry);
        let text = shader::generate(&d.variant, &self.target)
            .map_err(|e| backend_error(format!("generating {label}: {e}")))?;
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(text.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: Some(&layout),
                module: &module,
                entry_point: Some(d.entry),
                compilation_options: Default::default(),
                cache: None,
            });
        self.check(&format!("compiling {label}"))?;
        let pipeline = Arc::new(Pipeline {
            pipeline,
            layout_id,
            bind_layout,
        });
        state.pipelines.insert(key, pipeline.clone());
        Ok(pipeline)
    }

    fn layout(&self, access: &[Access]) -> (u64, wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        for (i, a) in access.iter().enumerate() {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: i as u32 + 1,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: *a == Access::Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let bind_layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: None,
                entries: &entries,
            });
        let layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: None,
                bind_group_layouts: &[Some(&bind_layout)],
                immediate_size: 0,
            });
        (self.fresh_id(), bind_layout, layout)
    }

    /// Submits everything recorded so far (with its parameters) as one command buffer.
    pub fn submit(&self) -> Result<()> {
        let mut state = lock(&self.state);
        self.submit_locked(&mut state)
    }

    fn submit_locked(&self, state: &mut State) -> Result<()> {
        let Some(encoder) = state.encoder.take() else {
            return self.check("submit");
        };
        if !state.params.is_empty() {
            self.queue
                .write_buffer(&self.params_buffer.buffer, 0, &state.params);
            state.params.clear();
        }
        self.queue.submit([encoder.finish()]);
        lock(&self.pool).submitted();
        self.check("running kernels")
    }
}

/// A wgpu error with its description and the chain of its sources (its
/// `Display` alone says only "Validation Error").
fn describe(e: &wgpu::Error) -> String {
    let mut text = match e {
        wgpu::Error::OutOfMemory { .. } => "out of device memory".to_string(),
        wgpu::Error::Validation { description, .. } => format!("validation error: {description}"),
        wgpu::Error::Internal { description, .. } => format!("internal error: {description}"),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let line = s.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = s.source();
    }
    text
}
