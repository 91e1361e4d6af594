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

/// How the student's most likely tokens compare with the target's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopOne {
    /// Fraction of rows where they are the same token.
    pub agreement: f64,
    /// Fraction of rows where the target's is one the student can predict
    /// (1 with the whole vocabulary): the most agreement can reach.
    pub coverage: f64,
}

/// Compares the argmax of each row: the student's logits are over
/// `student_tokens` (`None`: the whole vocabulary), the target's over the
/// whole vocabulary.
pub fn top_one(
    student_logits: &Tensor,
    student_tokens: Option<&[u32]>,
    target_logits: &Tensor,
) -> Result<TopOne> {
    let s: Vec<u32> = student_logits.argmax(D::Minus1)?.to_vec1()?;
    let t: Vec<u32> = target_logits.argmax(D::Minus1)?.to_vec1()?;
    let token = |i: u32| student_tokens.map_or(i, |tokens| tokens[i as usize]);
    let rows = t.len().max(1) as f64;
    let same = s.iter().zip(&t).filter(|&(&s, &t)| token(s) == t).count();
    let covered = match student_tokens {
        Some(tokens) => t.iter().filter(|t| tokens.binary_search(t).is_ok()).count(),
        None => t.len(),
    };
    Ok(TopOne {
        agreement: same as f64 / rows,
        coverage: covered as f64 / rows,
    })
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
    fn top_one_counts_rows_with_the_same_argmax() {
        let a = logits(&[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]);
        let b = logits(&[[0.0, 5.0, 0.0], [9.0, -1.0, 3.0]]);
        let whole = |agreement| TopOne {
            agreement,
            coverage: 1.0,
        };
        assert_eq!(top_one(&a, None, &b).unwrap(), whole(0.5));
        assert_eq!(top_one(&a, None, &a).unwrap(), whole(1.0));
    }

    #[test]
    fn top_one_maps_a_reduced_vocabulary_to_token_ids() {
        // The student predicts tokens 0 and 2 only; its rows are over those two.
        let student = Tensor::new(&[[1.0f32, 3.0], [5.0, 0.0]], &Device::Cpu).unwrap();
        let target = logits(&[[0.0, 1.0, 4.0], [0.0, 6.0, 1.0]]);
        let got = top_one(&student, Some(&[0, 2]), &target).unwrap();
        // Row 0: both pick token 2; row 1: the target's token 1 is out of reach.
        assert_eq!(
            got,
            TopOne {
                agreement: 0.5,
                coverage: 0.5
            }
        );
    }
}
