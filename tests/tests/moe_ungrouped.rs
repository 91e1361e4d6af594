//! `TANDEM_MOE_GROUPING=off` (the baseline `tandem bench` compares grouping
//! against) runs every expert one row at a time and gives the logits of the
//! grouped pass. Alone in its test binary: it sets the environment.

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;
use tandem_tests::{cpu_engine, max_abs_diff, tiny_gguf};

const PROMPT: [u32; 23] = [
    5, 77, 300, 12, 256, 99, 101, 3, 64, 65, 66, 200, 201, 7, 8, 9, 10, 11, 250, 120, 45, 46, 47,
];

#[test]
fn ungrouped_experts_give_the_grouped_logits() {
    for name in ["tiny-qwen2moe", "tiny-olmoe"] {
        let dir = tempfile::tempdir().unwrap();
        let model = SyntheticModel::preset(name, WeightFormat::Q8_0, 8).unwrap();
        let files = tiny_gguf(dir.path(), &model);
        let grouped = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
        std::env::set_var("TANDEM_MOE_GROUPING", "off");
        let ungrouped = cpu_engine(&files, 64, 512).score(&PROMPT, 0).unwrap();
        std::env::remove_var("TANDEM_MOE_GROUPING");
        let diff = max_abs_diff(&grouped, &ungrouped);
        assert!(diff < 1e-4, "{name}: max |diff| {diff}");
    }
}
