//! `--pp P` (and `--tp T --pp P`) under `mpirun`: CPU ranks, oversubscribed
//! on a small machine. Every layout gives the single-rank greedy tokens
//! (top log-probabilities within 1e-2), with the step's rows in several
//! micro-batches and in one; a post-norm architecture whose branch output
//! is still pending at a stage boundary; layer counts that do not divide;
//! wgpu ranks. More stages than layers is one clear error, and each rank's
//! weights and KV shrink as stages are added.
#![cfg(all(unix, feature = "mpi"))]

use tandem_core::quant::WeightFormat;
use tandem_tests::model_path;

mod ranks;
use ranks::{
    assert_refused, assert_same_as_one_rank, assert_same_on, largest, mpirun, random_model,
    rank_memory,
};

const PP2: (usize, &[&str]) = (2, &["--pp", "2"]);
/// The whole step's rows in one part: no overlap between the stages.
const PP2_WHOLE: (usize, &[&str]) = (2, &["--pp", "2", "--micro-batches", "1"]);
const PP3: (usize, &[&str]) = (3, &["--pp", "3", "--micro-batches", "4"]);
const TP2_PP2: (usize, &[&str]) = (4, &["--tp", "2", "--pp", "2"]);

#[test]
fn random_models_give_the_single_rank_tokens_over_stages() {
    let dir = tempfile::tempdir().unwrap();
    // Untied output head on rank 0, two layers: one per stage.
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    assert_same_as_one_rank(&tiny, &[PP2, PP2_WHOLE, TP2_PP2], "Once upon a time", 10);
    // Gemma 3: post-norms leave the branch pending at a stage's end, 7 layers over 3 stages.
    let gemma = random_model(dir.path(), "tiny-gemma3", WeightFormat::F16);
    assert_same_as_one_rank(&gemma, &[PP2, PP3], "Once upon a time", 8);
    let qwen3 = random_model(dir.path(), "tiny-qwen3", WeightFormat::F16);
    assert_same_as_one_rank(&qwen3, &[PP2], "Once upon a time", 8);
    // Mixture-of-Experts layers are layers like the others to a pipeline.
    let moe = random_model(dir.path(), "tiny-mixtral", WeightFormat::F16);
    assert_same_as_one_rank(&moe, &[PP2], "Once upon a time", 8);
}

#[test]
fn wgpu_stages_give_the_single_rank_tokens() {
    // The residual stream goes device → host → next rank → device.
    let dir = tempfile::tempdir().unwrap();
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    assert_same_on(&tiny, "wgpu", &[PP2], "Once upon a time", 8);
}

#[test]
fn real_checkpoints_give_the_single_rank_tokens_over_stages() {
    let prompt = "The capital of France is a city that";
    let smollm = model_path("smollm2-135m");
    assert_same_as_one_rank(&smollm, &[PP2, PP2_WHOLE, PP3, TP2_PP2], prompt, 16);
    let qwen = model_path("qwen2.5-0.5b");
    assert_same_as_one_rank(&qwen, &[PP2, TP2_PP2], "def fibonacci(n):", 12);
}

#[test]
fn more_stages_than_layers_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    let args = [
        "run",
        "--model",
        tiny.to_str().unwrap(),
        "--backend",
        "cpu",
        "hi",
    ];
    let out = mpirun(3, &["--pp", "3"], &args);
    let message = "--pp 3: the model has 2 layers, so at most 2 stages";
    assert_refused(&out, message, true);
    // The rank count and --tp × --pp disagree.
    let out = mpirun(2, &["--tp", "2", "--pp", "2"], &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--tp 2 --pp 2 needs 4 ranks"), "{stderr}");
}

#[test]
fn each_rank_holds_less_weight_and_kv_as_stages_are_added() {
    let model = model_path("smollm2-135m");
    let file = std::fs::metadata(&model).unwrap().len() as usize;
    // Full KV: 30 layers × 3 KV heads × 64 × (K + V) × 4 bytes.
    let full_kv = 30 * 3 * 64 * 2 * 4;
    let pp2 = rank_memory(PP2, &model);
    let pp3 = rank_memory(PP3, &model);
    let tp2_pp2 = rank_memory(TP2_PP2, &model);
    println!("--pp 2: {pp2:?}\n--pp 3: {pp3:?}\n--tp 2 --pp 2: {tp2_pp2:?}");
    let ((w2, kv2), (w3, kv3), (w4, kv4)) = (largest(&pp2), largest(&pp3), largest(&tp2_pp2));
    // Stage 0 holds the tied embedding (the output head) and fewer layers:
    // the stages balance weight bytes.
    assert!(
        w2 < file * 6 / 10,
        "--pp 2: {w2} of {file} bytes on one rank"
    );
    assert!(
        w3 < w2 && w4 < w2,
        "--pp 3: {w3}, --tp 2 --pp 2: {w4}, --pp 2: {w2}"
    );
    // KV per token follows each stage's layer count (and heads under --tp).
    let layers = |kv: usize| kv / (full_kv / 30);
    assert_eq!(
        pp2.iter().map(|r| layers(r.1)).sum::<usize>(),
        30,
        "{pp2:?}"
    );
    assert!(kv2 < full_kv && kv3 < kv2 && kv4 < kv2, "{kv2} {kv3} {kv4}");
}
