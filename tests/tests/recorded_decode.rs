//! Recorded decode steps (CUDA graphs), checked on a CPU backend that
//! records like CUDA does (`tandem_tests::recording_cpu`): the engine gives
//! the same tokens, logprobs and sampled draws with recording as without,
//! through joins and departures, forks, preemption, speculation, failed
//! captures and outputs that never come back.

use tandem_core::backend::KvDtype;
use tandem_core::engine::EngineStats;
use tandem_core::model::forward::{ForwardBatch, Model};
use tandem_core::model::recorded::DecodeRecorder;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::Backend;
use tandem_cpu::CpuBackend;
use tandem_tests::decode_mix::{self, engine, prompt, run};
use tandem_tests::recording_cpu::RecordingCpu;
use tandem_tests::{tiny, tiny_gguf};

/// Runs the requests eagerly on the CPU and recorded on `RecordingCpu`,
/// checks the events are identical, and returns the recorded run's counters.
fn same_as_eager(files: &ModelFiles, kv_tokens: usize, speculate: bool) -> EngineStats {
    let (want, eager_stats) = run(engine(CpuBackend::new(2), files, kv_tokens), speculate);
    let (got, stats) = run(engine(RecordingCpu::new(2), files, kv_tokens), speculate);
    assert_eq!(eager_stats.recorded_steps, Default::default());
    assert_eq!(got, want);
    stats
}

#[test]
fn recorded_decode_gives_the_eager_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::Q8_0, 21));
    let stats = same_as_eager(&files, 2048, false).recorded_steps;
    assert!(
        stats.recorded > 0 && stats.replayed > stats.recorded,
        "{stats:?}"
    );
    assert_eq!(stats.failed, 0, "{stats:?}");
}

#[test]
fn recorded_decode_survives_preemption() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 22));
    // Six blocks of 16 tokens: sequences are preempted and recomputed.
    let stats = same_as_eager(&files, 96, false);
    assert!(stats.preemptions > 0, "{stats:?}");
    assert!(stats.recorded_steps.replayed > 0, "{stats:?}");
}

#[test]
fn recorded_decode_with_speculation() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 23));
    let stats = same_as_eager(&files, 2048, true);
    assert!(stats.speculation.proposed_tokens > 0, "{stats:?}");
}

#[test]
fn failed_captures_run_eagerly() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 24));
    let (want, _) = run(engine(CpuBackend::new(2), &files, 2048), false);
    let (got, stats) = run(
        engine(RecordingCpu::failing_captures(2), &files, 2048),
        false,
    );
    assert_eq!(got, want);
    let stats = stats.recorded_steps;
    assert!(stats.failed > 0, "{stats:?}");
    assert_eq!((stats.recorded, stats.replayed), (0, 0));
    assert!(stats.last_error.unwrap().contains("fails every capture"));
}

#[test]
fn recording_on_and_off_give_the_same_events() {
    decode_mix::recorded_decode_matches_eager(|| RecordingCpu::new(2));
}

#[test]
fn recording_off_runs_eagerly() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 25));
    let mut off = engine(RecordingCpu::new(2), &files, 2048);
    off.enable_recording(false);
    let (_, stats) = run(off, false);
    assert_eq!(stats.recorded_steps, Default::default());
}

/// One decode token of sequence 0 at `pos`, its KV in block 0.
fn decode_batch(token: u32, pos: usize) -> ForwardBatch {
    let mut batch = ForwardBatch::new(16, 1);
    batch.push_sequence(&[token], pos, &[pos as u32], &[0]);
    batch.logit_rows = vec![0];
    batch
}

/// The decode logits of `tokens` after a 10-token prompt, computed eagerly.
fn eager_logits(files: &ModelFiles, tokens: &[u32]) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::new(2);
    let model = Model::load(&cpu, files, &mut |_, _| {}).unwrap();
    let mut kv = model.alloc_kv_caches(&cpu, 1, 16, KvDtype::F32).unwrap();
    let mut prefill = ForwardBatch::new(16, 1);
    prefill.push_sequence(&prompt(10, 9), 0, &(0..10).collect::<Vec<_>>(), &[0]);
    model.forward(&cpu, &prefill, &mut kv).unwrap();
    tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let logits = model
                .forward(&cpu, &decode_batch(t, 10 + i), &mut kv)
                .unwrap();
            cpu.download(&logits, model.config.vocab_size).unwrap()
        })
        .collect()
}

#[test]
fn outputs_that_never_come_back_start_a_fresh_recording() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 26));
    let tokens = [7, 99, 3, 42];
    let want = eager_logits(&files, &tokens);

    let b = RecordingCpu::new(2);
    let model = Model::load(&b, &files, &mut |_, _| {}).unwrap();
    let vocab = model.config.vocab_size;
    let mut kv = model.alloc_kv_caches(&b, 1, 16, KvDtype::F32).unwrap();
    let mut prefill = ForwardBatch::new(16, 1);
    prefill.push_sequence(&prompt(10, 9), 0, &(0..10).collect::<Vec<_>>(), &[0]);
    model.forward(&b, &prefill, &mut kv).unwrap();
    let mut recorder = DecodeRecorder::new(2, 4);
    let mut step = |recorder: &mut DecodeRecorder<RecordingCpu>, i: usize| {
        let out = recorder
            .run(&b, &model, &decode_batch(tokens[i], 10 + i), &mut kv)
            .unwrap();
        assert_eq!(
            b.download(&out.logits, vocab).unwrap(),
            want[i],
            "token {i}"
        );
        out
    };
    // Recorded, then kept: the next step must not replay into it.
    let kept = step(&mut recorder, 0);
    let second = step(&mut recorder, 1);
    assert_eq!(recorder.stats().recorded, 2);
    // An output of the dropped buffer set is refused; this set's are taken.
    recorder.give_back_logits(kept.logits, kept.generation);
    recorder.give_back_ids(kept.ids, kept.generation);
    recorder.give_back_logits(second.logits, second.generation);
    recorder.give_back_ids(second.ids, second.generation);
    let third = step(&mut recorder, 2);
    recorder.give_back_logits(third.logits, third.generation);
    recorder.give_back_ids(third.ids, third.generation);
    step(&mut recorder, 3);
    let stats = recorder.stats();
    assert_eq!((stats.recorded, stats.replayed), (2, 2), "{stats:?}");
}

#[test]
fn the_recorder_refuses_batches_it_cannot_replay() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 27));
    let b = RecordingCpu::new(1);
    let model = Model::load(&b, &files, &mut |_, _| {}).unwrap();
    let mut kv = model.alloc_kv_caches(&b, 4, 16, KvDtype::F32).unwrap();
    let mut recorder = DecodeRecorder::new(2, 2);
    // Two rows of one sequence (a prompt chunk), and a table too wide.
    let mut chunk = ForwardBatch::new(16, 1);
    chunk.push_sequence(&[1, 2], 0, &[0, 1], &[0]);
    chunk.logit_rows = vec![0, 1];
    let mut wide = ForwardBatch::new(16, 4);
    wide.push_sequence(&[1], 0, &[0], &[0]);
    wide.logit_rows = vec![0];
    for batch in [chunk, wide] {
        assert!(!recorder.accepts(&batch));
        let err = recorder.run(&b, &model, &batch, &mut kv).err().unwrap();
        assert!(err.to_string().contains("recorded decode step"), "{err}");
    }
}
