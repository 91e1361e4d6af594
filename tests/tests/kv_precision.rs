//! Per-layer KV precision (`--kv-dtype auto`, `plan:`): each layer's cache
//! takes the plan's key and value dtypes, a uniform plan is the uniform
//! dtype, a mixed plan gives the same tokens on the CPU and wgpu, and the
//! calibrated plan keeps within its budget; bad plans and too little
//! calibration text are refused with what is wrong.

use tandem_core::backend::{Backend, KvDtype};
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::kv::plan::{choose_plan, AutoKvPlan};
use tandem_core::kv::{KvPlan, KvPrecision};
use tandem_core::model::forward::{ForwardBatch, Model};
use tandem_core::model::kv_calibration::{calibrate_kv, calibration_passes, uniform_pairs_within};
use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_core::sched::SamplingParams;
use tandem_cpu::CpuBackend;
use tandem_tests::{tiny, tiny_gguf};
use tandem_wgpu::{WgpuBackend, WgpuOptions};

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + 11) % 250).collect()
}

fn engine<B: Backend>(
    backend: B,
    files: &ModelFiles,
    kv_precision: KvPrecision,
) -> tandem_core::Result<Engine<B>> {
    let config = EngineConfig {
        block_size: 4,
        num_blocks: 64,
        max_batch_tokens: 64,
        kv_precision,
        ..EngineConfig::default()
    };
    Engine::new(backend, files, config, &mut |_, _| {})
}

fn greedy<B: Backend>(engine: &mut Engine<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let seq = engine
        .add_request(prompt.to_vec(), SamplingParams::default(), n, vec![])
        .expect("request");
    while !engine.is_finished(seq) {
        engine.step().expect("step");
    }
    engine.tokens(seq).expect("kept")[prompt.len()..].to_vec()
}

fn three_layers() -> SyntheticModel {
    SyntheticModel::preset("tiny-llama3", WeightFormat::F32, 41).expect("preset")
}

fn mixed_plan() -> KvPlan {
    "int8/int2,int4/int8,int2/int4".parse().unwrap()
}

#[test]
fn each_layer_stores_its_plans_dtypes_and_they_change_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &three_layers());
    let cpu = CpuBackend::new(2);
    let model = Model::load(&cpu, &files, &mut |_, _| {}).unwrap();
    let plan = mixed_plan();
    let caches = model.alloc_planned_kv_caches(&cpu, 8, 4, &plan).unwrap();
    for (cache, want) in caches.iter().zip(plan.layers()) {
        assert_eq!(
            (cache.layout().keys, cache.layout().values),
            (want.keys, want.values)
        );
    }
    // Layer 0's values at 2 bits instead of 8 move the logits: the plan is
    // not a label.
    let tokens = prompt(13);
    let logits = |plan: &KvPlan| {
        let mut kv = model.alloc_planned_kv_caches(&cpu, 8, 4, plan).unwrap();
        let mut batch = ForwardBatch::new(4, 8);
        let slots: Vec<u32> = (0..tokens.len() as u32).collect();
        batch.push_sequence(&tokens, 0, &slots, &(0..8).collect::<Vec<_>>());
        batch.logit_rows = vec![tokens.len() as u32 - 1];
        let out = model.forward(&cpu, &batch, &mut kv).unwrap();
        cpu.download(&out, model.config.vocab_size).unwrap()
    };
    let int8 = logits(&KvPlan::uniform(KvDtype::Int8, 3));
    let two_bit_values: KvPlan = "int8/int2,int8/int8*2".parse().unwrap();
    assert_ne!(int8, logits(&two_bit_values));
    assert_eq!(int8, logits(&"int8/int8*3".parse().unwrap()));
}

#[test]
fn a_uniform_plan_is_the_uniform_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 8));
    let p = prompt(21);
    for dtype in [KvDtype::Int4, KvDtype::Int2] {
        let mut uniform = engine(CpuBackend::new(2), &files, dtype.into()).unwrap();
        let plan = KvPrecision::Plan(KvPlan::uniform(dtype, 2));
        let mut planned = engine(CpuBackend::new(2), &files, plan).unwrap();
        assert_eq!(greedy(&mut planned, &p, 12), greedy(&mut uniform, &p, 12));
        assert_eq!(planned.kv_bytes_per_token(), uniform.kv_bytes_per_token());
    }
}

