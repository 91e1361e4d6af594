//! End-to-end behaviour of the engine on tiny random models written to disk:
//! agreement with an independent dense forward pass, and the paged, chunked,
//! batched machinery being invisible in the results.

use tandem_core::backend::RopeStyle;
use tandem_core::engine::{FinishReason, Request};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::{ModelConfig, RopeScaling};
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_core::Error;
use tandem_tests::dense_reference::dense_forward;
use tandem_tests::{cpu_engine, max_abs_diff, tiny, tiny_gguf};

/// Awkward lengths: not multiples of the block size (16) or of each other.
const PROMPT: [u32; 37] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 65, 66, 200, 201, 7, 8, 9, 10, 11, 250, 120, 45, 46, 47,
    48, 1, 2, 19, 18, 17, 16, 15, 14, 13, 260, 259, 258, 257,
];

/// A tiny model of every architecture variant (`SyntheticModel::preset`).
const TINY_PRESETS: [&str; 6] = [
    "tiny",
    "tiny-llama3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
];

#[test]
fn f32_models_match_the_dense_reference_at_every_position() {
    for name in TINY_PRESETS {
        let dir = tempfile::tempdir().unwrap();
        let model = SyntheticModel::preset(name, WeightFormat::F32, 1).unwrap();
        let files = tiny_gguf(dir.path(), &model);
        let mut engine = cpu_engine(&files, 64, 512);
        let got = engine.score(&PROMPT, 0).unwrap();
        let want = dense_forward(&model.config, &model.f32_tensors(), &PROMPT);
        let vocab = model.config.vocab_size;
        for (pos, (g, w)) in got.chunks(vocab).zip(&want).enumerate() {
            let diff = max_abs_diff(g, w);
            assert!(diff < 1e-3, "{name}, position {pos}: max |diff| {diff}");
        }
    }
}

#[test]
fn chunked_prefill_and_decode_give_the_same_logits_as_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_1, 2));
    let vocab = files.config.vocab_size;
    let whole = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
    // 5-token chunks cross block boundaries at different offsets.
    let chunked = cpu_engine(&files, 64, 5).score(&PROMPT, 0).unwrap();
    assert!(max_abs_diff(&whole, &chunked) < 1e-4);
    let tail = cpu_engine(&files, 64, 7).score(&PROMPT, 30).unwrap();
    assert!(max_abs_diff(&whole[30 * vocab..], &tail) < 1e-4);
}

#[test]
fn batching_is_invisible_in_greedy_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 3));
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| PROMPT[i * 3..(i * 3 + 4 + i * 5).min(PROMPT.len())].to_vec())
        .collect();
    let greedy = SamplingParams::default();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut e = cpu_engine(&files, 128, 512);
            let s = e
                .add_request(p.clone(), greedy.clone(), 6 + p.len() % 4, vec![])
                .unwrap();
            while e.has_work() {
                e.step().unwrap();
            }
            e.tokens(s).unwrap()[p.len()..].to_vec()
        })
        .collect();
    // All at once, with a small token budget so prefills are chunked and interleave with decodes.
    let mut e = cpu_engine(&files, 5 * 128, 9);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.add_request(p.clone(), greedy.clone(), 6 + p.len() % 4, vec![])
                .unwrap()
        })
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    for ((id, p), want) in ids.iter().zip(&prompts).zip(&alone) {
        assert_eq!(&e.tokens(*id).unwrap()[p.len()..], want.as_slice());
    }
    for id in ids {
        e.remove(id);
    }
    assert_eq!(e.kv_manager().num_used_blocks(), 0, "every block is freed");
}

#[test]
fn generation_stops_at_stop_tokens_and_max_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_0, 4));
    let mut e = cpu_engine(&files, 128, 512);
    let s = e
        .add_request(PROMPT[..10].to_vec(), SamplingParams::default(), 5, vec![])
        .unwrap();
    let mut events = Vec::new();
    while e.has_work() {
        events.extend(e.step().unwrap());
    }
    assert_eq!(events.len(), 5);
    assert_eq!(events[4].finished, Some(FinishReason::Length));
    // Stopping on the token greedy decoding produces second.
    let second = events[1].token;
    let s2 = e
        .add_request(
            PROMPT[..10].to_vec(),
            SamplingParams::default(),
            50,
            vec![second],
        )
        .unwrap();
    let mut n = 0;
    while e.has_work() {
        for ev in e.step().unwrap() {
            assert_eq!(ev.seq, s2);
            n += 1;
            if n == 2 {
                assert_eq!(ev.finished, Some(FinishReason::Stop));
            }
        }
    }
    assert_eq!(n, 2);
    assert!(e.is_finished(s));
}

