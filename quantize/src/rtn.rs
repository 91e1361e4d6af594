//! Round to nearest: every group's step covers its values, every element
//! takes the nearest code. The baseline the other methods must beat.

use crate::grid::{QuantizedMatrix, Scheme, Step};
use crate::Result;

/// Quantizes `w` (`rows × cols`, row-major) to the nearest codes of `scheme`.
pub fn quantize(
    scheme: Scheme,
    name: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<QuantizedMatrix> {
    scheme.check_matrix(name, w.len(), rows, cols)?;
    let g = scheme.group_len(cols);
    let mut codes = Vec::with_capacity(w.len());
    let mut steps = Vec::with_capacity(w.len() / g);
    for group in w.chunks_exact(g) {
        let step = Step::covering(scheme, group);
        codes.extend(group.iter().map(|&v| step.code(v) as i8));
        steps.push(step);
    }
    Ok(QuantizedMatrix {
        scheme,
        rows,
        cols,
        codes,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_error_is_at_most_half_a_step() {
        let cols = 96;
        let w: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for scheme in [
            Scheme::new(4, 32).unwrap(),
            Scheme::new(3, 32).unwrap(),
            Scheme::Int8PerChannel,
        ] {
            let q = quantize(scheme, "w", &w, 3, cols).unwrap();
            let d = q.dequantize();
            for (i, (a, b)) in w.iter().zip(&d).enumerate() {
                let step = q.step(i / cols, i % cols);
                // f16 rounding of min/scale can push the far end by a hair.
                assert!(
                    (a - b).abs() <= step.scale * 0.5 + 2e-3,
                    "{scheme:?} {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn constant_group_is_exact() {
        let w = vec![0.25f32; 64];
        let q = quantize(Scheme::new(4, 32).unwrap(), "w", &w, 1, 64).unwrap();
        assert_eq!(q.dequantize(), w);
    }

    #[test]
    fn group_must_divide_columns() {
        let err = quantize(
            Scheme::new(4, 64).unwrap(),
            "blk.0.ffn_down.weight",
            &[0.0; 96],
            1,
            96,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("group size 64 does not divide the 96 columns of blk.0.ffn_down.weight"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_bits_and_groups_are_refused() {
        let e = Scheme::new(5, 128).unwrap_err().to_string();
        assert!(e.contains("5-bit weights are not supported"), "{e}");
        let e = Scheme::new(4, 100).unwrap_err().to_string();
        assert!(e.contains("group size 100 is not supported"), "{e}");
    }
}
