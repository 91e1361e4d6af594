//! The whole model on the wgpu backend (lavapipe on machines without a GPU)
//! against the CPU backend: logits of a tiny random model over a 40-token
//! prompt and 20 single-token decode steps, and SmolLM2-135M's greedy output.

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::Backend;
use tandem_tests::{cpu_engine, max_abs_diff, smollm2_path, tiny, tiny_gguf};
use tandem_wgpu::{WgpuBackend, WgpuOptions};

fn wgpu_engine(
    files: &ModelFiles,
    tokens: usize,
    max_batch_tokens: usize,
    options: WgpuOptions,
) -> Engine<WgpuBackend> {
    let backend = WgpuBackend::new(options).unwrap_or_else(|e| {
        panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers` (make test does it)")
    });
    let config = EngineConfig {
        max_batch_tokens,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(tokens);
    Engine::new(backend, files, config, &mut |_, _| {}).expect("wgpu engine")
}

fn greedy<B: Backend>(engine: &mut Engine<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let seq = engine
        .add_request(prompt.to_vec(), SamplingParams::default(), n, vec![])
        .unwrap();
    while !engine.is_finished(seq) {
        engine.step().unwrap();
    }
    let out = engine.tokens(seq).unwrap()[prompt.len()..].to_vec();
    engine.remove(seq);
    out
}

#[test]
fn tiny_model_logits_match_the_cpu_over_prefill_and_decode() {
    for (format, f16_shaders, tolerance) in [
        (WeightFormat::F16, true, 2e-3),
        (WeightFormat::F32, false, 2e-3),
        (WeightFormat::Q8_0, true, 5e-2),
        (WeightFormat::Q4_1, false, 5e-2),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let files = tiny_gguf(dir.path(), &tiny(format, 11));
        let vocab = files.config.vocab_size;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 300).collect();
        let generated = greedy(&mut cpu_engine(&files, 128, 512), &prompt, 20);
        let options = WgpuOptions {
            disable_f16: !f16_shaders,
            ..Default::default()
        };
        let mut gpu = wgpu_engine(&files, 128, 512, options.clone());
        assert_eq!(
            greedy(&mut gpu, &prompt, 20),
            generated,
            "{format}: greedy tokens"
        );
        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let want = cpu_engine(&files, 128, 512).score(&all, 0).unwrap();
        // The prompt in one pass, then the 20 generated tokens one decode step at a time.
        let prefill = gpu.score(&all[..40], 0).unwrap();
        let decode = wgpu_engine(&files, 128, 1, options)
            .score(&all, 40)
            .unwrap();
        let d1 = max_abs_diff(&prefill, &want[..40 * vocab]);
        let d2 = max_abs_diff(&decode, &want[40 * vocab..]);
        assert!(
            d1 < tolerance && d2 < tolerance,
            "{format}: prefill diff {d1}, decode diff {d2}"
        );
    }
}

#[test]
fn smollm2_greedy_output_equals_the_cpu_backend() {
    let files = tandem_core::model::load(&smollm2_path()).unwrap();
    let mut cpu = cpu_engine(&files, 256, 512);
    let mut gpu = wgpu_engine(&files, 256, 512, WgpuOptions::default());
    for prompt in [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village,",
    ] {
        let ids = files.tokenizer.encode(prompt, true).unwrap();
        assert_eq!(
            greedy(&mut gpu, &ids, 16),
            greedy(&mut cpu, &ids, 16),
            "{prompt:?}"
        );
    }
}
