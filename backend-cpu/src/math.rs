//! Vectorizable scalar math: loops over slices that call these compile to
//! SIMD code, unlike `f32::exp` (a libm call per element). Softmax in
//! attention and SiLU in SwiGLU evaluate one exponential per element, which
//! made them a visible share of prefill time with `f32::exp`.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a part exact in a few bits and a correction, so `n * LN2_HI`
/// is exact for the `n` that occur and the reduced argument keeps full precision.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding then subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22
/// to the nearest integer without a rounding instruction (absent in SSE2).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x` with a relative error of a few ulps (Cephes' `expf` polynomial).
/// Arguments are clamped to `[-87, 88]`, so the result stays a normal f32:
/// `exp(-inf)` is about `1.6e-38` rather than 0, which is harmless wherever
/// it multiplies or is added to finite values. NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2_E + ROUND_MAGIC;
    let n = shifted - ROUND_MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * r2 + r + 1.0;
    // 2^n built directly in the exponent field; n is in [-126, 127] after
    // the clamp, and `shifted` holds it in its low bits. Integer steps, not
    // `n as i32`: that conversion saturates, and kept unrolled loops of
    // exponentials scalar.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    e_r * two_n
}

/// The f32 of the f16 whose bits are `bits`, exactly, in branch-free
/// integer steps that loops vectorize (`half`'s slice conversion calls a
/// function per eight elements, which made it a quarter of the decode time
/// at a depth of 2048 with an F16 cache). NaNs stay NaNs.
#[inline(always)]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    const EXPONENT: u32 = 0x7c00 << 13;
    // Subnormals: the mantissa as that of 2^-14 (1 + m / 1024), less 2^-14.
    const MAGIC: u32 = 113 << 23;
    let h = u32::from(bits);
    let sign = (h & 0x8000) << 16;
    // Exponent and mantissa in their f32 places, the exponent biased by 15.
    let magnitude = (h & 0x7fff) << 13;
    let exponent = magnitude & EXPONENT;
    let normal = magnitude + ((127 - 15) << 23);
    let infinite_or_nan = magnitude + ((255 - 31) << 23);
    let subnormal = (f32::from_bits(magnitude + MAGIC) - f32::from_bits(MAGIC)).to_bits();
    let bits = if exponent == EXPONENT {
        infinite_or_nan
    } else if exponent == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// How kernels compute `a * b + c`: one rounding with FMA hardware, two
/// without (`f32::mul_add` without FMA instructions is a slow libm call).
/// Kernels generic over it are instantiated with [`Fused`] only inside
/// functions compiled with the `fma` target feature.
pub(crate) trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// `a * b + c` in one FMA instruction.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Fused;

#[cfg(target_arch = "x86_64")]
impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// `a * b + c` as a multiply and an add.
pub(crate) struct Separate;

impl MulAdd for Separate {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// `g * sigmoid(g)`.
#[inline(always)]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// `sqrt(2 / pi)`, the argument scale of GELU's tanh approximation.
pub(crate) const GELU_TANH_SCALE: f32 = 0.797_884_6;

/// GELU, tanh approximation: `0.5 g (1 + tanh(u))` with
/// `u = sqrt(2/pi) (g + 0.044715 g^3)`, written as `g / (1 + e^(-2u))`
/// (the same value), which needs one exponential and never overflows.
#[inline(always)]
pub(crate) fn gelu_tanh(g: f32) -> f32 {
    let u = GELU_TANH_SCALE * (g + 0.044_715 * g * g * g);
    g / (1.0 + exp(-2.0 * u))
}

/// `sum_i a[i] * b[i]` in 32 independent lanes (four 8-wide vectors, so
/// the additions do not wait on each other), then 8, then one by one.
#[inline(always)]
pub(crate) fn dot<M: MulAdd>(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut wide = [0f32; 32];
    let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
    let (a_rest, b_rest) = (a32.remainder(), b32.remainder());
    for (x, y) in a32.zip(b32) {
        for i in 0..32 {
            wide[i] = M::mul_add(x[i], y[i], wide[i]);
        }
    }
    let mut lanes = [0f32; 8];
    for k in 0..4 {
        for i in 0..8 {
            lanes[i] += wide[8 * k + i];
        }
    }
    let (a8, b8) = (a_rest.chunks_exact(8), b_rest.chunks_exact(8));
    let tail = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .fold(0.0, |s, (&x, &y)| M::mul_add(x, y, s));
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] = M::mul_add(x[i], y[i], lanes[i]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum_i x[i]^2` in eight independent lanes.
#[inline(always)]
pub(crate) fn sum_of_squares(x: &[f32]) -> f32 {
    dot::<Separate>(x, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_a_few_ulps() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= want * 4e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
    }

    #[test]
    fn exp_saturates_instead_of_overflowing() {
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
        assert!(exp(-1000.0) >= 0.0);
        assert!(exp(1000.0).is_finite());
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn f16_to_f32_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(bits), half::f16::from_bits(bits).to_f32());
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn dot_handles_every_tail() {
        for len in [0, 1, 8, 19, 32, 45, 64, 100] {
            let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(
                dot::<Separate>(&a, &a),
                (0..len).map(|i| (i * i) as f32).sum::<f32>()
            );
        }
    }
}
