//! SmolLM2-135M (`make model`) upcycled into a Mixture of Experts
//! (`tandem_tests::upcycle`: each FFN copied into 4 experts whose block
//! scales are jittered by 0.5%, a random router, top 2, renormalised):
//! it generates the dense model's greedy text, an INT8 KV cache the same
//! greedy text as an F16 one (as `native-cli/tests/smollm2_kv_dtype.rs`
//! asserts for the dense model), and its logits match the independent
//! NumPy reference (`tests/reference/moe_reference.py`).

use std::path::PathBuf;
use std::sync::OnceLock;

use tandem_core::backend::KvDtype;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::sched::SamplingParams;
use tandem_cpu::CpuBackend;
use tandem_tests::http_client::venv_python;
use tandem_tests::upcycle::{upcycle_gguf, Upcycle};
use tandem_tests::{cpu_engine, max_abs_diff, smollm2_path};

/// The reference's tolerance for real checkpoints (`real_models`): several
/// times the f32-against-f64 error over 30 layers.
const LOGIT_TOLERANCE: f32 = 0.05;

/// The upcycled file, written once for every test here.
fn upcycled() -> &'static PathBuf {
    static FILE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &FILE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("smollm2-4x135m.gguf");
            let how = Upcycle {
                experts: 4,
                experts_per_token: 2,
                jitter: 0.005,
                seed: 7,
            };
            upcycle_gguf(&smollm2_path(), &path, &how).unwrap();
            (dir, path)
        })
        .1
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Light passing through a prism is split into",
    "def fibonacci(n):",
];

fn greedy(files: &ModelFiles, kv_dtype: KvDtype, prompt: &[u32], n: usize) -> Vec<u32> {
    let config = EngineConfig {
        kv_precision: kv_dtype.into(),
        ..EngineConfig::default()
    }
    .with_capacity_tokens(512);
    let mut engine = Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap();
    let id = engine
        .add_request(prompt.to_vec(), SamplingParams::default(), n, vec![])
        .unwrap();
    while engine.has_work() {
        engine.step().unwrap();
    }
    engine.tokens(id).unwrap()[prompt.len()..].to_vec()
}

#[test]
fn upcycled_smollm2_continues_prompts_as_the_dense_model_does() {
    let dense = tandem_core::model::load(&smollm2_path()).unwrap();
    let moe = tandem_core::model::load(upcycled()).unwrap();
    let spec = moe.config.moe.expect("experts");
    assert_eq!((spec.experts, spec.experts_per_token), (4, 2));
    assert!(spec.normalize_weights, "Mixtral renormalises");
    for prompt in PROMPTS {
        let ids = dense.tokenizer.encode(prompt, true).unwrap();
        let want = greedy(&dense, KvDtype::F32, &ids, 16);
        let got = greedy(&moe, KvDtype::F32, &ids, 16);
        let text = |t: &[u32]| dense.tokenizer.decode(t).unwrap();
        assert_eq!(
            got,
            want,
            "{prompt:?}: {:?} against the dense {:?}",
            text(&got),
            text(&want)
        );
    }
}

#[test]
fn int8_kv_gives_the_upcycled_model_the_greedy_tokens_of_f16() {
    let moe = tandem_core::model::load(upcycled()).unwrap();
    for prompt in PROMPTS {
        let ids = moe.tokenizer.encode(prompt, true).unwrap();
        let f16 = greedy(&moe, KvDtype::F16, &ids, 16);
        let int8 = greedy(&moe, KvDtype::Int8, &ids, 16);
        assert_eq!(int8, f16, "greedy continuation of {prompt:?}");
    }
}

#[test]
fn upcycled_smollm2_logits_match_the_numpy_reference() {
    let moe = tandem_core::model::load(upcycled()).unwrap();
    let tokens = moe
        .tokenizer
        .encode("Mixture of experts layers route", true)
        .unwrap();
    let got = cpu_engine(&moe, 512, 512).score(&tokens, 0).unwrap();
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/reference/moe_reference.py");
    let out = std::process::Command::new(venv_python())
        .arg(script)
        .arg(upcycled())
        .arg(list.join(","))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<f32> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(want.len(), got.len());
    let diff = max_abs_diff(&got, &want);
    assert!(diff < LOGIT_TOLERANCE, "max |diff| {diff}");
}
