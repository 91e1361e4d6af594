//! Mixture-of-Experts models end to end, on tiny random models of every MoE
//! family (`tiny-mixtral`, `tiny-qwen2moe`, `tiny-qwen3moe`, `tiny-olmoe`,
//! `tiny-granitemoe`): GGUF (llama.cpp's stacked experts) and Hugging Face
//! directories (one tensor per expert, Granite's stacked) give the same
//! logits, the CPU matches the independent NumPy reference
//! (`tests/reference/moe_reference.py`), batching, chunking and the prefix
//! cache are invisible, and bad files fail naming the key or tensor.

use tandem_core::model::gguf::{GgufFile, GgufValue, GgufWriter};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelConfig;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_tests::kquant_moe::{
    moe_reference_logits, q4_k_m_gguf, widened_moe, KQUANT_MOE_PRESETS,
};
use tandem_tests::{cpu_engine, max_abs_diff, tiny_gguf};

const MOE_PRESETS: [&str; 5] = [
    "tiny-mixtral",
    "tiny-qwen2moe",
    "tiny-qwen3moe",
    "tiny-olmoe",
    "tiny-granitemoe",
];

/// Awkward length: not a multiple of the block size (16).
const PROMPT: [u32; 23] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 65, 66, 200, 201, 7, 8, 9, 10, 11, 250, 120, 45, 46, 47,
];

#[test]
fn every_moe_family_loads_alike_from_gguf_and_hugging_face_files() {
    for name in MOE_PRESETS {
        for format in [WeightFormat::F32, WeightFormat::BF16] {
            let dir = tempfile::tempdir().unwrap();
            let model = SyntheticModel::preset(name, format, 11).unwrap();
            let gguf = tiny_gguf(dir.path(), &model);
            let hf_dir = dir.path().join("hf");
            model.write_hf_dir(&hf_dir).unwrap();
            let hf = tandem_core::model::load(&hf_dir).unwrap();
            assert_eq!(gguf.config, model.config, "{name}: GGUF");
            let comparable = |c: &ModelConfig| ModelConfig {
                rope_style: model.config.rope_style,
                ..c.clone()
            };
            assert_eq!(comparable(&hf.config), model.config, "{name}: HF");
            let a = cpu_engine(&gguf, 64, 512).score(&PROMPT, 0).unwrap();
            let b = cpu_engine(&hf, 64, 512).score(&PROMPT, 0).unwrap();
            let diff = max_abs_diff(&a, &b);
            assert!(diff < 1e-4, "{name} {format}: max |diff| {diff}");
        }
    }
}

/// The CPU logits of every position against `moe_reference.py`, which
/// reads the GGUF file with the `gguf` package and routes with its own code.
#[test]
fn moe_logits_match_the_numpy_reference() {
    for (name, format) in [
        ("tiny-mixtral", WeightFormat::F32),
        ("tiny-qwen2moe", WeightFormat::Q8_0),
        ("tiny-qwen3moe", WeightFormat::F16),
        ("tiny-olmoe", WeightFormat::Q4_0),
        ("tiny-granitemoe", WeightFormat::F32),
        ("tiny-mixtral", WeightFormat::Q4_1),
        ("tiny-qwen3moe", WeightFormat::Q5_0),
        ("tiny-olmoe", WeightFormat::Q5_1),
        ("tiny-qwen2moe", WeightFormat::BF16),
        ("tiny-granitemoe", WeightFormat::IQ4_NL),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = SyntheticModel::preset(name, format, 5).unwrap();
        let files = tiny_gguf(dir.path(), &model);
        let got = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
        let want = moe_reference_logits(&dir.path().join("tiny.gguf"), &PROMPT);
        assert_eq!(want.len(), got.len(), "{name}");
        // Quantized activations apart (none here), f32 against f64.
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 2e-3, "{name} {format}: max |diff| {diff}");
    }
}

/// Experts in k-quants, mixed as llama.cpp's Q4_K_M does (Q4_K and Q6_K,
/// Q5_0 and Q8_0 where a row is not whole 256-element super-blocks), on
/// models 256 wide: the CPU logits against the NumPy reference.
#[test]
fn k_quant_experts_match_the_numpy_reference() {
    let mut expert_formats = std::collections::BTreeSet::new();
    for name in KQUANT_MOE_PRESETS {
        let dir = tempfile::tempdir().unwrap();
        let files = q4_k_m_gguf(dir.path(), &widened_moe(name, 17));
        expert_formats.extend(
            files
                .tensors
                .tensors()
                .iter()
                .filter(|t| t.name.contains("_exps") || t.name.contains("_shexp"))
                .map(|t| t.format.to_string()),
        );
        let got = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
        let want = moe_reference_logits(&dir.path().join("model.gguf"), &PROMPT);
        assert_eq!(want.len(), got.len(), "{name}");
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 2e-3, "{name}: max |diff| {diff}");
    }
    let want = ["Q4_K", "Q5_0", "Q6_K", "Q8_0"].map(String::from);
    assert!(
        want.iter().all(|f| expert_formats.contains(f)),
        "expert formats {expert_formats:?}"
    );
}

