//! The conformance suite with the fast CPU backend under test against a
//! second CPU backend: every kernel is the same code on both sides, except
//! the fused matmuls, which the suite compares with the unfused composition
//! they replace (and a different thread count, which must not matter).

use tandem_cpu::CpuBackend;
use tandem_tests::conformance;

#[test]
fn fused_matmuls_match_the_unfused_composition_on_the_cpu() {
    let report = conformance::compare_backends(&CpuBackend::new(3), &CpuBackend::new(2));
    println!("{report}");
    let problems = report.problems();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
