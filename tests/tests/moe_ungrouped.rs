//! `MoeSpec::group_rows` false (the baseline `tandem bench
//! --ungrouped-experts` compares grouping against) runs every expert one row
//! at a time and gives the logits of the grouped pass. The backend's log of
//! `matmul` calls shows which pass ran: grouped, at most one call per
//! expert and projection; ungrouped, one per row routed to an expert.

use std::sync::Arc;

use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_tests::faulty_cpu::{Faults, FaultyCpu};
use tandem_tests::{max_abs_diff, tiny_gguf};

const PROMPT: [u32; 23] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 65, 66, 200, 201, 7, 8, 9, 10, 11, 250, 120, 45, 46, 47,
];

/// The logits of every position of `PROMPT` (one pass) and the rows of
/// every `matmul` call that computed them.
fn score_logging_matmuls(files: &ModelFiles) -> (Vec<f32>, Vec<usize>) {
    let faults = Faults::new();
    let config = EngineConfig {
        max_batch_tokens: 512,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(64);
    let backend = FaultyCpu::new(2, Arc::clone(&faults));
    let mut engine = Engine::new(backend, files, config, &mut |_, _| {}).unwrap();
    let before = faults.matmul_rows().len();
    let logits = engine.score(&PROMPT, 0).unwrap();
    (logits, faults.matmul_rows()[before..].to_vec())
}

#[test]
fn ungrouped_experts_give_the_grouped_logits_one_row_per_call() {
    for name in ["tiny-qwen2moe", "tiny-olmoe"] {
        let dir = tempfile::tempdir().unwrap();
        let model = SyntheticModel::preset(name, WeightFormat::Q8_0, 8).unwrap();
        let mut files = tiny_gguf(dir.path(), &model);
        let (grouped, grouped_calls) = score_logging_matmuls(&files);
        let moe = files.config.moe.as_mut().unwrap();
        moe.group_rows = false;
        let moe = *moe;
        let (ungrouped, ungrouped_calls) = score_logging_matmuls(&files);

        let diff = max_abs_diff(&grouped, &ungrouped);
        assert!(diff < 1e-4, "{name}: max |diff| {diff}");
        let sum = |calls: &[usize]| calls.iter().sum::<usize>();
        assert_eq!(sum(&grouped_calls), sum(&ungrouped_calls), "{name}: rows");
        // Every other matmul takes the whole prompt; the shared expert gets
        // every row too.
        let layers = files.config.num_layers;
        let experts = moe.experts + usize::from(moe.shared_ffn.is_some());
        let per_row = moe.experts_per_token + usize::from(moe.shared_ffn.is_some());
        let expert_rows = 3 * layers * PROMPT.len() * per_row;
        let one_row = |calls: &[usize]| calls.iter().filter(|&&r| r == 1).count();
        assert_eq!(one_row(&ungrouped_calls), expert_rows, "{name}: ungrouped");
        let other_calls = ungrouped_calls.len() - expert_rows;
        let grouped_expert_calls = grouped_calls.len() - other_calls;
        assert!(
            grouped_expert_calls <= 3 * layers * experts,
            "{name}: {grouped_expert_calls} grouped expert calls for {experts} experts"
        );
    }
}