#[test]
fn a_mixed_plan_gives_the_same_tokens_on_cpu_and_wgpu() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &three_layers());
    let gpu = WgpuBackend::new(WgpuOptions::default()).unwrap_or_else(|e| {
        panic!("{e}\nthe wgpu tests need an adapter: `apt-get install mesa-vulkan-drivers`")
    });
    let plan = KvPrecision::Plan(mixed_plan());
    let mut cpu = engine(CpuBackend::new(2), &files, plan.clone()).unwrap();
    let mut gpu = engine(gpu, &files, plan).unwrap();
    // Prompts cross blocks mid-way and decoding re-quantizes INT4 key blocks.
    for len in [5, 19] {
        let p = prompt(len);
        assert_eq!(
            greedy(&mut gpu, &p, 14),
            greedy(&mut cpu, &p, 14),
            "prompt of {len}"
        );
    }
    let shape = cpu.model().kv_shape(4);
    assert_eq!(
        cpu.kv_bytes_per_token(),
        mixed_plan().bytes_per_token(shape)
    );
}

#[test]
fn a_calibrated_plan_stays_within_its_budget_and_beats_the_uniform_pairs_there() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &three_layers());
    let cpu = CpuBackend::new(1);
    let model = Model::load(&cpu, &files, &mut |_, _| {}).unwrap();
    let shape = model.kv_shape(4);
    let uniform = |d| KvPlan::uniform(d, 3).bits_per_element(shape);
    let (int2, int4, int8) = (
        uniform(KvDtype::Int2),
        uniform(KvDtype::Int4),
        uniform(KvDtype::Int8),
    );
    let mut picked_a_mixed_plan = false;
    for bits in [int2, (int2 + int4) / 2.0, int4, (int4 + int8) / 2.0, int8] {
        let c = calibrate_kv(&model, &cpu, &prompt(48), 4, bits).unwrap();
        assert!(c.passes <= calibration_passes(shape, 3, bits));
        // Every uniform pair within the budget was measured, and the base
        // is the best of them.
        assert_eq!(
            c.uniform.iter().map(|u| u.0).collect::<Vec<_>>(),
            uniform_pairs_within(shape, 3, bits)
        );
        assert!(c.uniform.iter().all(|u| u.1 >= c.base_kl));
        // Each layer was measured alone against F16 (a KL, never below 0).
        assert!(c.sensitivity.keys.iter().flatten().all(|&kl| kl >= 0.0));
        assert!(c.sensitivity.float.iter().all(|&loss| loss == 0.0));
        // The planner's pick comes from those losses, and is kept only
        // where it measures no worse than the best uniform pair.
        assert_eq!(c.chosen, choose_plan(&c.sensitivity, shape, bits).unwrap());
        if c.chosen_kl <= c.base_kl {
            assert_eq!(c.plan, c.chosen);
            picked_a_mixed_plan |= c.plan.uniform_dtype().is_none();
        } else {
            assert_eq!(c.plan, KvPlan::uniform_pair(c.base, 3));
        }
        assert!(
            c.plan.bits_per_element(shape) <= bits,
            "{} over {bits}",
            c.plan
        );

        let auto = KvPrecision::Auto(AutoKvPlan {
            bits_per_element: bits,
            calibration: prompt(48),
        });
        let mut e = engine(CpuBackend::new(2), &files, auto).unwrap();
        // The engine stores the calibrated plan.
        assert_eq!(e.kv_plan(), &c.plan);
        assert_eq!(greedy(&mut e, &prompt(9), 6).len(), 6);
    }
    assert!(picked_a_mixed_plan, "no budget kept a mixed plan");
}

#[test]
fn bad_precisions_are_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &three_layers());
    let refused = |precision: KvPrecision| match engine(CpuBackend::new(1), &files, precision) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    let err = refused(KvPrecision::Plan(KvPlan::uniform(KvDtype::Int8, 2)));
    assert!(err.contains("names 2 layers but the model has 3"), "{err}");
    let err = refused(KvPrecision::Auto(AutoKvPlan {
        bits_per_element: 4.5,
        calibration: prompt(20),
    }));
    assert!(err.contains("at least 32 tokens"), "{err}");
    let err = refused(KvPrecision::Auto(AutoKvPlan {
        bits_per_element: 1.0,
        calibration: prompt(40),
    }));
    assert!(err.contains("below the cheapest plan's"), "{err}");
}
