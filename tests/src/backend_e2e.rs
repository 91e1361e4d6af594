//! End-to-end checks of a GPU backend against the CPU backend, written once
//! and instantiated per backend (`tests/tests/end_to_end_{wgpu,cuda}.rs`):
//! logits of tiny random models over a 40-token prompt and 20 single-token
//! decode steps, and SmolLM2-135M's greedy output for three prompts.

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::Backend;

use crate::kquant_moe::{q4_k_m_gguf, widened_moe, KQUANT_MOE_PRESETS};
use crate::{cpu_engine, max_abs_diff, smollm2_path, tiny, tiny_gguf};

/// An engine on the backend under test with room for `tokens` tokens.
pub fn engine_on<B: Backend>(
    backend: B,
    files: &ModelFiles,
    tokens: usize,
    max_batch_tokens: usize,
) -> Engine<B> {
    let config = EngineConfig {
        max_batch_tokens,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(tokens);
    Engine::new(backend, files, config, &mut |_, _| {}).expect("engine on the backend under test")
}

/// `n` greedy tokens after `prompt`.
pub fn greedy<B: Backend>(engine: &mut Engine<B>, prompt: &[u32], n: usize) -> Vec<u32> {
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

/// Tiny random models in several formats: greedy tokens equal the CPU's, and
/// logits of the prompt (one pass) and of 20 single-token decode steps agree
/// within `tolerance(format)`. `make_backend(format)` opens the backend (it
/// may pick a shader variant per case).
pub fn tiny_models_match_the_cpu<B: Backend>(
    formats: &[WeightFormat],
    make_backend: impl Fn(WeightFormat) -> B,
    tolerance: impl Fn(WeightFormat) -> f32,
) {
    for &format in formats {
        let dir = tempfile::tempdir().unwrap();
        let files = tiny_gguf(dir.path(), &tiny(format, 11));
        let vocab = files.config.vocab_size;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 300).collect();
        let generated = greedy(&mut cpu_engine(&files, 128, 512), &prompt, 20);
        let mut gpu = engine_on(make_backend(format), &files, 128, 512);
        assert_eq!(
            greedy(&mut gpu, &prompt, 20),
            generated,
            "{format}: greedy tokens"
        );
        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let want = cpu_engine(&files, 128, 512).score(&all, 0).unwrap();
        let prefill = gpu.score(&all[..40], 0).unwrap();
        let decode = engine_on(make_backend(format), &files, 128, 1)
            .score(&all, 40)
            .unwrap();
        let d1 = max_abs_diff(&prefill, &want[..40 * vocab]);
        let d2 = max_abs_diff(&decode, &want[40 * vocab..]);
        let tol = tolerance(format);
        assert!(
            d1 < tol && d2 < tol,
            "{format}: prefill diff {d1}, decode diff {d2} (tolerance {tol})"
        );
    }
}

/// The tiny Mixture-of-Experts model of every MoE family (F16 experts):
/// greedy tokens and the logits of prompt and generated tokens equal the
/// CPU's within `tolerance`.
pub fn moe_models_match_the_cpu<B: Backend>(make_backend: impl Fn() -> B, tolerance: f32) {
    let presets = [
        "tiny-mixtral",
        "tiny-qwen2moe",
        "tiny-qwen3moe",
        "tiny-olmoe",
        "tiny-granitemoe",
    ];
    for name in presets {
        let dir = tempfile::tempdir().unwrap();
        let model = SyntheticModel::preset(name, WeightFormat::F16, 13).unwrap();
        let files = tiny_gguf(dir.path(), &model);
        moe_model_matches_the_cpu(make_backend(), &files, name, tolerance);
    }
}

/// MoE models 256 wide with k-quant experts in llama.cpp's Q4_K_M mix
/// (`kquant_moe`): as [`moe_models_match_the_cpu`].
pub fn kquant_moe_models_match_the_cpu<B: Backend>(make_backend: impl Fn() -> B, tolerance: f32) {
    for name in KQUANT_MOE_PRESETS {
        let dir = tempfile::tempdir().unwrap();
        let files = q4_k_m_gguf(dir.path(), &widened_moe(name, 13));
        moe_model_matches_the_cpu(make_backend(), &files, name, tolerance);
    }
}

/// Greedy tokens equal the CPU's, and the logits of prompt and generated
/// tokens within `tolerance`.
fn moe_model_matches_the_cpu<B: Backend>(
    backend: B,
    files: &ModelFiles,
    name: &str,
    tolerance: f32,
) {
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 300).collect();
    let generated = greedy(&mut cpu_engine(files, 64, 512), &prompt, 8);
    let mut gpu = engine_on(backend, files, 64, 512);
    assert_eq!(
        greedy(&mut gpu, &prompt, 8),
        generated,
        "{name}: greedy tokens"
    );
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let want = cpu_engine(files, 64, 512).score(&all, 0).unwrap();
    let got = gpu.score(&all, 0).unwrap();
    let diff = max_abs_diff(&got, &want);
    assert!(diff < tolerance, "{name}: max |diff| {diff}");
}

