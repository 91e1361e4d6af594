//! `tandem inspect` on tiny MoE GGUF files shows the experts, the experts
//! per token, the renormalisation, the shared expert and the active and
//! total parameter counts, which the test counts itself from the file's
//! tensors; a file whose expert counts disagree is one clear error.

use std::sync::Arc;

use tandem_core::model::gguf::{GgufFile, GgufValue, GgufWriter};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::Bytes;
use tandem_core::quant::WeightFormat;

mod common;
use common::{assert_clear_error, tandem};

/// `(total, active)` parameters of the GGUF file at `path`, from its
/// tensors: every matrix (norms and biases left out), and of the stacked
/// routed experts only `used` of every `experts`.
fn counted_parameters(path: &std::path::Path, experts: usize, used: usize) -> (usize, usize) {
    let files = tandem_core::model::load(path).unwrap();
    let (mut total, mut routed) = (0, 0);
    for t in files.tensors.tensors() {
        if t.name.contains("norm") || t.name.ends_with(".bias") {
            continue;
        }
        total += t.elems();
        if t.name.contains("_exps.") {
            routed += t.elems();
        }
    }
    (total, total - routed / experts * (experts - used))
}

#[test]
fn inspect_shows_experts_and_active_parameters() {
    let cases = [
        (
            "tiny-qwen2moe",
            "experts:        5 (2 per token, weights not renormalised, shared expert of 128)",
        ),
        (
            "tiny-mixtral",
            "experts:        4 (2 per token, weights renormalised)",
        ),
        (
            "tiny-olmoe",
            "experts:        8 (2 per token, weights not renormalised)",
        ),
    ];
    for (name, experts_line) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.gguf");
        let model = SyntheticModel::preset(name, WeightFormat::Q8_0, 3).unwrap();
        model.write_gguf(&path).unwrap();
        let moe = model.config.moe.unwrap();
        let out = tandem(&["inspect", path.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains(experts_line), "{name}: {text}");
        let (total, active) = counted_parameters(&path, moe.experts, moe.experts_per_token);
        assert!(active < total, "{name}");
        let counts = format!("({active} of {total})");
        let line = text
            .lines()
            .find(|l| l.starts_with("active params:"))
            .unwrap_or_else(|| panic!("{name}: no active parameters in {text}"));
        assert!(
            line.ends_with(&counts),
            "{name}: {line:?}, counted {counts}"
        );
    }
}

#[test]
fn inspect_refuses_more_experts_per_token_than_experts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    let model = SyntheticModel::preset("tiny-olmoe", WeightFormat::F32, 3).unwrap();
    let file = GgufFile::parse(Arc::new(Bytes::Owned(model.to_gguf().unwrap())), &path).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in &file.metadata {
        let value = match key.as_str() {
            "olmoe.expert_used_count" => GgufValue::U32(9),
            _ => value.clone(),
        };
        w.add_metadata(key, value).unwrap();
    }
    for info in &file.tensors {
        let data = file.tensor_data(info).unwrap().to_vec();
        w.add_tensor(&info.name, info.format, &info.shape, data)
            .unwrap();
    }
    std::fs::write(&path, w.to_bytes()).unwrap();
    let out = tandem(&["inspect", path.to_str().unwrap()]);
    assert_clear_error(&out, &["bad.gguf", "'olmoe.expert_used_count' 9"]);
}
