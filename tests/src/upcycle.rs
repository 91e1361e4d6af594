//! A Mixture-of-Experts model "upcycled" from a dense Llama GGUF file, as
//! Mixtral is laid out (`llama` with `expert_count`): every layer's FFN
//! copied into `experts` experts stacked in `ffn_*_exps`, each copy's block
//! scales jittered by a small random factor, and a random F32 router
//! `ffn_gate_inp`. Renormalised top-k weights sum to 1, so with a small
//! jitter the model computes nearly what the dense one does, whichever
//! experts the router picks.

use std::path::Path;
use std::sync::Arc;

use half::f16;
use tandem_core::model::gguf::{GgufFile, GgufValue, GgufWriter};
use tandem_core::quant::WeightFormat;
use tandem_core::sched::Rng;
use tandem_core::{Error, Result};

/// How to upcycle.
#[derive(Clone, Copy, Debug)]
pub struct Upcycle {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Standard deviation of the factor `1 + jitter · N(0, 1)` each block's
    /// scale is multiplied by, per expert.
    pub jitter: f32,
    pub seed: u64,
}

/// Writes the upcycled model of the dense `llama` GGUF file `dense` to `out`.
pub fn upcycle_gguf(dense: &Path, out: &Path, u: &Upcycle) -> Result<()> {
    let bytes = std::fs::read(dense).map_err(|e| Error::bad_file(dense, e.to_string()))?;
    let file = GgufFile::parse(Arc::new(tandem_core::model::Bytes::Owned(bytes)), dense)?;
    let architecture = file
        .metadata
        .iter()
        .find(|(key, _)| key == "general.architecture")
        .map(|(_, value)| value);
    let arch = match architecture {
        Some(GgufValue::String(a)) if a == "llama" => a.clone(),
        other => {
            return Err(Error::bad_file(
                dense,
                format!("upcycling needs a llama model, not {other:?}"),
            ))
        }
    };
    let mut w = GgufWriter::new();
    for (key, value) in &file.metadata {
        w.add_metadata(key, value.clone())?;
    }
    let count = |n: usize| GgufValue::U32(n as u32);
    w.add_metadata(&format!("{arch}.expert_count"), count(u.experts))?;
    w.add_metadata(
        &format!("{arch}.expert_used_count"),
        count(u.experts_per_token),
    )?;
    let mut rng = Rng::new(u.seed);
    for info in &file.tensors {
        let data = file
            .tensor_data(info)
            .ok_or_else(|| Error::bad_file(dense, format!("tensor {} is truncated", info.name)))?;
        let Some((layer, matrix)) = dense_ffn(&info.name) else {
            w.add_tensor(&info.name, info.format, &info.shape, data.to_vec())?;
            continue;
        };
        if matrix == "gate" {
            let hidden = info.shape[0];
            let scale = 1.0 / (hidden as f64).sqrt();
            let router: Vec<u8> = (0..hidden * u.experts)
                .flat_map(|_| ((normal(&mut rng) * scale) as f32).to_le_bytes())
                .collect();
            let name = format!("blk.{layer}.ffn_gate_inp.weight");
            w.add_tensor(&name, WeightFormat::F32, &[hidden, u.experts], router)?;
        }
        let mut stacked = Vec::with_capacity(data.len() * u.experts);
        for _ in 0..u.experts {
            let mut copy = data.to_vec();
            jitter_block_scales(&mut copy, info.format, u.jitter, &mut rng)
                .map_err(|m| Error::bad_file(dense, format!("tensor {}: {m}", info.name)))?;
            stacked.extend(copy);
        }
        let shape = [info.shape[0], info.shape[1], u.experts];
        let name = format!("blk.{layer}.ffn_{matrix}_exps.weight");
        w.add_tensor(&name, info.format, &shape, stacked)?;
    }
    w.write(out)
}

/// `(layer, "gate" | "up" | "down")` of a dense `blk.N.ffn_*.weight`.
fn dense_ffn(name: &str) -> Option<(usize, &str)> {
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let matrix = rest.strip_prefix("ffn_")?.strip_suffix(".weight")?;
    matches!(matrix, "gate" | "up" | "down").then_some((layer.parse().ok()?, matrix))
}

/// Multiplies the f16 scale that opens every block of GGML's legacy
/// formats by `1 + jitter · N(0, 1)`.
fn jitter_block_scales(
    data: &mut [u8],
    format: WeightFormat,
    jitter: f32,
    rng: &mut Rng,
) -> std::result::Result<(), String> {
    use WeightFormat::*;
    if !matches!(format, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0) {
        return Err(format!("cannot jitter {format} blocks"));
    }
    for block in data.chunks_exact_mut(format.block_bytes()) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let factor = 1.0 + jitter * normal(rng) as f32;
        block[..2].copy_from_slice(&f16::from_f32(d * factor).to_le_bytes());
    }
    Ok(())
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut Rng) -> f64 {
    let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
    let u2 = rng.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
