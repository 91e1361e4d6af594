//! Structured output over HTTP with the official `openai` client
//! (tests/serving/structured_client.py, with `jsonschema` validating every
//! JSON output; both installed by scripts/install-test-deps.sh): SmolLM2 on
//! the CPU, plainly and with n-gram speculation (`--speculate ngram
//! --draft-k 4`), and a tiny random model on wgpu (lavapipe here), whose
//! garbage the grammar must still force into valid JSON.

mod serving_support;

use std::path::PathBuf;

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::spec::{DraftLength, NgramProposer};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;
use tandem_server::{spawn_engine, BackgroundServer, ServerConfig};
use tandem_tests::{smollm2_path, tiny, tiny_gguf};
use tandem_wgpu::{WgpuBackend, WgpuOptions};

use serving_support::{assert_drains, metric, server_config, venv_python, KEY};

/// A server for the model `load` gives, on the backend `backend` makes.
fn serve<B: Backend + 'static>(
    model_id: &str,
    load: impl FnOnce() -> ModelFiles + Send + 'static,
    backend: impl FnOnce() -> B + Send + 'static,
    speculate: bool,
) -> BackgroundServer {
    let engine = spawn_engine(move |inbox| {
        let files = load();
        let config = EngineConfig {
            num_blocks: 512,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(backend(), &files, config, &mut |_, _| {})?;
        if speculate {
            engine.set_speculation(Box::new(NgramProposer::default()), DraftLength::Fixed(4))?;
        }
        let ModelFiles { tokenizer, .. } = files;
        inbox.run(engine, tokenizer)
    })
    .unwrap();
    let config = ServerConfig {
        model_id: model_id.into(),
        ..server_config()
    };
    BackgroundServer::start(engine, config, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// Runs the client script against `server`; panics with its output if a check fails.
fn run_client(server: &BackgroundServer, model_id: &str, max_tokens: usize, quick: bool) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = venv_python();
    let base_url = format!("http://{}/v1", server.addr);
    let mut command = std::process::Command::new(python);
    command
        .arg(root.join("serving/structured_client.py"))
        .args([&base_url, model_id, KEY, &max_tokens.to_string()]);
    if quick {
        command.arg("quick");
    }
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "structured client failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    assert_drains(server.addr);
}

fn smollm2() -> ModelFiles {
    tandem_core::model::load(&smollm2_path()).expect("load SmolLM2")
}

#[test]
fn json_schemas_validate_with_smollm2_on_the_cpu() {
    let server = serve("smollm2", smollm2, || CpuBackend::new(2), false);
    run_client(&server, "smollm2", 400, false);
}

#[test]
fn json_schemas_validate_with_smollm2_and_ngram_speculation() {
    let server = serve("smollm2", smollm2, || CpuBackend::new(2), true);
    run_client(&server, "smollm2", 400, true);
    let drafted = metric(server.addr, "tandem_spec_draft_tokens_total");
    let accepted = metric(server.addr, "tandem_spec_accepted_tokens_total");
    assert!(
        drafted > 0.0 && accepted < drafted,
        "{accepted} of {drafted} drafts accepted"
    );
}

#[test]
fn a_random_model_on_wgpu_still_writes_valid_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let load = move || {
        let mut model = tiny(WeightFormat::F32, 21);
        model.config.max_context = 4096;
        tiny_gguf(&path, &model)
    };
    let backend = || {
        WgpuBackend::new(WgpuOptions::default()).unwrap_or_else(|e| {
            panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers` (make test does it)")
        })
    };
    let server = serve("tiny", load, backend, false);
    // Its JSON has all the whitespace the grammar allows between tokens.
    run_client(&server, "tiny", 1500, true);
}
