//! What the student is trained and judged on: the KL divergence from the
//! target's next-token distribution (the quantity speculative sampling's
//! acceptance rate falls with), and how often both pick the same token
//! (greedy acceptance).

use candle_core::{Tensor, D};

use crate::Result;

/// Log-softmax over the last dimension; the maximum is taken out of the
/// graph, as the result does not depend on it.
fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&log_sum)?)
}

/// Mean over rows of `KL(target ‖ student)` in nats: `[rows, vocab]` logits
/// each, differentiable in the student's.
pub fn kl(student_logits: &Tensor, target_logits: &Tensor) -> Result<Tensor> {
    let rows = student_logits.dim(0)? as f64;
    let log_p = log_softmax(&target_logits.detach())?;
    let log_q = log_softmax(student_logits)?;
    let per_token = (log_p.exp()? * (log_p - log_q)?)?;
    Ok((per_token.sum_all()? / rows)?)
}

/// The fraction of rows where the student's most likely token is the target's.
pub fn agreement(student_logits: &Tensor, target_logits: &Tensor) -> Result<f64> {
    let s = student_logits.argmax(D::Minus1)?;
    let t = target_logits.argmax(D::Minus1)?;
    let same = s.eq(&t)?.to_dtype(candle_core::DType::F32)?.mean_all()?;
    Ok(same.to_scalar::<f32>()? as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits(rows: &[[f32; 3]; 2]) -> Tensor {
        Tensor::new(rows, &Device::Cpu).unwrap()
    }

    #[test]
    fn kl_is_zero_for_equal_distributions_and_matches_the_formula() {
        let a = logits(&[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]);
        let same = kl(&(a.clone() + 7.0).unwrap(), &a).unwrap();
        assert!(same.to_scalar::<f32>().unwrap().abs() < 1e-6);
        let b = logits(&[[0.0, 0.0, 0.0], [0.0, -1.0, 3.0]]);
        let p = [1.0f64, 2.0, 0.5].map(f64::exp);
        let z: f64 = p.iter().sum();
        let want: f64 = p
            .iter()
            .map(|&e| (e / z) * ((e / z) / (1.0 / 3.0)).ln())
            .sum::<f64>()
            / 2.0;
        let got = kl(&b, &a).unwrap().to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }

    #[test]
    fn agreement_counts_rows_with_the_same_argmax() {
        let a = logits(&[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]);
        let b = logits(&[[0.0, 5.0, 0.0], [9.0, -1.0, 3.0]]);
        assert_eq!(agreement(&a, &b).unwrap(), 0.5);
        assert_eq!(agreement(&a, &a).unwrap(), 1.0);
    }
}
