//! `--ep E` under `mpirun`: a random Mixture-of-Experts model's experts
//! placed over the ranks (whole experts per rank, or groups of ranks that
//! split each expert), and `--tp` of a MoE model (every expert split over
//! every rank), give the single-rank greedy tokens. With 4 experts, 2 per
//! token, on 4 ranks of one expert each, every decode step's row goes to
//! two ranks' experts only: the others contribute nothing but their part
//! of the all-reduce. A shared expert is split over all ranks; odd expert
//! counts give groups of different sizes; each rank holds fewer experts.
#![cfg(all(unix, feature = "mpi"))]

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

mod ranks;
use ranks::{assert_refused, assert_same_as_one_rank, largest, mpirun, random_model, rank_memory};

const EP2: (usize, &[&str]) = (2, &["--ep", "2"]);
const EP4: (usize, &[&str]) = (4, &["--ep", "4"]);
/// Two groups of two ranks: whole experts per group, each split within it.
const TP4_EP2: (usize, &[&str]) = (4, &["--tp", "4", "--ep", "2"]);
/// No expert parallelism: every expert split over both ranks.
const TP2: (usize, &[&str]) = (2, &["--tp", "2"]);
const EP2_PP2: (usize, &[&str]) = (4, &["--ep", "2", "--pp", "2"]);

#[test]
fn experts_over_ranks_give_the_single_rank_tokens() {
    let dir = tempfile::tempdir().unwrap();
    // 4 experts, 2 per token.
    let mixtral = random_model(dir.path(), "tiny-mixtral", WeightFormat::F16);
    assert_same_as_one_rank(
        &mixtral,
        &[EP2, EP4, TP4_EP2, TP2, EP2_PP2],
        "Once upon a time",
        10,
    );
    // 5 experts (2 and 3 per rank) and a shared expert wider than the routed ones.
    let qwen2moe = random_model(dir.path(), "tiny-qwen2moe", WeightFormat::Q8_0);
    assert_same_as_one_rank(&qwen2moe, &[EP2, TP2], "Once upon a time", 8);
    // Q/K norms; 6 experts, 3 per token.
    let qwen3moe = random_model(dir.path(), "tiny-qwen3moe", WeightFormat::F16);
    assert_same_as_one_rank(&qwen3moe, &[EP2], "Once upon a time", 8);
}

#[test]
fn steps_whose_tokens_all_go_to_one_ranks_experts_give_the_single_rank_tokens() {
    // One expert per token: every decode step's one row is routed to one
    // expert, so all of that step's tokens go to one rank and the other
    // runs no expert at all.
    let dir = tempfile::tempdir().unwrap();
    let mut model = SyntheticModel::preset("tiny-mixtral", WeightFormat::F16, 5).unwrap();
    if let Some(moe) = model.config.moe.as_mut() {
        moe.experts_per_token = 1;
    }
    let path = dir.path().join("tiny-top1.gguf");
    model.write_gguf(&path).unwrap();
    assert_same_as_one_rank(&path, &[EP2, EP4], "Once upon a time", 10);
}

#[test]
fn each_rank_holds_fewer_experts() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_model(dir.path(), "tiny-olmoe", WeightFormat::F16);
    let file = std::fs::metadata(&model).unwrap().len() as usize;
    let ep2 = rank_memory(EP2, &model);
    let ep4 = rank_memory(EP4, &model);
    println!("--ep 2: {ep2:?}\n--ep 4: {ep4:?}");
    let (w2, w4) = (largest(&ep2).0, largest(&ep4).0);
    // Attention is split too; the embedding and output head are not.
    assert!(
        w2 < file * 3 / 4 && w4 < w2,
        "weights per rank: {w2}, {w4} of {file}"
    );
}

#[test]
fn impossible_expert_placements_are_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let dense = random_model(dir.path(), "tiny", WeightFormat::Q4_1);
    let args = [
        "run",
        "--model",
        dense.to_str().unwrap(),
        "--backend",
        "cpu",
        "hi",
    ];
    for (ranks, flags, message) in [
        (2, &["--ep", "2"][..], "--ep 2: the model has no experts"),
        (
            4,
            &["--tp", "4", "--ep", "3"][..],
            "--ep 3: expert groups must divide the 4 ranks",
        ),
    ] {
        // Every rank refuses the placement on its own.
        assert_refused(&mpirun(ranks, flags, &args), message, false);
    }
}