#[test]
fn continuing_a_sequence_reuses_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F16, 5));
    let greedy = SamplingParams::default();
    // Turn 1 then turn 2 on one sequence...
    let mut e = cpu_engine(&files, 128, 512);
    let s = e
        .add_request(PROMPT[..12].to_vec(), greedy.clone(), 4, vec![])
        .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    e.extend(s, &PROMPT[20..30], 4).unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    let continued = e.tokens(s).unwrap().to_vec();
    // ...equals one request over the whole history.
    let mut fresh = cpu_engine(&files, 128, 512);
    let history = continued[..continued.len() - 4].to_vec();
    let f = fresh
        .add_request(history.clone(), greedy, 4, vec![])
        .unwrap();
    while fresh.has_work() {
        fresh.step().unwrap();
    }
    assert_eq!(fresh.tokens(f).unwrap(), continued.as_slice());
}

#[test]
fn seeded_sampling_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_1, 6));
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 1234,
        ..Default::default()
    };
    let run = || {
        let mut e = cpu_engine(&files, 128, 512);
        let s = e
            .add_request(PROMPT[..8].to_vec(), params.clone(), 12, vec![])
            .unwrap();
        while e.has_work() {
            e.step().unwrap();
        }
        e.tokens(s).unwrap().to_vec()
    };
    assert_eq!(run(), run());
}

#[test]
fn logit_bias_and_penalties_steer_generation_through_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_1, 6));
    let run = |params: SamplingParams| {
        let mut e = cpu_engine(&files, 128, 512);
        let s = e
            .add_request(PROMPT[..9].to_vec(), params, 10, vec![])
            .unwrap();
        while e.has_work() {
            e.step().unwrap();
        }
        e.tokens(s).unwrap()[9..].to_vec()
    };
    let plain = run(SamplingParams::default());
    // Banning the greedy first token changes the first token.
    let banned = run(SamplingParams {
        logit_bias: vec![(plain[0], -100.0)],
        ..Default::default()
    });
    assert_ne!(banned[0], plain[0]);
    assert!(!banned.contains(&plain[0]), "{banned:?}");
    // Forcing a token makes every step take it.
    let forced = run(SamplingParams {
        logit_bias: vec![(42, 100.0)],
        ..Default::default()
    });
    assert_eq!(forced, vec![42; 10]);
}

/// The penalized choice at each step equals the argmax of the raw logprobs
/// (which the engine reports) minus OpenAI's penalties over the tokens
/// generated so far; the prompt's tokens are not counted.
#[test]
fn frequency_and_presence_penalties_count_generated_tokens_only() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q4_1, 6));
    let vocab = files.config.vocab_size;
    let (frequency, presence) = (1.5f32, 0.75f32);
    let mut e = cpu_engine(&files, 128, 512);
    let prompt = PROMPT[..9].to_vec();
    let mut request = Request::new(
        prompt.clone(),
        SamplingParams {
            frequency_penalty: frequency,
            presence_penalty: presence,
            ..Default::default()
        },
        12,
    );
    request.logprobs = Some(vocab);
    let seq = e.submit(request).unwrap()[0];
    let mut events = Vec::new();
    while e.has_work() {
        events.extend(e.step().unwrap());
    }
    assert_eq!(events.len(), 12);
    let mut generated: Vec<u32> = Vec::new();
    for ev in events.iter().filter(|ev| ev.seq == seq) {
        let raw = &ev.logprobs.as_ref().unwrap().top;
        assert_eq!(raw.len(), vocab);
        let penalized = |&(t, lp): &(u32, f32)| {
            let count = generated.iter().filter(|&&g| g == t).count() as f32;
            let presence = if count > 0.0 { presence } else { 0.0 };
            (t, lp - count * frequency - presence)
        };
        let best = raw
            .iter()
            .map(penalized)
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
            .unwrap();
        assert_eq!(ev.token, best.0, "after {generated:?}");
        generated.push(ev.token);
    }
}

#[test]
fn bad_requests_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 7));
    let mut e = cpu_engine(&files, 1024, 512);
    let long = vec![1u32; files.config.max_context + 3];
    let err = e
        .add_request(long, SamplingParams::default(), 4, vec![])
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidRequest(_)) && err.to_string().contains("context"),
        "{err}"
    );
    let err = e
        .add_request(vec![], SamplingParams::default(), 4, vec![])
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    let err = e
        .add_request(vec![1, 100_000], SamplingParams::default(), 4, vec![])
        .unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let bad = SamplingParams {
        top_p: 7.0,
        ..Default::default()
    };
    assert!(e.add_request(vec![1, 2], bad, 4, vec![]).is_err());
    let bias_outside = SamplingParams {
        logit_bias: vec![(100_000, 1.0)],
        ..Default::default()
    };
    let err = e
        .add_request(vec![1, 2], bias_outside, 4, vec![])
        .unwrap_err();
    assert!(err.to_string().contains("logit_bias"), "{err}");
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
}

