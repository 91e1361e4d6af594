//! The whole model on the wgpu backend (lavapipe on machines without a GPU)
//! against the CPU backend (`tandem_tests::backend_e2e`), with the f16 and
//! f32 shader paths.

use tandem_core::quant::WeightFormat;
use tandem_tests::backend_e2e;
use tandem_wgpu::{WgpuBackend, WgpuOptions};

fn backend(options: WgpuOptions) -> WgpuBackend {
    WgpuBackend::new(options).unwrap_or_else(|e| {
        panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers` (make test does it)")
    })
}

#[test]
fn tiny_model_logits_match_the_cpu_over_prefill_and_decode() {
    // Alternate the f16 and f32 shader paths across formats.
    let formats = [
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
    ];
    backend_e2e::tiny_models_match_the_cpu(
        &formats,
        |format| {
            backend(WgpuOptions {
                disable_f16: matches!(format, WeightFormat::F32 | WeightFormat::Q4_1),
                ..Default::default()
            })
        },
        |format| if format.is_quantized() { 1e-2 } else { 2e-3 },
    );
}

#[test]
fn moe_models_match_the_cpu() {
    backend_e2e::moe_models_match_the_cpu(|| backend(WgpuOptions::default()), 2e-3);
}

#[test]
fn kquant_moe_models_match_the_cpu() {
    backend_e2e::kquant_moe_models_match_the_cpu(|| backend(WgpuOptions::default()), 2e-3);
}

#[test]
fn smollm2_greedy_output_equals_the_cpu_backend() {
    backend_e2e::smollm2_greedy_matches_the_cpu(backend(WgpuOptions::default()));
}

#[test]
fn fused_layers_match_the_unfused() {
    backend_e2e::fused_layers_match_the_unfused(|| backend(WgpuOptions::default()), 2e-3);
}

/// Decode launches per layer, fused against unfused: six fewer on the GPU
/// path (`gemv`); four on the CPU adapters' (`gemv_rows`), where the two
/// norm prologues run as `rms_norm` first.
#[test]
fn fused_decode_launches_fewer_kernels_per_layer() {
    for (gemv_per_row, fewer) in [(false, 6.0), (true, 4.0)] {
        let (fused, unfused, layers) = backend_e2e::decode_launches_fused_and_unfused(|| {
            backend(WgpuOptions {
                gemv_per_row: Some(gemv_per_row),
                ..Default::default()
            })
        });
        eprintln!(
            "gemv_per_row {gemv_per_row}: launches per token fused {fused}, unfused {unfused}, {layers} layers"
        );
        assert!(
            unfused - fused >= fewer * layers as f64,
            "gemv_per_row {gemv_per_row}: fused {fused}, unfused {unfused}"
        );
    }
}

#[test]
fn eagle_head_keeps_the_greedy_output() {
    backend_e2e::eagle_head_keeps_the_greedy_output(|| backend(WgpuOptions::default()), 2e-3);
}

#[test]
fn sparse_speculation_keeps_the_greedy_output() {
    backend_e2e::sparse_speculation_keeps_the_greedy_output(|| backend(WgpuOptions::default()));
}
