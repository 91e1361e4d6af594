//! One decoder layer's matmuls fused against unfused on the browser's
//! WebGPU ([`bench_fused_layer`], printed by `tests/web/kernels.mjs`): the
//! shapes of SmolLM2-135M (576 wide, 192-wide K and V, FFN 1536), Q4_1
//! weights, one token, as a decode step runs them. Attention and RoPE, the
//! same in both, are left out. The browser cannot block on the GPU, so each
//! timed batch ends with an awaited download of the residual stream.

use js_sys::{Date, Object, Reflect};
use wasm_bindgen::prelude::*;

use tandem_core::backend::{
    Backend, Glu, MatmulParams, MatmulTarget, NormPrologue, RmsNormParams, SplitOut,
};
use tandem_core::quant::{concat_rows, quantize_matrix, WeightFormat, WeightView};
use tandem_core::Result;
use tandem_wgpu::{WgpuBackend, WgpuTensor, WgpuWeight};

use crate::conformance::Rng;

const DIM: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const EPS: f32 = 1e-5;
/// Rounds of (unfused, fused); each side's time is its fastest round.
const ROUNDS: usize = 3;

/// Both ways of holding one layer's weights.
struct Layer {
    attn_norm: WgpuWeight,
    ffn_norm: WgpuWeight,
    q: WgpuWeight,
    k: WgpuWeight,
    v: WgpuWeight,
    qkv: WgpuWeight,
    o: WgpuWeight,
    gate: WgpuWeight,
    up: WgpuWeight,
    gate_up: WgpuWeight,
    down: WgpuWeight,
}

struct Activations {
    residual: WgpuTensor,
    delta: WgpuTensor,
    normed: WgpuTensor,
    q: WgpuTensor,
    k: WgpuTensor,
    v: WgpuTensor,
    gate: WgpuTensor,
    up: WgpuTensor,
    act: WgpuTensor,
}

/// Milliseconds per layer and launches per layer of each side, and the
/// adapter: `{ adapter, unfusedMs, fusedMs, unfusedLaunches, fusedLaunches }`.
/// `options` as `runKernelConformance`'s.
#[wasm_bindgen(js_name = benchFusedLayer)]
pub async fn bench_fused_layer(
    reps: u32,
    options: Option<Object>,
) -> std::result::Result<Object, JsError> {
    let js = |e: tandem_core::Error| JsError::new(&e.to_string());
    let gpu = WgpuBackend::new_async(crate::wgpu_options(options))
        .await
        .map_err(js)?;
    let layer = Layer::random(&gpu).map_err(js)?;
    let mut a = Activations::new(&gpu).map_err(js)?;
    let reps = reps.max(1);
    let mut best = [f64::INFINITY; 2];
    let mut launches = [0.0; 2];
    for _ in 0..ROUNDS {
        for (side, fused) in [false, true].into_iter().enumerate() {
            // The first call compiles the pipelines: not timed.
            layer.run(&gpu, &mut a, fused).map_err(js)?;
            gpu.download_async(&a.residual, 1).await.map_err(js)?;
            let (start, before) = (Date::now(), gpu.kernel_launches().unwrap_or(0));
            for _ in 0..reps {
                layer.run(&gpu, &mut a, fused).map_err(js)?;
            }
            gpu.download_async(&a.residual, 1).await.map_err(js)?;
            best[side] = best[side].min((Date::now() - start) / f64::from(reps));
            launches[side] = (gpu.kernel_launches().unwrap_or(0) - before) as f64 / f64::from(reps);
        }
    }
    let result = Object::new();
    let fields = [
        ("adapter", JsValue::from(gpu.adapter().to_string())),
        ("unfusedMs", best[0].into()),
        ("fusedMs", best[1].into()),
        ("unfusedLaunches", launches[0].into()),
        ("fusedLaunches", launches[1].into()),
    ];
    for (key, value) in fields {
        Reflect::set(&result, &key.into(), &value)
            .map_err(|_| JsError::new("cannot build the result object"))?;
    }
    Ok(result)
}

/// Deterministic values in [-0.5, 0.5).
fn values(n: usize, seed: u64) -> Vec<f32> {
    Rng(seed).values(n, 0.5)
}

/// A `rows` x `cols` Q4_1 matrix, small enough that the residual stream
/// stays finite over many repetitions.
fn q4_1(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let small: Vec<f32> = values(rows * cols, seed).iter().map(|v| 0.05 * v).collect();
    quantize_matrix(WeightFormat::Q4_1, cols, &small)
}

/// A Q4_1 matrix of `rows` x `cols` on the GPU.
fn upload(gpu: &WgpuBackend, rows: usize, cols: usize, data: &[u8]) -> Result<WgpuWeight> {
    gpu.upload_weight(WeightView {
        format: WeightFormat::Q4_1,
        rows,
        cols,
        data,
    })
}

