//! NVRTC: compiling `kernels/*.cu` to CUBIN for one GPU architecture.
//!
//! The backend compiles at first use; the `nvrtc_compile` test compiles every
//! kernel for `sm_90` on machines without a GPU. Both go through [`compile`],
//! so what the test checks is exactly what the backend loads.
//!
//! cudarc opens `libnvrtc` by name through the dynamic linker and panics when
//! it is absent. [`nvrtc_available`] asks first, and [`load_nvrtc_from`] makes
//! a copy outside the linker's search path (the PyPI wheel under `.tools/`, a
//! toolkit not registered with `ldconfig`) visible: a library already loaded
//! under its soname is what a later `dlopen` of that name returns.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cudarc::nvrtc::{result, sys};
use tandem_core::Result;

use crate::backend_error;

/// A real GPU architecture, e.g. `sm_90` for Hopper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuArch {
    pub major: u32,
    pub minor: u32,
}

impl GpuArch {
    pub const HOPPER: GpuArch = GpuArch { major: 9, minor: 0 };

    /// The `--gpu-architecture` value: `sm_90`.
    pub fn sm_name(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

impl std::fmt::Display for GpuArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.sm_name())
    }
}

/// How a kernel file is compiled.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    pub arch: GpuArch,
    /// Asks ptxas for its per-function register and spill figures (in the log).
    pub ptxas_verbose: bool,
}

impl CompileOptions {
    pub fn new(arch: GpuArch) -> Self {
        Self {
            arch,
            ptxas_verbose: false,
        }
    }

    /// The NVRTC command line. Kernels rely on IEEE division and square root
    /// (tolerances against the CPU reference are tight), so no fast-math.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--gpu-architecture={}", self.arch.sm_name()),
            "--std=c++17".to_string(),
            "--fmad=true".to_string(),
            "--device-as-default-execution-space".to_string(),
        ];
        if self.ptxas_verbose {
            args.push("--ptxas-options=-v".to_string());
        }
        args
    }
}

/// The output of one successful compilation.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    /// CUBIN for `CompileOptions::arch`, loadable with `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    /// NVRTC's log: warnings, and ptxas's figures when asked for.
    pub log: String,
}

/// Directories where an NVRTC library is looked for when the dynamic linker
/// does not find one: `$TANDEM_NVRTC_DIR`, the CUDA toolkit, and the wheel
/// that `scripts/install-nvrtc.sh` installs under the working directory.
pub fn nvrtc_search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("TANDEM_NVRTC_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(Path::new(&root).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.push(PathBuf::from(WHEEL_LIB_DIR));
    dirs
}

/// Where `scripts/install-nvrtc.sh` puts the NVRTC libraries, relative to the
/// repository root.
pub const WHEEL_LIB_DIR: &str = ".tools/cuda/nvidia/cu13/lib";

/// True when NVRTC can be used, loading it from [`nvrtc_search_dirs`] if the
/// dynamic linker does not find it on its own.
pub fn nvrtc_available() -> bool {
    if linker_finds_nvrtc() {
        return true;
    }
    nvrtc_search_dirs()
        .iter()
        .any(|dir| load_nvrtc_from(dir).is_ok())
}

fn linker_finds_nvrtc() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

/// Libraries opened by [`load_nvrtc_from`]; kept open for the life of the
/// process because cudarc holds function pointers into them.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Loads NVRTC (and its builtins library, which NVRTC opens by name) from
/// `dir`, so that cudarc finds it.
pub fn load_nvrtc_from(dir: &Path) -> Result<()> {
    if linker_finds_nvrtc() {
        return Ok(());
    }
    let mut preloaded = PRELOADED
        .lock()
        .map_err(|_| backend_error("NVRTC loader lock poisoned"))?;
    for name in ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"] {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(backend_error(format!(
                "NVRTC not found: {} does not exist",
                path.display()
            )));
        }
        // SAFETY: NVRTC's initialisers have no preconditions; the handle is
        // kept for the life of the process.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| backend_error(format!("cannot load {}: {e}", path.display())))?;
        preloaded.push(lib);
    }
    if linker_finds_nvrtc() {
        Ok(())
    } else {
        Err(backend_error(format!(
            "loaded NVRTC from {} but it is still not visible by its soname",
            dir.display()
        )))
    }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(backend_error(format!(
            "NVRTC not found (libnvrtc.so.13): install the CUDA 13 toolkit, set \
             TANDEM_NVRTC_DIR, or run scripts/install-nvrtc.sh (searched {:?})",
            nvrtc_search_dirs()
        )))
    }
}

