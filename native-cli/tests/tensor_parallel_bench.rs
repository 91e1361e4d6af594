//! `bench --tp T --pp P` under `mpirun`: the communication figures of a
//! split model. The bytes are exact: two all-reduces of `hidden_size` f32
//! per token per layer of rank 0's stage, and with pipeline stages one row
//! of `hidden_size` f32 per token sent from stage 0 to stage 1 (commands go
//! by broadcast, counted apart); the times only add up.
#![cfg(all(unix, feature = "mpi"))]

use std::process::Command;

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

/// `tandem bench` on `tp × pp` ranks (under `mpirun` when several).
fn bench(tp: usize, pp: usize, model: &str, extra: &[&str]) -> String {
    let ranks = tp * pp;
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
        .args(["-p", "12", "-n", "5", "-r", "2"])
        .args(["--tp", &tp.to_string(), "--pp", &pp.to_string()])
        .args(extra)
        .env("TANDEM_OFFLINE", "1");
    let out = c.output().expect("run tandem bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8(out.stdout).unwrap()
}

/// The tiny random model (2 layers, hidden 64) in `dir`, and its hidden size.
fn tiny(dir: &tempfile::TempDir) -> (String, usize) {
    let path = dir.path().join("tiny.gguf");
    let model = SyntheticModel::preset("tiny", WeightFormat::Q4_1, 5).unwrap();
    model.write_gguf(&path).unwrap();
    assert_eq!(model.config.num_layers, 2);
    (path.to_str().unwrap().to_string(), model.config.hidden_size)
}

/// Two repetitions of a 12-token prompt in one step, and of 5 tokens decoded
/// one per step (the one-token prompt's step included): (phase, steps, tokens).
const PHASES: [(&str, u64, u64); 2] = [("prefill", 2, 24), ("decode", 10, 10)];

/// What every phase of every shape satisfies: the counts, and the step time
/// is compute plus communication.
fn check_phase(phase: &str, p: &serde_json::Value, steps: u64, tokens: u64) {
    assert_eq!(
        (p["steps"].as_u64(), p["tokens"].as_u64()),
        (Some(steps), Some(tokens)),
        "{phase}: {p}"
    );
    let ms = |k: &str| p[k].as_f64().unwrap();
    assert!(
        ms("comm_ms_per_step") > 0.0 && ms("compute_ms_per_step") > 0.0,
        "{phase}: {p}"
    );
    let sum = ms("compute_ms_per_step") + ms("comm_ms_per_step");
    assert!((sum - ms("step_ms")).abs() < 1e-6 * ms("step_ms"), "{p}");
    // Every step's forward command went to the followers.
    assert!(ms("command_bytes_per_step") > 0.0, "{phase}: {p}");
}

#[test]
fn bench_reports_the_bytes_and_time_of_the_all_reduces() {
    let dir = tempfile::tempdir().unwrap();
    let (path, hidden) = tiny(&dir);

    let json: serde_json::Value = serde_json::from_str(&bench(2, 1, &path, &["--json"])).unwrap();
    let par = &json["parallel"];
    assert_eq!(
        (&par["ranks"], &par["tp"], &par["pp"], &par["stage_layers"]),
        (&2.into(), &2.into(), &1.into(), &2.into()),
        "{par}"
    );
    for (phase, steps, tokens) in PHASES {
        let p = &par[phase];
        check_phase(phase, p, steps, tokens);
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
        // One stage: nothing is sent down a pipe.
        assert_eq!(p["send_bytes_per_token"], 0.0, "{phase}: {p}");
        assert_eq!(p["expected_send_bytes_per_token"], 0, "{phase}: {p}");
        assert_eq!(p["send_recv_ms_per_step"], 0.0, "{phase}: {p}");
    }

    let text = bench(2, 1, &path, &[]);
    assert!(
        text.contains(&format!(
            "tp2 pp1 decode  all-reduce {} B per token per layer",
            8 * hidden
        )),
        "{text}"
    );
    assert!(text.contains("tp2 pp1 prefill step"), "{text}");
    assert!(!text.contains("send"), "{text}");

    // One rank: nothing to report.
    let json: serde_json::Value = serde_json::from_str(&bench(1, 1, &path, &["--json"])).unwrap();
    assert!(json.get("parallel").is_none(), "{json}");
    assert!(!bench(1, 1, &path, &[]).contains("all-reduce"));
}

#[test]
fn bench_reports_the_bytes_sent_between_pipeline_stages() {
    let dir = tempfile::tempdir().unwrap();
    let (path, hidden) = tiny(&dir);

    // Two stages of one rank: rank 0 is stage 0 and sends each row's
    // residual stream to stage 1 once, in 2 micro-batches (the default)
    // where a step has rows enough, and receives the one wanted row back.
    let json: serde_json::Value = serde_json::from_str(&bench(1, 2, &path, &["--json"])).unwrap();
    let par = &json["parallel"];
    assert_eq!(
        (
            &par["ranks"],
            &par["tp"],
            &par["pp"],
            &par["micro_batches"],
            &par["stage_layers"]
        ),
        (&2.into(), &1.into(), &2.into(), &2.into(), &1.into()),
        "{par}"
    );
    for ((phase, steps, tokens), sends) in PHASES.into_iter().zip([2.0, 1.0]) {
        let p = &par[phase];
        check_phase(phase, p, steps, tokens);
        assert_eq!(
            p["send_bytes_per_token"].as_f64(),
            Some((4 * hidden) as f64),
            "{phase}: {p}"
        );
        assert_eq!(p["expected_send_bytes_per_token"], 4 * hidden, "{phase}");
        assert_eq!(p["sends_per_step"], sends, "{phase}: {p}");
        assert_eq!(
            p["recv_bytes_per_step"].as_f64(),
            Some((4 * hidden) as f64),
            "{phase}: {p}"
        );
        let ms = |k: &str| p[k].as_f64().unwrap();
        assert!(ms("send_recv_ms_per_step") > 0.0, "{phase}: {p}");
        assert!(
            ms("comm_ms_per_step") >= ms("send_recv_ms_per_step"),
            "{phase}: {p}"
        );
        // No tensor parallelism: no all-reduce, no formula for one.
        assert!(p["all_reduce_bytes_per_token_per_layer"].is_null(), "{p}");
        assert!(
            p["expected_all_reduce_bytes_per_token_per_layer"].is_null(),
            "{p}"
        );
    }

    let text = bench(1, 2, &path, &["--micro-batches", "3"]);
    assert!(
        text.contains(&format!(
            "tp1 pp2 prefill send {} B per token to stage 1 (formula 4 × {hidden} = {} per stage boundary), 3.0 sends per step (3 micro-batches asked)",
            4 * hidden,
            4 * hidden
        )),
        "{text}"
    );
    assert!(text.contains("tp1 pp2 decode  step"), "{text}");
    assert!(!text.contains("all-reduce"), "{text}");

    // Two stages of two ranks: rank 0 all-reduces over its stage's one
    // layer, twice per micro-batch, and sends its rows to its peer of stage 1.
    let json: serde_json::Value = serde_json::from_str(&bench(2, 2, &path, &["--json"])).unwrap();
    let par = &json["parallel"];
    assert_eq!(
        (&par["ranks"], &par["stage_layers"]),
        (&4.into(), &1.into())
    );
    for ((phase, steps, tokens), reduces) in PHASES.into_iter().zip([4.0, 2.0]) {
        let p = &par[phase];
        check_phase(phase, p, steps, tokens);
        assert_eq!(
            p["all_reduce_bytes_per_token_per_layer"].as_f64(),
            Some((2 * 4 * hidden) as f64),
            "{phase}: {p}"
        );
        assert_eq!(p["all_reduces_per_step_per_layer"], reduces, "{phase}: {p}");
        assert_eq!(
            p["send_bytes_per_token"].as_f64(),
            Some((4 * hidden) as f64),
            "{phase}: {p}"
        );
    }
}
