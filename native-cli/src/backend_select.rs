//! `--backend`: which device runs the model. Commands are written once as a
//! [`WithBackend`] visitor, generic over the backend type, and this module
//! instantiates them for the backend the user chose.

#[cfg(not(all(feature = "wgpu", feature = "cuda")))]
use anyhow::bail;
use anyhow::Result;
use clap::ValueEnum;
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// CUDA if a GPU and driver are present, else a hardware WebGPU adapter, else the CPU.
    Auto,
    /// The multi-threaded CPU backend.
    Cpu,
    /// WebGPU through wgpu: Vulkan, Metal, DX12 or GL (software adapters too).
    Wgpu,
    /// NVIDIA GPUs through CUDA (kernels compiled by NVRTC at first use).
    Cuda,
}

/// A command body that runs on any backend.
pub trait WithBackend {
    type Output;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Output>;
}

pub fn dispatch<W: WithBackend>(
    choice: BackendChoice,
    threads: usize,
    body: W,
) -> Result<W::Output> {
    match choice {
        BackendChoice::Cpu => body.run(CpuBackend::new(threads)),
        BackendChoice::Wgpu => run_wgpu(body),
        BackendChoice::Cuda => run_cuda(body),
        BackendChoice::Auto => {
            #[cfg(feature = "cuda")]
            if tandem_cuda::driver_present() {
                if let Ok(cuda) = tandem_cuda::CudaBackend::new(0) {
                    return body.run(cuda);
                }
            }
            #[cfg(feature = "wgpu")]
            {
                let options = tandem_wgpu::WgpuOptions {
                    adapter: tandem_wgpu::AdapterPreference::HardwareOnly,
                    ..Default::default()
                };
                if let Ok(gpu) = tandem_wgpu::WgpuBackend::new(options) {
                    return body.run(gpu);
                }
            }
            body.run(CpuBackend::new(threads))
        }
    }
}

/// An explicit `--backend wgpu` accepts software adapters too (lavapipe, WARP).
#[cfg(feature = "wgpu")]
fn run_wgpu<W: WithBackend>(body: W) -> Result<W::Output> {
    body.run(tandem_wgpu::WgpuBackend::new(
        tandem_wgpu::WgpuOptions::default(),
    )?)
}

#[cfg(not(feature = "wgpu"))]
fn run_wgpu<W: WithBackend>(_: W) -> Result<W::Output> {
    bail!("this tandem was built without the wgpu backend (cargo feature `wgpu`)")
}

#[cfg(feature = "cuda")]
fn run_cuda<W: WithBackend>(body: W) -> Result<W::Output> {
    body.run(tandem_cuda::CudaBackend::new(0)?)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<W: WithBackend>(_: W) -> Result<W::Output> {
    bail!("this tandem was built without the CUDA backend (cargo feature `cuda`)")
}
