//! Compiled kernels on disk, so NVRTC runs once per kernel file, GPU
//! architecture and compiler, not once per process.
//!
//! A CUBIN is stored as `<dir>/<kernel>-<arch>-<key>.cubin`, where the key
//! hashes everything that decides its content: the full source (header
//! included), the architecture, the NVRTC options and the NVRTC version. The
//! directory is `$TANDEM_CACHE/cuda`, else `$XDG_CACHE_HOME/tandem/cuda`, else
//! `~/.cache/tandem/cuda`. The cache only ever saves time: a file that cannot
//! be read or written means compiling again.

use std::path::{Path, PathBuf};

use crate::nvrtc::GpuArch;

/// Everything a compiled kernel depends on.
#[derive(Clone, Debug)]
pub struct CacheKey<'a> {
    pub kernel: &'a str,
    pub source: &'a str,
    pub arch: GpuArch,
    pub options: &'a [String],
    pub nvrtc_version: (i32, i32),
}

impl CacheKey<'_> {
    /// 64-bit FNV-1a over every field, each followed by a separator byte so
    /// that moving text between fields changes the hash.
    pub fn hash(&self) -> u64 {
        let mut hasher = Fnv1a::new();
        hasher.field(self.kernel.as_bytes());
        hasher.field(self.source.as_bytes());
        hasher.field(self.arch.sm_name().as_bytes());
        for option in self.options {
            hasher.field(option.as_bytes());
        }
        hasher.field(&self.nvrtc_version.0.to_le_bytes());
        hasher.field(&self.nvrtc_version.1.to_le_bytes());
        hasher.finish()
    }

    pub fn file_name(&self) -> String {
        format!(
            "{}-{}-{:016x}.cubin",
            self.kernel,
            self.arch.sm_name(),
            self.hash()
        )
    }
}

/// FNV-1a, 64 bits: stable across Rust releases (unlike `DefaultHasher`),
/// which a cache on disk needs.
struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
        self.write(&[0xff]);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The cache directory, from the environment; `None` when no home is known.
pub fn default_dir() -> Option<PathBuf> {
    let from_env = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    from_env("TANDEM_CACHE")
        .map(|dir| dir.join("cuda"))
        .or_else(|| from_env("XDG_CACHE_HOME").map(|dir| dir.join("tandem").join("cuda")))
        .or_else(|| from_env("HOME").map(|home| home.join(".cache").join("tandem").join("cuda")))
}

/// A directory of compiled kernels.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn load(&self, key: &CacheKey<'_>) -> Option<Vec<u8>> {
        std::fs::read(self.dir.join(key.file_name()))
            .ok()
            .filter(|bytes| !bytes.is_empty())
    }

    /// Stores `cubin` atomically (a temporary file renamed into place), so a
    /// concurrent reader never sees half a file.
    pub fn store(&self, key: &CacheKey<'_>, cubin: &[u8]) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let final_path = self.dir.join(key.file_name());
        let temp_path = self
            .dir
            .join(format!("{}.tmp{}", key.file_name(), std::process::id()));
        std::fs::write(&temp_path, cubin)?;
        std::fs::rename(&temp_path, &final_path).inspect_err(|_| {
            // The rename failed; the temporary file is useless either way.
            let _ = std::fs::remove_file(&temp_path);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(source: &'a str, options: &'a [String], arch: GpuArch) -> CacheKey<'a> {
        CacheKey {
            kernel: "rms_norm",
            source,
            arch,
            options,
            nvrtc_version: (13, 0),
        }
    }

    #[test]
    fn the_key_changes_with_source_arch_options_and_compiler() {
        let options = vec!["--fmad=true".to_string()];
        let base = key("a", &options, GpuArch::HOPPER);
        let other_source = key("b", &options, GpuArch::HOPPER);
        let other_arch = key("a", &options, GpuArch { major: 8, minor: 0 });
        let no_options = key("a", &[], GpuArch::HOPPER);
        let mut other_nvrtc = base.clone();
        other_nvrtc.nvrtc_version = (13, 1);
        let hashes = [
            base.hash(),
            other_source.hash(),
            other_arch.hash(),
            no_options.hash(),
            other_nvrtc.hash(),
        ];
        for (i, a) in hashes.iter().enumerate() {
            for b in &hashes[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(base.hash(), key("a", &options, GpuArch::HOPPER).hash());
        assert!(base.file_name().starts_with("rms_norm-sm_90-"));
    }

    #[test]
    fn stored_kernels_load_back_and_missing_ones_do_not() {
        let dir =
            std::env::temp_dir().join(format!("tandem-cuda-cache-test-{}", std::process::id()));
        let cache = KernelCache::new(&dir);
        let options = Vec::new();
        let present = key("present", &options, GpuArch::HOPPER);
        let absent = key("absent", &options, GpuArch::HOPPER);
        cache.store(&present, b"cubin bytes").unwrap();
        assert_eq!(cache.load(&present).as_deref(), Some(&b"cubin bytes"[..]));
        assert_eq!(cache.load(&absent), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
