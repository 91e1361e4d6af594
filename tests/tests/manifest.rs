//! The kernel manifest is the single list of fused kernels: every entry has a
//! CPU implementation (a `Backend` method, checked by the compiler and run
//! here), a `shaders/NAME.wgsl` (or a WebGPU composition of other entries)
//! and a `kernels/NAME.cu`, and no shader or CUDA file exists without an
//! entry.

use std::collections::BTreeSet;
use std::path::Path;

use tandem_core::kernels::{MANIFEST, WEBGPU_COMPOSITIONS};

/// The `Backend` methods the manifest may name.
const BACKEND_KERNEL_METHODS: &[&str] = &[
    "embedding",
    "rms_norm",
    "rms_norm_residual",
    "matmul",
    "rope",
    "paged_kv_write",
    "paged_attention",
    "swiglu",
    "geglu",
    "scale",
    "gather_rows",
    "moe_route",
    "moe_combine",
    "argmax",
    "matmul_rms_norm",
    "matmul_glu",
    "matmul_residual",
    "mlp_residual",
    "select_kv_blocks",
];

fn files_with_extension(dir: &str, ext: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
    std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == ext).then(|| p.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect()
}

#[test]
fn names_are_unique_and_methods_exist() {
    let names: BTreeSet<_> = MANIFEST.iter().map(|k| k.name).collect();
    assert_eq!(names.len(), MANIFEST.len(), "duplicate manifest names");
    for k in MANIFEST {
        assert!(
            BACKEND_KERNEL_METHODS.contains(&k.method),
            "{}: unknown method {}",
            k.name,
            k.method
        );
        assert!(
            k.tolerance >= 0.0 && k.tolerance < 0.1,
            "{}: tolerance {}",
            k.name,
            k.tolerance
        );
    }
    for m in BACKEND_KERNEL_METHODS {
        assert!(
            MANIFEST.iter().any(|k| k.method == *m),
            "Backend::{m} has no manifest entry"
        );
    }
}

/// Checks that `dir/*.ext` holds exactly the manifest entries not in `composed`.
fn assert_one_file_per_entry(dir: &str, ext: &str, composed: &[(&str, &[&str])]) {
    let files = files_with_extension(dir, ext);
    let names: BTreeSet<String> = MANIFEST
        .iter()
        .filter(|k| !composed.iter().any(|(name, _)| *name == k.name))
        .map(|k| k.name.to_string())
        .collect();
    let missing: Vec<_> = names.difference(&files).collect();
    let stray: Vec<_> = files.difference(&names).collect();
    assert!(
        missing.is_empty(),
        "manifest entries without {dir}/NAME.{ext}: {missing:?}"
    );
    assert!(
        stray.is_empty(),
        "{dir}/*.{ext} files without a manifest entry: {stray:?}"
    );
}

#[test]
fn every_entry_has_a_wgsl_shader_or_a_composition() {
    assert_one_file_per_entry("shaders", "wgsl", WEBGPU_COMPOSITIONS);
    for (name, parts) in WEBGPU_COMPOSITIONS {
        assert!(
            MANIFEST.iter().any(|k| k.name == *name),
            "WebGPU composition of {name}, which is no manifest entry"
        );
        for part in *parts {
            assert!(
                MANIFEST.iter().any(|k| k.name == *part) && part != name,
                "{name}: its WebGPU part {part} is no other manifest entry"
            );
        }
    }
}

#[test]
fn every_entry_has_a_cuda_kernel() {
    assert_one_file_per_entry("kernels", "cu", &[]);
}
