//! The gated activations of the feed-forward block: SwiGLU and GeGLU.

use tandem_core::Result;

use crate::check;
use crate::math::{gelu_tanh, silu};
use crate::workers::Workers;

/// Fewest elements worth a task of their own.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// `out = silu(gate) * up`, elementwise over `len` elements.
pub(crate) fn swiglu(
    workers: &Workers,
    gate: &[f32],
    up: &[f32],
    len: usize,
    out: &mut [f32],
) -> Result<()> {
    gated("swiglu", silu, workers, gate, up, len, out)
}

/// `out = gelu_tanh(gate) * up`, elementwise over `len` elements.
pub(crate) fn geglu(
    workers: &Workers,
    gate: &[f32],
    up: &[f32],
    len: usize,
    out: &mut [f32],
) -> Result<()> {
    gated("geglu", gelu_tanh, workers, gate, up, len, out)
}

/// `out = act(gate) * up`, split across the workers. Generic over `act`
/// rather than a function pointer, so the activation inlines into the loop
/// and vectorizes.
fn gated(
    kernel: &str,
    act: impl Fn(f32) -> f32 + Sync,
    workers: &Workers,
    gate: &[f32],
    up: &[f32],
    len: usize,
    out: &mut [f32],
) -> Result<()> {
    check::buffer_len(kernel, "gate", gate.len(), len)?;
    check::buffer_len(kernel, "up", up.len(), len)?;
    check::buffer_len(kernel, "out", out.len(), len)?;
    let chunk = workers.chunk_len(len, 1, MIN_CHUNK_ELEMS);
    workers.for_each_chunk(&mut out[..len], chunk, |i, out| {
        let (gate, up) = (
            &gate[i * chunk..][..out.len()],
            &up[i * chunk..][..out.len()],
        );
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = act(g) * u;
        }
    });
    Ok(())
}

/// `x *= factor`, elementwise over `len` elements, in place.
pub(crate) fn scale(workers: &Workers, x: &mut [f32], len: usize, factor: f32) -> Result<()> {
    check::buffer_len("scale", "x", x.len(), len)?;
    let chunk = workers.chunk_len(len, 1, MIN_CHUNK_ELEMS);
    workers.for_each_chunk(&mut x[..len], chunk, |_, x| {
        x.iter_mut().for_each(|v| *v *= factor);
    });
    Ok(())
}
