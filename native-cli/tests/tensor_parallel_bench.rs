//! `bench --tp N` under `mpirun`: the communication figures of a split
//! model. The bytes all-reduced are exact (two all-reduces of `hidden_size`
//! f32 per token per layer); the times only add up.
#![cfg(all(unix, feature = "mpi"))]

use std::process::Command;

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

fn bench(ranks: usize, model: &str, extra: &[&str]) -> String {
    let mut c = match ranks {
        1 => Command::new(env!("CARGO_BIN_EXE_tandem")),
        _ => {
            let mut c = Command::new("mpirun");
            c.args(["--allow-run-as-root", "--oversubscribe", "-np"])
                .arg(ranks.to_string())
                .arg(env!("CARGO_BIN_EXE_tandem"));
            c
        }
    };
    c.args(["bench", "--model", model, "--backend", "cpu", "-t", "1"])
        .args(["-p", "12", "-n", "5", "-r", "2", "--tp", &ranks.to_string()])
        .args(extra)
        .env("TANDEM_OFFLINE", "1");
    let out = c.output().expect("run tandem bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn bench_reports_the_bytes_and_time_of_the_all_reduces() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let model = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 5).unwrap();
    model.write_gguf(&path).unwrap();
    let (hidden, layers) = (model.config.hidden_size, model.config.num_layers);
    let path = path.to_str().unwrap();

    let json: serde_json::Value = serde_json::from_str(&bench(2, path, &["--json"])).unwrap();
    let tp = &json["tensor_parallel"];
    assert_eq!(tp["ranks"], 2);
    // Two repetitions of a 12-token prompt in one step, and of 5 tokens decoded
    // one per step (the one-token prompt's step included).
    for (phase, steps, tokens) in [("prefill", 2, 24), ("decode", 10, 10)] {
        let p = &tp[phase];
        assert_eq!(
            (p["steps"].as_u64(), p["tokens"].as_u64()),
            (Some(steps), Some(tokens)),
            "{p}"
        );
        let per_token = p["all_reduce_bytes_per_token_per_layer"].as_f64().unwrap();
        assert_eq!(per_token, (2 * 4 * hidden) as f64, "{phase}: {p}");
        assert_eq!(
            p["expected_all_reduce_bytes_per_token_per_layer"],
            2 * 4 * hidden
        );
        assert_eq!(p["all_reduces_per_step_per_layer"], 2.0, "{phase}: {p}");
        let ms = |k: &str| p[k].as_f64().unwrap();
        assert!(
            ms("comm_ms_per_step") >= ms("all_reduce_ms_per_step"),
            "{p}"
        );
        assert!(
            ms("comm_ms_per_step") > 0.0 && ms("compute_ms_per_step") > 0.0,
            "{p}"
        );
        let sum = ms("compute_ms_per_step") + ms("comm_ms_per_step");
        assert!((sum - ms("step_ms")).abs() < 1e-6 * ms("step_ms"), "{p}");
        // Every step's forward command went to the followers.
        assert!(ms("command_bytes_per_step") > 0.0, "{p}");
    }
    assert!(layers > 0);

    let text = bench(2, path, &[]);
    assert!(
        text.contains(&format!(
            "tp2 decode  all-reduce {} B per token per layer",
            8 * hidden
        )),
        "{text}"
    );
    assert!(text.contains("tp2 prefill step"), "{text}");

    // One rank: nothing to report.
    let json: serde_json::Value = serde_json::from_str(&bench(1, path, &["--json"])).unwrap();
    assert!(json.get("tensor_parallel").is_none(), "{json}");
    assert!(!bench(1, path, &[]).contains("all-reduce"));
}
