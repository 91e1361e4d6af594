//! Shared helpers of the test suite: where the default model is, tiny random
//! models written to disk, and an independent dense forward pass (no KV
//! cache, no paging, no fusion) that the engine is checked against, a CPU
//! backend that records steps like CUDA graphs (`recording_cpu`), and one
//! that fails chosen calls on purpose (`faulty_cpu`); MoE models in
//! k-quants and the NumPy MoE reference (`kquant_moe`); and a minimal HTTP
//! client for the server (`http_client`); the exact-distribution test of
//! speculative sampling (`exact_sampling`); drafts distilled from tiny
//! targets (`distilled`).

pub mod backend_e2e;
pub mod conformance;
pub mod decode_mix;
pub mod dense_reference;
pub mod distilled;
pub mod exact_sampling;
pub mod faulty_cpu;
pub mod http_client;
pub mod kquant_moe;
pub mod recording_cpu;
pub mod upcycle;

use std::collections::HashMap;
use std::path::PathBuf;

use tandem_core::backend::Backend;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_cpu::CpuBackend;

/// The default model, fetched by `make model` (which `make test` runs first).
pub fn smollm2_path() -> PathBuf {
    model_path("smollm2-135m")
}

/// The file of a named real checkpoint (`scripts/models.tsv`) in the model cache,
/// `$TANDEM_CACHE` or `~/.cache/tandem`, where `scripts/fetch-model.sh NAME` puts it.
pub fn model_path(name: &str) -> PathBuf {
    let table = include_str!("../../scripts/models.tsv");
    let file = table
        .lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| line.split('\t').collect::<Vec<_>>())
        .find(|fields| fields[0] == name)
        .and_then(|fields| fields.get(1).copied())
        .unwrap_or_else(|| panic!("no model named {name:?} in scripts/models.tsv"));
    let cache = std::env::var_os("TANDEM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/tandem")
        });
    let path = cache.join(file);
    assert!(
        path.exists(),
        "{} is missing: run `scripts/fetch-model.sh {name}` (`make test` fetches it)",
        path.display()
    );
    path
}

/// A tiny random model written as GGUF into `dir` and loaded back from disk.
pub fn tiny_gguf(dir: &std::path::Path, model: &SyntheticModel) -> ModelFiles {
    let path = dir.join("tiny.gguf");
    model.write_gguf(&path).expect("write tiny GGUF");
    tandem_core::model::load(&path).expect("load tiny GGUF")
}

pub fn tiny(format: WeightFormat, seed: u64) -> SyntheticModel {
    SyntheticModel::preset("tiny", format, seed).expect("tiny preset")
}

/// A CPU engine with room for `tokens` tokens, chunking prompts at `max_batch_tokens`.
pub fn cpu_engine(
    files: &ModelFiles,
    tokens: usize,
    max_batch_tokens: usize,
) -> Engine<CpuBackend> {
    let config = EngineConfig {
        max_batch_tokens,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(tokens);
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).expect("engine")
}

/// Runs every prompt to completion together, prompt `i` sampled with
/// `params(i)`; returns each one's generated tokens.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    prompts: &[Vec<u32>],
    params: &dyn Fn(usize) -> SamplingParams,
    max_new: usize,
) -> Vec<Vec<u32>> {
    let ids: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            engine
                .add_request(p.clone(), params(i), max_new, vec![])
                .expect("request")
        })
        .collect();
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    while engine.has_work() {
        for ev in engine.step().expect("step") {
            out.entry(ev.seq).or_default().push(ev.token);
        }
    }
    ids.iter()
        .map(|id| {
            engine.remove(*id);
            out.remove(id).unwrap_or_default()
        })
        .collect()
}

/// Largest `|a - b|` over two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}