#[test]
fn random_full_size_shapes_are_described_without_allocating_f32_copies() {
    let m = SyntheticModel::preset("llama3-8b", WeightFormat::Q4_1, 0).unwrap();
    let bytes: usize = m
        .tensor_shapes()
        .iter()
        .map(|(_, s)| {
            let n: usize = s.iter().product();
            if s.len() == 1 {
                n * 4
            } else {
                n / 32 * 20
            }
        })
        .sum();
    assert!((4_500_000_000..5_500_000_000).contains(&bytes), "{bytes}");
    assert!(SyntheticModel::preset("nope", WeightFormat::F16, 0).is_err());
}

#[test]
fn gguf_and_hugging_face_files_of_one_model_give_the_same_logits() {
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let mut model = tiny(format, 8);
        model.config.tied_embeddings = format == WeightFormat::F16;
        let gguf = tiny_gguf(dir.path(), &model);
        let hf_dir = dir.path().join("hf");
        model.write_hf_dir(&hf_dir).unwrap();
        let hf = tandem_core::model::load(&hf_dir).unwrap();
        assert_eq!(hf.config.rope_style, RopeStyle::NeoX);
        assert_eq!(gguf.config.rope_style, RopeStyle::Interleaved);
        let text = "the inner heat of a tin can";
        let ids = gguf.tokenizer.encode(text, true).unwrap();
        assert_eq!(hf.tokenizer.encode(text, true).unwrap(), ids);
        let a = cpu_engine(&gguf, 64, 512).score(&ids, 0).unwrap();
        let b = cpu_engine(&hf, 64, 512).score(&ids, 0).unwrap();
        let diff = max_abs_diff(&a, &b);
        assert!(diff < 1e-4, "{format}: max |diff| {diff}");
    }
}

#[test]
fn every_architecture_loads_alike_from_gguf_and_hugging_face_files() {
    for name in TINY_PRESETS {
        for format in [WeightFormat::F32, WeightFormat::BF16] {
            let dir = tempfile::tempdir().unwrap();
            let model = SyntheticModel::preset(name, format, 11).unwrap();
            let gguf = tiny_gguf(dir.path(), &model);
            let hf_dir = dir.path().join("hf");
            model.write_hf_dir(&hf_dir).unwrap();
            let hf = tandem_core::model::load(&hf_dir).unwrap();
            // The files describe the same model; they differ in RoPE pairing
            // (llama.cpp permutes Llama's Q/K rows) and in how Llama 3's RoPE
            // scaling is written (GGUF: per-pair divisors).
            let comparable = |c: &ModelConfig| ModelConfig {
                rope_style: RopeStyle::NeoX,
                layers: Vec::new(),
                ..c.clone()
            };
            assert_eq!(comparable(&gguf.config), comparable(&hf.config), "{name}");
            assert_eq!(hf.config.layers, model.config.layers, "{name}: HF");
            match &gguf.config.layers[0].rope.scaling {
                RopeScaling::FreqFactors(f) => {
                    assert_eq!((name, f.len()), ("tiny-llama3", 8));
                }
                _ => assert_eq!(gguf.config, model.config, "{name}: GGUF"),
            }
            let a = cpu_engine(&gguf, 64, 512).score(&PROMPT, 0).unwrap();
            let b = cpu_engine(&hf, 64, 512).score(&PROMPT, 0).unwrap();
            let diff = max_abs_diff(&a, &b);
            assert!(diff < 1e-4, "{name} {format}: max |diff| {diff}");
        }
    }
}

#[test]
fn sliding_window_layers_forget_what_global_layers_remember() {
    // The logits at the last position depend on the first token only
    // through the global layers: with every layer local, changing it
    // changes nothing once it is out of every window.
    let mut local = SyntheticModel::preset("tiny-gemma3", WeightFormat::F32, 3).unwrap();
    let global = local.clone();
    for layer in &mut local.config.layers {
        layer.sliding_window = Some(5);
    }
    let mut other = PROMPT;
    other[0] = 42;
    let last = |model: &SyntheticModel, prompt: &[u32]| {
        let files = model.files().unwrap();
        let vocab = files.config.vocab_size;
        let logits = cpu_engine(&files, 64, 512).score(prompt, 0).unwrap();
        logits[logits.len() - vocab..].to_vec()
    };
    assert_eq!(last(&local, &PROMPT), last(&local, &other));
    assert!(max_abs_diff(&last(&global, &PROMPT), &last(&global, &other)) > 1e-4);
}

#[test]
fn fused_layers_give_the_unfused_bits() {
    // The CPU's fused matmuls run the unfused kernels' own arithmetic.
    tandem_tests::backend_e2e::fused_layers_match_the_unfused(
        || tandem_cpu::CpuBackend::new(2),
        0.0,
    );
}
