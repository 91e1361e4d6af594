//! Tool calling on a real model: `tandem serve` in-process on
//! `qwen2.5-0.5b` (whose chat template shows tools to the model) and the
//! official `openai` client (tests/serving/openai_tools.py): a call parsed
//! into `tool_calls`, the same call reassembled from streamed deltas, the
//! round trip (call, tool message, answer in text), `tool_choice` naming a
//! function, `required` and `none`, `parallel_tool_calls: false`, and chat
//! logprobs in OpenAI's shape. Greedy and a few dozen tokens per request.

use std::path::PathBuf;
use std::time::Duration;

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_cpu::CpuBackend;
use tandem_server::{spawn_engine, BackgroundServer, ServerConfig};
use tandem_tests::http_client::venv_python;
use tandem_tests::model_path;

const MODEL: &str = "qwen2.5-0.5b";
const KEY: &str = "sk-tools";

#[test]
fn the_official_client_calls_tools_on_qwen25() {
    let python = venv_python();
    let path = model_path(MODEL);
    let engine = spawn_engine(move |inbox| {
        let files = tandem_core::model::load(&path)?;
        let config = EngineConfig {
            max_context: Some(2048),
            max_batch_tokens: 512,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(4096);
        let engine = Engine::new(CpuBackend::new(2), &files, config, &mut |_, _| {})?;
        let ModelFiles { tokenizer, .. } = files;
        inbox.run(engine, tokenizer)
    })
    .unwrap();
    let config = ServerConfig {
        model_id: MODEL.into(),
        api_key: Some(KEY.into()),
        shutdown_grace: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let server = BackgroundServer::start(engine, config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("serving/openai_tools.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .args([&format!("http://{}/v1", server.addr), MODEL, KEY])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai tools check failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
}
