//! `--backend`: which device runs the model. Commands are written once as a
//! [`WithBackend`] visitor, generic over the backend type, and this module
//! instantiates them for the backend the user chose.

use anyhow::bail;
use anyhow::Result;
use clap::ValueEnum;
use tandem_core::Backend;
use tandem_cpu::{CpuBackend, CpuIsa};

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

/// `--cpu-isa`: the CPU backend's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CpuIsaChoice {
    /// The fastest this CPU runs.
    Best,
    /// AVX2 with AVX-512 F, BW, VL, VNNI and VBMI.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Plain Rust, vectorized by the compiler for the build target.
    Portable,
}

impl From<CpuIsaChoice> for CpuIsa {
    fn from(choice: CpuIsaChoice) -> Self {
        match choice {
            CpuIsaChoice::Best => CpuIsa::Best,
            CpuIsaChoice::Avx512 => CpuIsa::Avx512,
            CpuIsaChoice::Avx2 => CpuIsa::Avx2,
            CpuIsaChoice::Portable => CpuIsa::Portable,
        }
    }
}

/// Where a command runs: `--backend`, `--threads`, `--cpu-isa` and `--device`.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub backend: BackendChoice,
    pub threads: usize,
    pub cpu_isa: CpuIsaChoice,
    /// A CUDA device ordinal; `None`: this rank's index on its machine.
    pub device: Option<usize>,
}

impl Target {
    /// The CUDA device to open: `--device`, else the local rank (0 alone).
    fn cuda_device(&self) -> usize {
        self.device.unwrap_or_else(crate::parallel::local_rank)
    }
}

/// A command body that runs on any backend.
pub trait WithBackend {
    type Output;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Output>;
}

pub fn dispatch<W: WithBackend>(target: Target, body: W) -> Result<W::Output> {
    let threads = target.threads;
    if let (Some(device), BackendChoice::Cpu | BackendChoice::Wgpu) =
        (target.device, target.backend)
    {
        let name = target.backend.to_possible_value().expect("not skipped");
        bail!(
            "--device {device} picks a CUDA device; --backend {} has none to pick",
            name.get_name()
        );
    }
    if target.cpu_isa != CpuIsaChoice::Best && target.backend != BackendChoice::Cpu {
        bail!("--cpu-isa picks the CPU backend's kernels: add --backend cpu");
    }
    match target.backend {
        BackendChoice::Cpu => body.run(CpuBackend::with_isa(threads, target.cpu_isa.into())?),
        BackendChoice::Wgpu => run_wgpu(body),
        BackendChoice::Cuda => run_cuda(body, target.cuda_device()),
        BackendChoice::Auto => {
            #[cfg(feature = "cuda")]
            if tandem_cuda::driver_present() {
                if let Ok(cuda) = tandem_cuda::CudaBackend::new(target.cuda_device()) {
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
fn run_cuda<W: WithBackend>(body: W, device: usize) -> Result<W::Output> {
    body.run(tandem_cuda::CudaBackend::new(device)?)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<W: WithBackend>(_: W, _: usize) -> Result<W::Output> {
    bail!("this tandem was built without the CUDA backend (cargo feature `cuda`)")
}
