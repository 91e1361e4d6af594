//! Drafts distilled by `tandem-distill` from a tiny target for a few dozen
//! steps, written to a directory and loaded from there, as `--speculate
//! draft:DIR` loads them.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_distill::write::write_student;
use tandem_distill::{distill, vocab, Corpus, Device, Options, Student};

/// What [`draft`] trains, each from the target's layer 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distilled {
    Layers,
    /// With an output head of this many tokens: the windows' most frequent.
    Reduced(usize),
    Eagle,
}

/// A draft of `kind` distilled from `target` for 40 steps on windows of
/// `stem` followed by 20 random tokens, written to `dir` and loaded.
pub fn draft(target: &ModelFiles, dir: &Path, kind: Distilled, stem: &[u32]) -> ModelFiles {
    let vocab = target.config.vocab_size as u64;
    let mut rng = tandem_core::sched::Rng::new(5);
    let mut windows = |n: usize| -> Vec<Vec<u32>> {
        (0..n)
            .map(|_| {
                let random = (0..20).map(|_| (rng.next_u64() % vocab) as u32);
                stem.iter().copied().chain(random).collect()
            })
            .collect()
    };
    let corpus = Corpus {
        train: windows(64),
        eval: windows(2),
    };
    let mut student = match kind {
        Distilled::Eagle => Student::eagle_from_target(target, &[1], &Device::Cpu).unwrap(),
        _ => Student::from_target(target, &[1], &Device::Cpu).unwrap(),
    };
    if let Distilled::Reduced(size) = kind {
        let tokens = vocab::frequent_tokens(&target.tokenizer, &corpus.train, size).unwrap();
        student = student.with_output_tokens(tokens).unwrap();
    }
    let options = Options {
        steps: 40,
        batch: 4,
        lr: 3e-3,
        seed: 1,
        eval_every: 0,
        teacher_threads: 1,
    };
    let stop = AtomicBool::new(false);
    let summary = distill(
        target,
        &student,
        &corpus,
        &options,
        &stop,
        &mut |_| {},
        &mut |_, _| Ok(()),
    )
    .unwrap();
    eprintln!(
        "distilled {kind:?}: KL {:.3} -> {:.3}, agreement {:.2} -> {:.2}",
        summary.before.kl, summary.after.kl, summary.before.agreement, summary.after.agreement
    );
    write_student(target, &student, WeightFormat::F32, dir).unwrap();
    let draft = tandem_core::model::load(dir).unwrap();
    let reduced = match kind {
        Distilled::Reduced(size) => Some(size),
        _ => None,
    };
    assert_eq!(draft.config.output_tokens.as_ref().map(Vec::len), reduced);
    assert_eq!(draft.config.reads_hidden, kind == Distilled::Eagle);
    draft
}