/// SmolLM2-135M: 16 greedy tokens for three prompts equal the CPU backend's.
pub fn smollm2_greedy_matches_the_cpu<B: Backend>(backend: B) {
    let files = tandem_core::model::load(&smollm2_path()).unwrap();
    let mut cpu = cpu_engine(&files, 256, 512);
    let mut gpu = engine_on(backend, &files, 256, 512);
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

/// Engines of `capacity` tokens on `make_backend()`, one with the fused
/// layers (the default) and one `unfused`.
pub fn fused_and_unfused<B: Backend>(
    make_backend: impl Fn() -> B,
    files: &ModelFiles,
    capacity: usize,
) -> (Engine<B>, Engine<B>) {
    let engine = |unfused| {
        let config = EngineConfig {
            unfused,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(capacity);
        Engine::new(make_backend(), files, config, &mut |_, _| {}).expect("engine")
    };
    (engine(false), engine(true))
}

/// Fused matmuls (concatenated Q/K/V and gate/up with the norm as prologue,
/// the activation and residual add as epilogues) against the unfused
/// kernels on the same backend, on a tiny model of every architecture,
/// the MoE families and the k-quant mix (where gate and up differ in
/// format and stay separate): greedy tokens are identical and the logits
/// of prompt and generated tokens agree within `tolerance`. The backend
/// must fuse, or the test would compare the unfused path with itself.
pub fn fused_layers_match_the_unfused<B: Backend>(make_backend: impl Fn() -> B, tolerance: f32) {
    assert!(
        make_backend().fuses_matmuls(),
        "the backend has no fused matmuls"
    );
    let dense = [
        "tiny",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
    ];
    let moe = [
        "tiny-mixtral",
        "tiny-qwen2moe",
        "tiny-qwen3moe",
        "tiny-olmoe",
        "tiny-granitemoe",
    ];
    let prompt: Vec<u32> = (0..23).map(|i| (i * 41 + 5) % 300).collect();
    let check = |name: &str, files: &ModelFiles| {
        let (mut fused, mut unfused) = fused_and_unfused(&make_backend, files, 64);
        let generated = greedy(&mut unfused, &prompt, 10);
        assert_eq!(
            greedy(&mut fused, &prompt, 10),
            generated,
            "{name}: greedy tokens"
        );
        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let want = unfused.score(&all, 0).unwrap();
        let got = fused.score(&all, 0).unwrap();
        let diff = max_abs_diff(&got, &want);
        assert!(
            diff <= tolerance,
            "{name}: max |diff| {diff} (tolerance {tolerance})"
        );
    };
    for (i, name) in dense.iter().chain(&moe).enumerate() {
        let format = if i % 2 == 0 {
            WeightFormat::Q8_0
        } else {
            WeightFormat::F16
        };
        let dir = tempfile::tempdir().unwrap();
        let files = tiny_gguf(
            dir.path(),
            &SyntheticModel::preset(name, format, 17).unwrap(),
        );
        check(&format!("{name} {format}"), &files);
    }
    for name in KQUANT_MOE_PRESETS {
        let dir = tempfile::tempdir().unwrap();
        let files = q4_k_m_gguf(dir.path(), &widened_moe(name, 17));
        check(&format!("{name} Q4_K_M"), &files);
    }
}

/// Kernel launches per decoded token of the fused and the unfused layers
/// (`Backend::kernel_launches`), over 8 greedy decode steps of a tiny
/// Llama-style model, with its number of layers.
pub fn decode_launches_fused_and_unfused<B: Backend>(
    make_backend: impl Fn() -> B,
) -> (f64, f64, usize) {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 3));
    let prompt: Vec<u32> = (0..9).map(|i| (i * 29 + 3) % 300).collect();
    let per_token = |unfused| {
        let config = EngineConfig {
            unfused,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(64);
        let mut engine = Engine::new(make_backend(), &files, config, &mut |_, _| {}).unwrap();
        let seq = engine
            .add_request(prompt.clone(), SamplingParams::default(), 9, vec![])
            .unwrap();
        // The first step is the prefill; the rest decode one token each.
        engine.step().unwrap();
        let before = engine
            .backend()
            .kernel_launches()
            .expect("the backend counts launches");
        let mut steps = 0;
        while !engine.is_finished(seq) {
            engine.step().unwrap();
            steps += 1;
        }
        let after = engine.backend().kernel_launches().unwrap();
        (after - before) as f64 / steps as f64
    };
    (per_token(false), per_token(true), files.config.num_layers)
}

/// Sparse self-speculation on the backend under test: the greedy tokens of
/// its own plain decoding, for prompts of 19 and 11 KV blocks of which a
/// draft reads 7 (its selection kernel and key bounds on the device), no
/// block leaked.
pub fn sparse_speculation_keeps_the_greedy_output<B: Backend>(make_backend: impl Fn() -> B) {
    use tandem_core::spec::{DraftLength, SparseDraft};
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 17));
    let prompts: Vec<Vec<u32>> = [301u32, 170]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 113 + n) % 317).collect())
        .collect();
    let mut plain = engine_on(make_backend(), &files, 2048, 96);
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut plain, p, 24)).collect();
    let mut sparse = engine_on(make_backend(), &files, 2048, 96);
    let draft = SparseDraft::new(2).unwrap();
    sparse
        .set_speculation(Box::new(draft), DraftLength::Fixed(4))
        .unwrap();
    let got: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut sparse, p, 24)).collect();
    assert_eq!(got, want);
    assert_drafted_without_leaks(&sparse);
}

