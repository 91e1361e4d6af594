//! Finding adapters, describing them (`tandem inspect --devices`), and opening
//! a device on the best one with the features Tandem's shaders can use.

use tandem_core::{Error, Result};

/// Which adapters [`crate::WgpuBackend::new`] may pick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdapterPreference {
    /// The best hardware adapter; fail when there is none.
    HardwareOnly,
    /// The best hardware adapter, else a software one (lavapipe, WARP, SwiftShader).
    #[default]
    AllowSoftware,
}

/// The native API under wgpu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphicsApi {
    Vulkan,
    Metal,
    Dx12,
    Gl,
    /// The browser's WebGPU.
    WebGpu,
}

impl GraphicsApi {
    fn of(backend: wgpu::Backend) -> Option<Self> {
        match backend {
            wgpu::Backend::Vulkan => Some(GraphicsApi::Vulkan),
            wgpu::Backend::Metal => Some(GraphicsApi::Metal),
            wgpu::Backend::Dx12 => Some(GraphicsApi::Dx12),
            wgpu::Backend::Gl => Some(GraphicsApi::Gl),
            wgpu::Backend::BrowserWebGpu => Some(GraphicsApi::WebGpu),
            _ => None,
        }
    }
}

/// How to open the wgpu device.
#[derive(Clone, Debug, Default)]
pub struct WgpuOptions {
    pub adapter: AdapterPreference,
    /// Only adapters of this API (any when `None`; the ranking prefers
    /// Vulkan, Metal and DX12 over GL).
    pub api: Option<GraphicsApi>,
    /// Use the f32 shader path even where the adapter has `shader-f16`.
    pub disable_f16: bool,
    /// Use workgroup-memory reductions even where the adapter has subgroups.
    pub disable_subgroups: bool,
    /// Split weights into buffers of at most this many bytes even where the
    /// adapter's storage binding limit is larger (tests use it to exercise
    /// the split path with small matrices).
    pub max_weight_chunk_bytes: Option<u64>,
    /// Decode-sized matmuls with one thread per weight row (`gemv_rows` in
    /// `wgsl/matmul.wgsl`) instead of one workgroup per row (`gemv`). `None`:
    /// per row on CPU adapters (SwiftShader, lavapipe), where each workgroup
    /// barrier costs a switch of every invocation and the reductions
    /// dominate; per workgroup on GPUs, where reads must be coalesced.
    pub gemv_per_row: Option<bool>,
}

/// What an adapter is and what it offers, for `tandem inspect --devices`.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    /// `Vulkan`, `Metal`, `Dx12`, `Gl` or `BrowserWebGpu`.
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu` or `Other`.
    pub device_type: String,
    pub driver: String,
    /// A software rasterizer (`device_type` is `Cpu`).
    pub software: bool,
    /// It runs compute shaders at all (some GL adapters do not).
    pub compute: bool,
    pub shader_f16: bool,
    pub subgroups: bool,
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroups_per_dimension: u32,
}

impl AdapterReport {
    fn of(adapter: &wgpu::Adapter) -> Self {
        let info = adapter.get_info();
        let features = adapter.features();
        let limits = adapter.limits();
        AdapterReport {
            name: info.name,
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: [info.driver, info.driver_info]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" "),
            software: info.device_type == wgpu::DeviceType::Cpu,
            compute: adapter
                .get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::COMPUTE_SHADERS),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
            max_buffer_size: limits.max_buffer_size,
            max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
            max_compute_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
        }
    }
}

impl std::fmt::Display for AdapterReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        write!(
            f,
            "{} ({}, {}, {}): compute {}, shader-f16 {}, subgroups {}, \
             max storage binding {} MiB, max buffer {} MiB, workgroup storage {} KiB, \
             {} invocations/workgroup, {} workgroups/dimension",
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            yes_no(self.compute),
            yes_no(self.shader_f16),
            yes_no(self.subgroups),
            self.max_storage_buffer_binding_size >> 20,
            self.max_buffer_size >> 20,
            self.max_compute_workgroup_storage_size >> 10,
            self.max_compute_invocations_per_workgroup,
            self.max_compute_workgroups_per_dimension,
        )
    }
}

/// The limits every kernel of `shaders/` fits in: the WebGPU defaults for
/// workgroups (256 invocations, 16 KiB of workgroup memory).
pub(crate) const REQUIRED_INVOCATIONS: u32 = 256;
pub(crate) const REQUIRED_WORKGROUP_STORAGE: u32 = 16 * 1024 - 32;

const INSTALL_HINT: &str = "no usable wgpu adapter: install a Vulkan driver \
     (on Debian/Ubuntu without a GPU: `apt-get install mesa-vulkan-drivers` for lavapipe)";

/// An instance of just `backends`: starting GL wakes EGL, which is slow and
/// prints errors on headless machines, so it is started only when asked for.
fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    #[cfg(all(unix, not(target_os = "macos"), not(target_arch = "wasm32")))]
    quiet_device_select();
    let mut descriptor = wgpu::InstanceDescriptor::new_without_display_handle();
    descriptor.backends = backends;
    wgpu::Instance::new(descriptor)
}

/// Keeps Mesa's Vulkan device-select layer from printing a false alarm.
///
/// The layer (implicit, so on wherever Mesa's Vulkan drivers are installed)
/// asks the Wayland compositor for the default GPU when devices are
/// enumerated, because wgpu enables the Wayland surface extension (always:
/// wgpu has no option to leave it out). Without a usable `XDG_RUNTIME_DIR`,
/// libwayland then prints `error: XDG_RUNTIME_DIR is invalid or not set in
/// the environment.` before a command that works. The layer only puts the
/// default GPU first, and adapters are ranked here anyway, so where it can
/// only fail that way (no Wayland display and no `XDG_RUNTIME_DIR`) and was
/// not asked to choose (`MESA_VK_DEVICE_SELECT`, `DRI_PRIME`), its own
/// switch `NODEVICE_SELECT` turns it off for this process. Done once, before
/// any Vulkan instance exists, so no other thread reads the environment
/// meanwhile.
#[cfg(all(unix, not(target_os = "macos"), not(target_arch = "wasm32")))]
fn quiet_device_select() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
        let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR")
            .is_some_and(|dir| std::path::Path::new(&dir).is_absolute());
        let asked = ["NODEVICE_SELECT", "MESA_VK_DEVICE_SELECT", "DRI_PRIME"]
            .into_iter()
            .any(set);
        if !runtime_dir && !set("WAYLAND_DISPLAY") && !asked {
            std::env::set_var("NODEVICE_SELECT", "1");
        }
    });
}

