//! wgpu backend (in progress)