#[test]
fn every_weight_format_runs_as_experts() {
    let formats = [
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::IQ4_NL,
        WeightFormat::Int8PerChannel,
        WeightFormat::W8A8,
        WeightFormat::Int4 {
            group: tandem_core::quant::Int4Group::G64,
        },
    ];
    // Values against the reference: GGML's formats in
    // `moe_logits_match_the_numpy_reference`; here every format runs.
    let vocab = 320;
    for format in formats {
        let model = SyntheticModel::preset("tiny-mixtral", format, 9).unwrap();
        let files = model.files().unwrap();
        let got = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
        assert_eq!(got.len(), PROMPT.len() * vocab, "{format}");
        assert!(got.iter().all(|v| v.is_finite()), "{format}");
    }
}

#[test]
fn moe_batching_and_chunking_are_invisible_in_greedy_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let model = SyntheticModel::preset("tiny-qwen2moe", WeightFormat::Q8_0, 3).unwrap();
    let files = tiny_gguf(dir.path(), &model);
    let vocab = files.config.vocab_size;
    let whole = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
    let chunked = cpu_engine(&files, 64, 5).score(&PROMPT, 0).unwrap();
    assert!(max_abs_diff(&whole, &chunked) < 1e-4);
    let tail = cpu_engine(&files, 64, 7).score(&PROMPT, 17).unwrap();
    assert!(max_abs_diff(&whole[17 * vocab..], &tail) < 1e-4);

    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| PROMPT[i * 3..(i * 3 + 4 + i * 3).min(PROMPT.len())].to_vec())
        .collect();
    let greedy = SamplingParams::default();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut e = cpu_engine(&files, 128, 512);
            let s = e.add_request(p.clone(), greedy.clone(), 6, vec![]).unwrap();
            while e.has_work() {
                e.step().unwrap();
            }
            e.tokens(s).unwrap()[p.len()..].to_vec()
        })
        .collect();
    let mut e = cpu_engine(&files, 5 * 128, 9);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| e.add_request(p.clone(), greedy.clone(), 6, vec![]).unwrap())
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    for ((id, p), want) in ids.iter().zip(&prompts).zip(&alone) {
        assert_eq!(&e.tokens(*id).unwrap()[p.len()..], want.as_slice());
    }
}

#[test]
fn moe_prefix_cache_hits_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = SyntheticModel::preset("tiny-olmoe", WeightFormat::F32, 4).unwrap();
    let files = tiny_gguf(dir.path(), &model);
    let mut e = cpu_engine(&files, 256, 512);
    let run = |e: &mut tandem_core::engine::Engine<_>| {
        let s = e
            .add_request(PROMPT.to_vec(), SamplingParams::default(), 5, vec![])
            .unwrap();
        while e.has_work() {
            e.step().unwrap();
        }
        let tokens = e.tokens(s).unwrap().to_vec();
        e.remove(s);
        tokens
    };
    let first = run(&mut e);
    let hits_before = e.stats().prefix_hit_tokens;
    let second = run(&mut e);
    assert!(
        e.stats().prefix_hit_tokens > hits_before,
        "the prompt's blocks were reused"
    );
    assert_eq!(first, second);
}

/// A GGUF of `tiny-mixtral` with its metadata and tensors changed by `edit`.
fn edited_mixtral(
    dir: &std::path::Path,
    edit: impl Fn(&str, &mut GgufValue) -> bool,
    drop_tensor: Option<&str>,
) -> String {
    let model = SyntheticModel::preset("tiny-mixtral", WeightFormat::F32, 2).unwrap();
    let path = dir.join("edited.gguf");
    let original = model.to_gguf().unwrap();
    let bytes = std::sync::Arc::new(tandem_core::model::Bytes::Owned(original));
    let file = GgufFile::parse(bytes, &path).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in &file.metadata {
        let mut value = value.clone();
        if edit(key, &mut value) {
            w.add_metadata(key, value).unwrap();
        }
    }
    for info in &file.tensors {
        if Some(info.name.as_str()) == drop_tensor {
            continue;
        }
        let data = file.tensor_data(info).unwrap().to_vec();
        w.add_tensor(&info.name, info.format, &info.shape, data)
            .unwrap();
    }
    std::fs::write(&path, w.to_bytes()).unwrap();
    match tandem_core::model::load(&path) {
        Ok(_) => "loaded".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_moe_files_fail_naming_the_key_or_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let set = |target: &'static str, to: u32| {
        move |key: &str, value: &mut GgufValue| {
            if key == target {
                *value = GgufValue::U32(to);
            }
            true
        }
    };
    let cases = [
        (
            edited_mixtral(dir.path(), set("llama.expert_used_count", 0), None),
            "'llama.expert_used_count' 0",
        ),
        (
            edited_mixtral(dir.path(), set("llama.expert_used_count", 5), None),
            "'llama.expert_used_count' 5",
        ),
        (
            edited_mixtral(dir.path(), set("llama.expert_count", 8), None),
            "'blk.0.ffn_gate_inp.weight' has shape [64, 4], expected [64, 8]",
        ),
        (
            edited_mixtral(dir.path(), |_, _| true, Some("blk.1.ffn_gate_inp.weight")),
            "blk.1.ffn_gate_inp.weight",
        ),
        (
            edited_mixtral(dir.path(), |k, _| k != "llama.expert_used_count", None),
            "llama.expert_used_count",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{expected}: {message}");
    }
    assert_eq!(edited_mixtral(dir.path(), |_, _| true, None), "loaded");
}
