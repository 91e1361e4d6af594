// Temporary development probe: one synthetic SmolLM2-135M step (decode or prefill chunk).
use std::time::Instant;
use tandem_core::backend::*;
use tandem_core::quant::{quantize_row, WeightFormat, WeightView};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;

fn cpu_ns() -> u64 {
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
    let rows: usize = args[1].parse().unwrap(); // tokens in the step
    let context: usize = args[2].parse().unwrap(); // tokens already cached
    let threads: usize = args[3].parse().unwrap();
    let layers: usize = args.get(4).map_or(30, |s| s.parse().unwrap());
    let b = CpuBackend::new(threads);
    let (dim, kvd, ffn, vocab, heads, kvh, hd) = (576, 192, 1536, 49152, 9, 3, 64);
    let w = |cols: usize, n: usize, f: WeightFormat, seed: u64| { let bytes = quantize_row(f, &values(cols * n, seed, 0.05)); b.upload_weight(WeightView { format: f, rows: n, cols, data: &bytes }).unwrap() };
    struct L { q: tandem_cpu::Weight, k: tandem_cpu::Weight, v: tandem_cpu::Weight, o: tandem_cpu::Weight, g: tandem_cpu::Weight, u: tandem_cpu::Weight, d: tandem_cpu::Weight, n1: tandem_cpu::Weight, n2: tandem_cpu::Weight, cache: tandem_cpu::KvCache }
    let bs = 16; let max_blocks = (context + rows).div_ceil(bs) + 1;
    let layout = KvCacheLayout { num_blocks: max_blocks, block_size: bs, kv_heads: kvh, head_dim: hd, dtype: KvDtype::F32 };
    let ls: Vec<L> = (0..layers as u64).map(|i| L { q: w(dim, dim, WeightFormat::Q4_1, i*10+1), k: w(dim, kvd, WeightFormat::Q4_1, i*10+2), v: w(dim, kvd, WeightFormat::Q4_1, i*10+3), o: w(dim, dim, WeightFormat::Q4_1, i*10+4), g: w(dim, ffn, WeightFormat::Q4_1, i*10+5), u: w(dim, ffn, WeightFormat::Q4_1, i*10+6), d: w(ffn, dim, WeightFormat::Q4_1, i*10+7), n1: w(dim, 1, WeightFormat::F32, i*10+8), n2: w(dim, 1, WeightFormat::F32, i*10+9), cache: b.alloc_kv_cache(layout).unwrap() }).collect();
    let out_w = w(dim, vocab, WeightFormat::Q8_0, 999);
    let norm_out = w(dim, 1, WeightFormat::F32, 998);
    let tables = b.upload_indices(&(0..max_blocks as u32).collect::<Vec<_>>()).unwrap();
    let positions: Vec<u32> = (context..context + rows).map(|p| p as u32).collect();
    let pos = b.upload_indices(&positions).unwrap();
    let slots = pos.clone();
    let row_seq = b.upload_indices(&vec![0; rows]).unwrap();
    let inv_freq = b.upload(&(0..hd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32)).collect::<Vec<_>>()).unwrap();
    let mut ls = ls;
    // fill the context
    for l in &mut ls { let kv = b.upload(&values(context * kvd, 5, 1.0)).unwrap(); let s = b.upload_indices(&(0..context as u32).collect::<Vec<_>>()).unwrap(); b.paged_kv_write(&kv, &kv, &s, context, &mut l.cache).unwrap(); }
    let mut resid = b.upload(&values(rows * dim, 1, 1.0)).unwrap();
    let mut x = b.alloc(rows * dim).unwrap(); let mut q = b.alloc(rows * dim).unwrap(); let mut k = b.alloc(rows * kvd).unwrap(); let mut v = b.alloc(rows * kvd).unwrap();
    let mut att = b.alloc(rows * dim).unwrap(); let mut o = b.alloc(rows * dim).unwrap(); let mut g = b.alloc(rows * ffn).unwrap(); let mut u = b.alloc(rows * ffn).unwrap(); let mut h = b.alloc(rows * ffn).unwrap(); let mut dn = b.alloc(rows * dim).unwrap();
    let mut logits = b.alloc(vocab).unwrap(); let mut last = b.alloc(dim).unwrap(); let mut am = b.upload_indices(&[0]).unwrap();
    let zero = b.alloc(rows * dim).unwrap();
    let np = RmsNormParams { rows, dim, eps: 1e-5 }; let mp = MatmulParams { rows };
    let rp = |heads| RopeParams { rows, heads, head_dim: hd, rotary_dim: hd, style: RopeStyle::NeoX };
    let ap = AttentionParams { rows, heads, kv_heads: kvh, head_dim: hd, block_size: bs, max_blocks_per_seq: max_blocks, scale: 0.125, sliding_window: None };
    let mut iters = 0; let mut matmul_ns = 0u128; let mut attn_ns = 0u128;
    let (t0, c0) = (Instant::now(), cpu_ns());
    while t0.elapsed().as_secs_f64() < 4.0 || iters < 2 {
        for l in &mut ls {
            b.rms_norm_residual(&mut resid, &zero, &l.n1, np, &mut x).unwrap();
            let tm = Instant::now();
            b.matmul(&x, &l.q, None, mp, &mut q).unwrap(); b.matmul(&x, &l.k, None, mp, &mut k).unwrap(); b.matmul(&x, &l.v, None, mp, &mut v).unwrap();
            matmul_ns += tm.elapsed().as_nanos();
            b.rope(&mut q, &pos, &inv_freq, rp(heads)).unwrap(); b.rope(&mut k, &pos, &inv_freq, rp(kvh)).unwrap();
            b.paged_kv_write(&k, &v, &slots, rows, &mut l.cache).unwrap();
            let ta = Instant::now();
            b.paged_attention(&q, &l.cache, AttentionIndices { row_seq: &row_seq, positions: &pos, block_tables: &tables }, ap, &mut att).unwrap();
            attn_ns += ta.elapsed().as_nanos();
            let tm = Instant::now();
            b.matmul(&att, &l.o, None, mp, &mut o).unwrap();
            matmul_ns += tm.elapsed().as_nanos();
            b.rms_norm_residual(&mut resid, &o, &l.n2, np, &mut x).unwrap();
            let tm = Instant::now();
            b.matmul(&x, &l.g, None, mp, &mut g).unwrap(); b.matmul(&x, &l.u, None, mp, &mut u).unwrap();
            matmul_ns += tm.elapsed().as_nanos();
            b.swiglu(&g, &u, rows * ffn, &mut h).unwrap();
            let tm = Instant::now();
            b.matmul(&h, &l.d, None, mp, &mut dn).unwrap();
            matmul_ns += tm.elapsed().as_nanos();
            b.rms_norm_residual(&mut resid, &dn, &l.n1, np, &mut x).unwrap();
        }
        b.gather_rows(&x, &b.upload_indices(&[rows as u32 - 1]).unwrap(), 1, dim, &mut last).unwrap();
        let mut y = b.alloc(dim).unwrap();
        b.rms_norm(&last, &norm_out, RmsNormParams { rows: 1, dim, eps: 1e-5 }, &mut y).unwrap();
        let tm = Instant::now();
        b.matmul(&y, &out_w, None, MatmulParams { rows: 1 }, &mut logits).unwrap();
        matmul_ns += tm.elapsed().as_nanos();
        b.argmax(&logits, 1, vocab, &mut am).unwrap();
        iters += 1;
    }
    let wall = t0.elapsed().as_secs_f64() / iters as f64;
    let cpu = (cpu_ns() - c0) as f64 / 1e9 / iters as f64;
    println!("rows {rows} ctx {context} threads {threads}: wall {:.2} ms/step ({:.1} tok/s), cpu {:.2} ms/step; matmul wall {:.2} ms, attention wall {:.2} ms",
        wall * 1e3, rows as f64 / wall, cpu * 1e3, matmul_ns as f64 / 1e6 / iters as f64, attn_ns as f64 / 1e6 / iters as f64);
}
