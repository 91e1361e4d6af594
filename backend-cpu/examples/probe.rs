// Temporary development probe: on-CPU time per matmul (robust to a loaded machine).
use std::time::Instant;
use tandem_core::backend::MatmulParams;
use tandem_core::quant::{quantize_row, WeightFormat, WeightView};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

fn cpu_ns() -> u64 {
    // whole process: utime+stime in clock ticks (100 Hz)
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()) * 10_000_000
}
fn values(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed | 1;
    (0..len).map(|_| { state ^= state << 13; state ^= state >> 7; state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale }).collect()
}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let format = match args[1].as_str() { "q4_1" => WeightFormat::Q4_1, "q8_0" => WeightFormat::Q8_0, "q4_0" => WeightFormat::Q4_0, "f16" => WeightFormat::F16, "f32" => WeightFormat::F32, _ => WeightFormat::BF16 };
    let tokens: usize = args[2].parse().unwrap();
    let cols: usize = args[3].parse().unwrap();
    let n: usize = args[4].parse().unwrap();
    let copies: usize = args.get(5).map_or(1, |s| s.parse().unwrap());
    let threads: usize = args.get(6).map_or(1, |s| s.parse().unwrap());
    let backend = CpuBackend::new(threads);
    let bytes = quantize_row(format, &values(cols * n, 3, 0.05));
    let ws: Vec<_> = (0..copies).map(|_| backend.upload_weight(WeightView { format, rows: n, cols, data: &bytes }).unwrap()).collect();
    let x = backend.upload(&values(tokens * cols, 5, 1.0)).unwrap();
    let mut out = backend.alloc(tokens * n).unwrap();
    let mut iters = 0usize;
    let (t0, c0) = (Instant::now(), cpu_ns());
    let fixed: Option<usize> = std::env::var("ITERS").ok().map(|v| v.parse().unwrap());
    while fixed.map_or(t0.elapsed().as_secs_f64() < 3.0 || iters < 3, |n| iters < n) {
        for w in &ws { backend.matmul(&x, w, None, MatmulParams { rows: tokens }, &mut out).unwrap(); }
        iters += 1;
    }
    let cpu = (cpu_ns() - c0) as f64 / (iters * copies) as f64;
    let wall = t0.elapsed().as_secs_f64() * 1e9 / (iters * copies) as f64;
    println!("{:?} {}x{}x{}: cpu {:.1} us/op (wall {:.1}), {:.2} GB/s/core, {:.2} GMAC/s/core",
        format, tokens, cols, n, cpu / 1e3, wall / 1e3, bytes.len() as f64 / cpu, (tokens * cols * n) as f64 / cpu);
}
