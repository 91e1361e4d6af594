//! The whole model on the CUDA backend against the CPU backend
//! (`tandem_tests::backend_e2e`), and CUDA-graph decode against launching
//! every kernel (`tandem_tests::decode_mix`). Without a CUDA driver or
//! device the tests say so and pass, unless `TANDEM_REQUIRE_CUDA=1`
//! (scripts/gpu-check.sh sets it), where that fails.

use std::io::Write;

use tandem_core::quant::WeightFormat;
use tandem_cuda::CudaBackend;
use tandem_tests::{backend_e2e, decode_mix};

fn cuda() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var("TANDEM_REQUIRE_CUDA").as_deref() != Ok("1"),
                "TANDEM_REQUIRE_CUDA=1 but {e}"
            );
            // Written past libtest's capture so the skip shows in every run's output.
            let _ = writeln!(
                std::io::stderr(),
                "CUDA: no device, end-to-end tests not run ({e})"
            );
            None
        }
    }
}

#[test]
fn moe_models_match_the_cpu() {
    if cuda().is_none() {
        return;
    }
    backend_e2e::moe_models_match_the_cpu(|| CudaBackend::new(0).expect("CUDA device"), 2e-3);
}

#[test]
fn kquant_moe_models_match_the_cpu() {
    if cuda().is_none() {
        return;
    }
    backend_e2e::kquant_moe_models_match_the_cpu(
        || CudaBackend::new(0).expect("CUDA device"),
        2e-3,
    );
}

#[test]
fn tiny_model_logits_match_the_cpu_over_prefill_and_decode() {
    if cuda().is_none() {
        return;
    }
    let formats = [
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::F32,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
    ];
    backend_e2e::tiny_models_match_the_cpu(
        &formats,
        |_| CudaBackend::new(0).expect("CUDA device"),
        |format| if format.is_quantized() { 1e-2 } else { 2e-3 },
    );
}

#[test]
fn smollm2_greedy_output_equals_the_cpu_backend() {
    if let Some(backend) = cuda() {
        backend_e2e::smollm2_greedy_matches_the_cpu(backend);
    }
}

#[test]
fn cuda_graph_decode_gives_the_eager_events() {
    if cuda().is_some() {
        decode_mix::recorded_decode_matches_eager(|| CudaBackend::new(0).expect("CUDA device"));
    }
}

/// NCCL on one rank, on the backend's stream, through the path a `--tp`
/// job's branch outputs take: it initialises, and the sum over one rank
/// leaves the data as it was.
#[test]
fn nccl_all_reduce_on_one_rank() {
    use tandem_core::Backend;
    let Some(cuda) = cuda() else {
        return;
    };
    let comm = tandem_core::parallel::SingleRank;
    cuda.join_ranks(&comm).expect("NCCL on one rank");
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut t = cuda.upload(&data).unwrap();
    cuda.all_reduce_sum(&mut t, 999, &comm).unwrap();
    assert_eq!(cuda.download(&t, 1000).unwrap(), data);
}

#[test]
fn eagle_head_keeps_the_greedy_output() {
    if cuda().is_none() {
        return;
    }
    backend_e2e::eagle_head_keeps_the_greedy_output(
        || CudaBackend::new(0).expect("CUDA device"),
        2e-3,
    );
}

#[test]
fn sparse_speculation_keeps_the_greedy_output() {
    if cuda().is_none() {
        return;
    }
    backend_e2e::sparse_speculation_keeps_the_greedy_output(|| {
        CudaBackend::new(0).expect("CUDA device")
    });
}
