//! Distillation on tiny random targets: the written draft computes what the
//! trained student computes, and training lowers the KL divergence from the
//! target on text it never saw, with the whole vocabulary or a reduced one.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use candle_core::Device;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::Rng;
use tandem_core::spec::{DraftModel, DraftModelConfig, EagleDraft};
use tandem_core::tokenizer::ChatMessage;
use tandem_cpu::CpuBackend;
use tandem_distill::corpus::EvalSource;
use tandem_distill::train::evaluate;
use tandem_distill::write::write_student;
use tandem_distill::{distill, responses, vocab, Corpus, Options, Student};

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

/// Windows of 48 tokens: 1500 words to train on, 300 others to evaluate.
fn sentences(target: &ModelFiles, seed: u64) -> Corpus {
    let (train_text, eval_text) = (text(seed, 1500), text(seed + 1, 300));
    Corpus::new(
        &target.tokenizer,
        &train_text,
        EvalSource::Text(&eval_text),
        48,
    )
    .unwrap()
}

/// The student's logits for one window (its first pass), flattened.
fn student_logits(student: &Student, window: &[u32], hidden: Option<&[f32]>) -> Vec<f32> {
    student.forward(window, 1, window.len(), hidden).unwrap()[0]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
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
    let corpus = sentences(&target, 1);
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
    let want = student_logits(&student, window, None);
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
fn a_reduced_vocabulary_draft_learns_and_loads_as_trained() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 35);
    let corpus = sentences(&target, 5);
    let vocab_size = target.config.vocab_size;
    let tokens = vocab::frequent_tokens(&target.tokenizer, &corpus.train, 20).unwrap();
    assert_eq!(tokens.len(), 20);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]));
    for eos in target.tokenizer.eos_tokens() {
        assert!(tokens.contains(eos), "end-of-sequence {eos} left out");
    }
    // Twenty tokens, the specials among them, hold most of a text of 24 words.
    assert!(vocab::coverage(&tokens, &corpus.eval) > 0.7);
    let student = Student::from_target(&target, &[1], &Device::Cpu)
        .unwrap()
        .with_output_tokens(tokens.clone())
        .unwrap();
    let summary = train(&target, &student, &corpus, 40);
    eprintln!(
        "reduced: KL {:.4} -> {:.4}, agreement {:.3} -> {:.3}, coverage {:.3}",
        summary.before.kl,
        summary.after.kl,
        summary.before.agreement,
        summary.after.agreement,
        summary.after.coverage
    );
    assert!(
        summary.after.kl < 0.6 * summary.before.kl,
        "KL among the draft's tokens {:.4} -> {:.4}: not lowered by 40%",
        summary.before.kl,
        summary.after.kl
    );
    assert!(summary.after.agreement <= summary.after.coverage);

    let out = dir.path().join("draft");
    write_student(&target, &student, WeightFormat::F32, &out).unwrap();
    let draft = tandem_core::model::load(&out).unwrap();
    assert_eq!(draft.config.output_tokens.as_deref(), Some(&tokens[..]));
    let config = EngineConfig::default().with_capacity_tokens(128);
    let err = Engine::new(CpuBackend::new(1), &draft, config, &mut |_, _| {})
        .err()
        .expect("a reduced-vocabulary draft does not run alone");
    assert!(err.to_string().contains("20 of its"), "{err}");

    let backend = CpuBackend::new(1);
    let draft_config = DraftModelConfig {
        block_size: 16,
        capacity_tokens: 256,
        kv_dtype: Default::default(),
        max_batch_tokens: 64,
        cascade: None,
    };
    let mut loaded = DraftModel::load(&backend, &draft, None, draft_config).unwrap();
    let window = &corpus.eval[0];
    let want = student_logits(&student, window, None);
    let got = loaded.score(&backend, window).unwrap();
    assert_eq!(got.len(), window.len() * vocab_size);
    for (row, wide) in want.chunks(tokens.len()).zip(got.chunks(vocab_size)) {
        for (t, &logit) in wide.iter().enumerate() {
            match tokens.binary_search(&(t as u32)) {
                Ok(i) => assert!((logit - row[i]).abs() < 1e-3, "token {t}"),
                Err(_) => assert_eq!(logit, f32::NEG_INFINITY, "token {t}"),
            }
        }
    }
}

