//! The cross-backend kernel suite (`tandem_tests::conformance`) on the default wgpu adapter — lavapipe
//! on machines without a GPU — with every shader variant the adapter allows:
//! f16 and subgroups as available, each turned off, and weights split into
//! several buffers; then long steps, and bad input. Without an adapter the
//! tests fail and say how to install one; they never pass silently.

use tandem_tests::conformance;

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
            [
                (!b.uses_f16()).then_some("shader-f16"),
                (!b.uses_subgroups()).then_some("subgroups")
            ]
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

/// Decode-sized matmuls take `gemv_rows` on CPU adapters (lavapipe) and
/// `gemv` on GPUs; the default run covers one, this the other.
#[test]
fn kernels_match_cpu_with_the_other_gemv_path() {
    let software = backend(WgpuOptions::default()).adapter().software;
    run(WgpuOptions {
        gemv_per_row: Some(!software),
        ..WgpuOptions::default()
    });
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
/// adapter that runs compute shaders (Mesa's llvmpipe does). Only with
/// `TANDEM_WGPU_GL=1`: on llvmpipe it takes minutes rather than seconds.
#[test]
fn kernels_match_cpu_on_gl_when_asked() {
    if std::env::var_os("TANDEM_WGPU_GL").is_none() {
        println!("GL run not done: set TANDEM_WGPU_GL=1 to run the suite on wgpu's GL backend");
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

/// More dispatches than one submit holds parameters for, with tensors
/// dropped and uploaded between them: recycled buffers and mid-step uploads
/// must not disturb the work already recorded.
#[test]
fn long_steps_with_recycled_buffers_stay_in_order() {
    use tandem_core::backend::Backend;

    fn chain<B: Backend>(be: &B, steps: usize) -> Vec<f32> {
        let len = 37;
        let mut a = be
            .upload(&(0..len).map(|i| i as f32 / 5.0 - 3.0).collect::<Vec<_>>())
            .unwrap();
        for step in 0..steps {
            // Uploaded while earlier steps are still only recorded.
            let up: Vec<f32> = (0..len)
                .map(|i| 1.0 + ((i + step) % 7) as f32 / 50.0)
                .collect();
            let up = be.upload(&up).unwrap();
            let mut next = be.alloc(len).unwrap();
            be.swiglu(&a, &up, len, &mut next).unwrap();
            a = next;
        }
        be.download(&a, len).unwrap()
    }

    let b = backend(WgpuOptions::default());
    let steps = 1500;
    let got = chain(&b, steps);
    let want = chain(&tandem_cpu::CpuBackend::new(1), steps);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "element {i}: {g} vs {w}"
        );
    }
}

/// Bad sizes and indices are errors that name the problem, never panics.
#[test]
fn bad_input_is_an_error() {
    use tandem_core::backend::{
        Backend, KvCacheLayout, KvDtype, MatmulParams, RopeParams, RopeStyle,
    };
    use tandem_core::quant::{WeightFormat, WeightView};

    let b = backend(WgpuOptions::default());
    let x = b.upload(&[1.0; 10]).unwrap();
    let mut out = b.alloc(4).unwrap();
    let data = vec![0u8; 4 * 4 * 5];
    let w = b
        .upload_weight(WeightView {
            format: WeightFormat::F32,
            rows: 4,
            cols: 5,
            data: &data,
        })
        .unwrap();
    let err = b
        .matmul(&x, &w, None, MatmulParams { rows: 3 }, &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("matmul x"), "{err}");

    let short = WeightView {
        format: WeightFormat::Q4_0,
        rows: 2,
        cols: 64,
        data: &[0u8; 10],
    };
    assert!(b.upload_weight(short).is_err());
    let ragged = WeightView {
        format: WeightFormat::Q8_0,
        rows: 2,
        cols: 40,
        data: &[0u8; 200],
    };
    assert!(b.upload_weight(ragged).is_err());

    let positions = b.upload_indices(&[0]).unwrap();
    let mut xs = b.upload(&[0.0; 8]).unwrap();
    let freq = b.upload(&[1.0; 4]).unwrap();
    let odd = RopeParams {
        rows: 1,
        heads: 1,
        head_dim: 8,
        rotary_dim: 3,
        style: RopeStyle::NeoX,
    };
    assert!(b.rope(&mut xs, &positions, &freq, odd).is_err());

    let mut cache = b
        .alloc_kv_cache(KvCacheLayout {
            num_blocks: 2,
            block_size: 4,
            kv_heads: 1,
            head_dim: 8,
            keys: KvDtype::F16,
            values: KvDtype::F16,
        })
        .unwrap();
    let err = b.copy_kv_blocks(&mut cache, &[(0, 2)]).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let err = b.download(&out, 5).unwrap_err();
    assert!(err.to_string().contains("download"), "{err}");
}

/// A table larger than one storage binding (Qwen2.5-0.5B's Q8_0
/// output.weight is 145 MB, the browser binds 128 MiB) is split by rows into
/// chunks: the lookup and the tied output matmul must read across every
/// chunk. The binding limit is lowered here so a small table takes that
/// path, with rows whose bytes are not a multiple of 4 (Q5_0, Q6_K) and
/// tokens on both sides of every chunk boundary.
#[test]
fn embedding_and_tied_output_read_a_table_split_across_bindings() {
    use tandem_core::backend::{Backend, MatmulParams};
    use tandem_core::kernels::{matmul_kernel_name, spec};
    use tandem_core::quant::{quantize_matrix, WeightFormat, WeightView};

    fn embed<B: Backend>(be: &B, table: &B::Weight, tokens: &[u32], dim: usize) -> Vec<f32> {
        let ids = be.upload_indices(tokens).unwrap();
        let mut out = be.alloc(tokens.len() * dim).unwrap();
        be.embedding(table, &ids, tokens.len(), &mut out).unwrap();
        be.download(&out, tokens.len() * dim).unwrap()
    }

    fn logits<B: Backend>(
        be: &B,
        table: &B::Weight,
        x: &[f32],
        rows: usize,
        vocab: usize,
    ) -> Vec<f32> {
        let xs = be.upload(x).unwrap();
        let mut out = be.alloc(rows * vocab).unwrap();
        be.matmul(&xs, table, None, MatmulParams { rows }, &mut out)
            .unwrap();
        be.download(&out, rows * vocab).unwrap()
    }

    let chunk_bytes = 64 * 1024;
    let gpu = backend(WgpuOptions {
        max_weight_chunk_bytes: Some(chunk_bytes),
        ..WgpuOptions::default()
    });
    let cpu = tandem_cpu::CpuBackend::new(1);
    let vocab = 1000;
    for (format, dim) in [
        (WeightFormat::Q8_0, 896),
        (WeightFormat::Q5_0, 864),
        (WeightFormat::Q6_K, 768),
    ] {
        let values: Vec<f32> = (0..vocab * dim)
            .map(|i| ((i * 7919 % 2003) as f32 / 1001.5 - 1.0) * (1.0 + (i / dim % 5) as f32))
            .collect();
        let bytes = quantize_matrix(format, dim, &values);
        let view = WeightView {
            format,
            rows: vocab,
            cols: dim,
            data: &bytes,
        };
        let rows_per_chunk = chunk_bytes as usize / format.row_bytes(dim).unwrap();
        assert!(
            vocab > 3 * rows_per_chunk,
            "{format}: the table must span chunks"
        );
        let mut tokens = vec![0, vocab as u32 - 1];
        for start in (rows_per_chunk..vocab).step_by(rows_per_chunk) {
            tokens.extend([start as u32 - 1, start as u32]);
        }
        let g_table = gpu.upload_weight(view).unwrap();
        let c_table = cpu.upload_weight(view).unwrap();

        let got = embed(&gpu, &g_table, &tokens, dim);
        let want = embed(&cpu, &c_table, &tokens, dim);
        let tolerance = spec("embedding").unwrap().tolerance;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tolerance * (1.0 + w.abs()),
                "{format} embedding of token {} column {}: {g} vs {w}",
                tokens[i / dim],
                i % dim
            );
        }

        // The tied output: logits over the whole vocabulary, decode and prefill.
        let tolerance = spec(matmul_kernel_name(format)).unwrap().tolerance;
        for rows in [1, 17] {
            // Multiples of 1/128 reaching 127/128 in every block of 32: exact
            // in the Q8 activations a CPU matmul may use.
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| match i % 32 {
                    0 => 127.0 / 128.0,
                    _ => ((i * 31 % 255) as f32 - 127.0) / 128.0,
                })
                .collect();
            let got = logits(&gpu, &g_table, &x, rows, vocab);
            let want = logits(&cpu, &c_table, &x, rows, vocab);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= tolerance * (1.0 + w.abs()),
                    "{format} {rows}-row logits, row {} token {}: {g} vs {w}",
                    i / vocab,
                    i % vocab
                );
            }
        }
    }
}
