//! [`KernelSet`]: compiled kernel modules, one per kernel file (and weight
//! format), compiled at first use through the disk cache.

use super::*;

/// Compiled kernel modules, one per kernel file (per file and weight format
/// for `sources::PER_FORMAT_FILES`), and their functions.
pub(super) struct KernelSet {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) arch: GpuArch,
    pub(super) disk: Option<KernelCache>,
    /// By unit: the file's name, or `NAME.STEM` for one format of a file.
    pub(super) modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    pub(super) functions: Mutex<HashMap<String, CudaFunction>>,
}

impl KernelSet {
    pub(super) fn new(ctx: Arc<CudaContext>, arch: GpuArch) -> Self {
        KernelSet {
            ctx,
            arch,
            disk: cache::default_dir().map(KernelCache::new),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    /// Kernel `entry` of `file`; of its unit for the format named `stem`
    /// when the file is compiled per format.
    pub(super) fn function(
        &self,
        file: &'static str,
        stem: Option<&str>,
        entry: &str,
    ) -> Result<CudaFunction> {
        let mut functions = self
            .functions
            .lock()
            .map_err(|_| backend_error("kernel table lock poisoned"))?;
        if let Some(f) = functions.get(entry) {
            return Ok(f.clone());
        }
        let kernel_file = sources::kernel_file(file)
            .ok_or_else(|| backend_error(format!("no kernel file {file}.cu")))?;
        let f = self
            .module(kernel_file, stem)?
            .load_function(entry)
            .map_err(|e| backend_error(format!("{file}.cu has no kernel {entry}: {e}")))?;
        functions.insert(entry.to_string(), f.clone());
        Ok(f)
    }

    pub(super) fn module(&self, file: &KernelFile, stem: Option<&str>) -> Result<Arc<CudaModule>> {
        let unit = match stem {
            Some(stem) => format!("{}.{stem}", file.name),
            None => file.name.to_string(),
        };
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| backend_error("kernel module lock poisoned"))?;
        if let Some(m) = modules.get(&unit) {
            return Ok(m.clone());
        }
        let source = match stem {
            Some(stem) => sources::format_unit(file.name, file.source, stem),
            None => sources::translation_unit(file.name, file.source),
        };
        let cubin = self.cubin(&unit, &source)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| backend_error(format!("loading {unit}.cu for {}: {e}", self.arch)))?;
        modules.insert(unit, module.clone());
        Ok(module)
    }

    /// The CUBIN of a translation unit: from the disk cache, else compiled
    /// (and then cached).
    pub(super) fn cubin(&self, unit: &str, source: &str) -> Result<Vec<u8>> {
        let options = CompileOptions::new(self.arch);
        let args = options.to_args();
        let key = CacheKey {
            kernel: unit,
            source,
            arch: self.arch,
            options: &args,
            nvrtc_version: nvrtc::nvrtc_version()?,
        };
        if let Some(cubin) = self.disk.as_ref().and_then(|d| d.load(&key)) {
            return Ok(cubin);
        }
        let compiled = nvrtc::compile(unit, source, &options)?;
        if let Some(disk) = &self.disk {
            // A cache that cannot be written only means compiling again next time.
            let _ = disk.store(&key, &compiled.cubin);
        }
        Ok(compiled.cubin)
    }
}