#[test]
fn an_eagle_head_learns_from_the_targets_hidden_states_and_loads_as_trained() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 37);
    let corpus = sentences(&target, 6);
    let student = Student::eagle_from_target(&target, &[1], &Device::Cpu)
        .unwrap()
        .with_output_tokens(vocab::frequent_tokens(&target.tokenizer, &corpus.train, 40).unwrap())
        .unwrap();
    assert!(student.reads_hidden());
    let summary = train(&target, &student, &corpus, 40);
    let second = summary
        .after
        .second_agreement
        .expect("an EAGLE head's second draft");
    eprintln!(
        "EAGLE: KL {:.4} -> {:.4}, agreement {:.3} -> {:.3}, second draft {second:.3}",
        summary.before.kl, summary.after.kl, summary.before.agreement, summary.after.agreement
    );
    assert!(
        summary.after.kl < 0.6 * summary.before.kl,
        "KL on held-apart text {:.4} -> {:.4}: not lowered by 40%",
        summary.before.kl,
        summary.after.kl
    );

    let out = dir.path().join("eagle");
    write_student(&target, &student, WeightFormat::F32, &out).unwrap();
    let head = tandem_core::model::load(&out).unwrap();
    assert!(head.config.reads_hidden);
    assert_eq!(head.config.num_layers, 1);
    let config = EngineConfig::default().with_capacity_tokens(128);
    let err = Engine::new(CpuBackend::new(1), &head, config, &mut |_, _| {})
        .err()
        .expect("an EAGLE head does not run alone");
    assert!(err.to_string().contains("EAGLE head"), "{err}");

    // The loaded head, fed the target's hidden states, gives the student's logits.
    let window = &corpus.eval[0];
    let config = EngineConfig::default().with_capacity_tokens(128);
    let mut engine = Engine::new(CpuBackend::new(1), &target, config, &mut |_, _| {}).unwrap();
    let (_, hidden) = engine.score_hidden(window).unwrap();
    let backend = CpuBackend::new(1);
    let draft_config = DraftModelConfig {
        block_size: 16,
        capacity_tokens: 256,
        kv_dtype: Default::default(),
        // Awkward chunks: the scratch sequence is fed in three passes.
        max_batch_tokens: 20,
        cascade: None,
    };
    let dim = target.config.hidden_size;
    let mut loaded = EagleDraft::load(&backend, &head, dim, draft_config.clone()).unwrap();
    let want = student_logits(&student, window, Some(&hidden));
    let got = loaded.score(&backend, window, &hidden).unwrap();
    let tokens = student.output_tokens().unwrap();
    let vocab_size = target.config.vocab_size;
    assert_eq!(got.len(), window.len() * vocab_size);
    for (row, wide) in want.chunks(tokens.len()).zip(got.chunks(vocab_size)) {
        for (&t, &logit) in tokens.iter().zip(row) {
            let diff = (wide[t as usize] - logit).abs();
            assert!(diff < 1e-3, "token {t}: {} vs {logit}", wide[t as usize]);
        }
    }
    let err = EagleDraft::load(&backend, &head, dim + 1, draft_config.clone())
        .err()
        .unwrap();
    assert!(err.to_string().contains("hidden states of"), "{err}");
    let err = DraftModel::load(&backend, &head, None, draft_config)
        .err()
        .unwrap();
    assert!(err.to_string().contains("EAGLE head"), "{err}");
}

#[test]
fn the_targets_hidden_states_give_its_logits_through_its_head() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 38);
    let config = EngineConfig {
        max_batch_tokens: 7,
        ..EngineConfig::default()
    }
    .with_capacity_tokens(128);
    let mut engine = Engine::new(CpuBackend::new(1), &target, config, &mut |_, _| {}).unwrap();
    let tokens: Vec<u32> = (0..19).map(|i| (i * 37 % 300) as u32).collect();
    let (logits, hidden) = engine.score_hidden(&tokens).unwrap();
    assert_eq!(logits, engine.score(&tokens, 0).unwrap());
    let (dim, vocab) = (target.config.hidden_size, target.config.vocab_size);
    assert_eq!(hidden.len(), tokens.len() * dim);
    let norm = tandem_distill::target_weights::load(&target, "output_norm.weight").unwrap();
    let head_name = match target.config.tied_embeddings {
        true => "token_embd.weight",
        false => "output.weight",
    };
    let head = tandem_distill::target_weights::load(&target, head_name).unwrap();
    for (h, want) in hidden.chunks(dim).zip(logits.chunks(vocab)) {
        let rms =
            (h.iter().map(|x| x * x).sum::<f32>() / dim as f32 + target.config.rms_eps).sqrt();
        let normed: Vec<f32> = h.iter().zip(&norm.data).map(|(x, w)| x / rms * w).collect();
        for (row, &want) in head.data.chunks(dim).zip(want) {
            let got: f32 = row.iter().zip(&normed).map(|(a, b)| a * b).sum();
            assert!(
                (got - want).abs() < 1e-3 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }
}

#[test]
fn the_target_answers_instructions_in_its_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path(), 36);
    let instructions: Vec<String> = ["light and glass", "red green blue", "Newton"]
        .map(String::from)
        .to_vec();
    let mut reported = Vec::new();
    let mut progress = |done, generated| reported.push((done, generated));
    let got = responses::answer(&target, &instructions, 5, 1, &mut progress).unwrap();
    assert_eq!(got.len(), 3);
    let tokenizer = &target.tokenizer;
    let mut generated = 0;
    for (conversation, text) in got.iter().zip(&instructions) {
        let turn = [ChatMessage::new("user", text.as_str())];
        let rendered = tokenizer.apply_chat_template(&turn, true).unwrap();
        let prompt = tokenizer.encode(&rendered, true).unwrap();
        assert!(conversation.starts_with(&prompt), "{text}");
        let answer = conversation.len() - prompt.len();
        assert!((1..=5).contains(&answer), "{text}: {answer} tokens");
        generated += answer;
    }
    assert_eq!(reported.last(), Some(&(3, generated)));
    // Greedy: the same answers again.
    let again = responses::answer(&target, &instructions, 5, 1, &mut |_, _| {}).unwrap();
    assert_eq!(again, got);
    let err = responses::answer(&target, &instructions, 0, 1, &mut |_, _| {})
        .err()
        .unwrap();
    assert!(err.to_string().contains("0 tokens"), "{err}");
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
    let mut teacher = tandem_distill::teacher::Teacher::new(&target, 32, 1, false).unwrap();
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
    let twice = Student::from_target(&target, &[1], &Device::Cpu)
        .unwrap()
        .with_output_tokens(vec![1, 2, 3])
        .unwrap()
        .with_output_tokens(vec![1, 2])
        .err()
        .unwrap();
    assert!(twice.to_string().contains("already"), "{twice}");
    let windows = [vec![1, 2, 3]];
    for size in [0, target.config.vocab_size] {
        let err = vocab::frequent_tokens(&target.tokenizer, &windows, size)
            .err()
            .unwrap();
        assert!(err.to_string().contains("draft vocabulary"), "{err}");
    }
}
