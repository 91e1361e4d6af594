//! The gated activation of the feed-forward block.

use tandem_core::Result;

use crate::check;
use crate::math::silu;
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
    let kernel = "swiglu";
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
            *o = silu(g) * u;
        }
    });
    Ok(())
}