/// NVRTC's version, part of the kernel cache key.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| backend_error(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles one translation unit (`name` is used in diagnostics) to CUBIN.
/// A compile error is returned with NVRTC's log in the message.
pub fn compile(name: &str, source: &str, options: &CompileOptions) -> Result<CompiledKernel> {
    require_nvrtc()?;
    let c_source = CString::new(source)
        .map_err(|_| backend_error(format!("{name}: kernel source contains a NUL byte")))?;
    let c_name = CString::new(name)
        .map_err(|_| backend_error(format!("{name}: file name contains a NUL byte")))?;
    let program = Program(
        result::create_program(&c_source, Some(&c_name))
            .map_err(|e| backend_error(format!("{name}: nvrtcCreateProgram: {e:?}")))?,
    );
    // SAFETY: `program` is live until it is dropped at the end of this function.
    let compiled = unsafe { result::compile_program(program.0, &options.to_args()) };
    let log = unsafe { result::get_program_log(program.0) }
        .map(|raw| c_chars_to_string(&raw))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(backend_error(format!(
            "{name}: NVRTC compile for {} failed ({e:?}):\n{log}",
            options.arch.sm_name()
        )));
    }
    let cubin = unsafe { program.cubin() }
        .map_err(|e| backend_error(format!("{name}: nvrtcGetCUBIN: {e:?}")))?;
    Ok(CompiledKernel { cubin, log })
}

/// Owns an `nvrtcProgram`, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    /// # Safety
    /// The program must have been compiled successfully for a real architecture.
    unsafe fn cubin(&self) -> std::result::Result<Vec<u8>, result::NvrtcError> {
        let mut size = 0usize;
        sys::nvrtcGetCUBINSize(self.0, &mut size).result()?;
        let mut cubin = vec![0u8; size];
        sys::nvrtcGetCUBIN(self.0, cubin.as_mut_ptr().cast::<c_char>()).result()?;
        Ok(cubin)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here. A
        // failure to free it leaks a little host memory; nothing to report to.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Resource use of one compiled function, as ptxas reports it with `-v`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionUsage {
    pub name: String,
    pub registers: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

impl FunctionUsage {
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// Reads ptxas's `-v` lines out of an NVRTC log:
///
/// ```text
/// ptxas info    : Function properties for rms_norm
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 18 registers, used 1 barriers, 380 bytes cmem[0]
/// ```
pub fn parse_ptxas_usage(log: &str) -> Vec<FunctionUsage> {
    let mut functions: Vec<FunctionUsage> = Vec::new();
    for line in log.lines() {
        let line = line.trim();
        if let Some(name) = line
            .split_once("Function properties for ")
            .map(|(_, name)| name.trim())
        {
            functions.push(FunctionUsage {
                name: name.to_string(),
                ..FunctionUsage::default()
            });
        } else if let Some(current) = functions.last_mut() {
            if line.contains("bytes stack frame") {
                current.stack_frame_bytes = number_before(line, "bytes stack frame");
                current.spill_store_bytes = number_before(line, "bytes spill stores");
                current.spill_load_bytes = number_before(line, "bytes spill loads");
            } else if line.contains("Used ") && line.contains(" registers") {
                current.registers = number_after(line, "Used ");
            }
        }
    }
    functions
}

fn number_before(line: &str, unit: &str) -> u32 {
    line.split_once(unit)
        .and_then(|(head, _)| head.split([',', ' ']).rev().find(|w| !w.is_empty()))
        .and_then(|w| w.parse().ok())
        .unwrap_or(0)
}

fn number_after(line: &str, prefix: &str) -> u32 {
    line.split_once(prefix)
        .and_then(|(_, tail)| tail.split_whitespace().next())
        .and_then(|w| w.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_figures_are_read_per_function() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'
ptxas info    : Function properties for rms_norm
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 1 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 400 bytes cmem[0]
";
        let usage = parse_ptxas_usage(log);
        assert_eq!(
            usage,
            vec![
                FunctionUsage {
                    name: "rms_norm".into(),
                    registers: 18,
                    stack_frame_bytes: 0,
                    spill_store_bytes: 0,
                    spill_load_bytes: 0,
                },
                FunctionUsage {
                    name: "big".into(),
                    registers: 255,
                    stack_frame_bytes: 48,
                    spill_store_bytes: 40,
                    spill_load_bytes: 36,
                },
            ]
        );
        assert!(!usage[0].spills());
        assert!(usage[1].spills());
    }

    #[test]
    fn options_name_the_architecture_and_ask_for_ptxas_figures() {
        let mut options = CompileOptions::new(GpuArch::HOPPER);
        options.ptxas_verbose = true;
        let args = options.to_args();
        assert!(args.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(args.contains(&"--ptxas-options=-v".to_string()));
    }
}