/// `parts` (rows, data) of `cols` columns uploaded one by one, then
/// concatenated by rows as the loader does.
fn with_concatenation<const N: usize>(
    gpu: &WgpuBackend,
    cols: usize,
    parts: [(usize, Vec<u8>); N],
) -> Result<([WgpuWeight; N], WgpuWeight)> {
    let mut separate = Vec::with_capacity(N);
    for (rows, data) in &parts {
        separate.push(upload(gpu, *rows, cols, data)?);
    }
    let views = parts.each_ref().map(|(rows, data)| WeightView {
        format: WeightFormat::Q4_1,
        rows: *rows,
        cols,
        data,
    });
    let whole = concat_rows(&views).expect("one format and width");
    let rows = parts.iter().map(|(rows, _)| rows).sum();
    let separate = separate.try_into().ok().expect("one weight per part");
    Ok((separate, upload(gpu, rows, cols, &whole)?))
}

/// An RMSNorm weight near 1.
fn norm(gpu: &WgpuBackend, seed: u64) -> Result<WgpuWeight> {
    let data: Vec<u8> = values(DIM, seed)
        .iter()
        .flat_map(|v| (1.0 + v).to_le_bytes())
        .collect();
    gpu.upload_weight(WeightView {
        format: WeightFormat::F32,
        rows: 1,
        cols: DIM,
        data: &data,
    })
}

fn prologue(weight: &WgpuWeight) -> Option<NormPrologue<'_, WgpuWeight>> {
    Some(NormPrologue { weight, eps: EPS })
}

impl Layer {
    fn random(gpu: &WgpuBackend) -> Result<Self> {
        let qkv_parts =
            [(DIM, 3), (KV, 4), (KV, 5)].map(|(rows, seed)| (rows, q4_1(rows, DIM, seed)));
        let ([q, k, v], qkv) = with_concatenation(gpu, DIM, qkv_parts)?;
        let glu_parts = [(FFN, 8), (FFN, 9)].map(|(rows, seed)| (rows, q4_1(rows, DIM, seed)));
        let ([gate, up], gate_up) = with_concatenation(gpu, DIM, glu_parts)?;
        let o = upload(gpu, DIM, DIM, &q4_1(DIM, DIM, 7))?;
        let down = upload(gpu, DIM, FFN, &q4_1(DIM, FFN, 11))?;
        Ok(Layer {
            attn_norm: norm(gpu, 1)?,
            ffn_norm: norm(gpu, 2)?,
            q,
            k,
            v,
            qkv,
            o,
            gate,
            up,
            gate_up,
            down,
        })
    }

    /// One layer as the forward pass runs it, `fused` or not, with the
    /// projected Q standing in for the attention's output.
    fn run(&self, gpu: &WgpuBackend, a: &mut Activations, fused: bool) -> Result<()> {
        let mm = MatmulParams { rows: 1 };
        let norm = RmsNormParams {
            rows: 1,
            dim: DIM,
            eps: EPS,
        };
        if fused {
            let mut qkv = [
                SplitOut {
                    out: &mut a.q,
                    width: DIM,
                },
                SplitOut {
                    out: &mut a.k,
                    width: KV,
                },
                SplitOut {
                    out: &mut a.v,
                    width: KV,
                },
            ];
            let attn_norm = prologue(&self.attn_norm);
            gpu.matmul_rms_norm(&a.residual, attn_norm, &self.qkv, None, mm, &mut qkv)?;
            gpu.matmul_residual(&a.q, &self.o, mm, &mut a.residual)?;
            let ffn_norm = NormPrologue {
                weight: &self.ffn_norm,
                eps: EPS,
            };
            let (gate_up, down) = (&self.gate_up, &self.down);
            return gpu.mlp_residual(
                &mut a.residual,
                ffn_norm,
                gate_up,
                down,
                Glu::SwiGlu,
                mm,
                &mut a.act,
            );
        }
        // The previous layer's down projection waits in `delta`.
        gpu.rms_norm_residual(
            &mut a.residual,
            &a.delta,
            &self.attn_norm,
            norm,
            &mut a.normed,
        )?;
        let mut qkv = [
            (&self.q, &mut a.q),
            (&self.k, &mut a.k),
            (&self.v, &mut a.v),
        ]
        .map(|(w, out)| MatmulTarget { w, bias: None, out });
        gpu.matmuls(&a.normed, &mut qkv, mm)?;
        gpu.matmul(&a.q, &self.o, None, mm, &mut a.delta)?;
        gpu.rms_norm_residual(
            &mut a.residual,
            &a.delta,
            &self.ffn_norm,
            norm,
            &mut a.normed,
        )?;
        let mut gate_up = [(&self.gate, &mut a.gate), (&self.up, &mut a.up)]
            .map(|(w, out)| MatmulTarget { w, bias: None, out });
        gpu.matmuls(&a.normed, &mut gate_up, mm)?;
        gpu.swiglu(&a.gate, &a.up, FFN, &mut a.act)?;
        gpu.matmul(&a.act, &self.down, None, mm, &mut a.delta)
    }
}

impl Activations {
    fn new(gpu: &WgpuBackend) -> Result<Self> {
        let zeros = |n| gpu.upload(&vec![0.0; n]);
        Ok(Activations {
            residual: gpu.upload(&values(DIM, 12))?,
            delta: zeros(DIM)?,
            normed: zeros(DIM)?,
            q: zeros(DIM)?,
            k: zeros(KV)?,
            v: zeros(KV)?,
            gate: zeros(FFN)?,
            up: zeros(FFN)?,
            act: zeros(FFN)?,
        })
    }
}
