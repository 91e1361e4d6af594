//! The CUDA kernels compile on every machine, GPU or not: each
//! `kernels/*.cu` goes through NVRTC for `sm_90` (H100/H200) to CUBIN, the
//! same path `tandem-cuda` takes at run time, and ptxas's figures are checked.
//! A compile error, an instruction ptxas rejects, a register spill, a
//! manifest entry without a `.cu` file or a `.cu` file without a manifest
//! entry fails the suite.
//!
//! NVRTC comes from the system, or from the NVIDIA wheel that
//! `scripts/install-nvrtc.sh` puts under `.tools/` (`make test` runs it).
//! Without NVRTC the compile tests fail when `CI` is set and otherwise say
//! loudly that they were skipped.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_core::kernels::MANIFEST;
use tandem_cuda::nvrtc::{self, CompileOptions, FunctionUsage, GpuArch};
use tandem_cuda::sources;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lies in the repository")
        .to_path_buf()
}

fn kernels_dir() -> PathBuf {
    repo_root().join("kernels")
}

/// Stems of the `.cu` files in `kernels/`.
fn cu_files() -> BTreeSet<String> {
    std::fs::read_dir(kernels_dir())
        .expect("read kernels/")
        .map(|entry| entry.expect("read kernels/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
        .map(|path| {
            path.file_stem()
                .expect("file stem")
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// True when NVRTC is loaded. Otherwise fails under CI and prints a SKIPPED
/// line naming the install script elsewhere.
fn nvrtc_or_skip(test: &str) -> bool {
    let wheel = repo_root().join(nvrtc::WHEEL_LIB_DIR);
    if nvrtc::nvrtc_available() || nvrtc::load_nvrtc_from(&wheel).is_ok() {
        return true;
    }
    let message = format!(
        "NVRTC (libnvrtc.so.13) not found on the library path or in {}: run scripts/install-nvrtc.sh",
        wheel.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{test}: {message} (CI is set, so this is a failure)");
    }
    // Straight to stderr: libtest captures `eprintln!` of passing tests.
    let _ = writeln!(
        std::io::stderr(),
        "\n******** SKIPPED {test}: {message} ********\n"
    );
    false
}

fn hopper_with_ptxas_figures() -> CompileOptions {
    let mut options = CompileOptions::new(GpuArch::HOPPER);
    options.ptxas_verbose = true;
    options
}

#[test]
fn kernel_files_match_the_manifest() {
    let files = cu_files();
    let manifest: BTreeSet<String> = MANIFEST.iter().map(|k| k.name.to_string()).collect();
    let missing: Vec<&String> = manifest.difference(&files).collect();
    let stray: Vec<&String> = files.difference(&manifest).collect();
    assert!(
        missing.is_empty() && stray.is_empty(),
        "kernels/ out of step with the manifest: missing .cu for {missing:?}, stray .cu files {stray:?}"
    );
    for file in sources::KERNEL_FILES {
        let on_disk = std::fs::read_to_string(kernels_dir().join(format!("{}.cu", file.name)))
            .expect("read kernel file");
        assert_eq!(
            on_disk, file.source,
            "{}.cu differs from the copy embedded in tandem-cuda",
            file.name
        );
    }
}

#[test]
fn every_kernel_compiles_for_sm_90_without_spills() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm_90_without_spills") {
        return;
    }
    let units: Vec<(String, String)> = cu_files()
        .into_iter()
        .map(|name| {
            let path = kernels_dir().join(format!("{name}.cu"));
            let text = std::fs::read_to_string(&path).expect("read kernel file");
            let unit = sources::translation_unit(&name, &text);
            (name, unit)
        })
        .collect();
    let mut problems = Vec::new();
    let mut table = Vec::new();
    for (name, compiled) in compile_in_parallel(&units) {
        let compiled = match compiled {
            Ok(compiled) => compiled,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        assert!(!compiled.cubin.is_empty(), "{name}.cu: empty CUBIN");
        let usage = nvrtc::parse_ptxas_usage(&compiled.log);
        if usage.is_empty() {
            problems.push(format!(
                "{name}.cu: no ptxas figures in the log:\n{}",
                compiled.log
            ));
        }
        for f in &usage {
            if f.spills() {
                problems.push(format!(
                    "{name}.cu: {} spills ({} bytes stores, {} bytes loads, {} registers)",
                    f.name, f.spill_store_bytes, f.spill_load_bytes, f.registers
                ));
            }
        }
        table.extend(usage.into_iter().map(|f| (name.clone(), f)));
    }
    print_usage_table(&table);
    assert!(
        problems.is_empty(),
        "kernel compilation problems:\n{}",
        problems.join("\n")
    );
}

/// Each `(name, unit)` compiled for sm_90, one NVRTC call per core at a time
/// (the fused matmul files take minutes each), results in input order.
fn compile_in_parallel(
    units: &[(String, String)],
) -> Vec<(String, Result<nvrtc::CompiledKernel, String>)> {
    let options = hopper_with_ptxas_figures();
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut results: Vec<(usize, Result<nvrtc::CompiledKernel, String>)> =
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.min(units.len()))
                .map(|_| {
                    s.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some((name, unit)) = units.get(i) else {
                                return done;
                            };
                            done.push((
                                i,
                                nvrtc::compile(name, unit, &options).map_err(|e| e.to_string()),
                            ));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("compile worker panicked"))
                .collect()
        });
    results.sort_by_key(|(i, _)| *i);
    results
        .into_iter()
        .map(|(i, r)| (units[i].0.clone(), r))
        .collect()
}

fn print_usage_table(table: &[(String, FunctionUsage)]) {
    println!(
        "ptxas figures for sm_90 (kernel file, function, registers, stack, spill stores/loads):"
    );
    for (file, f) in table {
        println!(
            "  {file:<18} {:<32} {:>3} regs  {:>3} B stack  {}/{} B spill",
            f.name, f.registers, f.stack_frame_bytes, f.spill_store_bytes, f.spill_load_bytes
        );
    }
}

#[test]
fn a_broken_kernel_is_a_compile_error() {
    if !nvrtc_or_skip("a_broken_kernel_is_a_compile_error") {
        return;
    }
    let options = hopper_with_ptxas_figures();
    let front_end = "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }";
    let err = nvrtc::compile("broken", front_end, &options)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("undefined_name"),
        "expected the compile error to name the identifier, got {err:?}"
    );

    // An instruction ptxas does not know fails too (it only reaches ptxas
    // because NVRTC passes inline assembly through unchecked).
    let back_end =
        "extern \"C\" __global__ void broken(float* x) { asm volatile(\"not.an.instruction;\"); }";
    assert!(
        nvrtc::compile("broken", back_end, &options).is_err(),
        "an unknown PTX instruction compiled"
    );
}

#[test]
fn the_header_is_pasted_into_every_kernel() {
    for file in sources::KERNEL_FILES {
        let unit = sources::translation_unit(file.name, file.source);
        assert!(
            unit.contains("#line 1 \"common.cuh\""),
            "{}.cu does not include common.cuh",
            file.name
        );
        assert!(
            !unit
                .lines()
                .any(|line| line.trim_start().starts_with("#include")),
            "{}.cu includes a header NVRTC would not find",
            file.name
        );
    }
}