/// Every adapter wgpu finds, best first.
pub async fn list_adapters_async() -> Vec<AdapterReport> {
    let backends = wgpu::Backends::all();
    ranked_adapters(&instance(backends), backends)
        .await
        .iter()
        .map(AdapterReport::of)
        .collect()
}

/// Every adapter wgpu finds, best first (blocking; use
/// [`list_adapters_async`] in the browser).
#[cfg(not(target_arch = "wasm32"))]
pub fn list_adapters() -> Vec<AdapterReport> {
    pollster::block_on(list_adapters_async())
}

/// Adapters that can run compute shaders, best first: hardware before
/// software, discrete before integrated, native APIs before GL.
async fn ranked_adapters(
    instance: &wgpu::Instance,
    backends: wgpu::Backends,
) -> Vec<wgpu::Adapter> {
    let mut adapters = instance.enumerate_adapters(backends).await;
    let rank = |a: &wgpu::Adapter| {
        let info = a.get_info();
        let device = match info.device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        let api = u8::from(info.backend == wgpu::Backend::Gl);
        (device, api)
    };
    adapters.sort_by_key(rank);
    adapters
}

/// An open device and what it was opened with.
pub(crate) struct OpenDevice {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub report: AdapterReport,
    pub f16: bool,
    pub subgroups: bool,
}

pub(crate) async fn open(options: &WgpuOptions) -> Result<OpenDevice> {
    let usable = |a: &wgpu::Adapter| {
        let report = AdapterReport::of(a);
        report.compute
            && !(options.adapter == AdapterPreference::HardwareOnly && report.software)
            && options
                .api
                .is_none_or(|api| GraphicsApi::of(a.get_info().backend) == Some(api))
    };
    // GL only when asked for, or as the last resort of a caller that takes
    // software adapters too (hardware GL without Vulkan, Metal or DX12 is rare).
    let stages = match (options.api, options.adapter) {
        (Some(GraphicsApi::Gl), _) => vec![wgpu::Backends::GL],
        (_, AdapterPreference::HardwareOnly) => vec![wgpu::Backends::PRIMARY],
        (_, AdapterPreference::AllowSoftware) => vec![wgpu::Backends::PRIMARY, wgpu::Backends::GL],
    };
    let mut candidates: Vec<wgpu::Adapter> = Vec::new();
    for backends in stages {
        candidates = ranked_adapters(&instance(backends), backends).await;
        candidates.retain(usable);
        if !candidates.is_empty() {
            break;
        }
    }
    let Some(adapter) = candidates.into_iter().next() else {
        let what = match (options.adapter, options.api) {
            (_, Some(api)) => format!("no usable wgpu adapter for {api:?}"),
            (AdapterPreference::HardwareOnly, None) => "no hardware wgpu adapter found".into(),
            (AdapterPreference::AllowSoftware, None) => INSTALL_HINT.into(),
        };
        return Err(Error::backend("wgpu", what));
    };

    let report = AdapterReport::of(&adapter);
    let limits = adapter.limits();
    if limits.max_compute_invocations_per_workgroup < REQUIRED_INVOCATIONS
        || limits.max_compute_workgroup_size_x < REQUIRED_INVOCATIONS
        || limits.max_compute_workgroup_storage_size < REQUIRED_WORKGROUP_STORAGE
    {
        return Err(Error::backend(
            "wgpu",
            format!(
                "adapter {} allows {} invocations and {} bytes of workgroup memory per \
                 workgroup; Tandem's kernels need {REQUIRED_INVOCATIONS} and {REQUIRED_WORKGROUP_STORAGE}",
                report.name,
                limits.max_compute_invocations_per_workgroup,
                limits.max_compute_workgroup_storage_size
            ),
        ));
    }

    let f16 = report.shader_f16 && !options.disable_f16;
    let subgroups = report.subgroups && !options.disable_subgroups;
    let mut features = wgpu::Features::empty();
    if f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    if subgroups {
        features |= wgpu::Features::SUBGROUP;
    }
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("tandem"),
            required_features: features,
            // Everything the adapter offers: larger bindings mean fewer weight chunks.
            required_limits: limits,
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        })
        .await
        .map_err(|e| Error::backend("wgpu", format!("opening {}: {e}", report.name)))?;
    Ok(OpenDevice {
        device,
        queue,
        report,
        f16,
        subgroups,
    })
}
