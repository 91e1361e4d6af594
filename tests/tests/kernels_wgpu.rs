//! The cross-backend kernel suite (`tandem_tests::conformance`) on the
//! default wgpu adapter — lavapipe on machines without a GPU — with every
//! shader variant the adapter allows: f16 and subgroups as available, each
//! turned off, and weights split into several buffers. Without an adapter the
//! tests fail and say how to install one; they never pass silently.

#[path = "../src/conformance.rs"]
mod conformance;

use tandem_wgpu::{GraphicsApi, WgpuBackend, WgpuOptions};

fn backend(options: WgpuOptions) -> WgpuBackend {
    match WgpuBackend::new(options) {
        Ok(b) => b,
        Err(e) => panic!(
            "{e}\nThe wgpu tests need an adapter. Without a GPU, install Mesa's software \
             Vulkan driver: `apt-get install mesa-vulkan-drivers` (`make test` does it).\n\
             Adapters found: {:#?}",
            tandem_wgpu::list_adapters()
        ),
    }
}

fn run(options: WgpuOptions) -> WgpuBackend {
    let b = backend(options);
    println!("adapter: {}", b.adapter());
    let report = conformance::run_conformance(&b);
    println!("{report}");
    let problems = report.problems();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    b
}

#[test]
fn kernels_match_cpu_with_every_feature_the_adapter_has() {
    let b = run(WgpuOptions::default());
    assert_eq!(b.uses_f16(), b.adapter().shader_f16);
    assert_eq!(b.uses_subgroups(), b.adapter().subgroups);
    if !b.uses_f16() || !b.uses_subgroups() {
        println!(
            "note: {} lacks {}; those shader paths were not run here",
            b.adapter().name,
            [(!b.uses_f16()).then_some("shader-f16"), (!b.uses_subgroups()).then_some("subgroups")]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" and ")
        );
    }
}

#[test]
fn kernels_match_cpu_without_f16() {
    let b = run(WgpuOptions {
        disable_f16: true,
        ..WgpuOptions::default()
    });
    assert!(!b.uses_f16());
}

#[test]
fn kernels_match_cpu_without_subgroups() {
    let b = run(WgpuOptions {
        disable_subgroups: true,
        ..WgpuOptions::default()
    });
    assert!(!b.uses_subgroups());
}

/// Chunks of at most 2 KiB split every test matrix into several buffers,
/// as a large weight is split by the adapter's storage binding limit.
#[test]
fn kernels_match_cpu_with_weights_split_into_chunks() {
    run(WgpuOptions {
        max_weight_chunk_bytes: Some(2048),
        ..WgpuOptions::default()
    });
}

/// wgpu's GL backend (no f16, no subgroups), where the machine has a GL
/// adapter that runs compute shaders (Mesa's llvmpipe does).
#[test]
fn kernels_match_cpu_on_gl() {
    let has_gl = tandem_wgpu::list_adapters()
        .iter()
        .any(|a| a.backend == "Gl" && a.compute);
    if !has_gl {
        println!("no GL adapter with compute shaders here: the GL run was not done");
        return;
    }
    run(WgpuOptions {
        api: Some(GraphicsApi::Gl),
        ..WgpuOptions::default()
    });
}

#[test]
fn list_adapters_reports_the_default_adapter() {
    let adapters = tandem_wgpu::list_adapters();
    for a in &adapters {
        println!("{a}");
    }
    let b = backend(WgpuOptions::default());
    assert!(
        adapters.iter().any(|a| a.name == b.adapter().name),
        "{} missing from {adapters:#?}",
        b.adapter().name
    );
}
