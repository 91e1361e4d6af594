//! Finding the driver and the devices.

use cudarc::driver::{result, sys};
use tandem_core::Result;

use crate::backend_error;

/// True when the CUDA driver library (`libcuda.so`) can be opened. Every
/// other driver call in this crate is made only after this returns true:
/// cudarc panics when it cannot find the library.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library under its candidate names.
    unsafe { sys::is_culib_present() }
}

/// The error for a machine without the driver.
pub fn no_driver_error() -> tandem_core::Error {
    backend_error("no CUDA driver found (libcuda.so not loadable)")
}

pub(crate) fn require_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(no_driver_error())
    }
}

/// What `tandem inspect --devices` prints for one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceReport {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0) for an H100/H200.
    pub compute_capability: (u32, u32),
    pub total_memory_bytes: usize,
}

impl std::fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} (sm_{}{}, {:.1} GiB)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// The CUDA devices of this machine. Without a driver: the "no CUDA driver
/// found" error; with a driver but no device: an empty list.
pub fn list_devices() -> Result<Vec<DeviceReport>> {
    require_driver()?;
    result::init().map_err(|e| backend_error(format!("cuInit: {e}")))?;
    let count =
        result::device::get_count().map_err(|e| backend_error(format!("cuDeviceGetCount: {e}")))?;
    (0..count).map(device_report).collect()
}

fn device_report(ordinal: i32) -> Result<DeviceReport> {
    let what = |call: &str, e: result::DriverError| {
        backend_error(format!("device {ordinal}: {call}: {e}"))
    };
    let device = result::device::get(ordinal).map_err(|e| what("cuDeviceGet", e))?;
    let name = result::device::get_name(device).map_err(|e| what("cuDeviceGetName", e))?;
    // SAFETY: `device` is a valid handle from cuDeviceGet.
    let total_memory_bytes =
        unsafe { result::device::total_mem(device) }.map_err(|e| what("cuDeviceTotalMem", e))?;
    let attribute = |attr| {
        // SAFETY: as above.
        unsafe { result::device::get_attribute(device, attr) }
            .map(|v| v.max(0) as u32)
            .map_err(|e| what("cuDeviceGetAttribute", e))
    };
    let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceReport {
        ordinal: ordinal as usize,
        name,
        compute_capability: (major, minor),
        total_memory_bytes,
    })
}
