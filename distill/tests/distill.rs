//! Distillation on tiny random targets: the written draft computes what the
//! trained student computes, and training lowers the KL divergence from the
//! target on text it never saw.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use candle_core::Device;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::Rng;
use tandem_cpu::CpuBackend;
use tandem_distill::corpus::EvalSource;
use tandem_distill::train::evaluate;
use tandem_distill::write::write_student;
use tandem_distill::{distill, Corpus, Options, Student};

const WORDS: [&str; 24] = [
    "the", "light", "falls", "on", "a", "glass", "and", "bends", "toward", "its", "edge", "where",
    "colours", "part", "into", "bands", "of", "red", "green", "blue", "that", "Newton", "saw",
    "again",
];

/// Sentences of random words, the same for the same seed.
fn text(seed: u64, words: usize) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::new();
    for i in 0..words {
        out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        out.push_str(if i % 11 == 10 { ". " } else { " " });
    }
    out
}

fn tiny_target(dir: &Path, seed: u64) -> ModelFiles {
    let path = dir.join("target.gguf");
    SyntheticModel::preset("tiny", WeightFormat::F32, seed)
        .unwrap()
        .write_gguf(&path)
        .unwrap();
    tandem_core::model::load(&path).unwrap()
}

fn options(steps: usize) -> Options {
    Options {
        steps,
        batch: 4,
        lr: 3e-3,
        seed: 7,
        eval_every: 0,
        teacher_threads: 1,
    }
}

fn train(
    target: &ModelFiles,
    student: &Student,
    corpus: &Corpus,
    steps: usize,
) -> tandem_distill::Summary {
    let stop = AtomicBool::new(false);
    distill(
        target,
        student,
        corpus,
        &options(steps),
        &stop,
        &mut |_| {},
        &mut |_, _| Ok(()),
    )
    .unwrap()
}

#[test]
fn training_lowers_the_kl_on_held_apart_text() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 31);
    let (train_text, eval_text) = (text(1, 1500), text(2, 300));
    let corpus = Corpus::new(
        &target.tokenizer,
        &train_text,
        EvalSource::Text(&eval_text),
        48,
    )
    .unwrap();
    let student = Student::from_target(&target, &[1], &Device::Cpu).unwrap();
    let summary = train(&target, &student, &corpus, 40);
    eprintln!(
        "KL {:.4} -> {:.4}, agreement {:.3} -> {:.3}",
        summary.before.kl, summary.after.kl, summary.before.agreement, summary.after.agreement
    );
    assert_eq!(summary.steps_done, 40);
    assert!(!summary.interrupted);
    assert!(
        summary.after.kl < 0.6 * summary.before.kl,
        "KL on held-apart text {:.4} -> {:.4}: not lowered by 40%",
        summary.before.kl,
        summary.after.kl
    );
}

#[test]
fn the_written_draft_computes_what_the_student_computes() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 32);
    let corpus = Corpus::new(
        &target.tokenizer,
        &text(3, 400),
        EvalSource::HeldOutTail { tokens: 200 },
        24,
    )
    .unwrap();
    // Layer 1 alone: the student's layer 0 keeps layer 1's RoPE and weights.
    let student = Student::from_target(&target, &[1], &Device::Cpu).unwrap();
    train(&target, &student, &corpus, 3);
    let out = dir.path().join("draft");
    write_student(&target, &student, WeightFormat::F32, &out).unwrap();
    let draft = tandem_core::model::load(&out).unwrap();
    assert_eq!(draft.config.num_layers, 1);
    assert_eq!(draft.tokenizer.vocab_size(), target.tokenizer.vocab_size());
    let config = EngineConfig {
        max_batch_tokens: 64,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(128);
    let mut engine = Engine::new(CpuBackend::new(1), &draft, config, &mut |_, _| {}).unwrap();
    let window = &corpus.eval[0];
    let want: Vec<f32> = student
        .forward(window, 1, window.len())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let got = engine.score(window, 0).unwrap();
    let diff = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(want.len(), got.len());
    assert!(diff < 1e-3, "the loaded draft's logits differ by {diff}");
}

#[test]
fn a_student_of_the_whole_target_matches_it_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 33);
    let corpus = Corpus::new(
        &target.tokenizer,
        &text(4, 400),
        EvalSource::HeldOutTail { tokens: 200 },
        32,
    )
    .unwrap();
    let student = Student::from_target(&target, &[0, 1], &Device::Cpu).unwrap();
    let mut teacher = tandem_distill::teacher::Teacher::new(&target, 32, 1).unwrap();
    let eval = teacher.score(&corpus.eval).unwrap();
    let e = evaluate(&student, &eval).unwrap();
    assert!(e.kl < 1e-4 && e.agreement == 1.0, "{e:?}");
}

#[test]
fn bad_layers_and_short_text_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 34);
    let err = Student::from_target(&target, &[2], &Device::Cpu)
        .err()
        .unwrap();
    assert!(err.to_string().contains("layer 2"), "{err}");
    let err = Corpus::new(
        &target.tokenizer,
        "too short",
        EvalSource::HeldOutTail { tokens: 4 },
        32,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("window of 32"), "{err}");
}
