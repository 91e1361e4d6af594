//! The acceptance rule of speculative sampling (Leviathan et al. 2023,
//! Chen et al. 2023): a draft token `x` drawn from the draft distribution
//! `q` is kept with probability `min(1, p(x) / q(x))` under the target
//! distribution `p`; at the first rejection the replacement is drawn from
//! the residual `max(p - q, 0)` renormalised, and when every draft is kept
//! one more token is drawn from `p` at the next position. Every emitted
//! token is then distributed exactly as the target alone would sample it.
//! Greedy decoding is the special case where `p` is one-hot at the argmax.
//! A constrained sequence's `p` is its distribution among the tokens its
//! grammar allows after the drafts before it: a draft outside that mask has
//! `p(x) = 0` and is rejected.

use crate::sched::Sampler;

/// A sparse distribution: `(token, probability)`, probabilities summing to 1.
pub type Distribution = Vec<(u32, f64)>;

/// What the verifier decided for one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How many leading drafts were accepted.
    pub accepted: usize,
    /// The token after them: the correction drawn at the first rejection,
    /// or the bonus token drawn after the last draft.
    pub next: u32,
}

/// Probability of `token` in `dist`.
fn prob(dist: &[(u32, f64)], token: u32) -> f64 {
    dist.iter().find(|d| d.0 == token).map_or(0.0, |d| d.1)
}

/// Verifies `drafts` against the target. `target(i, accepted)` is the target's
/// distribution for the token after `drafts[..i]` (its sampler applied, with
/// `accepted` = the drafts kept so far as history); it is asked for rows
/// `0..=drafts.len()` at most. `draft_dists[i]` is the distribution `drafts[i]`
/// was drawn from; `None` means the drafts were proposed deterministically
/// (n-gram lookup, greedy drafting), i.e. one-hot.
pub fn verify(
    sampler: &mut Sampler,
    drafts: &[u32],
    draft_dists: Option<&[Distribution]>,
    mut target: impl FnMut(usize, &[u32]) -> Distribution,
) -> Verdict {
    let infallible = try_verify(sampler, drafts, draft_dists, |i, accepted| {
        Ok::<_, std::convert::Infallible>(target(i, accepted))
    });
    match infallible {
        Ok(verdict) => verdict,
        Err(never) => match never {},
    }
}

/// [`verify`] with a target that can fail (a constraint's mask at a
/// draft position): the first error ends the verification.
pub fn try_verify<E>(
    sampler: &mut Sampler,
    drafts: &[u32],
    draft_dists: Option<&[Distribution]>,
    mut target: impl FnMut(usize, &[u32]) -> Result<Distribution, E>,
) -> Result<Verdict, E> {
    for (i, &x) in drafts.iter().enumerate() {
        let p = target(i, &drafts[..i])?;
        let q_x = draft_dists.map_or(1.0, |d| prob(&d[i], x));
        let p_x = prob(&p, x);
        // Deterministic drafts under a one-hot target need no random draw.
        let keep = if p_x >= q_x {
            true
        } else if p_x == 0.0 {
            false
        } else {
            sampler.uniform() < p_x / q_x
        };
        if keep {
            continue;
        }
        let residual = residual(&p, draft_dists.map(|d| d[i].as_slice()), x);
        return Ok(Verdict {
            accepted: i,
            next: sampler.draw(&residual),
        });
    }
    let p = target(drafts.len(), drafts)?;
    Ok(Verdict {
        accepted: drafts.len(),
        next: sampler.draw(&p),
    })
}

/// `max(p - q, 0)` renormalised; `q = None` is one-hot at `rejected`. When
/// nothing is left (p and q agree up to rounding) it falls back to `p`.
fn residual(p: &[(u32, f64)], q: Option<&[(u32, f64)]>, rejected: u32) -> Distribution {
    let q_of = |t: u32| match q {
        Some(q) => prob(q, t),
        None => f64::from(u8::from(t == rejected)),
    };
    let mut r: Distribution = p
        .iter()
        .map(|&(t, pt)| (t, (pt - q_of(t)).max(0.0)))
        .filter(|d| d.1 > 0.0)
        .collect();
    let total: f64 = r.iter().map(|d| d.1).sum();
    if total <= 1e-12 {
        return p.to_vec();
    }
    for d in &mut r {
        d.1 /= total;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::SamplingParams;

    fn greedy() -> Sampler {
        Sampler::new(SamplingParams::default())
    }

    #[test]
    fn greedy_keeps_drafts_up_to_the_first_disagreement() {
        let target = [5, 6, 9, 8];
        let v = verify(&mut greedy(), &[5, 6, 7], None, |i, _| {
            vec![(target[i], 1.0)]
        });
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                next: 9
            }
        );
        let v = verify(&mut greedy(), &[5, 6, 9], None, |i, _| {
            vec![(target[i], 1.0)]
        });
        assert_eq!(
            v,
            Verdict {
                accepted: 3,
                next: 8
            }
        );
        let v = verify(&mut greedy(), &[], None, |i, _| vec![(target[i], 1.0)]);
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                next: 5
            }
        );
    }

    #[test]
    fn history_given_to_the_target_is_the_accepted_drafts() {
        let mut seen = Vec::new();
        verify(&mut greedy(), &[1, 2, 3], None, |i, h| {
            seen.push(h.to_vec());
            vec![([1, 2, 4, 0][i], 1.0)]
        });
        assert_eq!(seen, vec![vec![], vec![1], vec![1, 2]]);
    }

    #[test]
    fn residual_removes_the_draft_mass() {
        let p = vec![(0, 0.5), (1, 0.3), (2, 0.2)];
        let q = vec![(0, 0.7), (1, 0.1), (2, 0.2)];
        let r = residual(&p, Some(&q), 0);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].0, 1);
        assert!((r[0].1 - 1.0).abs() < 1e-12);
        let r = residual(&p, None, 0);
        assert!((prob(&r, 1) - 0.6).abs() < 1e-12 && (prob(&r, 2) - 0.4).abs() < 1e-12);
    }
}