/// `engine`'s proposer drafted, some drafts were accepted, and with its
/// requests done no KV block is left in use.
fn assert_drafted_without_leaks<B: Backend>(engine: &Engine<B>) {
    let stats = engine.stats().speculation;
    assert!(
        stats.proposed_tokens > 0 && stats.accepted_tokens > 0,
        "{stats:?}"
    );
    assert_eq!(engine.kv_manager().num_used_blocks(), 0);
}

/// An EAGLE head on the backend under test, drafting for the target there:
/// the target's greedy tokens with drafts accepted, no block leaked; and
/// the head's logits from the target's hidden states as the CPU's within
/// `tolerance`.
pub fn eagle_head_keeps_the_greedy_output<B: Backend>(
    make_backend: impl Fn() -> B,
    tolerance: f32,
) {
    use crate::distilled::{draft, Distilled};
    use tandem_core::spec::{DraftLength, DraftModelConfig, EagleDraft};
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 19));
    let stem: Vec<u32> = (0..12).map(|i| (i * 41 + 3) % 317).collect();
    let head = draft(&target, &dir.path().join("eagle"), Distilled::Eagle, &stem);
    let config = DraftModelConfig {
        block_size: 16,
        capacity_tokens: 1024,
        kv_dtype: Default::default(),
        max_batch_tokens: 64,
        cascade: None,
    };
    let hidden = target.config.hidden_size;
    let prompts = [stem.clone(), stem[..7].to_vec()];
    let mut plain = engine_on(make_backend(), &target, 1024, 64);
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut plain, p, 20)).collect();
    let mut engine = engine_on(make_backend(), &target, 1024, 64);
    let eagle = EagleDraft::load(engine.backend(), &head, hidden, config.clone()).unwrap();
    engine
        .set_speculation(Box::new(eagle), DraftLength::Fixed(3))
        .unwrap();
    let got: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut engine, p, 20)).collect();
    assert_eq!(got, want);
    assert_drafted_without_leaks(&engine);

    let mut cpu = cpu_engine(&target, 256, 64);
    let (_, states) = cpu.score_hidden(&stem).unwrap();
    let cpu_backend = tandem_cpu::CpuBackend::new(1);
    let mut on_cpu = EagleDraft::load(&cpu_backend, &head, hidden, config.clone()).unwrap();
    let backend = make_backend();
    let mut on_backend = EagleDraft::load(&backend, &head, hidden, config).unwrap();
    let diff = max_abs_diff(
        &on_backend.score(&backend, &stem, &states).unwrap(),
        &on_cpu.score(&cpu_backend, &stem, &states).unwrap(),
    );
    assert!(diff < tolerance, "the head's logits differ by {diff}");
}
